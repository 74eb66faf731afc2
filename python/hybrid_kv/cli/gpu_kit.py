"""``hybrid-kv gpu-kit``: the whole transport below vLLM on one device, every step bounded, a JSON summary.

Also runnable as ``python -m hybrid_kv.cli.gpu_kit`` (what ``scripts/gpu-kit.sh`` does), which imports nothing of
the other subcommands (no ``rich``: the accelerator image carries only the kit's wheels).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ._args import int_in, positive_float, positive_int

__all__ = ["EXAMPLES", "MAX_BUDGET_S", "add_arguments", "main", "register", "run"]

MAX_BUDGET_S = 3600.0
"""Longest whole run (one hour)."""

EXAMPLES = """examples:
  hybrid-kv gpu-kit --out kit.json                     every step on the first GPU
  hybrid-kv gpu-kit --device cpu --out kit.json        the dry run: host memory, tiny presets, about a minute
  hybrid-kv gpu-kit --steps transfer --presets deepseek-v3 --tokens 131072 --out ds.json

Each step runs in its own process group, stopped at its bound (--bound STEP=SECONDS, and what is left of
--budget-s); a failed step records why and the next one runs. Exit status: 0 every step ok, 1 a step failed
(the JSON says which and why), 2 bad arguments."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..kit.config import STEPS

    p.add_argument("--out", required=True, help="where to write the JSON summary (rewritten after every step)")
    p.add_argument("--device", default="cuda", help="torch device of the pools: cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--logs", help="folder of the step and rank logs (default: the summary's path without .json, -logs)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {', '.join(STEPS)}")
    p.add_argument("--budget-s", type=positive_float(MAX_BUDGET_S), default=420.0, help="the whole run's bound")
    p.add_argument("--bound", action="append", default=[], metavar="STEP=SECONDS", help="one step's time bound")
    p.add_argument("--presets", help="presets of the transfer and streaming steps, comma-separated")
    p.add_argument("--tokens", type=positive_int(1 << 20), help="longest request of a transfer batch")
    p.add_argument("--requests", type=positive_int(64), help="requests in a transfer batch")
    p.add_argument("--repeats", type=positive_int(20), help="timed repeats (medians)")
    p.add_argument("--registration-mib", type=positive_int(1 << 20), help="pool registered per preset, MiB")
    p.add_argument("--stream-tokens", type=positive_int(1 << 20), help="prompt of the streamed request")
    p.add_argument("--compute-dim", type=int_in(0, 1 << 16), help="per-layer matrix side (0: like the model's)")
    p.add_argument("--planner-pool-gib", type=positive_int(1 << 10), help="each rank's pool in the planner layouts")
    p.add_argument("--chunk-mib", type=positive_int(4096), help="bytes the device byte check takes per step, MiB")
    p.add_argument(
        "--ucx-error-mode",
        choices=("peer", "none"),
        help="UCX error handling of the ranks' endpoints (default peer, as the connector)",
    )
    p.add_argument("--corrupt", action="store_true", help=argparse.SUPPRESS)  # fault injection for the tests


def run(args: argparse.Namespace) -> int:
    from ..errors import CliError
    from ..kit.config import BOUNDS_S, STEPS, KitConfig
    from ..kit.runner import run_kit
    from ..kit.summary import lines

    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        raise CliError(f"--steps: unknown step(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(STEPS)}")
    bounds: dict[str, float] = dict(BOUNDS_S)
    for text in args.bound:
        step, _, secs = text.partition("=")
        try:
            bounds[step] = positive_float(MAX_BUDGET_S)(secs)
        except argparse.ArgumentTypeError as exc:
            raise CliError(f"--bound {text!r}: {exc}") from None
        if step not in STEPS:
            raise CliError(f"--bound {text!r}: unknown step {step!r}; known: {', '.join(STEPS)}")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise CliError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    out = os.path.abspath(args.out)
    logs = os.path.abspath(args.logs or (out[:-5] if out.endswith(".json") else out) + "-logs")
    cfg = KitConfig.for_device(
        args.device,
        log_dir=logs,
        presets=[p.strip() for p in args.presets.split(",")] if args.presets else None,
        tokens=args.tokens,
        requests=args.requests,
        repeats=args.repeats,
        registration_mib=args.registration_mib,
        stream_tokens=args.stream_tokens,
        compute_dim=args.compute_dim,
        planner_pool_gib=args.planner_pool_gib,
        chunk=args.chunk_mib << 20 if args.chunk_mib else None,
        corrupt=args.corrupt or None,
        ucx_error_mode=args.ucx_error_mode,
    )
    _check_presets(cfg.presets)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)

    def echo(line: str) -> None:
        print(f"[gpu-kit] {line}", file=sys.stderr, flush=True)

    echo(f"device {cfg.device}, steps {', '.join(steps)}, budget {args.budget_s:.0f} s, summary {out}, logs {logs}")
    summary = run_kit(cfg, out, steps, args.budget_s, bounds, echo)
    print("\n".join(lines(summary)))
    print(f"summary: {out}")
    return 0 if summary["ok"] else 1


def _check_presets(names: Sequence[str]) -> None:
    from ..errors import CliError
    from ..presets import preset_names

    unknown = [n for n in names if n not in preset_names()]
    if unknown:
        raise CliError(f"--presets: unknown preset(s) {', '.join(unknown)}; known: {', '.join(preset_names())}")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "gpu-kit",
        help="the transport below vLLM on one device (or --device cpu), JSON summary",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hybrid_kv.cli.gpu_kit``: this subcommand alone, with the CLI's error handling."""
    from . import main as cli_main

    return cli_main(["gpu-kit", *(sys.argv[1:] if argv is None else argv)], only="gpu_kit")


if __name__ == "__main__":
    sys.exit(main())
