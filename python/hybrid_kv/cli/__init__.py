"""The ``hybrid-kv`` command line.

Every module in this package that defines ``register(subparsers)`` adds one subcommand; the subcommand's
handler is stored as ``func`` on its parser and returns the exit status. Expected failures (bad input,
incompatible peers, failed transfers) print one line on stderr and exit non-zero, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import pkgutil
import sys
from collections.abc import Sequence

from .._core import __version__
from ..errors import ArgumentError, CliError, HybridKvError
from ._args import OneLineParser

__all__ = ["EPILOG", "EXTRA_OF_MODULE", "build_parser", "install_hint", "main", "one_line", "require"]

EPILOG = """examples:
  hybrid-kv demo                         run the default P/D demo and verify every byte
  hybrid-kv regions                      region table of a tiny Kimi-Linear-like layout
  hybrid-kv plan scenario.json --json    every rank's transfers for a scenario
  hybrid-kv check scenario.json          validate every rank pair before launch
  hybrid-kv gpu-kit --out kit.json       the transport on one GPU (or --device cpu), JSON summary
"""


EXTRA_OF_MODULE = {"torch": "torch", "nixl": "nixl", "zmq": "nixl", "msgspec": "nixl", "cryptography": "nixl"}
"""Optional modules and the extra of ``pyproject.toml`` that installs each (zmq, msgspec and cryptography come
with ``nixl``)."""


def install_hint(modules: Sequence[str]) -> str:
    """``torch and zmq, which are not installed: pip install 'hybrid-kv[torch,nixl]'``."""
    extras = list(dict.fromkeys(EXTRA_OF_MODULE.get(m, m) for m in modules))
    names = ", ".join(modules[:-1]) + f" and {modules[-1]}" if len(modules) > 1 else modules[0]
    which = "which is" if len(modules) == 1 else "which are"
    return f"{names}, {which} not installed: pip install 'hybrid-kv[{','.join(extras)}]'"


def require(*modules: str) -> None:
    """Raise :class:`CliError` naming the extra to install when any of ``modules`` is not importable."""
    missing = []
    for m in modules:
        try:
            found = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(m)
    if missing:
        raise CliError(f"needs {install_hint(missing)}")


def one_line(message: str) -> str:
    """A multi-line error (a handshake error lists one finding per line) as one line: ``head: a; b``."""
    head, *rest = [line.strip() for line in message.splitlines() if line.strip()] or [""]
    return f"{head} {'; '.join(rest)}" if rest else head


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser with one subparser per command module (``only``: that module's alone, so that the
    others' imports are not needed)."""
    parser = OneLineParser(
        prog="hybrid-kv",
        description="Plan and run KV-cache transfers between prefill and decode for hybrid MLA+SSM models.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hybrid-kv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name.startswith("_") or (only is not None and mod.name != only):
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None, only: str | None = None) -> int:
    """Entry point of ``hybrid-kv``; returns the exit status (``only``: see ``build_parser``)."""
    parser = build_parser(only)
    try:
        args = parser.parse_args(argv)
    except ArgumentError as e:
        print(f"{e.prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        status: int = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (``hybrid-kv plan --json | head -1``): nothing to report. Point stdout at
        # /dev/null so the interpreter's final flush does not complain either.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except ModuleNotFoundError as e:
        root = (e.name or "").partition(".")[0]
        if root not in EXTRA_OF_MODULE:
            raise
        print(f"hybrid-kv {args.command}: error: needs {install_hint([root])}", file=sys.stderr)
        return 2
    except (HybridKvError, CliError, OSError, json.JSONDecodeError) as e:
        print(f"hybrid-kv {args.command}: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hybrid-kv {args.command}: interrupted", file=sys.stderr)
        return 130
    return status


if __name__ == "__main__":
    sys.exit(main())
