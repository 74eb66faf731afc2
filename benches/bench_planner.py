"""hybrid-kv planning against NumPy and Python-loop baselines, side by side in one run.

Run (about 1 minute on a 2-core box, about 3 with ``--full``)::

    PYTHONPATH=python python benches/bench_planner.py [--quick] [--repeats N] [--json out.json] [--plot docs/img/x.png]

Sections (one module each in ``benches/planner_bench/``; each prints a markdown table of medians and ratios
measured in the same run, implementations interleaved round-robin so noise hits them alike):

1. ``tables``: the local descriptor table of DeepSeek-V3 (61 MLA regions x 100,000 kernel blocks = 6.1 M
   descriptors) and Kimi-Linear-48B-A3B (7 HMA regions shared by MLA + KDA, TP1 and TP4): hybrid-kv
   ``RegionTable.local_descs`` (N x 3) and ``local_rows`` (strided N x 5) against the NumPy build of
   vLLM PR #48209 (``baselines.numpy_impl``) and a Python loop (``baselines.python_loop``). Building an
   N x 3 table is bound by first-touch page faults when its memory is fresh, so the section runs twice,
   each in a child process with glibc's allocator pinned: ``fresh`` (every large block a new mapping, as
   at start-up) and ``reused`` (large blocks recycled, as in a process that rebuilt tables before).
2. ``prep``: table -> prepped NIXL handle (``prep_xfer_dlist`` on a real DRAM agent, same descriptor
   counts, regions scaled down to fit a real buffer) for the N x 3 and the strided N x 5 forms.
3. ``planning``: the ids of one request, ``PeerPlan.plan`` in both modes against the NumPy D.3/D.5 build:
   ``reference`` (``coalesce=False``, one id per block per region: its id pairs must equal NumPy's) and
   ``coalesced`` (the default, chunk ids: its resolved ``(local_addr, remote_addr, len)`` byte moves, merged
   into maximal runs per remote rank, must equal the reference plan's).
4. ``e2e``: one request READ through NIXL between two DRAM agents, data verified, each mode posted through
   handles prepped from its own plan's tables; planning overhead and descriptors posted with and without
   NIXL's merging, for both modes.

The baselines are reimplementations written for comparison only (see ``benches/baselines``); their
outputs are checked equal to hybrid-kv's before anything is timed. Ratios, not absolute times, are the
result: the box is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

# planner_bench/ sits beside this script, which Python puts on sys.path
from planner_bench.e2e import bench_e2e
from planner_bench.planning import bench_planning
from planner_bench.prep import bench_prep
from planner_bench.tables import ALLOC_MODES, bench_tables, bench_tables_pinned, pin_allocator

SECTIONS: dict[str, Callable[[argparse.Namespace, dict[str, Any]], None]] = {
    "tables": bench_tables,
    "prep": bench_prep,
    "planning": bench_planning,
    "e2e": bench_e2e,
}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen sections; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of: " + ", ".join(SECTIONS))
    p.add_argument("--repeats", type=int, default=7, help="rounds per case (median reported)")
    p.add_argument("--loop-repeats", type=int, default=2, help="rounds for the slow Python-loop baseline")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds (smoke test)")
    p.add_argument("--full", action="store_true", help="also the 128K-token end-to-end transfer (2.5 GB of pools)")
    p.add_argument("--json", help="write every sample and median to this file")
    p.add_argument("--plot", help="write the planning-time plot (PNG) to this path")
    p.add_argument("--alloc", choices=ALLOC_MODES, help=argparse.SUPPRESS)  # set in the tables child process
    args = p.parse_args(argv)
    if args.alloc:
        pin_allocator(args.alloc)
    if args.quick:
        args.repeats = min(args.repeats, 3)
        args.loop_repeats = 1
    results: dict[str, Any] = {"args": vars(args)}
    t0 = time.perf_counter()
    for s in args.sections.split(","):
        ts = time.perf_counter()
        run = bench_tables_pinned if (s.strip() == "tables" and args.alloc) else SECTIONS[s.strip()]
        run(args, results)
        sys.stdout.flush()
        print(f"\n({s.strip()}{', ' + args.alloc + ' pages' if args.alloc else ''}: {time.perf_counter() - ts:.0f} s)")
    if not args.alloc:
        print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
