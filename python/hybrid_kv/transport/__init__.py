"""NIXL transport for hybrid-kv: registers memory, preps the planner's descriptor tables, runs the
handshake side channel, posts transfers and reports completion and failure.

It knows nothing about planning: it consumes the ``(N, 3)``/``(N, 5)`` uint64 tables and int32 id
arrays the planner produces.

``Endpoint`` (NIXL and zmq, the ``nixl`` extra) is imported on first use, so the planner's inputs
(``Transfer``, tables) import without the extra.

The API is the names in ``__all__``; the submodules (side channel, courier, agent, in-flight bookkeeping...) are
this package's internals, imported by hybrid-kv's own packages and tests, and may change without notice.
"""

from typing import TYPE_CHECKING, Any

from ..errors import HandshakeError, TransferError
from .requests import (
    NOT_YET,
    Check,
    CheckVerdict,
    ControlMessage,
    Op,
    PeerKey,
    PollResult,
    RemoteEvent,
    RequestHandle,
    RequestState,
    Transfer,
    TransferStats,
)
from .tables import CheckedTable, check_ids

if TYPE_CHECKING:
    from .endpoint import Endpoint


def __getattr__(name: str) -> Any:
    if name == "Endpoint":
        from .endpoint import Endpoint

        return Endpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "NOT_YET",
    "Check",
    "CheckVerdict",
    "CheckedTable",
    "ControlMessage",
    "Endpoint",
    "HandshakeError",
    "Op",
    "PeerKey",
    "PollResult",
    "RemoteEvent",
    "RequestHandle",
    "RequestState",
    "Transfer",
    "TransferError",
    "TransferStats",
    "check_ids",
]
