"""One rich console for every subcommand: wide enough for tables when output is not a terminal."""

from __future__ import annotations

import sys

from rich.console import Console


def console(stderr: bool = False) -> Console:
    """A console that does not squeeze tables to 80 columns when piped."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, width=None if stream.isatty() else 160)
