"""Time one ``PeerPlan.plan`` call through Python (the binding's whole cost per request).

DeepSeek-V3, decode TP 16 rank 0 pulling from prefill TP 8, contiguous requests of 64, 512 and 2048 blocks
(4K, 32K and 128K tokens at 64-token blocks), coalesced (the default) and reference (``coalesce=False``).
Median of 2000 calls after 100 warm-up calls. Run: ``PYTHONPATH=python python benches/plan_call.py``.
"""

from __future__ import annotations

import statistics
import time

import hybrid_kv
from hybrid_kv.presets import get_preset


def main() -> None:
    ds = get_preset("deepseek-v3")

    def table_and_meta(tp: int, rank: int, engine: str) -> tuple[hybrid_kv.RegionTable, bytes]:
        table = hybrid_kv.build_region_table(ds.rank_layout(tp=tp, rank=rank, num_blocks=4096))
        return table, table.handshake_payload(ds.engine_info(engine, "pull"))

    decode, _ = table_and_meta(16, 0, "decode")
    remotes = [table_and_meta(8, r, "prefill")[1] for r in hybrid_kv.handshake_target_ranks(0, 16, 8)]
    for coalesce in (True, False):
        peer = hybrid_kv.PeerPlan(decode, remotes, "pull", coalesce=coalesce)
        for n in (64, 512, 2048):
            local, remote = [list(range(100, 100 + n))], [list(range(7, 7 + n))]
            for _ in range(100):
                peer.plan(local, remote)
            times = []
            for _ in range(2000):
                t0 = time.perf_counter()
                peer.plan(local, remote)
                times.append(time.perf_counter() - t0)
            mode = "coalesced" if coalesce else "reference"
            print(f"{mode:9s} {n:5d} blocks: plan() {statistics.median(times) * 1e6:7.2f} us")


if __name__ == "__main__":
    main()
