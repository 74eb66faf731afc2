"""``hybrid-kv check``: validate a P/D deployment before launch, from a scenario file or a model preset.

* ``hybrid-kv check SCENARIO.json``: build every rank of the scenario, run the handshake checks on every rank
  pair (each local rank against the remote ranks it handshakes with), and plan the requests on every local rank
  whose pairs pass; a verdict table lists every pair with all of its findings.
* ``hybrid-kv check --preset NAME --prefill-tp N --decode-tp M``: the pre-flight report of a real deployment
  of a model preset (see :mod:`hybrid_kv.preflight`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..preflight import PRESET_EXAMPLES, add_preset_arguments, run_preset
from . import CliError
from ._console import console as make_console
from ._console import count
from ._input import read_scenario

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

    report: dict[str, Any] = json.loads(check_scenario(read_scenario(args.scenario)))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_check_report(report)
    return 0 if report["summary"]["compatible"] else 1


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
