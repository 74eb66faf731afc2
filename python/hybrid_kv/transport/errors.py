"""Exceptions raised by the transport.

These are plain ``Exception`` subclasses so that the transport can be used and tested before the
native binding exists; the package root re-parents them under ``hybrid_kv.HybridKvError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["HandshakeError", "TransferError"]


class TransferError(Exception):
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


class HandshakeError(Exception):
    """Connecting to a peer failed: timeout, protocol mismatch, remote error or rejected payload."""


def _rebuild(cls: type[TransferError], message: str, request_id: str | None, failed: tuple[Any, ...]) -> TransferError:
    return cls(message, request_id=request_id, failed=failed)
