"""``hybrid-kv plan SCENARIO.json``: plan every request of a scenario on every local rank."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.table import Table

from .._core import plan_scenario
from ..errors import CliError
from ._console import console as make_console
from ._input import read_scenario

__all__ = ["register", "run"]


def run(args: argparse.Namespace) -> int:
    """Plan the scenario and print the transfers (a table, or JSON with ``--json``)."""
    for flag, given in (("--compact", args.compact), ("--no-moves", args.no_moves)):
        if given and not args.json:
            raise CliError(f"{flag} only applies to --json output; add --json or drop {flag}")
    report = plan_scenario(read_scenario(args.scenario), moves=args.json and not args.no_moves)
    if args.json:
        print(json.dumps(report, indent=None if args.compact else 2))
        return 0
    console = make_console()
    p_tp, d_tp = report["tp"]
    console.print(
        f"mode {report['mode']}: {report['local_side']} ranks post the transfers (prefill TP {p_tp}, decode TP {d_tp})"
    )
    t = Table(title="transfers")
    for col in ("request", "local rank", "remote rank", "local table", "descriptors", "bytes", "notify"):
        t.add_column(col, justify="left" if col in ("request", "local table") else "right")
    for req in report["requests"]:
        for rank in req["ranks"]:
            notify = ",".join(str(r) for r in rank["notify_ranks"])
            if not rank["transfers"]:
                t.add_row(req["id"], str(rank["local_rank"]), "-", "-", "0", "0", notify)
            for tr in rank["transfers"]:
                t.add_row(
                    req["id"],
                    str(rank["local_rank"]),
                    str(tr["remote_rank"]),
                    tr["local_table"],
                    str(len(tr["local_ids"])),
                    str(tr["bytes"]),
                    notify,
                )
    console.print(t)
    return 0


def register(sub: Any) -> None:
    """Add the ``plan`` subcommand."""
    p = sub.add_parser(
        "plan",
        help="plan every request of a scenario file on every rank",
        description="Build every rank of a P/D deployment described by a scenario file (see docs/scenario.md), "
        "plan each request on every local rank (decode in pull mode, prefill in push mode) and print the "
        "transfers. With --json, print every transfer's descriptor ids and byte moves.",
        epilog="""examples:
  hybrid-kv plan tests/data/scenarios/kimi_tiny_8p2d_push.json      transfers per request and rank pair
  hybrid-kv plan scenario.json --json --no-moves                    descriptor ids only
  hybrid-kv plan - < scenario.json                                  scenario on stdin

Exit status: 0 when every request plans; 2 for an unreadable or malformed scenario or a request that
cannot be planned (one line on stderr).""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("scenario", help="scenario JSON file, or - for stdin")
    p.add_argument("--json", action="store_true", help="print the full report as JSON (ids and moves)")
    p.add_argument("--no-moves", action="store_true", help="with --json, leave out the resolved byte moves")
    p.add_argument("--compact", action="store_true", help="with --json, print on one line")
    p.set_defaults(func=run)
