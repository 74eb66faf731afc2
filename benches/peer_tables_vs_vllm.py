"""Per-peer tables side by side with vLLM 0.33.0's own ``add_remote_agent``, DeepSeek-V3 (61 MLA layers x 100,000
64-token kernel blocks of 73,728 bytes per rank), in one process, interleaved round by round.

hybrid-kv: ``PeerPlan(local, payloads, mode, coalesce=...)`` (decoding and checking every target rank's payload bytes)
plus every ``local_rows`` and ``remote_rows``, as ``benches/peer_tables.py`` times it.

vLLM: for every target rank (``TransferTopology.handshake_target_ranks``), ``msgspec`` decoding of that rank's
``NixlAgentMetadata`` bytes (what ``_nixl_handshake`` does before it) and ``add_remote_agent(meta, rank, remote_tp)``
of ``NixlPullConnectorWorker`` / ``NixlPushConnectorWorker``, vLLM's code unchanged. The worker is made with
``object.__new__`` and given the attributes ``register_kv_caches`` would set for this geometry (one MLA region per
layer, ``_region_is_mla`` all true, ``src_blocks_data`` from vLLM's own ``register_local_xfer_handler`` run once at
set-up, as vLLM runs it once at registration, not per peer). Stubbed: NIXL itself, by ``RecordingNixl`` (its
``add_remote_agent`` returns a name, ``prep_xfer_dlist`` returns a handle and keeps the descriptor array it was
given, so the bench checks that vLLM prepped one strided row per layer). Each call starts from no state for the peer
engine (its entries in the topology and per-engine dicts are dropped first, outside the timing), so both sides build
a peer from scratch.

Interleaved call by call (vLLM, coalesced, reference, vLLM, ...), ``--calls`` timed calls each, in ``--runs`` fresh
processes (each its own interpreter, caches and allocator state), each run once idle and once beside ``--busy``
processes spinning ``python3 -c "while True: pass"`` (started before the run's process, killed after it), the idle
and loaded runs alternating. Per run the median of each implementation's calls; reported: the median over the runs
of each median and of each run's ratio vLLM / hybrid-kv (above 1: hybrid-kv is faster), with the runs' range.

What is timed on each side is what a connector does per peer engine; what either side does once per rank is done
before the timing, on both sides: vLLM's local handles (``register_local_xfer_handler``), hybrid-kv's coalesced base
local table (``RegionTable.chunked_bases``, shared by every plan of the rank, and its rows copied into numpy once:
``PeerPlan.local_rows`` of a shared table). ``fresh local`` (``--fresh-local``) shows what a harness that also counts
the latter pays: a new ``RegionTable`` per call, whose first plan builds the base table's 7,686 chunk rows and copies
them out.

``--against DIR`` adds another build of the extension (coalesced), loaded beside this one as in
``benches/peer_tables.py`` (DIR holds a package ``h5old`` with that build's ``_core.cpython-*.so``).

Run (vLLM 0.33 venv, no GPU needed): ``PYTHONPATH=python ~/.venvs/hybrid-kv-vllm/bin/python
benches/peer_tables_vs_vllm.py [--runs 3] [--busy 2] [--calls 400] [--fresh-local] [--against /tmp/h6-before]``
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import msgspec

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from other_build import import_package  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker  # noqa: E402
from vllm.v1.kv_cache_interface import MLAAttentionSpec  # noqa: E402

import hybrid_kv  # noqa: E402
from hybrid_kv.presets import get_preset  # noqa: E402

PRESET = get_preset("deepseek-v3")
NUM_BLOCKS = 100_000
CASES = (
    ("P8 -> D16 pull", 8, 16, "pull"),
    ("P8 -> D16 push", 8, 16, "push"),
    ("P16 -> D8 pull", 16, 8, "pull"),
    ("P16 -> D8 push", 16, 8, "push"),
)
REMOTE_ENGINE = "remote-engine"


class RecordingNixl:
    """Stands in for vLLM's NixlWrapper: cheap returns, and the descriptor arrays it was asked to prep are kept."""

    def __init__(self) -> None:
        self.prepped: list[Any] = []

    def add_remote_agent(self, metadata: bytes) -> str:
        return "remote-agent"

    def prep_xfer_dlist(self, agent: str, descs: Any, mem_type: str = "VRAM") -> int:
        self.prepped.append(descs)
        return len(self.prepped)


