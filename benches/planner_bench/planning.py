"""3. Per-request planning: hybrid-kv ``PeerPlan.plan`` against the NumPy D.3 build, reference ids checked
equal to NumPy's and coalesced bytes checked equal to the reference's; the planning-time plot.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from baselines import numpy_impl
from baselines.geometry import Geometry

import hybrid_kv as hk
from hybrid_kv.presets import get_preset

from .common import KIB, peer_plan_binding
from .timing import fmt_r, fmt_t, print_table, side_by_side


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
    """``(remote rank, local ids, remote ids)`` of every transfer of hybrid-kv's plan."""
    p = peer.plan(lids, rids)
    return [(int(t.remote_rank), t.local_ids, t.remote_ids) for t in p.transfers]


def np_plan(d: Deploy, lids: list[list[int]], rids: list[list[int]]) -> list[tuple[int, Any, Any]]:
    """``(remote rank, local ids, remote ids)`` of every transfer of the NumPy baseline's plan."""
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
    """The P/D deployments the section plans for (decode rank 0, pull)."""
    return [
        deploy("DeepSeek-V3 P8->D16", "deepseek-v3", 8, 16, 100_000, 100_000),
        deploy("DeepSeek-V3 P16->D8", "deepseek-v3", 16, 8, 100_000, 100_000),
        deploy("Kimi-Linear P1->D4", "kimi-linear-48b-a3b", 1, 4, 2_000, 8_000),
        deploy("Kimi-Linear P4->D1", "kimi-linear-48b-a3b", 4, 1, 8_000, 2_000),
    ]


def bench_planning(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Section 3: per-request planning, hybrid-kv reference and coalesced against NumPy."""
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
    """Plot planning time per request against request length, one panel per model, to ``path``."""
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
