"""Exceptions raised by the transport.

Both derive from the package's exception hierarchy, so ``except hybrid_kv.TransferError`` (or
``hybrid_kv.HybridKvError``) catches what the transport raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._core import HandshakeError
from .._core import TransferError as _CoreTransferError

__all__ = ["HandshakeError", "TransferError"]


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
