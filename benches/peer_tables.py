"""Per-peer table construction through Python, DeepSeek-V3 (61 MLA layers x 100,000 kernel blocks per rank): what
a connector pays once per peer engine, ``PeerPlan(local, payloads, mode)`` (decoding and checking the peers'
payload bytes included) plus every table it preps (``local_rows`` of every key, ``remote_rows`` of every rank),
coalesced (the default) and reference (``coalesce=False``), for P8 -> D16 pull and push and P16 -> D8 pull.

This is hybrid-kv alone; ``benches/peer_tables_vs_vllm.py`` runs the same tables side by side with vLLM 0.33.0's
own ``add_remote_agent``. ``--against DIR`` times another build of the extension in the
same process, interleaved round robin: DIR holds a package ``h5old`` with that build's
``_core.cpython-*.so`` (its module init is ``PyInit__core``, so it loads beside ``hybrid_kv._core``).

Median of 7 rounds of 30 calls each per implementation.

Run: ``PYTHONPATH=python python benches/peer_tables.py [--against /tmp/h5-before]``
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from other_build import import_package

import hybrid_kv
from hybrid_kv.presets import get_preset

PRESET = get_preset("deepseek-v3")
CASES = (("P8 -> D16 pull", 8, 16, "pull"), ("P8 -> D16 push", 8, 16, "push"), ("P16 -> D8 pull", 16, 8, "pull"))


def rank(core: Any, tp: int, r: int, engine: str, mode: str) -> tuple[Any, bytes]:
    table = core.RegionTable.from_json(json.dumps(PRESET.rank_layout(tp=tp, rank=r, num_blocks=100_000)))
    return table, table.handshake_payload(PRESET.engine_info(engine, mode))


def peer_tables(core: Any, p_tp: int, d_tp: int, mode: str, coalesce: bool) -> Callable[[], None]:
    """One peer's tables, built from scratch: local rank 0 of the posting side against every target rank."""
    local_tp, remote_tp, local_engine, remote_engine = (
        (d_tp, p_tp, "decode", "prefill") if mode == "pull" else (p_tp, d_tp, "prefill", "decode")
    )
    local, _ = rank(core, local_tp, 0, local_engine, mode)
    targets = core.handshake_target_ranks(0, local_tp, remote_tp)
    payloads = [rank(core, remote_tp, r, remote_engine, mode)[1] for r in targets]

    def build() -> None:
        peer = core.PeerPlan(local, payloads, mode, coalesce=coalesce)
        for key in peer.table_keys:
            peer.local_rows(key)
        for r in peer.remote_ranks:
            peer.remote_rows(r)

    return build


def sample_us(fn: Callable[[], None], calls: int = 30) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", help="directory holding package h5old with another build's _core extension")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    impls: dict[str, Any] = {"this build": hybrid_kv._core}
    if args.against:
        import_package(args.against, "h5old")
        impls["other build"] = importlib.import_module("h5old._core")
    for name, p_tp, d_tp, mode in CASES:
        for coalesce in (True, False):
            fns = {k: peer_tables(core, p_tp, d_tp, mode, coalesce) for k, core in impls.items()}
            times: dict[str, list[float]] = {k: [] for k in fns}
            for fn in fns.values():
                fn()  # warm-up
            for _ in range(args.rounds):
                for k, fn in fns.items():
                    times[k].append(sample_us(fn))
            med = {k: statistics.median(v) for k, v in times.items()}
            cells = ", ".join(f"{k} {v:.0f} us" for k, v in med.items())
            ratio = f" (other / this {med['other build'] / med['this build']:.2f}x)" if len(med) > 1 else ""
            print(f"{name}, {'coalesced' if coalesce else 'reference'}: {cells}{ratio}", flush=True)


if __name__ == "__main__":
    main()
