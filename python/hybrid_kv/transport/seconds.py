"""Timeouts and deadlines as checked numbers of seconds (``check_seconds``)."""

from __future__ import annotations

__all__ = ["MAX_SECONDS", "check_seconds"]

MAX_SECONDS = 1e7
"""The longest timeout or deadline accepted (about 116 days): anything longer is a mistake, not a wait."""


def check_seconds(value: object, what: str) -> float:
    """``value`` as a number of seconds: finite, positive and at most ``MAX_SECONDS``.

    Raises:
        ValueError: anything else (NaN, infinities, zero, negative, not a number), naming ``what`` and the value.
    """
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of seconds, got {value!r}") from None
    if not 0 < seconds <= MAX_SECONDS:  # NaN fails every comparison
        raise ValueError(f"{what} must be finite, positive and at most {MAX_SECONDS:g} s, got {value!r}")
    return seconds
