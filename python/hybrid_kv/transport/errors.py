"""Exceptions raised by the transport.

Both derive from the package's exception hierarchy, so ``except hybrid_kv.TransferError`` (or
``hybrid_kv.HybridKvError``) catches what the transport raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._core import HandshakeError
from .._core import TransferError as _CoreTransferError

__all__ = ["HandshakeError", "TransferError", "check_seconds"]

MAX_SECONDS = 1e7
"""The longest timeout or deadline accepted (about 116 days): anything longer is a mistake, not a wait."""


class TransferError(_CoreTransferError):
    """A transfer request was rejected before posting, or failed while in flight.

    Attributes:
        request_id: the request this error belongs to (``None`` when not tied to one request).
        failed: the transfers (``hybrid_kv.transport.Transfer``) whose bytes are not known to have
            landed, with their local and remote descriptor ids, so an engine can recompute them.
    """

    def __init__(self, message: str, *, request_id: str | None = None, failed: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.failed = tuple(failed)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), self.request_id, self.failed))


def _rebuild(cls: type[TransferError], message: str, request_id: str | None, failed: tuple[Any, ...]) -> TransferError:
    return cls(message, request_id=request_id, failed=failed)


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
