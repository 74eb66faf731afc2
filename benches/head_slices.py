"""Planning cost of token-granular head slices (token-major pages split between TP sizes: one descriptor per token
and head slice) and head-granular pieces (heads-major pages of different kernel blocks on the two sides: one
descriptor per head and common unit) next to page-granular ones (heads-major pages of equal kernel blocks: one
descriptor per page and head slice), side by side in one run.

A GQA model of 48 layers, 8 KV heads of 128 bf16 elements, 16-token pages, 4096 blocks per rank; decode TP 1
pulls from prefill TP 2 (each prefill rank holds half the heads). For each case: the ``PeerPlan`` build
(tables, once per peer engine), then ``plan()`` of contiguous and scattered requests of 64, 512 and 2048 blocks,
coalesced (the default) and reference, with the id pairs each plan posts. Median of the timed calls. The
head-granular case gives the decode 8-token kernel blocks (two per 16-token block) against the prefill's 16; so
does the ``HKTV`` case (vLLM's CPU attention pages: each head's K transposed, so a head's unit is ``HEAD_DIM`` K
runs and one V run).
Run: ``PYTHONPATH=python python benches/head_slices.py``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import hybrid_kv
from hybrid_kv.layout import layer, rank_layout

LAYERS, HEADS, HEAD_DIM, TOKENS, BLOCKS = 48, 8, 128, 16, 4096
FACTORS = {
    "model": "gqa-bench",
    "dtype": "bfloat16",
    "cache_dtype": "auto",
    "total_num_kv_heads": HEADS,
    "head_size": HEAD_DIM,
    "num_hidden_layers": LAYERS,
    "attn_backend": "bench",
    "hma": False,
    "speculative": [],
    "transfer_mode": "pull",
}


def rank(order: str, tp: int, r: int, engine: str, kernel: int = TOKENS) -> tuple[hybrid_kv.RegionTable, bytes]:
    heads = HEADS // tp
    spec = {"type": "full_attention", "num_kv_heads": heads, "head_size": HEAD_DIM, "dtype_bytes": 2}
    page = TOKENS * heads * 2 * HEAD_DIM * 2
    origin = (1 << 40) * (1 + r + 4 * (engine == "prefill"))
    layers = [
        layer(f"layers.{i}.attn", 0, spec, base=origin + i * (BLOCKS * page + 4096), nbytes=BLOCKS * page)
        for i in range(LAYERS)
    ]
    layout = rank_layout(
        layers,
        logical_block_size=TOKENS,
        kernel_block_size=kernel,
        num_logical_blocks=BLOCKS,
        tp_rank=r,
        tp_size=tp,
        total_num_kv_heads=HEADS,
        kv_layout=order,
    )
    table = hybrid_kv.build_region_table(layout)
    info = {"engine_id": engine, "attn_backend": "bench", "transfer_mode": "pull"}
    return table, table.handshake_payload({**info, "compat_hash": hybrid_kv.compat_hash(FACTORS)})


def median_us(fn: Any, runs: int) -> float:
    for _ in range(max(3, runs // 20)):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    print(f"GQA {LAYERS} layers x {HEADS} KV heads x {HEAD_DIM}, {TOKENS}-token pages; decode TP 1 <- prefill TP 2")
    cases = (
        ("HND", TOKENS, "page-granular"),
        ("NHD", TOKENS, "token-granular"),
        ("HND", TOKENS // 2, "head-granular, decode kernel blocks of 8 tokens"),
        ("HKTV", TOKENS // 2, "K-transposed pieces, decode kernel blocks of 8 tokens"),
    )
    for order, kernel, what in cases:
        decode, own = rank(order, 1, 0, "decode", kernel)
        payloads = [rank(order, 2, r, "prefill")[1] for r in (0, 1)]
        for coalesce in (True, False):
            build = median_us(lambda d=decode, p=payloads, c=coalesce: hybrid_kv.PeerPlan(d, p, "pull", coalesce=c), 5)
            peer = hybrid_kv.PeerPlan(decode, payloads, "pull", coalesce=coalesce)
            rows = sum(peer.local_rows(k).shape[0] for k in peer.table_keys)
            descs = sum(peer.table_descriptors(k) for k in peer.table_keys)
            kind = "coalesced" if coalesce else "reference"
            print(
                f"{order} ({what}) {kind}: PeerPlan {build / 1e3:8.2f} ms, "
                f"local tables {rows} rows = {descs} descriptors"
            )
            for n in (64, 512, 2048):
                for shape in ("contiguous", "scattered"):
                    local = (
                        [list(range(100, 100 + n))] if shape == "contiguous" else [[(7 * i) % BLOCKS for i in range(n)]]
                    )
                    remote = (
                        [list(range(7, 7 + n))]
                        if shape == "contiguous"
                        else [[(11 * i + 3) % BLOCKS for i in range(n)]]
                    )
                    us = median_us(lambda p=peer, lo=local, re=remote: p.plan(lo, re), 200 if n < 2048 else 50)
                    ids = sum(len(t.local_ids) for t in peer.plan(local, remote).transfers)
                    print(f"    {n:5d} blocks {shape:10s}: plan() {us:10.1f} us, {ids:8d} id pairs")


if __name__ == "__main__":
    main()
