"""Bounded argument types for every subcommand, and the limits they enforce.

Every number on the command line is untrusted: each option that sizes something takes one of these as its
argparse ``type=``, so a bad value is refused while parsing, before anything is built, with one line naming
the option, the value and the accepted range. Help texts state the limits from the same constants.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from ..errors import ArgumentError
from ..limits import MAX_BLOCK_TOKENS as MAX_BLOCK_TOKENS  # the limits live beside the library that checks them
from ..limits import MAX_NUM_BLOCKS as MAX_NUM_BLOCKS
from ..limits import MAX_TP_SIZE as MAX_TP_SIZE

__all__ = [
    "MAX_BLOCK_TOKENS",
    "MAX_NUM_BLOCKS",
    "MAX_TP_SIZE",
    "OneLineParser",
    "int_in",
    "positive_float",
    "positive_int",
]

_SHOWN_CHARS = 40


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors raise :class:`ArgumentError` instead of printing usage and exiting.

    Subparsers are created with the parent's class, so every subcommand's errors are one line too.
    """

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ArgumentError(self.prog, message)


def _shown(text: str) -> str:
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high}], got {_shown(text)}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high}], got {value}")
        return value

    parse.__name__ = f"integer in [{low}, {high}]"
    return parse


def positive_int(high: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``[1, high]``."""
    return int_in(1, high)


def positive_float(high: float) -> Callable[[str], float]:
    """An argparse type: a finite number in ``(0, high]`` (``nan``, ``inf``, zero and negatives refused)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number in (0, {high:g}], got {_shown(text)}") from None
        if not (math.isfinite(value) and 0 < value <= high):
            raise argparse.ArgumentTypeError(f"must be a finite number in (0, {high:g}], got {value:g}")
        return value

    parse.__name__ = f"number in (0, {high:g}]"
    return parse
