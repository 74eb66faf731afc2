"""Reading a scenario file (or stdin) as untrusted bytes: bounded in size, UTF-8, one-line errors."""

from __future__ import annotations

import os
import sys

from ..errors import CliError

__all__ = ["MAX_SCENARIO_BYTES", "read_scenario"]

MAX_SCENARIO_BYTES = 64 * 2**20
"""Largest scenario accepted (64 MiB: the largest example is a few KiB; a million requests of a few ids fit)."""


def read_scenario(path: str) -> str:
    """The text of the scenario file at ``path`` (``-``: stdin).

    A regular file over :data:`MAX_SCENARIO_BYTES` is refused by its size before it is read; anything else
    (stdin, pipes, devices) is read up to one byte past the limit. Raises :class:`CliError` naming the file,
    the size and the limit, or the offset of the first byte that is not UTF-8; ``OSError`` when unreadable.
    """
    name = "scenario on stdin" if path == "-" else f"scenario file {path}"
    if path == "-":
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:  # a text stream put in place of stdin (tests, notebooks): already decoded
            text: str = sys.stdin.read(MAX_SCENARIO_BYTES + 1)
            if len(text) > MAX_SCENARIO_BYTES:
                raise CliError(f"{name} is over the limit of {MAX_SCENARIO_BYTES} characters")
            return text
        data: bytes = stream.read(MAX_SCENARIO_BYTES + 1)
    else:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_SCENARIO_BYTES:
                raise CliError(f"{name} is {size} bytes, over the limit of {MAX_SCENARIO_BYTES}")
            data = f.read(MAX_SCENARIO_BYTES + 1)
    if len(data) > MAX_SCENARIO_BYTES:
        raise CliError(f"{name} is over the limit of {MAX_SCENARIO_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CliError(f"{name} is not UTF-8 text: byte {e.start} is {data[e.start]:#04x} ({e.reason})") from None
