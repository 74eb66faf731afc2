"""Step ``planner``: the Rust planner's timings at real scale, on this machine's cores.

Layouts with synthetic addresses (nothing is allocated), each rank's pool ``planner_pool_gib`` of one GPU. For
DeepSeek-V3 (P8 -> D16 pull and push, P16 -> D8 pull), Kimi-Linear-48B-A3B (P4 -> D1 pull, P1 -> D4 push) and
Qwen3-Next-80B-A3B (P2 -> D1 pull), as the posting rank 0 pays them: its region table and strided local rows, one
``PeerPlan`` (the peers' payloads decoded and validated, every table built) and every table it preps; then per
request (4K, 32K and 128K tokens, contiguous) ``plan``, ``plan_staged`` (layer stages) and the passive rank's
``MirrorPlan.moves`` (verified transfers); and how many 128K-token requests per second the planner plans on one
thread and on every core at once (the binding releases the GIL for requests of 1024 ids or more).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from ..config import KitConfig
from ..step import Report

__all__ = ["CASES", "TOKENS", "run"]

CASES = (
    ("deepseek-v3", 8, 16, "pull"),
    ("deepseek-v3", 8, 16, "push"),
    ("deepseek-v3", 16, 8, "pull"),
    ("kimi-linear-48b-a3b", 4, 1, "pull"),
    ("kimi-linear-48b-a3b", 1, 4, "push"),
    ("qwen3-next-80b-a3b", 2, 1, "pull"),
)
TOKENS = (4096, 32768, 131072)


def run(cfg: KitConfig, report: Report) -> None:
    threads = len(os.sched_getaffinity(0))
    report.put("threads", threads)
    for preset, p_tp, d_tp, mode in CASES:
        key = f"{preset} P{p_tp}->D{d_tp} {mode}"
        try:
            report.put(key, _case(cfg, preset, p_tp, d_tp, mode, threads))
        except Exception as exc:  # noqa: BLE001 - the next case still runs
            import traceback

            report.problem(f"{key}: {type(exc).__name__}: {exc}", traceback.format_exc())


def _median_s(fn: Callable[[], Any], calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _once_s(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _ids(preset: Any, tp: int, tokens: int, first: int) -> list[list[int]]:
    """One contiguous request: ``tokens`` worth of blocks per attention group, one state per SSM group."""
    logical = preset.geometry(tp).logical_block_size
    out, nxt = [], first
    for kind in preset.group_kinds():
        n = 1 if kind == "ssm" else -(-tokens // logical)
        out.append(list(range(nxt, nxt + n)))
        nxt += n
    return out


def _case(cfg: KitConfig, name: str, p_tp: int, d_tp: int, mode: str, threads: int) -> dict[str, Any]:
    import hybrid_kv as hk
    from hybrid_kv.presets import get_preset

    p = get_preset(name)
    local_tp, remote_tp = (d_tp, p_tp) if mode == "pull" else (p_tp, d_tp)
    local_role, remote_role = ("decode", "prefill") if mode == "pull" else ("prefill", "decode")
    pool = cfg.planner_pool_gib << 30

    def blocks(tp: int) -> int:
        return max(2, pool // (p.geometry(tp).page_bytes * p.num_tensors))

    table_s, local = _once_s(lambda: hk.build_region_table(p.rank_layout(local_tp, 0, blocks(local_tp))))
    rows_s, rows = _once_s(local.local_rows)
    own = local.handshake_payload(p.engine_info(local_role, mode))
    targets = [int(r) for r in hk.handshake_target_ranks(0, local_tp, remote_tp)]
    remotes = {}
    for r in targets:
        t = hk.build_region_table(p.rank_layout(remote_tp, r, blocks(remote_tp)))
        remotes[r] = t.handshake_payload(p.engine_info(remote_role, mode))
    payloads = [remotes[r] for r in targets]
    peer_s, peer = _once_s(lambda: hk.PeerPlan(local, payloads, mode, own_payload=own))

    def prep_tables() -> None:
        for key in peer.table_keys:
            peer.local_rows(key)
        for r in peer.remote_ranks:
            peer.remote_rows(r)

    tables_s, _ = _once_s(prep_tables)
    schedule = hk.StreamSchedule(local, granularity="layer")
    mirror_s, mirror = _once_s(lambda: hk.MirrorPlan(remotes[targets[0]], own))
    per_request: dict[str, Any] = {}
    limit = min(blocks(local_tp), blocks(remote_tp))
    for tokens in TOKENS:
        lo, ro = _ids(p, local_tp, tokens, 1), _ids(p, remote_tp, tokens, 3)
        if max(max(g) for g in lo + ro) >= limit:
            per_request[str(tokens)] = {"skipped": f"needs more than the {limit} blocks of a rank's pool"}
            continue
        plan = peer.plan(lo, ro)
        per_request[str(tokens)] = {
            "ids": sum(int(t.local_ids.size) for t in plan.transfers),
            "descriptors": sum(int(t.num_descriptors) for t in plan.transfers),
            "bytes": sum(int(t.bytes) for t in plan.transfers),
            "plan_us": _median_s(partial(peer.plan, lo, ro), cfg.planner_calls) * 1e6,
            "plan_staged_us": _median_s(partial(peer.plan_staged, lo, ro, schedule), cfg.planner_calls) * 1e6,
            "mirror_moves_us": _median_s(partial(mirror.moves, lo, ro), max(5, cfg.planner_calls // 10)) * 1e6,
        }
    big = [k for k, v in per_request.items() if "plan_us" in v]
    parallel = _parallel(peer, p, local_tp, remote_tp, int(big[-1]), threads, cfg.planner_calls) if big else {}
    return {
        "local_tp": local_tp,
        "remote_tp": remote_tp,
        "targets": targets,
        "blocks_per_rank": {"local": blocks(local_tp), "remote": blocks(remote_tp)},
        "local_rows": int(rows.shape[0]),
        "local_descriptors": int(rows[:, 4].sum()),
        "region_table_s": table_s,
        "local_rows_s": rows_s,
        "peer_plan_s": peer_s,
        "peer_tables_s": tables_s,
        "mirror_plan_s": mirror_s,
        "requests": per_request,
        "parallel": parallel,
    }


def _parallel(peer: Any, p: Any, local_tp: int, remote_tp: int, tokens: int, threads: int, calls: int) -> Any:
    """Requests of ``tokens`` planned per second on one thread and on ``threads`` threads at once."""
    lo, ro = _ids(p, local_tp, tokens, 1), _ids(p, remote_tp, tokens, 3)
    n = max(threads * 8, calls)

    def work(k: int) -> None:
        for _ in range(k):
            peer.plan(lo, ro)

    one_s, _ = _once_s(lambda: work(n))
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, [1] * threads))  # warm the threads
        many_s, _ = _once_s(lambda: list(pool.map(work, [n // threads] * threads)))
    done = (n // threads) * threads
    return {
        "tokens": tokens,
        "threads": threads,
        "plans_per_s_one_thread": n / one_s,
        "plans_per_s_all_threads": done / many_s,
        "speedup": (done / many_s) / (n / one_s),
    }
