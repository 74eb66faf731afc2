"""2. Table -> prepped NIXL handle (real agent, DRAM, real buffer).

Full-size layouts come from hybrid_kv.presets. For NIXL, which must resolve every descriptor against
registered memory, the scaled layouts here keep the descriptor counts (regions, kernel blocks, ppl, SSM streams)
of the presets but shrink every page so the whole table fits one real buffer.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
from baselines import numpy_impl, python_loop
from baselines.geometry import Geometry

import hybrid_kv as hk

from .common import nixl_agent
from .timing import fmt_r, fmt_t, print_table, side_by_side


def mla_spec(head_size: int, dtype_bytes: int) -> dict[str, Any]:
    """An MLA layer spec of ``head_size`` latents of ``dtype_bytes`` bytes per token."""
    return {"type": "mla", "head_size": head_size, "dtype_bytes": dtype_bytes}


def scaled_deepseek_v3(base: int, regions: int = 61, num_blocks: int = 100_000) -> dict[str, Any]:
    """DeepSeek-V3's 61 x 100k kernel blocks with 8-byte pages (1 token of 8 one-byte latents), packed."""
    page = 8
    layers = [
        hk.layer(
            f"model.layers.{i}.self_attn",
            0,
            mla_spec(8, 1),
            base=base + i * num_blocks * page,
            nbytes=num_blocks * page,
        )
        for i in range(regions)
    ]
    return hk.rank_layout(layers, logical_block_size=1, kernel_block_size=1, num_logical_blocks=num_blocks)


def scaled_deepseek_v3_bytes(regions: int = 61, num_blocks: int = 100_000) -> int:
    """Bytes of the buffer :func:`scaled_deepseek_v3` spans."""
    return regions * num_blocks * 8


def scaled_kimi_linear(base: int, regions: int = 7, num_logical_blocks: int = 2_000) -> dict[str, Any]:
    """Kimi-Linear TP1's counts (7 HMA regions of MLA + 3 KDA groups, ppl 30, 4 SSM streams) with 8-byte
    kernel pages and a 208-byte KDA state padded to the 240-byte logical page."""
    ppl, page = 30, 240
    kda = {
        "type": "ssm",
        "kind": "gdn",
        "conv_shape": [24, 3],
        "conv_dtype_bytes": 2,
        "temporal_shape": [1, 4, 4],
        "temporal_dtype_bytes": 4,
        "page_size_padded": page,
    }
    layers = []
    for i in range(regions):
        kw = {"base": base + i * num_logical_blocks * page, "nbytes": num_logical_blocks * page}
        layers.append(hk.layer(f"mla.{i}", 0, mla_spec(8, 1), **kw))
        layers += [hk.layer(f"kda_{g}.{i}", g, kda, **kw) for g in (1, 2, 3)]
    return hk.rank_layout(layers, logical_block_size=ppl, kernel_block_size=1, num_logical_blocks=num_logical_blocks)


def scaled_kimi_linear_bytes(regions: int = 7, num_logical_blocks: int = 2_000) -> int:
    """Bytes of the buffer :func:`scaled_kimi_linear` spans."""
    return regions * num_logical_blocks * 240


def bench_prep(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Section 2: table -> prepped NIXL handle for the N x 3 and strided N x 5 forms and the baselines."""
    nb = 100_000 if not args.quick else 20_000
    size = max(scaled_deepseek_v3_bytes(61, nb), scaled_kimi_linear_bytes(7, 2_000))
    buf = np.zeros(size, dtype=np.uint8)
    base = buf.ctypes.data
    agent = nixl_agent("bench-prep")
    reg = agent.register_memory(np.array([[base, size, 0]], dtype=np.uint64), "DRAM")
    cases = [
        ("DeepSeek-V3 61x100k", scaled_deepseek_v3(base, 61, nb)),
        ("Kimi-Linear TP1 (2000 logical blocks)", scaled_kimi_linear(base, 7, 2_000)),
    ]
    rows = []
    out = results.setdefault("prep", {})

    def prep(make: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", make(), "DRAM")
            agent.release_dlist_handle(h)

        return run

    for name, layout in cases:
        table = hk.build_region_table(layout)
        g = Geometry.from_table(table)
        n = int(table.local_descs().shape[0])
        impls = {
            "hybrid-kv Nx5": prep(table.local_rows),
            "hybrid-kv Nx3": prep(table.local_descs),
            "numpy Nx3": prep(lambda g=g: numpy_impl.local_descs(g)),
            "python loop": prep(lambda g=g: python_loop.local_descs(g)),
        }
        t = side_by_side(
            impls,
            args.repeats,
            repeats_for={"python loop": max(1, min(args.repeats, args.loop_repeats))},
            inner={"hybrid-kv Nx5": 50},
        )
        med = {k: t.median(k) for k in t.samples}
        out[name] = {"descriptors": n, "median_s": med, "samples_s": t.samples}
        rows.append(
            [
                name,
                f"{n:,}",
                f"{table.local_rows().shape[0]}",
                fmt_t(med["hybrid-kv Nx5"]),
                fmt_t(med["hybrid-kv Nx3"]),
                fmt_t(med["numpy Nx3"]),
                fmt_t(med["python loop"]),
                fmt_r(t.ratio("hybrid-kv Nx3", "hybrid-kv Nx5")),
                fmt_r(t.ratio("numpy Nx3", "hybrid-kv Nx5")),
                fmt_r(t.ratio("python loop", "hybrid-kv Nx5")),
            ]
        )
    agent.deregister_memory(reg)
    print_table(
        "Table -> prepped NIXL handle (build + prep_xfer_dlist, DRAM, median)",
        [
            "layout",
            "descriptors",
            "Nx5 rows",
            "hybrid-kv Nx5",
            "hybrid-kv Nx3",
            "NumPy Nx3",
            "Python loop (tuples)",
            "hk Nx3/hk Nx5",
            "NumPy Nx3/hk Nx5",
            "loop/hk Nx5",
        ],
        rows,
    )
