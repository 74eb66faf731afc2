"""``hybrid-kv check``: validate a P/D deployment before launch, from a scenario file or a model preset.

* ``hybrid-kv check SCENARIO.json``: build every rank of the scenario, run the handshake checks on every rank
  pair (each local rank against the remote ranks it handshakes with), and plan the requests on every local rank
  whose pairs pass; a verdict table lists every pair with all of its findings.
* ``hybrid-kv check --preset NAME --prefill-tp N --decode-tp M``: the pre-flight report of a real deployment
  of a model preset: the report is :mod:`hybrid_kv.preflight`'s, its options and printing are here.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import CliError
from ..preflight import DEFAULT_KV_GIB, MAX_KV_GIB, MAX_TOKENS, TINY_KV_GIB, Report, preflight
from ..presets import preset_names
from ._args import MAX_BLOCK_TOKENS, MAX_NUM_BLOCKS, MAX_TP_SIZE, positive_float, positive_int
from ._console import console as make_console
from ._console import count
from ._input import read_scenario

__all__ = [
    "EXAMPLES",
    "PRESET_EXAMPLES",
    "add_preset_arguments",
    "print_check_report",
    "print_preset_report",
    "register",
    "run",
    "run_preset",
    "run_scenario",
]

PRESET_EXAMPLES = """preset pre-flight examples:
  hybrid-kv check --preset kimi-linear-48b-a3b --prefill-tp 8 --decode-tp 1
  hybrid-kv check --preset deepseek-v3 --prefill-tp 8 --decode-tp 8 --tokens 32768 --json
  hybrid-kv check --preset qwen3-next-80b-a3b --prefill-tp 2 --decode-tp 4 --mode push --kv-gib 60
"""

EXAMPLES = (
    """scenario examples:
  hybrid-kv check scenario.json
  hybrid-kv check scenario.json --json

"""
    + PRESET_EXAMPLES
    + """
