"""Pre-flight report of a real deployment of a model preset, before any GPU is touched.

From a preset and both engines' TP sizes this sizes both pools, writes the deployment as a scenario
(``Preset.scenario``, the format ``hybrid-kv check SCENARIO.json`` reads) with one request of a given length,
and hands it to the Rust check (``check_scenario``): it builds every rank's layout, region table and handshake
metadata, validates every handshake pair, builds the peer plan of every rank that posts transfers and plans
the request. This module only adds what is the preset's to say and reports:

* the compatibility verdict, with every reason when it is not;
* per rank: regions, local descriptor tables (strided rows as prepped, and descriptors once expanded),
  remote tables, the peer ranks it talks to;
* per request: descriptors, bytes and NIXL transfers of each posting rank;
* warnings when a configuration will be descriptor-bound (many small descriptors per request).

``hybrid-kv check --preset NAME --prefill-tp N --decode-tp M`` prints it (``--json`` for machines; the command
line is :mod:`hybrid_kv.cli.check`). Nothing here needs torch, NIXL or zmq.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ._core import LayoutError, check_scenario
from .limits import MAX_BLOCK_TOKENS, MAX_NUM_BLOCKS, MAX_TP_SIZE
from .model_preset import Preset
from .presets import get_preset

__all__ = [
    "DEFAULT_KV_GIB",
    "MANY_DESCRIPTORS",
    "MAX_KV_GIB",
    "MAX_TOKENS",
    "SMALL_DESCRIPTOR_BYTES",
    "TINY_KV_GIB",
    "RankReport",
    "Report",
    "pool_blocks",
    "preflight",
]

# Heuristics for "descriptor-bound" (UCX posts one work request per descriptor; #55434 measured
# descriptor posting at 57% of the transfer time with ~112k descriptors per transfer over cuda_ipc).
SMALL_DESCRIPTOR_BYTES = 64 * 1024
MANY_DESCRIPTORS = 100_000
DEFAULT_KV_GIB = 40.0
TINY_KV_GIB = 0.25
MAX_TOKENS = 2**24
"""Longest request costed (16M tokens): its block ids are listed per group."""
MAX_KV_GIB = 16384.0
"""Most KV-cache memory per rank (16 TiB), which sizes the pools."""


@dataclass
class RankReport:
    """One rank: its regions, tables, peers and what one request costs it."""

    role: str
    rank: int
    regions: int
    local_rows: int
    local_descriptors: int
    posts: bool
    peers: list[int] = field(default_factory=list)
    tables: dict[str, dict[str, int]] = field(default_factory=dict)
    remote_descriptors: dict[int, int] = field(default_factory=dict)
    request_descriptors: int = 0
    request_bytes: int = 0
    request_transfers: int = 0


@dataclass
class Report:
    """The whole pre-flight report."""

    preset: str
    description: str
    source: str
    mode: str
    tokens: int
    prefill: dict[str, Any]
    decode: dict[str, Any]
    compatible: bool = True
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    ranks: list[RankReport] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pool_blocks(preset: Preset, tp: int, kv_gib: float, kernel_block_size: int | None) -> int:
    """Logical blocks a rank holds when ``kv_gib`` GiB of its memory is KV cache."""
    page = preset.geometry(tp, kernel_block_size=kernel_block_size).page_bytes
    return max(1, int(kv_gib * 2**30) // (page * preset.num_tensors))


def _request_ids(preset: Preset, logical: int, tokens: int) -> list[list[int]]:
    """One request's logical ids per group: consecutive blocks, attention groups first."""
    out, nxt = [], 0
    for kind in preset.group_kinds():
        n = 1 if kind == "ssm" else max(1, math.ceil(tokens / logical))
        out.append(list(range(nxt, nxt + n)))
        nxt += n
    return out


