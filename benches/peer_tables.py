"""Per-peer table construction through Python: ``PeerPlan(local, payloads, "pull")`` for DeepSeek-V3 (61 MLA
layers x 100,000 kernel blocks per rank), decode rank 0, coalesced (the default) and reference tables.

What a connector pays once per peer engine, including decoding and checking the peers' payload bytes.
Median of 7 samples of 50 calls each.

Run: ``PYTHONPATH=python python benches/peer_tables.py``
"""

from __future__ import annotations

import statistics
import time

import hybrid_kv
from hybrid_kv.presets import get_preset

PRESET = get_preset("deepseek-v3")


def rank(tp: int, r: int, engine: str) -> tuple[hybrid_kv.RegionTable, bytes]:
    table = hybrid_kv.build_region_table(PRESET.rank_layout(tp=tp, rank=r, num_blocks=100_000))
    return table, table.handshake_payload(PRESET.engine_info(engine, "pull"))


def median_us(fn: object, calls: int = 50, samples: int = 7) -> float:
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()  # type: ignore[operator]
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times) * 1e6


def main() -> None:
    for p_tp, d_tp in ((8, 16), (16, 8)):
        decode, _ = rank(d_tp, 0, "decode")
        payloads = [rank(p_tp, r, "prefill")[1] for r in hybrid_kv.handshake_target_ranks(0, d_tp, p_tp)]
        coalesced = median_us(lambda d=decode, p=payloads: hybrid_kv.PeerPlan(d, p, "pull"))
        reference = median_us(lambda d=decode, p=payloads: hybrid_kv.PeerPlan(d, p, "pull", coalesce=False))
        print(f"P{p_tp} -> D{d_tp}: coalesced {coalesced:.0f} us, reference {reference:.0f} us")


if __name__ == "__main__":
    main()