Exit status: 0 compatible; 1 the deployment is incompatible (the report says why); 2 bad arguments or an
unreadable / malformed scenario file (one line on stderr)."""
)


def _finding_line(f: dict[str, str]) -> str:
    """``check: local X, remote Y`` (``check: value Y`` for a value with no counterpart)."""
    if f["local"]:
        return f"{f['check']}: local {f['local']}, remote {f['remote']}"
    return f"{f['check']}: value {f['remote']}"


def _summary_line(report: dict[str, Any]) -> str:
    s = report["summary"]
    p_tp, d_tp = report["tp"]
    setup = f"prefill TP {p_tp} -> decode TP {d_tp}, {report['mode']} ({report['local_side']} posts)"
    if not report["pairs"]:  # an engine cannot be built at its TP size: the reason says why
        from rich.markup import escape

        return f"[bold red]INCOMPATIBLE[/bold red]: {setup}; {escape('; '.join(report['reasons']))}"
    if s["compatible"]:
        pairs = "the rank pair passes" if s["pairs"] == 1 else f"all {s['pairs']} rank pairs pass"
        return (
            f"[bold green]COMPATIBLE[/bold green]: {setup}; {pairs} the handshake checks; "
            f"{count(s['requests'], 'request')} plan into {count(s['transfers'], 'transfer')}, "
            f"{count(s['bytes'], 'byte')}"
        )
    findings = sum(len(p["findings"]) for p in report["pairs"])
    return (
        f"[bold red]INCOMPATIBLE[/bold red]: {setup}; {s['incompatible_pairs']} of {count(s['pairs'], 'rank pair')} "
        f"{'fails' if s['incompatible_pairs'] == 1 else 'fail'} with {count(findings, 'finding')}"
    )


def print_check_report(report: dict[str, Any]) -> None:
    """The verdict table (one row per rank pair, findings one per line) and the summary line."""
    from rich.markup import escape
    from rich.table import Table

    table = Table()
    table.add_column("P rank", justify="right")
    table.add_column("D rank", justify="right")
    table.add_column("verdict")
    table.add_column("findings", overflow="fold")
    for pair in report["pairs"]:
        lines = [
            escape(_finding_line(f)) + (f" [dim]({escape(f['detail'])})[/dim]" if f["detail"] else "")
            for f in pair["findings"]
        ]
        table.add_row(
            str(pair["prefill_rank"]),
            str(pair["decode_rank"]),
            "[green]compatible[/green]" if pair["verdict"] == "compatible" else "[red]incompatible[/red]",
            "\n".join(lines) if lines else "-",
        )
    console = make_console()
    if report.get("name"):
        console.print(f"[bold]{escape(report['name'])}[/bold]")
    if report["pairs"]:
        console.print(table)
    console.print(_summary_line(report))


def run_scenario(args: argparse.Namespace) -> int:
    """Handshake-check every rank pair of the scenario and plan its requests; 0 only when every pair passes.

    1 when the deployment is incompatible, an engine that cannot be built at its TP size included (as
    ``check --preset`` reports it); a malformed scenario raises (one line, exit 2).
    """
    from .._core import check_scenario

    report = check_scenario(read_scenario(args.scenario))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_check_report(report)
    return 0 if report["summary"]["compatible"] else 1


# ---------------------------------------------------------------------------------------------- --preset


def add_preset_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--preset`` options of ``hybrid-kv check`` (a pre-flight report instead of a scenario file); every
    number is bounded while parsing (see :mod:`hybrid_kv.cli._args`)."""
    tp, blocks, kernel = positive_int(MAX_TP_SIZE), positive_int(MAX_NUM_BLOCKS), positive_int(MAX_BLOCK_TOKENS)
    g = p.add_argument_group("preset pre-flight (instead of a scenario file)")
    g.add_argument("--preset", metavar="NAME", help=f"model preset: {', '.join(preset_names())}")
    g.add_argument("--prefill-tp", type=tp, metavar="N", help=f"prefill TP size, 1-{MAX_TP_SIZE} (with --preset)")
    g.add_argument("--decode-tp", type=tp, metavar="M", help=f"decode TP size, 1-{MAX_TP_SIZE} (with --preset)")
    g.add_argument("--mode", choices=("pull", "push"), default="pull", help="who posts transfers (default pull)")
    g.add_argument(
        "--tokens",
        type=positive_int(MAX_TOKENS),
        default=32768,
        metavar="L",
        help=f"request length to cost, 1-{MAX_TOKENS} (default 32768)",
    )
    g.add_argument(
        "--kv-gib",
        type=positive_float(MAX_KV_GIB),
        metavar="G",
        help=f"KV-cache GiB per rank, sizing the pools, at most {MAX_KV_GIB:g} (default {DEFAULT_KV_GIB:g}; "
        f"{TINY_KV_GIB:g} for tiny presets)",
    )
    g.add_argument(
        "--num-blocks",
        type=blocks,
        metavar="N",
        help=f"logical blocks per pool, 1-{MAX_NUM_BLOCKS} (overrides --kv-gib)",
    )
    g.add_argument(
        "--prefill-block-size",
        type=kernel,
        metavar="K",
        help=f"prefill kernel block, 1-{MAX_BLOCK_TOKENS} (default: preset's)",
    )
    g.add_argument(
        "--decode-block-size",
        type=kernel,
        metavar="K",
        help=f"decode kernel block, 1-{MAX_BLOCK_TOKENS} (default: preset's)",
    )
    g.add_argument(
        "--no-coalesce",
        action="store_true",
        help="cost one descriptor per kernel unit, without chunk rows (the plans nixl < 1.5 users get)",
    )


