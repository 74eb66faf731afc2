"""Validate and plan from peer payloads: ``validate_handshake`` per payload then ``PeerPlan`` (each call decodes
the payloads again: the call sequence before ``own_payload`` existed) against ``PeerPlan(..., own_payload=...)``, which
decodes each payload once, validates and plans.

Median of 30 calls. Run: ``python benches/validate_then_plan.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import hybrid_kv as hk
from hybrid_kv.presets import get_preset


def median_us(fn: Callable[[], object], n: int = 30) -> float:
    """Median wall time of ``fn`` in microseconds."""
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2] * 1e6


def main() -> None:
    for name, d_tp, p_tp in (("deepseek-v3", 16, 8), ("kimi-linear-48b-a3b", 1, 4)):
        pre = get_preset(name)
        decode = hk.build_region_table(pre.rank_layout(tp=d_tp, rank=0, num_blocks=4096))
        mine = decode.handshake_payload(pre.engine_info("decode", "pull"))
        info = pre.engine_info("prefill", "pull")
        payloads = [
            hk.build_region_table(pre.rank_layout(tp=p_tp, rank=r, num_blocks=4096)).handshake_payload(info)
            for r in hk.handshake_target_ranks(0, d_tp, p_tp)
        ]

        def separate(payloads: list[bytes] = payloads, mine: bytes = mine, decode: hk.RegionTable = decode) -> None:
            for p in payloads:
                hk.validate_handshake(mine, p)
            hk.PeerPlan(decode, payloads, "pull")

        def once(payloads: list[bytes] = payloads, mine: bytes = mine, decode: hk.RegionTable = decode) -> None:
            hk.PeerPlan(decode, payloads, "pull", own_payload=mine)

        n = len(payloads)
        print(
            f"{name} D TP{d_tp} <- P TP{p_tp}, {n} payload(s) of {len(payloads[0])} B: "
            f"validate_handshake x{n} + PeerPlan {median_us(separate):.0f} us; "
            f"PeerPlan(own_payload=) {median_us(once):.0f} us; "
            f"decode_meta x{n} alone {median_us(lambda p=payloads: [hk.decode_meta(x) for x in p]):.0f} us"
        )


if __name__ == "__main__":
    main()
