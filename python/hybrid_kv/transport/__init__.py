"""NIXL transport for hybrid-kv: registers memory, preps the planner's descriptor tables, runs the
handshake side channel, posts transfers and reports completion and failure.

It knows nothing about planning: it consumes the ``(N, 3)``/``(N, 5)`` uint64 tables and int32 id
arrays the planner produces.
"""

from .endpoint import Endpoint
from .errors import HandshakeError, TransferError
from .requests import ControlMessage, Op, PeerKey, PollResult, RemoteEvent, RequestHandle, RequestState, Transfer
from .tables import DescTable, check_ids, expand_strided

__all__ = [
    "ControlMessage",
    "DescTable",
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
    "check_ids",
    "expand_strided",
]
