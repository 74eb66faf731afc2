"""1. Local descriptor tables: hybrid-kv ``local_descs`` (N x 3) and ``local_rows`` (strided N x 5) against the
NumPy and Python-loop baselines, once per allocator mode, each in a child process of ``bench_planner.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np
from baselines import numpy_impl, python_loop
from baselines.geometry import Geometry

import hybrid_kv as hk
from hybrid_kv.presets import get_preset

from .timing import fmt_r, fmt_t, print_table, side_by_side

# The script the ``tables`` section reruns in a child process per allocator mode.
ENTRY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_planner.py")


def check_tables(table: Any, g: Geometry, loop: bool) -> None:
    """hybrid-kv's N x 3 and N x 5 tables equal the NumPy baseline's (and the Python loop's when ``loop``)."""
    ours = table.local_descs()
    ref = numpy_impl.local_descs(g)
    assert ours.dtype == np.uint64 and np.array_equal(ours, ref), "numpy baseline disagrees with hybrid-kv"
    assert np.array_equal(table.local_rows(), numpy_impl.local_rows(g)), "numpy rows disagree"
    if loop:
        lst = python_loop.local_descs(g)
        assert np.array_equal(np.array(lst, dtype=np.uint64), ours), "python loop disagrees with hybrid-kv"


ALLOC_MODES = ("fresh", "reused")


def pin_allocator(mode: str) -> None:
    """Pin glibc malloc so every large block is fresh pages (``fresh``) or recycled memory (``reused``).

    ``fresh``: a fixed 256 KiB mmap threshold, so each large array is a new mapping, unmapped when freed.
    ``reused``: no mmap and no trimming, so freed blocks stay in the heap and are handed out again.
    """
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    if mode == "fresh":
        ok = libc.mallopt(m_mmap_threshold, 256 * 1024)
    else:
        ok = libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 31)
    if not ok:
        raise RuntimeError(f"glibc mallopt refused the {mode!r} settings")


def bench_tables(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Run the table benchmark once per allocator mode, each in a child process (mallopt is per process
    and would otherwise change the later sections' allocations too)."""
    import subprocess
    import tempfile

    out = results.setdefault("tables", {})
    for mode in ALLOC_MODES:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, ENTRY, "--sections", "tables", "--alloc", mode]
            cmd += ["--repeats", str(args.repeats), "--loop-repeats", str(args.loop_repeats), "--json", f.name]
            cmd += ["--quick"] if args.quick else []
            subprocess.run(cmd, check=True)
            out[mode] = json.load(f)["tables"]


def bench_tables_pinned(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Section 1 in this process, its allocator already pinned: build and time the local tables."""
    ds, kimi = get_preset("deepseek-v3"), get_preset("kimi-linear-48b-a3b")
    cases: list[tuple[str, dict[str, Any]]] = [
        ("DeepSeek-V3 61x100k", ds.rank_layout(1, 0, 100_000 if not args.quick else 20_000)),
        ("Kimi-Linear TP1 (2000 logical blocks)", kimi.rank_layout(1, 0, 2_000)),
        ("Kimi-Linear TP4 rank 0 (8000 logical blocks)", kimi.rank_layout(4, 0, 8_000)),
    ]
    rows = []
    out = results.setdefault("tables", {})
    for name, layout in cases:
        layout_json = json.dumps(layout)
        table = hk.RegionTable.from_json(layout_json)
        g = Geometry.from_table(table)
        n = table.local_descs().shape[0]
        check_tables(table, g, loop=n <= 1_000_000)
        reps = args.repeats
        t = side_by_side(
            {
                "region table build": lambda lj=layout_json: hk.RegionTable.from_json(lj),
                "hybrid-kv Nx3": table.local_descs,
                "hybrid-kv Nx5": table.local_rows,
                "numpy Nx3": lambda g=g: numpy_impl.local_descs(g),
                # The floor for any N x 3 build: allocating and writing that many bytes once.
                "fill floor": lambda n=n: np.empty((n, 3), dtype=np.uint64).fill(1),
                "numpy Nx5": lambda g=g: numpy_impl.local_rows(g),
                "python loop": lambda g=g: python_loop.local_descs(g),
            },
            reps,
            repeats_for={"python loop": max(1, min(reps, args.loop_repeats))},
            inner={"hybrid-kv Nx5": 100, "numpy Nx5": 100, "region table build": 10},
        )
        med = {k: t.median(k) for k in t.samples}
        out[name] = {"descriptors": n, "median_s": med, "samples_s": t.samples}
        rows.append(
            [
                name,
                f"{n:,}",
                fmt_t(med["region table build"]),
                fmt_t(med["hybrid-kv Nx3"]),
                fmt_t(med["fill floor"]),
                fmt_t(med["numpy Nx3"]),
                fmt_t(med["python loop"]),
                fmt_r(t.ratio("numpy Nx3", "hybrid-kv Nx3")),
                fmt_r(t.ratio("python loop", "hybrid-kv Nx3")),
                fmt_t(med["hybrid-kv Nx5"]),
                fmt_t(med["numpy Nx5"]),
                fmt_r(t.ratio("numpy Nx3", "hybrid-kv Nx5")),
                fmt_r(t.ratio("python loop", "hybrid-kv Nx5")),
                f"{n / med['hybrid-kv Nx3'] / 1e6:,.0f} M/s",
            ]
        )
        del table
    print_table(
        f"Local descriptor tables, {args.alloc} pages (median; ratio = baseline / hybrid-kv, same run)",
        [
            "layout",
            "descriptors",
            "region table",
            "hybrid-kv Nx3",
            "np.empty + fill",
            "NumPy Nx3",
            "Python loop",
            "NumPy/hk (Nx3)",
            "loop/hk (Nx3)",
            "hybrid-kv Nx5",
            "NumPy Nx5",
            "NumPy Nx3/hk Nx5",
            "loop/hk Nx5",
            "hk Nx3 desc/s",
        ],
        rows,
    )