def run_preset(args: argparse.Namespace) -> int:
    """``hybrid-kv check --preset ...``: print the report; 0 compatible, 1 incompatible."""
    if args.prefill_tp is None or args.decode_tp is None:
        raise CliError("--preset needs --prefill-tp and --decode-tp")
    report = preflight(
        args.preset,
        args.prefill_tp,
        args.decode_tp,
        mode=args.mode,
        tokens=args.tokens,
        kv_gib=args.kv_gib,
        num_blocks=args.num_blocks,
        prefill_block_size=args.prefill_block_size,
        decode_block_size=args.decode_block_size,
        coalesce=not getattr(args, "no_coalesce", False),
    )
    if getattr(args, "json", False):
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print_preset_report(report)
    return 0 if report.compatible else 1


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def print_preset_report(report: Report) -> None:
    """Human-readable report (rich)."""
    from rich.table import Table

    out = make_console()
    out.print(
        f"[bold]hybrid-kv check[/bold]: {report.preset} ({report.description}); prefill TP "
        f"{report.prefill['tp']} -> decode TP {report.decode['tp']}, {report.mode}"
    )
    out.print(f"  source: {report.source}")
    for side in ("prefill", "decode"):
        s = getattr(report, side)
        if "num_blocks" in s:
            out.print(
                f"  {side:7}: TP {s['tp']}, logical block {s['logical_block_size']} tokens = {s['ppl']} x "
                f"{s['kernel_block_size']}-token kernel blocks of {_size(s['kernel_page_bytes'])}, page "
                f"{_size(s['page_bytes'])}, {s['num_blocks']} blocks x {s['tensors']} tensors per rank "
                f"({_size(s['num_blocks'] * s['page_bytes'] * s['tensors'])})"
            )
    if report.ranks:
        t = Table(title=f"per rank (request of {report.tokens} tokens)")
        for col in ("rank", "regions", "local table", "peers", "remote tables", "req. descs", "req. bytes", "xfers"):
            t.add_column(col, justify="left" if col in ("rank", "local table", "peers", "remote tables") else "right")
        for rr in report.ranks:
            local = f"{rr.local_rows} rows = {rr.local_descriptors} descs"
            if len(rr.tables) > 1:
                local += f" (+{len(rr.tables) - 1} split)"
            remote = ", ".join(f"{r}: {n}" for r, n in rr.remote_descriptors.items()) or "-"
            posting = rr.posts and rr.request_descriptors
            t.add_row(
                f"{rr.role} {rr.rank}" + (" *" if rr.posts else ""),
                str(rr.regions),
                local,
                ", ".join(map(str, rr.peers)) or "-",
                remote,
                str(rr.request_descriptors) if posting else "-",
                _size(rr.request_bytes) if posting else "-",
                str(rr.request_transfers) if posting else "-",
            )
        out.print(t)
        out.print("  * posts the transfers (decode in pull mode, prefill in push mode)")
    if report.compatible:
        out.print("[bold green]COMPATIBLE[/bold green]: every handshake pair validates and every posting rank plans")
    else:
        n = len(report.reasons)
        out.print(f"[bold red]INCOMPATIBLE[/bold red]: {n} reason{'' if n == 1 else 's'}")
        for r in report.reasons:
            out.print(f"  - {r}")
    for w in report.warnings:
        out.print(f"[yellow]warning[/yellow]: {w}")


def run(args: argparse.Namespace) -> int:
    """Dispatch on the input: ``--preset`` or a scenario file."""
    if args.preset is not None:
        if args.scenario is not None:
            raise CliError("give either a scenario file or --preset, not both")
        return run_preset(args)
    if args.scenario is None:
        raise CliError("give a scenario file or --preset NAME --prefill-tp N --decode-tp M")
    return run_scenario(args)


def register(sub: Any) -> None:
    """Add the ``check`` subcommand."""
    p = sub.add_parser(
        "check",
        help="validate a deployment before launch (scenario file or model preset)",
        description="Validate a P/D deployment before any GPU is touched: a scenario file (every rank pair "
        "handshake-checked, every request planned, a verdict per pair), or a model preset at given TP sizes (a "
        "pre-flight report: compatibility with reasons, regions and descriptor tables per rank, peers, descriptors and "
        "bytes per request, descriptor-bound warnings).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("scenario", nargs="?", help="scenario JSON file, or - for stdin")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_preset_arguments(p)
    p.set_defaults(func=run)
