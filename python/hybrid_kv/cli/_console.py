"""One rich console for every subcommand: wide enough for tables when output is not a terminal, and without
the trailing spaces rich pads table rows with (so piped output diffs and greps cleanly)."""

from __future__ import annotations

import sys
from typing import IO

from rich.console import Console

__all__ = ["console", "count"]


class _RStripLines:
    """A text stream that writes each complete line without its trailing spaces."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._pending = ""

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        if lines:
            self._stream.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._stream.write(self._pending)
            self._pending = ""
        self._stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", None) or "utf-8"


def console(stderr: bool = False) -> Console:
    """A console that does not squeeze tables to 80 columns nor pad lines with spaces when piped."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(file=stream)
    return Console(file=_RStripLines(stream), width=160)  # type: ignore[arg-type]


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``1 request``, ``3 requests`` (``plural`` for irregular nouns)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