def layout(tp: int, r: int) -> dict[str, Any]:
    return PRESET.rank_layout(tp=tp, rank=r, num_blocks=NUM_BLOCKS)  # type: ignore[no-any-return]


def geometry(lay: dict[str, Any]) -> tuple[list[int], list[int], int]:
    """Base addresses, per-layer block lengths and the kernel block size of a rank layout."""
    bs = lay["kernel_block_size"]
    bases = [layer["memory"]["base"] for layer in lay["layers"]]
    lens = [bs * layer["spec"]["head_size"] * layer["spec"]["dtype_bytes"] for layer in lay["layers"]]
    return bases, lens, bs


def vllm_worker(local_tp: int, mode: str) -> tuple[Any, RecordingNixl]:
    """vLLM's worker for local rank 0 with the state register_kv_caches leaves for this geometry."""
    cls = NixlPullConnectorWorker if mode == "pull" else NixlPushConnectorWorker
    w: Any = object.__new__(cls)
    bases, lens, bs = geometry(layout(local_tp, 0))
    n = len(bases)
    nixl = RecordingNixl()
    w.nixl_wrapper = nixl
    w.engine_id, w.tp_rank, w.device_id, w.block_size = "local-engine", 0, 0, bs
    w.transfer_topo = TransferTopology(
        tp_rank=0, tp_size=local_tp, block_size=bs, engine_id=w.engine_id, is_mla=True, is_mamba=False,
        total_num_kv_heads=1, attn_backends=[], dcp_size=1,
    )  # fmt: skip
    w.use_mla, w._has_mamba, w.pp_size, w.dcp_size = True, False, 1, 1
    w._group_spec_types = (MLAAttentionSpec,)
    w._layer_specs = {}
    w._transfer_layer_region_indices = ()
    w._transfer_layer_names = ()
    w._packed_member_layouts = {}
    w._head_sharded_draft_regions = set()
    w._head_sharded_draft_kv_heads = None
    w._region_is_mla = [True] * n
    w._mixed_mem_types = False
    w._physical_blocks_per_logical_kv_block = 1
    w._is_hma_required = False
    w.use_host_buffer = False
    w.kv_cache_layout = w.host_buffer_kv_cache_layout = "HND"
    w.backend_name = "FLASHMLA"
    w.enable_permute_local_kv = False
    w.nixl_memory_type = "VRAM"
    w.num_regions = n
    w.num_blocks = NUM_BLOCKS
    w.block_len_per_layer = lens
    w.block_stride_per_layer = list(lens)
    w.region_num_blocks = [NUM_BLOCKS] * n
    w.region_group_ids = [0] * n
    w.region_mem_types = ["VRAM"] * n
    w.region_names = [layer["name"] for layer in layout(local_tp, 0)["layers"]]
    w.num_descs = NUM_BLOCKS * n
    w._remote_agents = defaultdict(dict)
    w.kv_caches_base_addr = defaultdict(dict)
    w.kv_caches_base_addr[w.engine_id][0] = bases
    w.tp_mappings, w.draft_tp_mappings = {}, {}
    w.dst_num_blocks, w.dst_region_num_blocks, w.dst_region_group_ids = {}, {}, {}
    w.dst_uses_region_group_mapping, w.dst_region_mem_types = {}, {}
    w.dst_xfer_side_handles = defaultdict(dict)
    w.src_xfer_handles_by_block_size, w.src_blocks_data_by_block_size = {}, {}
    w.src_xfer_handles_by_tp_ratio, w._dram_src_handles_by_tp_ratio = {}, {}
    w.src_xfer_handles_by_block_size[bs], w.src_blocks_data = w.register_local_xfer_handler(bs)
    return w, nixl