def preflight(
    preset_name: str,
    prefill_tp: int,
    decode_tp: int,
    *,
    mode: str = "pull",
    tokens: int = 32768,
    kv_gib: float | None = None,
    num_blocks: int | None = None,
    prefill_block_size: int | None = None,
    decode_block_size: int | None = None,
    coalesce: bool = True,
) -> Report:
    """Build the report. Bad arguments (unknown preset, sizes out of their bounds) raise ``HybridKvError``
    naming the value and the bound; an incompatible deployment is a report with ``compatible=False`` and its
    reasons. ``coalesce=False`` costs the reference plans (no chunk rows, one descriptor per kernel unit; what
    nixl < 1.5 users run)."""
    preset = get_preset(preset_name)
    if mode not in ("pull", "push"):
        raise LayoutError(f"mode must be 'pull' or 'push', got {mode!r}")
    if kv_gib is None:
        kv_gib = TINY_KV_GIB if preset.tiny_of else DEFAULT_KV_GIB
    _check_bounds(tokens, kv_gib, num_blocks, prefill_tp, decode_tp, prefill_block_size, decode_block_size)
    report = Report(preset.name, preset.description, preset.source, mode, tokens, {"tp": prefill_tp}, {"tp": decode_tp})
    kb = {"prefill": prefill_block_size, "decode": decode_block_size}
    tps = {"prefill": prefill_tp, "decode": decode_tp}
    for side in ("prefill", "decode"):
        try:
            preset.check_tp(tps[side], side)
        except LayoutError as exc:
            report.reasons.append(str(exc))
    lo, hi = sorted((prefill_tp, decode_tp))
    if hi % lo:
        report.reasons.append(f"prefill TP {prefill_tp} and decode TP {decode_tp}: one must divide the other")
    if report.reasons:
        report.compatible = False
        return report

    blocks: dict[str, int] = {}
    ids: dict[str, list[list[int]]] = {}
    for side in ("prefill", "decode"):
        tp = tps[side]
        try:
            geo = preset.geometry(tp, kernel_block_size=kb[side])
        except LayoutError as exc:
            report.reasons.append(f"{side}: {exc}")
            continue
        blocks[side] = num_blocks or pool_blocks(preset, tp, kv_gib, kb[side])
        _check_kernel_blocks(side, blocks[side], geo.ppl, num_blocks is None)
        getattr(report, side).update(tp=tp, num_blocks=blocks[side], tensors=preset.num_tensors, **geo.to_dict())
        ids[side] = _request_ids(preset, geo.logical_block_size, tokens)
    if report.reasons:
        report.compatible = False
        return report

    scenario = preset.scenario(
        prefill_tp,
        decode_tp,
        mode=mode,
        prefill_kernel_block_size=prefill_block_size,
        decode_kernel_block_size=decode_block_size,
        requests=[{"id": f"{tokens} tokens", "prefill": ids["prefill"], "decode": ids["decode"]}],
    )
    for side in ("prefill", "decode"):
        scenario[side]["num_blocks"] = blocks[side]  # each pool sized by its own page
    checked = check_scenario(json.dumps(scenario), coalesce=coalesce, ranks=True)
    report.ranks = [_rank_report(r) for r in checked.get("ranks", [])]
    report.reasons = list(checked["reasons"])
    report.compatible = bool(checked["compatible"])
    if report.compatible:
        report.warnings = _warnings(report, "decode" if mode == "pull" else "prefill")
    return report


def _rank_report(r: dict[str, Any]) -> RankReport:
    """A rank of the Rust check's report (``check_scenario(..., ranks=True)``) as a ``RankReport``."""
    return RankReport(
        role=str(r["role"]),
        rank=int(r["rank"]),
        regions=int(r["regions"]),
        local_rows=int(r["local_rows"]),
        local_descriptors=int(r["local_descriptors"]),
        posts=bool(r["posts"]),
        peers=[int(p) for p in r["peers"]],
        tables={t["key"]: {"rows": int(t["rows"]), "descriptors": int(t["descriptors"])} for t in r["tables"]},
        remote_descriptors={int(rank): int(n) for rank, n in r["remote_descriptors"]},
        request_descriptors=int(r["request_descriptors"]),
        request_bytes=int(r["request_bytes"]),
        request_transfers=int(r["request_transfers"]),
    )


