"""``hybrid-kv check``: validate a P/D deployment before launch, from a scenario file or a model preset.

* ``hybrid-kv check SCENARIO.json``: build every rank of the scenario and plan each of its requests on every
  rank that posts transfers; any layout, handshake or planning problem is reported.
* ``hybrid-kv check --preset NAME --prefill-tp N --decode-tp M``: the pre-flight report of a real deployment
  of a model preset (see :mod:`hybrid_kv.preflight`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..preflight import PRESET_EXAMPLES, add_preset_arguments, run_preset
from . import CliError
from ._console import console as make_console

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


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    return Path(path).read_text(encoding="utf-8")


def run_scenario(args: argparse.Namespace) -> int:
    """Build and plan the whole scenario; a problem raises (one line, exit 2)."""
    from .._core import plan_scenario

    report: dict[str, Any] = json.loads(plan_scenario(_read(args.scenario), moves=False))
    requests = report.get("requests", [])
    transfers = sum(len(rank["transfers"]) for req in requests for rank in req["ranks"])
    if args.json:
        print(json.dumps({"compatible": True, "requests": len(requests), "transfers": transfers}))
        return 0
    p_tp, d_tp = report["tp"]
    make_console().print(
        f"[bold green]COMPATIBLE[/bold green]: prefill TP {p_tp} -> decode TP {d_tp}, {report['mode']}; every rank "
        f"builds and {len(requests)} request(s) plan into {transfers} transfer(s)"
    )
    return 0


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
        description="Validate a P/D deployment before any GPU is touched: a scenario file (every rank built, every "
        "request planned), or a model preset at given TP sizes (a pre-flight report: compatibility with reasons, "
        "regions and descriptor tables per rank, peers, descriptors and bytes per request, descriptor-bound warnings).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("scenario", nargs="?", help="scenario JSON file, or - for stdin")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_preset_arguments(p)
    p.set_defaults(func=run)