def agent_metadata_bytes(remote_tp: int, r: int) -> bytes:
    lay = layout(remote_tp, r)
    bases, lens, bs = geometry(lay)
    n = len(bases)
    meta = NixlAgentMetadata(
        engine_id=REMOTE_ENGINE, agent_metadata=b"\0" * 64, kv_caches_base_addr=bases, device_id=0,
        num_blocks=NUM_BLOCKS, block_lens=lens, block_strides=list(lens), kv_cache_layout="HND", block_size=bs,
        ssm_sizes=(0, 0), attn_backend_name="FLASHMLA", physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[NUM_BLOCKS] * n, region_group_ids=[0] * n,
        region_names=[layer["name"] for layer in lay["layers"]], region_mem_types=["VRAM"] * n,
    )  # fmt: skip
    return msgspec.msgpack.encode(meta)


def vllm_peer(p_tp: int, d_tp: int, mode: str) -> tuple[Callable[[], None], Callable[[], None], RecordingNixl]:
    """(reset, build, nixl): build = decode + add_remote_agent of every target rank, from a clean peer state."""
    local_tp, remote_tp = (d_tp, p_tp) if mode == "pull" else (p_tp, d_tp)
    w, nixl = vllm_worker(local_tp, mode)
    targets = w.transfer_topo.handshake_target_ranks(remote_tp)
    payloads = [(r, agent_metadata_bytes(remote_tp, r)) for r in targets]
    decoder = msgspec.msgpack.Decoder(NixlAgentMetadata)

    def reset() -> None:
        w.transfer_topo.unregister_remote_engine(REMOTE_ENGINE)
        for d in (w.tp_mappings, w.dst_num_blocks, w.dst_region_num_blocks, w.dst_region_group_ids,
                  w.dst_uses_region_group_mapping, w.dst_region_mem_types, w.dst_xfer_side_handles,
                  w.kv_caches_base_addr):  # fmt: skip
            d.pop(REMOTE_ENGINE, None)
        w.src_xfer_handles_by_tp_ratio.clear()
        nixl.prepped.clear()

    def build() -> None:
        for r, data in payloads:
            w.add_remote_agent(decoder.decode(data), r, remote_tp)

    return reset, build, nixl


def ours_peer(core: Any, p_tp: int, d_tp: int, mode: str, coalesce: bool) -> Callable[[], None]:
    local_tp, remote_tp, local_engine, remote_engine = (
        (d_tp, p_tp, "decode", "prefill") if mode == "pull" else (p_tp, d_tp, "prefill", "decode")
    )

    def rank(tp: int, r: int, engine: str) -> tuple[Any, bytes]:
        table = core.RegionTable.from_json(json.dumps(layout(tp, r)))
        return table, table.handshake_payload(PRESET.engine_info(engine, mode))

    local, _ = rank(local_tp, 0, local_engine)
    payloads = [rank(remote_tp, r, remote_engine)[1] for r in core.handshake_target_ranks(0, local_tp, remote_tp)]

    def build() -> None:
        peer = core.PeerPlan(local, payloads, mode, coalesce=coalesce)
        for key in peer.table_keys:
            peer.local_rows(key)
        for r in peer.remote_ranks:
            peer.remote_rows(r)

    return build