def _check_bounds(
    tokens: int,
    kv_gib: float,
    num_blocks: int | None,
    prefill_tp: int,
    decode_tp: int,
    prefill_block_size: int | None,
    decode_block_size: int | None,
) -> None:
    """``LayoutError`` naming the first argument outside its bound (before any of them sizes anything)."""
    ints = [
        ("request length (tokens)", tokens, MAX_TOKENS),
        ("number of blocks", num_blocks, MAX_NUM_BLOCKS),
        ("prefill TP size", prefill_tp, MAX_TP_SIZE),
        ("decode TP size", decode_tp, MAX_TP_SIZE),
        ("prefill kernel block size", prefill_block_size, MAX_BLOCK_TOKENS),
        ("decode kernel block size", decode_block_size, MAX_BLOCK_TOKENS),
    ]
    for what, value, high in ints:
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise LayoutError(f"{what} must be an integer, got {value!r}")
        if value < 1:
            raise LayoutError(f"{what} must be positive, got {value}")
        if value > high:
            raise LayoutError(f"{what} is {value}, over the limit of {high}")
    if not (math.isfinite(kv_gib) and 0 < kv_gib <= MAX_KV_GIB):
        raise LayoutError(f"KV memory per rank must be a finite number in (0, {MAX_KV_GIB:g}] GiB, got {kv_gib} GiB")


def _check_kernel_blocks(side: str, blocks: int, ppl: int, from_kv_gib: bool) -> None:
    """``LayoutError`` when a pool of ``blocks`` logical blocks has more kernel blocks than int32 ids address."""
    if blocks * ppl > MAX_NUM_BLOCKS:
        given = "--kv-gib" if from_kv_gib else "--num-blocks"
        raise LayoutError(
            f"{side} pool of {blocks} logical blocks x {ppl} kernel blocks is {blocks * ppl} kernel blocks, over the "
            f"limit of {MAX_NUM_BLOCKS} (descriptor ids are int32); lower {given}"
        )


def _ranks_text(role: str, ranks: list[int]) -> str:
    """``decode rank 3``, ``decode ranks 0-7`` or ``decode ranks 0, 2, 5``."""
    if len(ranks) == 1:
        return f"{role} rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{role} ranks {ranks[0]}-{ranks[-1]}"
    return f"{role} ranks {', '.join(map(str, ranks))}"


def _warnings(report: Report, active: str) -> list[str]:
    """One warning per distinct finding, naming every rank it applies to (ranks of one engine usually all
    cost the same, and eight identical lines say less than one)."""
    by_text: dict[tuple[str, str], list[int]] = {}
    for role, rank, text in _rank_warnings(report):
        by_text.setdefault((role, text), []).append(rank)
    return [f"{_ranks_text(role, ranks)}: {text}" for (role, text), ranks in by_text.items()]


def _rank_warnings(report: Report) -> list[tuple[str, int, str]]:
    out = []
    for rr in report.ranks:
        if not rr.posts or not rr.request_descriptors:
            continue
        per = rr.request_bytes / rr.request_descriptors
        if per < SMALL_DESCRIPTOR_BYTES:
            out.append(
                (
                    rr.role,
                    rr.rank,
                    f"descriptor-bound: {rr.request_descriptors} descriptors of {per / 1024:.1f} KiB on average "
                    f"per {report.tokens}-token request (below "
                    f"{SMALL_DESCRIPTOR_BYTES // 1024} KiB, UCX posting rather than bandwidth limits the transfer); "
                    "a larger kernel block or fewer regions would help",
                )
            )
        elif rr.request_descriptors > MANY_DESCRIPTORS:
            out.append(
                (
                    rr.role,
                    rr.rank,
                    f"{rr.request_descriptors} descriptors per {report.tokens}-token request (above "
                    f"{MANY_DESCRIPTORS}); posting them will take a large share of the transfer time",
                )
            )
    return out
