"""hybrid-kv planning against NumPy and Python-loop baselines, side by side in one run.

Run (about 1 minute on a 2-core box, about 3 with ``--full``)::

    PYTHONPATH=python python benches/bench_planner.py [--quick] [--repeats N] [--json out.json] [--plot docs/img/x.png]

Sections (each prints a markdown table of medians and ratios measured in the same run, implementations
interleaved round-robin so noise hits them alike):

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
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from baselines import numpy_impl, python_loop  # noqa: E402
from baselines.geometry import Geometry  # noqa: E402

import hybrid_kv as hk  # noqa: E402
from hybrid_kv.presets import get_preset  # noqa: E402

# ----------------------------------------------------------------------------------------------------
# Full-size layouts come from hybrid_kv.presets. For NIXL, which must resolve every descriptor against
# registered memory, these keep the descriptor counts (regions, kernel blocks, ppl, SSM streams) of the
# presets but shrink every page so the whole table fits one real buffer.


def mla_spec(head_size: int, dtype_bytes: int) -> dict[str, Any]:
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
    return regions * num_logical_blocks * 240


# ----------------------------------------------------------------------------------------------------
# Timing: implementations interleaved round-robin, GC off inside each timed call, medians.


@dataclass
class Timings:
    samples: dict[str, list[float]] = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def ratio(self, slow: str, fast: str) -> float:
        return self.median(slow) / self.median(fast)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    gc.disable()
    try:
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out
    finally:
        gc.enable()


def side_by_side(
    impls: dict[str, Callable[[], Any]],
    repeats: int,
    *,
    repeats_for: dict[str, int] | None = None,
    inner: dict[str, int] | None = None,
    sample_s: float | None = None,
) -> Timings:
    """Time every implementation ``repeats`` times, one sample of each per round, after a warm-up.

    ``repeats_for`` caps the rounds of slow implementations. ``inner`` times a batch of calls per sample
    (for microsecond work) and divides; ``sample_s`` instead sizes each implementation's batch so that one
    sample lasts about that long, so fast and slow implementations are timed over equally long stretches
    (a 50-call batch of a 2 us call is over before caches and branch predictors settle, one of a 25 us call
    is not). Each call's result is dropped before the next call, as a connector drops ids once posted. The
    warm-up is one batch (one call left the first case's NumPy baseline up to 1.6x slower than later ones).
    """
    caps = repeats_for or {}
    inner = dict(inner or {})
    res = Timings({k: [] for k in impls})

    def batch(fn: Callable[[], Any], n: int) -> None:
        for _ in range(n):
            fn()

    for name, fn in impls.items():
        if sample_s is not None:
            one, _ = timed(lambda fn=fn: batch(fn, 10))  # type: ignore[misc]
            inner[name] = max(1, round(sample_s / max(one / 10, 1e-9)))
        batch(fn, inner.get(name, 1))  # warm-up: page in code and allocator arenas
    for rnd in range(repeats):
        for name, fn in impls.items():
            if rnd >= caps.get(name, repeats):
                continue
            n = inner.get(name, 1)
            if n == 1:
                dt, out = timed(fn)
                del out
            else:
                dt, _ = timed(lambda fn=fn, n=n: batch(fn, n))  # type: ignore[misc]
                dt /= n
            res.samples[name].append(dt)
    return res


def fmt_t(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_r(x: float) -> str:
    return f"{x:,.0f}x" if x >= 100 else f"{x:.1f}x" if x >= 10 else f"{x:.2f}x"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    sys.stdout.flush()


# ----------------------------------------------------------------------------------------------------
# 1. Local descriptor tables.


def check_tables(table: Any, g: Geometry, loop: bool) -> None:
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
            cmd = [sys.executable, os.path.abspath(__file__), "--sections", "tables", "--alloc", mode]
            cmd += ["--repeats", str(args.repeats), "--loop-repeats", str(args.loop_repeats), "--json", f.name]
            cmd += ["--quick"] if args.quick else []
            subprocess.run(cmd, check=True)
            out[mode] = json.load(f)["tables"]


def bench_tables_pinned(args: argparse.Namespace, results: dict[str, Any]) -> None:
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


# ----------------------------------------------------------------------------------------------------
# 2. Table -> prepped NIXL handle (real agent, DRAM, real buffer).


def nixl_agent(name: str, telemetry: bool = False) -> Any:
    from nixl._api import nixl_agent as agent_cls
    from nixl._api import nixl_agent_config

    # Progress thread off: it busy-polls and would steal one of the two cores.
    return agent_cls(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"], capture_telemetry=telemetry))


def bench_prep(args: argparse.Namespace, results: dict[str, Any]) -> None:
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


# ----------------------------------------------------------------------------------------------------
# 3. Per-request planning: hybrid-kv PeerPlan.plan against the NumPy D.3 build.

KIB = 1024


def peer_plan_binding() -> Any:
    """``hybrid_kv.PeerPlan`` (None until the plan binding is built into the extension)."""
    return getattr(hk, "PeerPlan", None) or getattr(hk._core, "PeerPlan", None)


def local_tables(peer: Any) -> list[tuple[str, Any]]:
    """Every local table of a ``PeerPlan`` as strided rows, keyed as transfers name them."""
    return [(k, peer.local_rows(k)) for k in peer.table_keys]


@dataclass
class Deploy:
    """One local (active) rank against the peer engine: hybrid-kv's plan and the baseline's inputs."""

    name: str
    peer: Any  # coalesced (the default): chunk rows, one id per power-of-two run of consecutive blocks
    peer_ref: Any  # coalesce=False: the reference tables, one id per block per region
    kinds: list[bool]  # is_attention per group
    routes: list[tuple[int, list[bool]]]
    local: numpy_impl.Side
    remote: numpy_impl.Side
    local_logical: int
    remote_logical: int
    local_blocks: int
    remote_blocks: int


def deploy(
    name: str, preset_name: str, p_tp: int, d_tp: int, p_blocks: int, d_blocks: int, mode: str = "pull"
) -> Deploy:
    """Decode rank 0 (pull) or prefill rank 0 (push) of a P/D pair built from a preset."""
    PeerPlan = peer_plan_binding()
    preset = get_preset(preset_name)
    local_is_d = mode == "pull"
    l_tp, r_tp = (d_tp, p_tp) if local_is_d else (p_tp, d_tp)
    l_n, r_n = (d_blocks, p_blocks) if local_is_d else (p_blocks, d_blocks)
    l_side, r_side = ("decode", "prefill") if local_is_d else ("prefill", "decode")
    local = hk.build_region_table(preset.rank_layout(l_tp, 0, l_n))
    targets = hk.handshake_target_ranks(0, l_tp, r_tp)
    info = preset.engine_info(r_side, mode)
    payloads = [hk.build_region_table(preset.rank_layout(r_tp, r, r_n)).handshake_payload(info) for r in targets]
    peer = PeerPlan(local, payloads, mode)
    peer_ref = PeerPlan(local, payloads, mode, coalesce=False)
    assert peer.coalesced and not peer_ref.coalesced
    rg = Geometry.from_table(hk.build_region_table(preset.rank_layout(r_tp, targets[0], r_n)))
    lg = Geometry.from_table(local)
    kinds = [k != "ssm" for k in preset.group_kinds()]
    # TP mapping for MLA models: attention from one rank, SSM shards from every target.
    routes = [(t, [(i == 0) if k else True for k in kinds]) for i, t in enumerate(targets)]
    lgeo = preset.geometry(l_tp)
    rgeo = preset.geometry(r_tp)
    return Deploy(
        name,
        peer,
        peer_ref,
        kinds,
        routes,
        numpy_impl.Side.of(lg, lgeo.logical_block_size),
        numpy_impl.Side.of(rg, rgeo.logical_block_size),
        lgeo.logical_block_size,
        rgeo.logical_block_size,
        l_n,
        r_n,
    )


def request_ids(d: Deploy, tokens: int, fragmented: bool, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Logical block ids per group for a ``tokens``-token request on each side (one SSM state per group)."""
    rng = np.random.default_rng(seed)

    def side(logical: int, blocks: int, off: int) -> list[list[int]]:
        n = -(-tokens // logical)
        if fragmented:
            att = rng.choice(blocks, size=n, replace=False).tolist()
        else:
            att = list(range(off, off + n))
        ssm = rng.choice(blocks, size=len(d.kinds), replace=False).tolist()
        return [att if k else [ssm[g]] for g, k in enumerate(d.kinds)]

    return side(d.local_logical, d.local_blocks, 3), side(d.remote_logical, d.remote_blocks, 5)


def hk_plan(peer: Any, lids: list[list[int]], rids: list[list[int]]) -> list[tuple[int, Any, Any]]:
    p = peer.plan(lids, rids)
    return [(int(t.remote_rank), t.local_ids, t.remote_ids) for t in p.transfers]


def np_plan(d: Deploy, lids: list[list[int]], rids: list[list[int]]) -> list[tuple[int, Any, Any]]:
    return numpy_impl.plan_request(d.kinds, d.routes, d.local, d.remote, lids, rids, pull=True)


def check_plan(d: Deploy, lids: list[list[int]], rids: list[list[int]]) -> int:
    """The reference plan moves the baseline's (local id, remote id) pairs per remote rank; returns the count."""
    ours = hk_plan(d.peer_ref, lids, rids)
    ref = np_plan(d, lids, rids)
    assert [r for r, _, _ in ours] == [r for r, _, _ in ref], f"{d.name}: ranks {ours} vs {ref}"
    total = 0
    for (r, li, ri), (_, bl, br) in zip(ours, ref, strict=True):
        a = np.stack([np.asarray(li, dtype=np.int64), np.asarray(ri, dtype=np.int64)], axis=1)
        b = np.stack([bl.astype(np.int64), br.astype(np.int64)], axis=1)
        key = lambda x: x[np.lexsort((x[:, 1], x[:, 0]))]  # noqa: E731
        assert a.shape == b.shape and np.array_equal(key(a), key(b)), f"{d.name}: rank {r} pairs differ"
        total += a.shape[0]
    return total


def merged_moves(plan: Any) -> dict[int, np.ndarray]:
    """Every byte a plan moves, per remote rank, as sorted maximal ``(local_addr, remote_addr, len)`` runs.

    Moves that continue each other on both sides (``la + len`` and ``ra + len`` are the next move's starts)
    are merged, so a chunk descriptor and the run of block descriptors it replaces give the same rows.
    """
    by: dict[int, list[np.ndarray]] = {}
    for i, t in enumerate(plan.transfers):
        by.setdefault(int(t.remote_rank), []).append(plan.moves(i).astype(np.int64))
    out = {}
    for rank, parts in by.items():
        m = np.concatenate(parts)
        m = m[np.lexsort((m[:, 1], m[:, 0]))]
        la, ra, n = m[:, 0], m[:, 1], m[:, 2]
        assert (n > 0).all() and (la[1:] >= la[:-1] + n[:-1]).all(), f"rank {rank}: local byte ranges overlap"
        start = np.ones(len(m), dtype=bool)
        start[1:] = (la[1:] != la[:-1] + n[:-1]) | (ra[1:] != ra[:-1] + n[:-1])
        group = np.cumsum(start) - 1
        out[rank] = np.stack([la[start], ra[start], np.bincount(group, weights=n).astype(np.int64)], axis=1)
    return out


def check_coalesced(d: Deploy, lids: list[list[int]], rids: list[list[int]]) -> int:
    """The coalesced plan moves exactly the reference plan's bytes per remote rank; returns its id count."""
    plan = d.peer.plan(lids, rids)
    ours, ref = merged_moves(plan), merged_moves(d.peer_ref.plan(lids, rids))
    assert sorted(ours) == sorted(ref), f"{d.name}: coalesced ranks {sorted(ours)} vs {sorted(ref)}"
    for r in ref:
        assert np.array_equal(ours[r], ref[r]), f"{d.name}: rank {r} coalesced bytes differ from the reference"
    return sum(len(t.local_ids) for t in plan.transfers)


def deployments(args: argparse.Namespace) -> list[Deploy]:
    return [
        deploy("DeepSeek-V3 P8->D16", "deepseek-v3", 8, 16, 100_000, 100_000),
        deploy("DeepSeek-V3 P16->D8", "deepseek-v3", 16, 8, 100_000, 100_000),
        deploy("Kimi-Linear P1->D4", "kimi-linear-48b-a3b", 1, 4, 2_000, 8_000),
        deploy("Kimi-Linear P4->D1", "kimi-linear-48b-a3b", 4, 1, 8_000, 2_000),
    ]


def bench_planning(args: argparse.Namespace, results: dict[str, Any]) -> None:
    if peer_plan_binding() is None:
        print("\n### Per-request planning: skipped (hybrid_kv has no PeerPlan binding yet)")
        return
    lengths = [4 * KIB, 32 * KIB, 128 * KIB]
    curve = [1 * KIB, 2 * KIB, 4 * KIB, 8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB, 128 * KIB]
    out = results.setdefault("planning", {})
    rows = []
    for d in deployments(args):
        for tokens in sorted(set(lengths) | (set(curve) if args.plot else set())):
            lids, rids = request_ids(d, tokens, fragmented=False)
            n_ref = check_plan(d, lids, rids)
            n_co = check_coalesced(d, lids, rids)
            t = side_by_side(
                {
                    "hybrid-kv coalesced": lambda d=d, lids=lids, rids=rids: hk_plan(d.peer, lids, rids),
                    "hybrid-kv reference": lambda d=d, lids=lids, rids=rids: hk_plan(d.peer_ref, lids, rids),
                    "numpy": lambda d=d, lids=lids, rids=rids: np_plan(d, lids, rids),
                },
                3 * args.repeats,  # 2 ms samples: more rounds cost little and steady the medians
                sample_s=2e-3,
            )
            med = {k: t.median(k) for k in t.samples}
            out[f"{d.name} {tokens // KIB}K"] = {
                "deploy": d.name,
                "tokens": tokens,
                "ids": n_ref,
                "ids_coalesced": n_co,
                "median_s": med,
                "samples_s": t.samples,
            }
            if tokens in lengths:
                rows.append(
                    [
                        d.name,
                        f"{tokens // KIB}K",
                        f"{n_ref:,}",
                        f"{n_co:,}",
                        fmt_t(med["hybrid-kv reference"]),
                        fmt_t(med["hybrid-kv coalesced"]),
                        fmt_t(med["numpy"]),
                        fmt_r(t.ratio("numpy", "hybrid-kv reference")),
                        fmt_r(t.ratio("numpy", "hybrid-kv coalesced")),
                        f"{1 / med['hybrid-kv coalesced']:,.0f}",
                    ]
                )
    print_table(
        "Per-request planning (ids of every transfer of one request; median, same run; reference ids checked "
        "equal to NumPy's, coalesced bytes checked equal to the reference's)",
        [
            "deployment (local = D rank 0, pull)",
            "request",
            "id pairs (reference = NumPy)",
            "id pairs (coalesced)",
            "hk reference",
            "hk coalesced",
            "NumPy",
            "NumPy/hk reference",
            "NumPy/hk coalesced",
            "hk coalesced requests/s",
        ],
        rows,
    )
    if args.plot:
        plot_planning(out, args.plot)


def plot_planning(out: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by: dict[str, list[tuple[int, dict[str, float]]]] = {}
    for v in out.values():
        by.setdefault(v["deploy"], []).append((v["tokens"], v["median_s"]))
    models = sorted({name.split(" ")[0] for name in by})
    fig, axes = plt.subplots(1, len(models), figsize=(11, 4.5), sharey=True, squeeze=False)
    styles = [
        ("hybrid-kv coalesced", "o-", 1.0),
        ("hybrid-kv reference", "^-.", 0.8),
        ("numpy", "s--", 0.6),
    ]
    for ax, model in zip(axes[0], models, strict=True):
        for i, (name, pts) in enumerate(sorted((k, v) for k, v in by.items() if k.split(" ")[0] == model)):
            pts.sort(key=lambda p: p[0])
            x = [p[0] / KIB for p in pts]
            for impl, style, alpha in styles:
                label = f"{'NumPy' if impl == 'numpy' else impl}, {name.split(' ', 1)[1]}"
                ax.plot(x, [p[1][impl] * 1e6 for p in pts], style, color=f"C{i}", alpha=alpha, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("request length (K tokens)")
        ax.set_title(model)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("planning time per request (us, median)")
    fig.suptitle("Per-request planning: hybrid-kv coalesced / reference vs NumPy (D.3), same run")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nplot written to {path}")


# ----------------------------------------------------------------------------------------------------
# 4. End to end: one request READ through NIXL between two agents (real DRAM pools), planned by hybrid-kv
#    versus the same ids handed to NIXL by hand; descriptors posted with and without NIXL's merging.


class E2E:
    """A TP1 -> TP1 pull of ``preset``: prefill agent "P" (target) and decode agent "D" (initiator), in one
    process with progress threads off (D polls, and pumps P, as the transport does); the presets' pools are on
    huge pages."""

    def __init__(self, preset_name: str, num_blocks: int, kernel_block_size: int | None = None) -> None:
        import torch

        preset = get_preset(preset_name)
        self.preset = preset
        self.num_blocks = num_blocks
        self.pools: dict[str, list[Any]] = {}
        self.tables: dict[str, Any] = {}
        self.agents: dict[str, Any] = {}
        self.regs: dict[str, Any] = {}
        gen = torch.Generator().manual_seed(1)
        for side in ("P", "D"):
            pools, layers, geo = preset.torch_layers(1, 0, num_blocks, kernel_block_size=kernel_block_size)
            if side == "P":
                for t in pools:
                    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
            self.geo = geo
            self.pools[side] = pools
            self.tables[side] = hk.build_region_table(preset.layout_from_tensors(layers, geo, 0, num_blocks))
            agent = nixl_agent(side, telemetry=side == "D")
            self.regs[side] = agent.register_memory(self.tables[side].registration(), "DRAM")
            self.agents[side] = agent
        self.d, self.p = self.agents["D"], self.agents["P"]
        self.d.add_remote_agent(self.p.get_agent_metadata())
        payload = self.tables["P"].handshake_payload(preset.engine_info("prefill", "pull"))
        # Both modes, each transferring through handles prepped from its own plan's tables (chunk ids index the
        # coalesced tables' appended rows).
        self.peers: dict[str, Any] = {}
        self.lh: dict[str, dict[str, Any]] = {}
        self.rh: dict[str, dict[int, Any]] = {}
        for mode, co in (("coalesced", True), ("reference", False)):
            peer = peer_plan_binding()(self.tables["D"], [payload], "pull", coalesce=co)
            self.peers[mode] = peer
            prep = self.d.prep_xfer_dlist
            self.lh[mode] = {k: prep("NIXL_INIT_AGENT", rows, "DRAM") for k, rows in local_tables(peer)}
            self.rh[mode] = {0: self.d.prep_xfer_dlist("P", peer.remote_rows(0), "DRAM")}
        self.kinds = [k != "ssm" for k in preset.group_kinds()]

    def ids(self, tokens: int, fragmented: bool, seed: int) -> tuple[list[list[int]], list[list[int]]]:
        rng = np.random.default_rng(seed)
        n = -(-tokens // self.geo.logical_block_size)

        def side(off: int) -> list[list[int]]:
            pick = rng.permutation(self.num_blocks)
            att = pick[:n].tolist() if fragmented else list(range(off, off + n))
            # SSM states in blocks the attention run does not use (a request's blocks are distinct).
            free = [b for b in pick.tolist() if b not in set(att)]
            return [att if k else [free[g]] for g, k in enumerate(self.kinds)]

        return side(1), side(2)

    def post(self, transfers: list[tuple[int, str, Any, Any]], mode: str, skip_merge: bool = False) -> int:
        """Post every transfer through ``mode``'s handles, wait for all, release; returns the descriptors NIXL
        posted (after merging)."""
        handles = []
        lh, rh = self.lh[mode], self.rh[mode]
        for rank, key, li, ri in transfers:
            h = self.d.make_prepped_xfer("READ", lh[key], li, rh[rank], ri, skip_desc_merge=skip_merge)
            state = self.d.transfer(h)
            handles.append((h, state))
        descs = 0
        for h, state in handles:
            while state != "DONE":
                if state == "ERR":
                    raise RuntimeError("NIXL transfer failed")
                self.p.get_new_notifs()
                state = self.d.check_xfer_state(h)
            descs += int(self.d.get_xfer_telemetry(h).descCount)
            self.d.release_xfer_handle(h)
        return descs

    def plan(self, lids: list[list[int]], rids: list[list[int]], mode: str) -> list[tuple[int, str, Any, Any]]:
        p = self.peers[mode].plan(lids, rids)
        return [(int(t.remote_rank), str(t.local_table), t.local_ids, t.remote_ids) for t in p.transfers]

    def clear(self) -> None:
        """Zero the decode pools, so that ``verify`` after a transfer checks that transfer alone."""
        for t in self.pools["D"]:
            t.zero_()

    def verify(self, lids: list[list[int]], rids: list[list[int]], tokens: int) -> None:
        """The attention pages and SSM states of the request arrived intact (pools hold random bytes)."""
        geo = self.geo
        n_kernel = -(-tokens // geo.kernel_block_size)
        for g, attn in enumerate(self.kinds):
            for lb, rb in zip(lids[g], rids[g], strict=True):
                for t in range(len(self.pools["D"])):
                    dst = self.pools["D"][t][lb].numpy()
                    src = self.pools["P"][t][rb].numpy()
                    if attn:
                        k = min(geo.ppl, n_kernel) * geo.kernel_page_bytes
                        assert np.array_equal(dst[:k], src[:k]), f"attention block {lb} of tensor {t} differs"
                    else:
                        k = geo.state_bytes
                        assert np.array_equal(dst[:k], src[:k]), f"SSM state {lb} of tensor {t} differs"
            if attn:
                n_kernel -= geo.ppl * len(lids[g])

    def bytes_of(self, transfers: list[tuple[int, str, Any, Any]], mode: str) -> int:
        tabs = dict(local_tables(self.peers[mode]))
        total = 0
        for _, key, li, _ in transfers:
            rows = tabs[key]
            lens = np.repeat(rows[:, 1], rows[:, 4].astype(np.int64))
            total += int(lens[np.asarray(li, dtype=np.int64)].sum())
        return total

    def close(self) -> None:
        for side, agent in self.agents.items():
            if side == "D":
                for mode in self.peers:
                    for h in [*self.lh[mode].values(), *self.rh[mode].values()]:
                        agent.release_dlist_handle(h)
            agent.deregister_memory(self.regs[side])
        self.agents.clear()


def e2e_case(
    args: argparse.Namespace,
    e: E2E,
    model: str,
    lengths: list[int],
    out: dict[str, Any],
    rows_over: list[list[str]],
    rows_merge: list[list[str]],
) -> None:
    modes = ("coalesced", "reference")
    for tokens in lengths:
        for frag in (False, True):
            lids, rids = e.ids(tokens, frag, seed=tokens)
            planned = {m: e.plan(lids, rids, m) for m in modes}
            for m in modes:
                e.clear()
                e.post(planned[m], m)
                e.verify(lids, rids, tokens)
            nbytes = e.bytes_of(planned["reference"], "reference")
            assert e.bytes_of(planned["coalesced"], "coalesced") == nbytes, "coalesced plan moves other bytes"
            ids = {m: sum(len(li) for _, _, li, _ in planned[m]) for m in modes}
            # The same number of bytes copied by one memcpy between touched buffers: the bar for the transfer.
            src_buf, dst_buf = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
            dst_buf.fill(1)
            impls: dict[str, Callable[[], Any]] = {
                "memcpy": lambda s=src_buf, d=dst_buf: np.copyto(d, s),
                "plan only": lambda lids=lids, rids=rids: e.plan(lids, rids, "coalesced"),
                "plan only reference": lambda lids=lids, rids=rids: e.plan(lids, rids, "reference"),
                "by hand": lambda p=planned["coalesced"]: e.post(p, "coalesced"),
                "by hand reference": lambda p=planned["reference"]: e.post(p, "reference"),
                "hybrid-kv": lambda lids=lids, rids=rids: e.post(e.plan(lids, rids, "coalesced"), "coalesced"),
            }
            if not frag:
                impls["no merge"] = lambda p=planned["coalesced"]: e.post(p, "coalesced", skip_merge=True)
                impls["no merge reference"] = lambda p=planned["reference"]: e.post(p, "reference", skip_merge=True)
            t = side_by_side(impls, args.repeats, inner={"plan only": 20, "plan only reference": 20})
            med = {k: t.median(k) for k in t.samples}
            posted = {m: e.post(planned[m], m) for m in modes}
            posted_nomerge = {m: e.post(planned[m], m, skip_merge=True) for m in modes}
            label = f"{model} {tokens // KIB}K {'fragmented' if frag else 'contiguous'}"
            out[label] = {
                "tokens": tokens,
                "fragmented": frag,
                "bytes": nbytes,
                "ids": ids["reference"],
                "ids_coalesced": ids["coalesced"],
                "descs_posted": posted["reference"],
                "descs_posted_nomerge": posted_nomerge["reference"],
                "descs_posted_coalesced": posted["coalesced"],
                "descs_posted_coalesced_nomerge": posted_nomerge["coalesced"],
                "median_s": med,
                "samples_s": t.samples,
            }
            over = med["plan only"] / med["by hand"]
            rows_over.append(
                [
                    label,
                    f"{nbytes / 2**20:,.0f} MiB",
                    f"{ids['reference']:,}",
                    f"{ids['coalesced']:,}",
                    fmt_t(med["plan only reference"]),
                    fmt_t(med["plan only"]),
                    fmt_t(med["by hand"]),
                    fmt_t(med["hybrid-kv"]),
                    f"{100 * over:.3f}%",
                    f"{100 * (med['hybrid-kv'] - med['by hand']) / med['by hand']:+.1f}%",
                ]
            )

            def gbs(k: str, nbytes: int = nbytes, med: dict[str, float] = med) -> str:
                return f"{nbytes / med[k] / 1e9:.2f}" if k in med else "-"

            rows_merge.append(
                [
                    label,
                    f"{ids['reference']:,}",
                    f"{posted['reference']:,}",
                    f"{posted_nomerge['reference']:,}",
                    f"{ids['coalesced']:,}",
                    f"{posted['coalesced']:,}",
                    f"{posted_nomerge['coalesced']:,}",
                    gbs("by hand reference"),
                    gbs("by hand"),
                    gbs("no merge reference"),
                    gbs("no merge"),
                    gbs("memcpy"),
                    f"{med['memcpy'] / med['by hand']:.2f}",
                    f"{med['memcpy'] / med['hybrid-kv']:.2f}",
                ]
            )


def bench_e2e(args: argparse.Namespace, results: dict[str, Any]) -> None:
    if peer_plan_binding() is None:
        print("\n### End-to-end transfer: skipped (hybrid_kv has no PeerPlan binding yet)")
        return
    cases: list[tuple[str, str, int | None, list[int]]] = [
        ("Kimi-Linear", "kimi-linear-48b-a3b", None, [4 * KIB, 32 * KIB] + ([128 * KIB] if args.full else [])),
        # Descriptor-bound: DeepSeek-V3 with 16-token kernel blocks (18 KiB pages, one block per descriptor).
        ("DeepSeek-V3 (block 16)", "deepseek-v3", 16, [4 * KIB] + ([32 * KIB] if args.full else [])),
    ]
    out = results.setdefault("e2e", {})
    rows_over: list[list[str]] = []
    rows_merge: list[list[str]] = []
    for model, preset_name, kb, lengths in cases:
        logical = get_preset(preset_name).geometry(1, kernel_block_size=kb).logical_block_size
        e = E2E(preset_name, 2 * -(-max(lengths) // logical) + 4, kb)
        try:
            e2e_case(args, e, model, lengths, out, rows_over, rows_merge)
        finally:
            e.close()
    print_table(
        "Planning overhead on a real NIXL READ (TP1 -> TP1 pull, DRAM, two agents in one process; median)",
        [
            "request",
            "bytes",
            "id pairs reference",
            "id pairs coalesced",
            "plan() reference",
            "plan() coalesced",
            "by hand, coalesced (post+wait)",
            "hybrid-kv, coalesced (plan+post+wait)",
            "plan / transfer (coalesced)",
            "difference",
        ],
        rows_over,
    )
    print_table(
        "Descriptors posted (NIXL telemetry descCount) and throughput, reference and coalesced ids, with and "
        "without NIXL's merging (unmerged throughput: contiguous only)",
        [
            "request",
            "ref ids",
            "ref posted (merged)",
            "ref posted (skip_desc_merge)",
            "coalesced ids",
            "coalesced posted (merged)",
            "coalesced posted (skip_desc_merge)",
            "GB/s ref merged",
            "GB/s coalesced merged",
            "GB/s ref unmerged",
            "GB/s coalesced unmerged",
            "GB/s memcpy",
            "by hand / memcpy",
            "hybrid-kv / memcpy",
        ],
        rows_merge,
    )


# ----------------------------------------------------------------------------------------------------


SECTIONS: dict[str, Callable[[argparse.Namespace, dict[str, Any]], None]] = {
    "tables": bench_tables,
    "prep": bench_prep,
    "planning": bench_planning,
    "e2e": bench_e2e,
}


def main(argv: list[str] | None = None) -> int:
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