def fresh_local_peer(core: Any, p_tp: int, d_tp: int, mode: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """(reset, build) as ``ours_peer`` coalesced, with a new local ``RegionTable`` per call (made in the untimed
    reset), so nothing the rank's earlier plans built is reused."""
    local_tp, remote_tp, local_engine, remote_engine = (
        (d_tp, p_tp, "decode", "prefill") if mode == "pull" else (p_tp, d_tp, "prefill", "decode")
    )
    local_json = json.dumps(layout(local_tp, 0))
    payloads = [
        core.RegionTable.from_json(json.dumps(layout(remote_tp, r))).handshake_payload(
            PRESET.engine_info(remote_engine, mode)
        )
        for r in core.handshake_target_ranks(0, local_tp, remote_tp)
    ]
    held: list[Any] = []

    def reset() -> None:
        held[:] = [core.RegionTable.from_json(local_json)]

    def build() -> None:
        peer = core.PeerPlan(held[0], payloads, mode, coalesce=True)
        for key in peer.table_keys:
            peer.local_rows(key)
        for r in peer.remote_ranks:
            peer.remote_rows(r)

    return reset, build


def one_call_us(reset: Callable[[], None], build: Callable[[], None]) -> float:
    """Microseconds of one build, after an untimed reset."""
    reset()
    t0 = time.perf_counter()
    build()
    return (time.perf_counter() - t0) * 1e6


def run_once(calls: int, fresh_local: bool, against: str | None) -> dict[str, dict[str, float]]:
    """One process's medians: ``{case: {implementation: us}}``."""
    logging.getLogger("vllm").setLevel(logging.ERROR)
    other = None
    if against:
        import_package(against, "h5old")
        other = importlib.import_module("h5old._core")
    out: dict[str, dict[str, float]] = {}
    for name, p_tp, d_tp, mode in CASES:
        v_reset, v_build, nixl = vllm_peer(p_tp, d_tp, mode)
        v_reset()
        v_build()
        remote_rows = [len(d) for d in nixl.prepped]
        assert remote_rows and all(n == 61 for n in remote_rows), remote_rows
        impls = {
            "vllm": (v_reset, v_build),
            "coalesced": (lambda: None, ours_peer(hybrid_kv._core, p_tp, d_tp, mode, True)),
            "reference": (lambda: None, ours_peer(hybrid_kv._core, p_tp, d_tp, mode, False)),
        }
        if fresh_local:
            impls["fresh local"] = fresh_local_peer(hybrid_kv._core, p_tp, d_tp, mode)
        if other is not None:
            impls["other"] = (lambda: None, ours_peer(other, p_tp, d_tp, mode, True))
        times: dict[str, list[float]] = {k: [] for k in impls}
        for reset, build in impls.values():
            reset()
            build()  # warm-up
        for _ in range(calls):
            for k, (reset, build) in impls.items():
                times[k].append(one_call_us(reset, build))
        out[name] = {k: statistics.median(v) for k, v in times.items()}
    return out


def child(argv: list[str]) -> dict[str, dict[str, float]]:
    """Run ``run_once`` in a fresh interpreter (this file with ``--child``) and return its medians."""
    cmd = [sys.executable, __file__, "--child", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def busy(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen(["python3", "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=400, help="timed calls per implementation, case and run")
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per load condition")
    ap.add_argument("--busy", type=int, default=2, help="spinning processes beside the loaded runs (0: idle only)")
    ap.add_argument("--fresh-local", action="store_true", help="add a column with a new RegionTable per call")
    ap.add_argument("--against", help="directory holding package h5old with another build's _core (extra column)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_once(args.calls, args.fresh_local, args.against)))
        return
    argv = ["--calls", str(args.calls)] + (["--fresh-local"] if args.fresh_local else [])
    argv += ["--against", args.against] if args.against else []
    loads = ["idle"] + ([f"{args.busy} busy"] if args.busy else [])
    runs: dict[str, list[dict[str, dict[str, float]]]] = {load: [] for load in loads}
    for i in range(args.runs):
        for load in loads if i % 2 == 0 else loads[::-1]:
            spinning = busy(args.busy) if load != "idle" else []
            try:
                print(
                    f"run {i + 1}/{args.runs}, {load}: load average {os.getloadavg()[0]:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
                runs[load].append(child(argv))
            finally:
                for p in spinning:
                    p.kill()
                    p.wait()
    impls = [k for k in runs[loads[0]][0][CASES[0][0]] if k != "vllm"]
    head = "".join(f" hybrid-kv {k} | ratio |" for k in impls)
    print(
        f"median of {args.runs} fresh-process runs, each the median of {args.calls} interleaved calls; ratio = vLLM / "
        "hybrid-kv, per run, median [min-max]"
    )
    print(f"| case | load | vLLM 0.33.0 add_remote_agent |{head}")
    print("|---|---|---|" + "---|---|" * len(impls))
    for name, *_ in CASES:
        for load in loads:
            rs = [r[name] for r in runs[load]]
            cells = []
            for k in impls:
                ratios = sorted(r["vllm"] / r[k] for r in rs)
                cells.append(
                    f" {statistics.median(r[k] for r in rs):.0f} us | **{statistics.median(ratios):.2f}x** "
                    f"[{ratios[0]:.2f}-{ratios[-1]:.2f}] |"
                )
            print(f"| {name} | {load} | {statistics.median(r['vllm'] for r in rs):.0f} us |" + "".join(cells))


if __name__ == "__main__":
    main()
