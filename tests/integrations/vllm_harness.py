"""Drive hybrid-kv's vLLM connector with vLLM's own objects: a real ``Scheduler`` per engine (in the test
process) and one process per TP worker (vLLM's ``init_distributed_environment`` over gloo, the connector built
by vLLM's ``KVConnectorFactory`` role WORKER, KV caches allocated by vLLM's ``allocate_kv_cache`` from the
``KVCacheConfig`` vLLM's planner made). CPU workers fork from a server that imported vLLM once (``PRELOAD``);
CUDA workers are spawned.

Each engine step: ``Scheduler.schedule()`` -> every worker binds the connector metadata, ``start_load_kv``,
``wait_for_save``, ``get_transfer_results`` -> results aggregated like vLLM's ``KVOutputAggregator`` (a
request is finished once every worker reported it) -> ``Scheduler.update_from_output``. Prefill workers
"compute" a request by writing its KV shares into the blocks the scheduler gave it (``Content``); decode
workers compare every byte of their KV memory with what it must hold.

With ``EngineSpec.layerwise`` a prefill step is a forward as vLLM runs it: the workers bind the metadata, then
write each layer's KV in forward order (layer number order) for the requests the step computes and call
``save_kv_layer`` after each attention layer (SSM layers get no hook), optionally sleeping ``layer_s`` per
layer (compute time, the CPU idle as under a GPU kernel), then ``start_load_kv`` and ``wait_for_save``. A
request's attention pages get the tokens computed so far, its SSM states an intermediate value until the
step of its last chunk: bytes posted before their layer ran, or an intermediate state, reach the decode and
fail its byte check. ``route_concurrent`` sends requests to the decode and the prefill at once with a
stream capability, as a router doing concurrent push does.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from free_ports import listen_port
from free_ports import listen_ports as side_channel_ports  # noqa: F401  (the name the tests import from here)

MODELS = ("kimi", "gqa", "mla")
KB = 16  # kernel block (tokens) of every attention group here


@dataclass(frozen=True)
class EngineSpec:
    """One engine: everything a worker process needs to rebuild its config (picklable)."""

    engine_id: str
    model: str  # kimi | gqa | mla
    model_dir: str
    tp: int
    mode: str
    port: int
    num_blocks: int = 160
    host: str = "127.0.0.1"
    extra: tuple[tuple[str, Any], ...] = ()
    seed: int = 0
    netns: str | None = None  # network namespace (``ip netns`` name) the workers run in; None: the test's own
    device: str = "cpu"  # "cpu", or "cuda": worker r's KV caches on GPU r % device_count (NIXL VRAM)
    layerwise: bool = False  # prefill steps as forwards, layer by layer with save hooks (see the module docs)
    layer_s: float = 0.0  # compute time of each layer in a layerwise forward (a sleep)
    max_batched_tokens: int = 4096  # the scheduler's token budget per step (smaller: chunked prefill)
    block_size: int = 32  # the scheduler's block (tokens) of the GQA and MLA models
    gqa_kernel_block: int = KB  # the attention kernel block (tokens) of the GQA model

    @property
    def logical_block_size(self) -> int:
        if self.model == "kimi":
            from hybrid_kv.presets import get_preset

            return get_preset("tiny-kimi-linear").geometry(self.tp).logical_block_size
        return self.block_size


# ---------------------------------------------------------------------------------------------- models


def write_model_dirs(root: Path) -> dict[str, str]:
    """Tiny HF configs (no weights, no tokenizer: only ModelConfig reads them)."""
    configs = {
        "kimi": {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": 1024,
            "hidden_size": 64,
            "num_hidden_layers": 12,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "intermediate_size": 128,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "q_lora_rank": None,
            "mla_use_nope": True,
            "torch_dtype": "bfloat16",
            "max_position_embeddings": 4096,
            "num_experts": 4,
            "num_experts_per_token": 2,
            "moe_intermediate_size": 32,
            "linear_attn_config": {
                "kda_layers": [i + 1 for i in range(12) if i % 4 != 3],
                "full_attn_layers": [4, 8, 12],
                "num_heads": 4,
                "head_dim": 16,
                "short_conv_kernel_size": 4,
            },
        },
        "gqa": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 1024,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 8,
            "intermediate_size": 128,
            "torch_dtype": "bfloat16",
            "max_position_embeddings": 4096,
        },
        "mla": {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": 1024,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "q_lora_rank": None,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 2,
            "torch_dtype": "bfloat16",
            "max_position_embeddings": 4096,
        },
    }
    out = {}
    for name, cfg in configs.items():
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg))
        out[name] = str(d)
    return out


def layer_specs(spec: EngineSpec) -> dict[str, Any]:
    """Per-layer KV-cache specs of one TP rank, as the model's attention layers would report them."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    bs, tp = spec.logical_block_size, spec.tp
    out: dict[str, Any] = {}
    if spec.model == "kimi":
        from hybrid_kv.presets import get_preset

        geo = get_preset("tiny-kimi-linear").geometry(tp)
        for i in range(12):
            if i % 4 == 3:
                out[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
                    block_size=bs, num_kv_heads=1, head_size=48, dtype=torch.bfloat16
                )
            else:
                out[f"model.layers.{i}.self_attn.kda"] = MambaSpec(
                    block_size=bs,
                    shapes=((3 * 64 // tp, 3), (4 // tp, 16, 16)),
                    dtypes=(torch.bfloat16, torch.float32),
                    page_size_padded=geo.page_bytes,
                    mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                )
    elif spec.model == "gqa":
        for i in range(2):
            out[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=bs, num_kv_heads=4 // tp, head_size=8, dtype=torch.bfloat16
            )
    else:
        for i in range(2):
            out[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
                block_size=bs, num_kv_heads=1, head_size=48, dtype=torch.bfloat16
            )
    return out


def build(spec: EngineSpec) -> tuple[Any, Any, dict[str, Any]]:
    """``(VllmConfig, KVCacheConfig, layer specs)`` of an engine, through vLLM's own config and planner."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    mc = ModelConfig(model=spec.model_dir, dtype="bfloat16", seed=0, skip_tokenizer_init=True, max_model_len=2048)
    extra = {"mode": spec.mode, "side_channel_port": spec.port, "side_channel_host": spec.host, **dict(spec.extra)}
    vc = VllmConfig(
        model_config=mc,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=spec.max_batched_tokens,
            max_model_len=2048,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
        ),
        cache_config=CacheConfig(block_size=spec.logical_block_size, cache_dtype="auto", enable_prefix_caching=False),
        parallel_config=ParallelConfig(tensor_parallel_size=spec.tp),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridKvConnector",
            kv_connector_module_path="hybrid_kv.integrations.vllm",
            kv_role="kv_both",
            engine_id=spec.engine_id,
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig(spec.device),
    )
    # vLLM turns the hybrid KV-cache manager (HMA) off on platforms without a GPU; every GPU deployment of a
    # hybrid model runs with it on, which is the configuration under test.
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    from hybrid_kv.integrations.vllm import HybridKvConnector

    vc.cache_config.kv_cache_layout = HybridKvConnector.get_required_kvcache_layout(vc) or "LBNHC"
    specs = layer_specs(spec)
    groups = get_global_kv_cache_groups(vc, [specs])
    page = max(s.page_size_bytes for s in specs.values())
    tensors = 3 if spec.model == "kimi" else 2
    kv_cfg = get_kv_cache_configs(vc, [specs], [page * tensors * spec.num_blocks], groups)[0]
    return vc, kv_cfg, specs


# ---------------------------------------------------------------------------------------------- content


def _rand(seed: int, key: tuple[int, ...], n: int) -> np.ndarray:
    return np.random.default_rng([seed, *key]).integers(0, 256, n, dtype=np.uint8)


class Content:
    """The logical (pre-TP) KV of one request: per (region, group) attention cells or one SSM state."""

    def __init__(self, seed: int, index: int, tokens: int) -> None:
        self.seed, self.index, self.tokens = seed, index, tokens

    def cells(self, region: int, group: int, heads: int, cell: int) -> np.ndarray:
        data = _rand(self.seed, (1, self.index, region, group), self.tokens * heads * cell)
        return data.reshape(self.tokens, heads, cell)

    def state_share(self, region: int, group: int, spec: Any, rank: int, tp: int) -> np.ndarray:
        """Rank ``rank``'s state: its channel slice of each conv sub-projection (Q|K|V), then its temporal rows."""
        conv_local, rows = spec.shapes[0]
        temporal = spec.shapes[1]
        value = temporal[0] * temporal[1] * tp  # global V channels (GDN/KDA)
        key = (conv_local * tp - value) // 2
        esz = 2
        parts = []
        for p, dims in enumerate((key, key, value)):
            g = _rand(self.seed, (2, self.index, region, group, p), dims * rows * esz).reshape(dims, rows * esz)
            parts.append(g[rank * dims // tp : (rank + 1) * dims // tp].reshape(-1))
        s = temporal[0] * tp
        rest = int(np.prod(temporal[1:])) * 4
        t = _rand(self.seed, (3, self.index, region, group), s * rest).reshape(s, rest)
        parts.append(t[rank * s // tp : (rank + 1) * s // tp].reshape(-1))
        return np.concatenate(parts)


class Memory:
    """A worker's KV memory as vLLM allocated it, addressed per layer view (bytes)."""

    def __init__(self, kv_caches: dict[str, Any], kv_cfg: Any, specs: dict[str, Any], tp: int, rank: int) -> None:
        import torch

        self.torch = torch
        self.kv_caches = kv_caches
        self.storage = next(iter(kv_caches.values())).untyped_storage()
        self.base = self.storage.data_ptr()
        self.flat = torch.empty(0, dtype=torch.uint8, device=self.storage.device).set_(self.storage).view(-1)
        self.tp, self.rank, self.specs = tp, rank, specs
        self.num_blocks = kv_cfg.num_blocks
        self.group_of = {n: gi for gi, g in enumerate(kv_cfg.transfer_groups) for n in g.layer_names}
        ptrs = sorted({v.data_ptr() for v in kv_caches.values()})
        self.region_of = {n: ptrs.index(v.data_ptr()) for n, v in kv_caches.items()}

    def bytes_view(self, name: str, flat: Any) -> Any:
        """Layer ``name``'s view over ``flat`` (this memory or a copy of it) as uint8 ``(blocks, H, N, C bytes)``."""
        v = self.kv_caches[name]
        esz = v.element_size()
        shape = (*v.shape[:-1], v.shape[-1] * esz)
        stride = (*(s * esz for s in v.stride()[:-1]), 1)
        return self.torch.as_strided(flat, shape, stride, (v.data_ptr() - self.base)).numpy()

    def write(
        self,
        flat: Any,
        ids: list[list[int]],
        content: Content,
        tokens: int | None = None,
        *,
        layers: set[str] | None = None,
        states: Content | None = None,
    ) -> None:
        """Write ``content`` into the blocks ``ids`` (per transfer group) of this rank; attention cells only for
        the first ``tokens`` tokens when given (what a transfer covers). ``layers``: only these layers;
        ``states``: what SSM layers write (default ``content``; an earlier chunk's intermediate state)."""
        from vllm.v1.kv_cache_interface import MambaSpec

        for name in self.kv_caches:
            g = self.group_of.get(name)
            if g is None or g >= len(ids) or not ids[g] or (layers is not None and name not in layers):
                continue
            spec, region, view = self.specs[name], self.region_of[name], self.bytes_view(name, flat)
            if isinstance(spec, MambaSpec):
                share = (states or content).state_share(region, g, spec, self.rank, self.tp)
                for b in ids[g]:
                    view[b, 0, 0, : share.size] = share
                continue
            ppl = view.shape[0] // self.num_blocks
            kb, local_heads, cell = view.shape[2], view.shape[1], view.shape[3]
            total_heads = (
                local_heads * self.tp if spec.num_kv_heads > 1 or type(spec).__name__ == "FullAttentionSpec" else 1
            )
            heads = [self.rank * total_heads // self.tp + h for h in range(local_heads)] if total_heads > 1 else [0]
            cells = content.cells(region, g, total_heads, cell)
            limit = content.tokens if tokens is None else min(tokens, content.tokens)
            kernel = [b * ppl + k for b in ids[g] for k in range(ppl)]
            for j, k in enumerate(kernel):
                n = min(kb, limit - j * kb)
                if n <= 0:
                    break
                view[k, :, :n, :] = cells[j * kb : j * kb + n, heads].transpose(1, 0, 2)

    def snapshot(self) -> Any:
        """A host (CPU) copy of this memory's bytes; ``write`` and ``bytes_view`` work on it."""
        return self.flat.to("cpu", copy=True)

    def forward_order(self) -> list[str]:
        """The layers in the order a forward runs them (layer number, as vLLM's models do)."""
        return sorted(self.kv_caches, key=lambda n: (int(n.split("layers.")[1].split(".")[0]), n))

    def compute_layer(self, name: str, work: list[tuple[list[list[int]], int, int, bool]], seed: int) -> None:
        """Layer ``name`` of a forward writes its KV for each ``(ids, content index, tokens computed, last
        chunk)`` of ``work``: attention cells of the tokens computed so far (every cell of the blocks once it is
        the last chunk, what the byte check expects), SSM states final only in the last chunk."""
        host = self.snapshot()
        for ids, index, covered, last in work:
            content = Content(seed, index, CONTENT_TOKENS)
            states = None if last else Content(seed, index + INTERMEDIATE, CONTENT_TOKENS)
            self.write(host, ids, content, None if last else covered, layers={name}, states=states)
        self.flat.copy_(host)


# ---------------------------------------------------------------------------------------------- worker process


CLONE_NEWNET = 0x40000000  # <sched.h>: setns(2) nstype of a network namespace
CLONE_NEWNS = 0x00020000  # <sched.h>: unshare(2) flag of a mount namespace
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 0x80000, 2  # <sys/mount.h>


def enter_netns(name: str) -> None:
    """Move this process into network namespace ``name`` (``/run/netns/NAME``, as ``ip netns add`` made it),
    as ``ip netns exec`` does: ``setns``, then a private mount namespace with a fresh ``/sys``, since UCX
    finds its network devices under ``/sys/class/net``, which otherwise lists the old namespace's devices.

    ``setns`` moves the calling thread only and ``unshare(CLONE_NEWNS)`` needs a single-threaded process:
    call it first thing in a fresh process, before any thread, socket or UCX context exists.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"entering network namespace {name!r}: {what} failed: {os.strerror(err)}")

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        check(libc.setns(fd, CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"", b"/", b"none", MS_SLAVE | MS_REC, None), "making / a slave mount")
    check(libc.umount2(b"/sys", MNT_DETACH), "unmounting /sys")
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mounting this namespace's sysfs on /sys")


def worker_main(spec: EngineSpec, rank: int, dist_port: int, conn: Any) -> None:
    try:
        if spec.netns is not None:
            enter_netns(spec.netns)
        _worker(spec, rank, dist_port, conn)
    except BaseException as exc:  # report, never hang the test
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        except Exception:
            pass


INTERMEDIATE = 100_000  # content index offset of the SSM states a non-last chunk leaves


def _fail_first_transfer(connector: Any, request_ids: set[str]) -> None:
    """Make NIXL fail (``ERR``) the first transfer this worker posts for each of ``request_ids`` (endpoint ids:
    a push's decode request id), as a transfer of the request's first released stage failing on the wire."""
    from hybrid_kv.transport import notifications

    nixl = connector.worker.server._agent.nixl
    real_make, real_transfer = nixl.make_prepped_xfer, nixl.transfer
    doomed: dict[int, str] = {}

    def make(*args: Any, **kwargs: Any) -> Any:
        handle = real_make(*args, **kwargs)
        notice = notifications.parse(kwargs.get("notif_msg", b""))
        if notice is not None and notice.request_id in request_ids:
            doomed[id(handle)] = notice.request_id
        return handle

    def transfer(handle: Any, *args: Any, **kwargs: Any) -> Any:
        rid = doomed.pop(id(handle), None)
        if rid is not None and rid in request_ids:
            request_ids.discard(rid)
            return "ERR"
        return real_transfer(handle, *args, **kwargs)

    nixl.make_prepped_xfer, nixl.transfer = make, transfer


def _worker(spec: EngineSpec, rank: int, dist_port: int, conn: Any) -> None:
    import torch

    torch.set_num_threads(1)
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    vc, kv_cfg, specs = build(spec)
    local_rank = rank
    if spec.device == "cuda":
        # TP ranks may share a GPU here (TP 2 on a one-GPU machine): vLLM's GPU collectives (NCCL, custom and
        # symmetric-memory all-reduce) need one GPU per rank and nothing here uses them; gloo stays
        from vllm.distributed.parallel_state import set_custom_all_reduce

        set_custom_all_reduce(False)
        local_rank = rank % torch.cuda.device_count()
        torch.cuda.set_device(local_rank)
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=spec.tp,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{dist_port}",
            local_rank=local_rank,
            backend="gloo",
        )
        ensure_model_parallel_initialized(spec.tp, 1)
        connector = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kv_cfg)
        kernel = [
            spec.gqa_kernel_block
            if spec.model == "gqa"
            else KB
            if isinstance(g.kv_cache_spec, MLAAttentionSpec)
            else g.kv_cache_spec.block_size
            for g in kv_cfg.kv_cache_groups
        ]
        device = torch.device("cuda", local_rank) if spec.device == "cuda" else torch.device("cpu")
        kv_caches = allocate_kv_cache(kv_cfg, device, KVCacheLayout[vc.cache_config.kv_cache_layout], kernel)
        mem = Memory(kv_caches, kv_cfg, specs, spec.tp, rank)
        garbage = _rand(spec.seed, (7, zlib.crc32(spec.engine_id.encode()), rank), mem.flat.numel())
        mem.flat.copy_(torch.from_numpy(garbage))  # every byte starts as garbage: untouched ones must stay so
        connector.register_kv_caches(kv_caches)
        from hybrid_kv.torch_adapter import tensor_memory

        mem_types = sorted({tensor_memory(v, n)["mem_type"] for n, v in kv_caches.items()})
        conn.send(("ok", {"blocks": kv_cfg.num_blocks, "mem_types": mem_types}))
        before: Any = mem.snapshot()
        stuck: Any = None  # the real NIXL calls while "stick" is on
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                connector.shutdown()
                conn.send(("ok", None))
                return
            if cmd == "fill":  # the prefill's "forward": its requests' KV shares land in their blocks
                host = mem.snapshot()
                for ids, index, tokens in args[0]:
                    mem.write(host, ids, Content(spec.seed, index, tokens))
                mem.flat.copy_(host)
                before = host
                conn.send(("ok", None))
            elif cmd == "mark":
                before = mem.snapshot()
                conn.send(("ok", None))
            elif cmd == "rewrite_after_digest":  # verify tests: request args[0]'s blocks are re-written (another
                # request's content, a reused block) right after this prefill worker digested them for a decode
                target, index = args

                def rewrite(rid: str, ids: list[list[int]], target: str = target, index: int = index) -> None:
                    if rid == target:
                        host = mem.snapshot()
                        mem.write(host, ids, Content(spec.seed, index, 64))
                        mem.flat.copy_(host)

                connector.worker.after_digest = rewrite
                conn.send(("ok", None))
            elif cmd == "forward":  # a prefill forward, layer by layer with vLLM's save hooks (see the module docs)
                meta, work, fail = args
                t0 = time.perf_counter()
                if fail:
                    _fail_first_transfer(connector, set(fail))
                connector.bind_connector_metadata(meta)
                for name in mem.forward_order():
                    mem.compute_layer(name, work, spec.seed)
                    if spec.layer_s:
                        time.sleep(spec.layer_s)
                    if not isinstance(specs[name], MambaSpec):
                        connector.save_kv_layer(name, None, None)
                hooks = connector.worker.hooks
                released = (hooks.released, hooks.num_stages) if hooks is not None and hooks.active else None
                connector.start_load_kv(None)
                connector.wait_for_save()
                before = mem.snapshot()
                res = connector.get_transfer_results(set())
                invalid = connector.get_block_ids_with_load_errors()
                stats = connector.get_kv_connector_stats()
                connector.clear_connector_metadata()
                dt = time.perf_counter() - t0
                out = (set(res.finished_sending), set(res.finished_recving), set(res.failed_recving), invalid)
                conn.send(("ok", (*out, None if stats is None else stats.data, dt, released)))
            elif cmd == "stick":  # NIXL "posts" this worker's transfers without moving a byte and will not cancel
                # them (releasing raises, as for a transfer still in progress) until called with False
                nixl = connector.worker.server._agent.nixl
                if args[0]:
                    stuck = (nixl.transfer, nixl.check_xfer_state, nixl.release_xfer_handle)

                    def refuse(xfer: Any) -> None:
                        from hybrid_kv.transport.agent import NIXL_ERRORS

                        raise NIXL_ERRORS[0]("still in progress")

                    nixl.transfer = lambda xfer, *a, **k: "PROC"
                    nixl.check_xfer_state = lambda xfer: "PROC"
                    nixl.release_xfer_handle = refuse
                else:
                    nixl.transfer, nixl.check_xfer_state, nixl.release_xfer_handle = stuck
                conn.send(("ok", None))
            elif cmd == "stream_state":  # prefill side: registrations kept, engines linked
                w = connector.worker
                conn.send(("ok", (w.leases.stream_reg_count(), sorted(w.links))))
            elif cmd == "step":
                meta = args[0]
                t0 = time.perf_counter()
                connector.bind_connector_metadata(meta)
                connector.start_load_kv(None)
                connector.wait_for_save()
                res = connector.get_transfer_results(set())
                invalid = connector.get_block_ids_with_load_errors()
                stats = connector.get_kv_connector_stats()
                connector.clear_connector_metadata()
                dt = time.perf_counter() - t0
                conn.send(
                    (
                        "ok",
                        (
                            set(res.finished_sending),
                            set(res.finished_recving),
                            set(res.failed_recving),
                            invalid,
                            None if stats is None else stats.data,
                            dt,
                            None,
                        ),
                    )
                )
            elif cmd == "verify_some":  # as verify, not looking at the bytes blocks args[1] hold (a failed load's)
                checks, skip = args
                expected = before.clone()
                for ids, index, tokens, moved in checks:
                    mem.write(expected, ids, Content(spec.seed, index, tokens), moved)
                skipped = np.zeros(expected.numel(), dtype=bool)
                for k in range(4):  # the bytes a write to ``skip`` reaches (one content leaves a byte 0 in 256)
                    probe = torch.zeros_like(expected)
                    mem.write(probe, skip, Content(spec.seed, 10**6 + k, 2048))
                    skipped |= probe.numpy() != 0
                now, want = mem.snapshot().numpy(), expected.numpy()
                diff = np.flatnonzero((now != want) & ~skipped)
                msg = None if diff.size == 0 else f"{diff.size} bytes differ; first at byte {int(diff[0])}"
                conn.send(("ok", (msg, int(now.size))))
            elif cmd == "verify":  # every byte: what landed, and that nothing else changed
                expected = before.clone()
                for ids, index, tokens, moved in args[0]:
                    mem.write(expected, ids, Content(spec.seed, index, tokens), moved)
                now = mem.snapshot().numpy()
                want = expected.numpy()
                diff = np.flatnonzero(now != want)
                msg = None if diff.size == 0 else f"{diff.size} bytes differ; first at byte {int(diff[0])}"
                conn.send(("ok", (msg, int(now.size))))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))


PRELOAD = (
    "torch",
    "vllm.config",
    "vllm.distributed",
    "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.kv_cache_layout",
    "vllm.v1.worker.utils",
    "hybrid_kv.integrations.vllm.connector",
    "vllm_harness",
)
"""What the CPU workers' fork server imports once, so each worker starts without importing vLLM again (about 10 s
of CPU a process, most of these tests' time)."""


def _context(device: str) -> Any:
    """Worker processes for CPU engines fork from a server that preloaded vLLM (``PRELOAD``; it starts no thread
    and no CUDA); CUDA workers are spawned (a process that forks must not have touched CUDA, and spawn guarantees
    it)."""
    if device != "cpu":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server starts (the first worker)
    return ctx


class Workers:
    """An engine's worker processes."""

    def __init__(self, spec: EngineSpec, timeout_s: float = 240.0) -> None:
        ctx = _context(spec.device)
        self.spec = spec
        self.timeout_s = timeout_s
        dist_port = listen_port()
        self.conns = []
        self.procs = []
        for r in range(spec.tp):
            a, b = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(spec, r, dist_port, b), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        self.ready: list[Any] = self.gather()  # each rank's ready report: blocks, the NIXL memory types of its KV

    def gather(self) -> list[Any]:
        out = []
        for r, c in enumerate(self.conns):
            if not c.poll(self.timeout_s):
                raise TimeoutError(f"{self.spec.engine_id} rank {r}: no answer within {self.timeout_s} s")
            kind, value = c.recv()
            if kind != "ok":
                raise RuntimeError(f"{self.spec.engine_id} rank {r}: {value}")
            out.append(value)
        return out

    def call(self, *cmd: Any) -> list[Any]:
        for c in self.conns:
            c.send(cmd)
        return self.gather()

    def close(self) -> None:
        try:
            self.call("stop")
        except Exception:
            pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


# ---------------------------------------------------------------------------------------------- engines


@dataclass
class Engine:
    """A real vLLM ``Scheduler`` with the connector's scheduler half, and its workers."""

    spec: EngineSpec
    workers: Workers
    vc: Any
    kv_cfg: Any
    scheduler: Any
    pending: dict[str, dict[str, int]] = field(default_factory=lambda: {"send": {}, "recv": {}})
    outputs: dict[str, Any] = field(default_factory=dict)
    finish_reasons: dict[str, Any] = field(default_factory=dict)  # request -> vLLM's FinishReason, once finished
    metas: list[Any] = field(default_factory=list)
    stats: list[dict[str, Any]] = field(default_factory=list)
    worker_step_s: float = 0.0
    fills: dict[str, tuple[int, int]] = field(default_factory=dict)  # request -> (content index, tokens)
    released: list[Any] = field(default_factory=list)  # layerwise forwards: (stages released by hooks, stages)
    fail: set[str] = field(default_factory=set)  # endpoint request ids whose first posted transfer NIXL fails

    @classmethod
    def start(cls, spec: EngineSpec) -> Engine:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        workers = Workers(spec)
        vc, kv_cfg, _ = build(spec)
        vc.cache_config.num_gpu_blocks = kv_cfg.num_blocks
        sched = Scheduler(
            vllm_config=vc,
            kv_cache_config=kv_cfg,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=spec.logical_block_size,
        )
        return cls(spec, workers, vc, kv_cfg, sched)

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def add(self, request_id: str, tokens: list[int], params: dict[str, Any] | None, index: int) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=1 if params and params.get("do_remote_decode") else 2)
        sp.update_from_generation_config({}, 50256)
        req = Request(request_id=request_id, prompt_token_ids=list(tokens), sampling_params=sp, pooling_params=None)
        req.kv_transfer_params = params
        self.scheduler.add_request(req)
        self.fills[request_id] = (index, len(tokens))
        return req

    def step(self) -> dict[str, Any]:
        """One engine step; returns the finished requests' ``kv_transfer_params`` by request id."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        self.metas.append(meta)
        work = self._forward_work(so) if self.spec.layerwise else []
        if work:
            fail, self.fail = sorted(self.fail), set()
            results = self.workers.call("forward", meta, work, fail)
        else:
            if self.spec.mode and so.scheduled_new_reqs and not self.spec.layerwise:  # the prefill "forward"
                fills = []
                for new in so.scheduled_new_reqs:
                    if new.req_id in self.fills and self._is_prefill(new.req_id):
                        index, tokens = self.fills[new.req_id]
                        ids = self.connector.scheduler.clip(self.scheduler.kv_cache_manager.get_block_ids(new.req_id))
                        fills.append((ids, index, tokens))
                if fills:
                    self.workers.call("fill", fills)
            results = self.workers.call("step", meta)
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        invalid: set[int] = set()
        for s, r, f, inv, stats, dt, released in results:
            self.worker_step_s += dt
            if released is not None:
                self.released.append(released)
            for kind, ids, done in (("send", s, sending), ("recv", r, recving)):
                for rid in ids:
                    n = self.pending[kind].get(rid, 0) + 1
                    if n == self.spec.tp:
                        self.pending[kind].pop(rid, None)
                        done.add(rid)
                    else:
                        self.pending[kind][rid] = n
            failed |= f
            invalid |= inv
            if stats:
                self.stats.append(stats)
        req_ids = list(so.num_scheduled_tokens)
        kv_out = KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            failed_recving=failed,
            invalid_block_ids=invalid,
        )
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[self._sampled(r) for r in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kv_out,
        )
        finished: dict[str, Any] = {}
        for eco in self.scheduler.update_from_output(so, mro).values():
            for out in eco.outputs:
                if out.finish_reason is not None:
                    finished[out.request_id] = out.kv_transfer_params
                    self.finish_reasons[out.request_id] = out.finish_reason
        self.outputs.update(finished)
        return finished

    def _sampled(self, rid: str) -> list[int]:
        """What the model runner samples for ``rid`` this step: nothing for a prefill chunk that is not the last
        (vLLM discards it), else one token."""
        req = self.scheduler.requests.get(rid)
        return [] if req is not None and req.num_computed_tokens < req.num_tokens else [7]

    def _forward_work(self, so: Any) -> list[tuple[list[list[int]], int, int, bool]]:
        """This step's prefill computation: ``(blocks, content index, tokens computed after it, last chunk)`` per
        prefill request it schedules."""
        computed = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        work = []
        for rid, n in so.num_scheduled_tokens.items():
            if rid not in self.fills or not self._is_prefill(rid):
                continue
            covered = computed[rid] + n
            last = covered >= self.scheduler.requests[rid].num_prompt_tokens
            ids = self.connector.scheduler.clip(self.scheduler.kv_cache_manager.get_block_ids(rid))
            work.append((ids, self.fills[rid][0], covered, last))
        return work

    def _is_prefill(self, rid: str) -> bool:
        req = self.scheduler.requests.get(rid)
        return bool(req is not None and req.kv_transfer_params and req.kv_transfer_params.get("do_remote_decode"))

    def idle(self) -> bool:
        return not self.scheduler.requests and not any(self.pending.values())

    def counter(self, key: str) -> int:
        """Counter ``key`` of the connector's stats (``stats.COUNTERS``), summed over every step and worker."""
        return sum(int(s.get(key, 0)) for s in self.stats)

    def close(self) -> None:
        self.workers.close()


def run_until(engines: list[Engine], done: Any, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > end:
            raise TimeoutError("engines did not reach the expected state in time")
        for e in engines:
            e.step()


def prompt(index: int, n: int) -> list[int]:
    return [(index * 131 + i * 7) % 1000 + 1 for i in range(n)]


def cpu_count_ok() -> bool:
    return (os.cpu_count() or 1) >= 1


# ---------------------------------------------------------------------------------------------- one P -> D run

CONTENT_TOKENS = 2048  # tokens of KV each request's content holds (more than any prompt here)


def move(p: Engine, d: Engine, lengths: list[int], *, first: int = 0) -> list[tuple[int, dict[str, Any]]]:
    """Prefill request ``first + i`` (a prompt of ``lengths[i]`` tokens, KV content ``first + i``) on ``p``, hand its
    ``kv_transfer_params`` to ``d`` as a router does, and run both engines until every decode request finished
    and ``p`` is idle. Returns ``(content index, kv_transfer_params as the prefill returned them)`` per request."""
    ids = [first + k for k in range(len(lengths))]
    for i, n in zip(ids, lengths, strict=True):
        p.add(f"p-{i}", prompt(i, n), {"do_remote_decode": True}, i)
        p.fills[f"p-{i}"] = (i, CONTENT_TOKENS)
    run_until([p], lambda: all(f"p-{i}" in p.outputs for i in ids))
    reqs = []
    for i, n in zip(ids, lengths, strict=True):
        params = dict(p.outputs[f"p-{i}"])
        reqs.append((i, dict(params)))  # as the prefill returned them (the decode's connector consumes its copy)
        d.add(f"d-{i}", prompt(i, n), params, i)
    run_until([p, d], lambda: all(f"d-{i}" in d.outputs for i in ids) and p.idle())
    return reqs


def stream_params(p: Engine, cap: str) -> dict[str, Any]:
    """A decode request's ``kv_transfer_params`` for a concurrent push from ``p``, as a router writes them."""
    return {
        "do_remote_prefill": True,
        "hkv_stream": cap,
        "remote_engine_id": p.spec.engine_id,
        "remote_host": p.spec.host,
        "remote_port": p.spec.port,
        "tp_size": p.spec.tp,
    }


def route_concurrent(
    p: Engine, d: Engine, lengths: list[int], *, first: int = 0, wait: bool = True
) -> list[tuple[int, dict[str, Any]]]:
    """Send request ``first + i`` (a prompt of ``lengths[i]`` tokens, KV content ``first + i``) to ``d`` and ``p``
    at once with one fresh capability, as a router doing concurrent push does: the decode requests first, then
    (``wait``) both engines step until every prefill worker holds the registrations and is connected to ``d``,
    so the prefill streams; then the prefill requests. Runs until every decode request finished and ``p`` is
    idle. Returns ``(content index, the prefill's returned kv_transfer_params)`` per request."""
    caps = {}
    for k, n in enumerate(lengths):
        i = first + k
        caps[i] = os.urandom(16).hex()
        d.add(f"d-{i}", prompt(i, n), stream_params(p, caps[i]), i)
    if wait:
        n, engine = len(lengths), d.spec.engine_id
        run_until([d, p], lambda: all(k >= n and engine in links for k, links in p.workers.call("stream_state")))
    for k, n in enumerate(lengths):
        i = first + k
        p.add(f"p-{i}", prompt(i, n), {"do_remote_decode": True, "hkv_stream": caps[i]}, i)
        p.fills[f"p-{i}"] = (i, CONTENT_TOKENS)
    ids = [first + k for k in range(len(lengths))]
    run_until([p, d], lambda: all(f"d-{i}" in d.outputs for i in ids) and p.idle())
    return [(i, dict(p.outputs[f"p-{i}"])) for i in ids]


def verify_moved(p: Engine, d: Engine, reqs: list[tuple[int, dict[str, Any]]]) -> int:
    """Check every byte of ``d``'s workers after ``move`` (or ``route_concurrent``): each request's blocks hold its
    content (attention cells for the tokens the transfer covers, whole SSM states) and no other byte changed;
    the check reports a wrong content; ``p``'s memory is unchanged; both engines are idle and ``p`` freed every
    block. Returns the number of decode bytes checked."""
    from hybrid_kv.integrations.vllm.layout import transfer_group_kinds

    recv = {rid: r for meta in d.metas for rid, r in meta.recv.items()}
    kinds = transfer_group_kinds(d.kv_cfg)
    checks = []
    for i, params in reqs:
        r = recv[f"d-{i}"]
        remote = params["remote_block_ids"]  # the prefill's blocks, as its output names them
        if not r.cap:
            assert r.remote_block_ids == remote
        moved = None
        for g, kind in enumerate(kinds):
            if kind != "ssm":
                moved = min(
                    len(remote[g]) * p.spec.logical_block_size,
                    len(r.local_block_ids[g]) * d.spec.logical_block_size,
                )
        checks.append((r.local_block_ids, i, CONTENT_TOKENS, moved))
    checked = 0
    for problem, nbytes in d.workers.call("verify", checks):
        assert problem is None, problem
        assert nbytes > 0
        checked += nbytes
    wrong = [(checks[0][0], checks[0][1] + 1000, CONTENT_TOKENS, checks[0][3])]
    assert all(problem is not None for problem, _ in d.workers.call("verify", wrong)), "the byte check is blind"
    for problem, _ in p.workers.call("verify", []):
        assert problem is None, f"prefill memory changed: {problem}"
    assert p.idle() and d.idle()
    assert p.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == p.kv_cfg.num_blocks - 1
    return checked
