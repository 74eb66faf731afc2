"""The harness's worker processes: one per TP rank, each building vLLM's distributed environment, the
connector (role WORKER) and KV caches, then serving the test's commands (fill, forward, step, verify, faults);
CPU workers fork from a server that imported vLLM once (``PRELOAD``). ``vllm_harness`` describes the harness."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
import zlib
from typing import Any

import numpy as np
from free_ports import listen_port
from harness_memory import Content, Memory, _rand
from harness_models import KB, EngineSpec, build

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
    "harness_worker",
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
