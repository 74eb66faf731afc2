"""Decoding untrusted msgpack from peers: a bounded pre-scan, then a typed decode, and one error type out.

Every decoder of peer bytes (control messages, lease claims, tickets, the demo's messages) goes through
``decode``: the Rust pre-scan (``msgpack_prescan``) walks the bytes once, iteratively, and refuses anything over
the caller's bounds (size, elements per container, string length, nesting) before msgspec sees it, so no input
makes a decoder recurse deeply or allocate from a claimed length; msgspec then checks every field's type and
range. Whatever goes wrong, the caller gets its own error type with one line saying why, never another
exception (a decoder bug included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import msgspec

from ._core import msgpack_prescan
from .limits import MAX_GROUPS, MAX_REQUEST_ID_CHARS, MAX_TP_SIZE

__all__ = [
    "GRANT_BYTES",
    "MAX_BLOCKS_PER_GROUP",
    "MAX_TICKET_CHARS",
    "BlockIdLists",
    "Count",
    "Grant",
    "Hex64",
    "Host",
    "Limits",
    "Name",
    "Port",
    "RequestId",
    "TpSize",
    "WallTime",
    "decode",
]

GRANT_BYTES = 16
"""Bytes of a random grant or capability (128 bits)."""
MAX_BLOCKS_PER_GROUP = 1 << 20
"""Most block ids in one group of a message (a 16 M-token context in 16-token blocks)."""
MAX_TICKET_CHARS = 12 * MAX_GROUPS * 1024 + 1024
"""Longest ticket text decoded; longer is refused before base64 allocates (a ticket of a 64 K-token request in
16-token blocks over 4 groups is about 22 KB)."""

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS)]
Grant = Annotated[bytes, msgspec.Meta(min_length=GRANT_BYTES, max_length=GRANT_BYTES)]
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
BlockIdLists = Annotated[
    list[Annotated[list[BlockId], msgspec.Meta(max_length=MAX_BLOCKS_PER_GROUP)]], msgspec.Meta(max_length=MAX_GROUPS)
]
WallTime = Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]  # also refuses NaN and infinities
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
TpSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)]
Count = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Hex64 = Annotated[str, msgspec.Meta(pattern="^([0-9a-f]{16})?$")]

T = TypeVar("T")
E = TypeVar("E", bound=Exception)


@dataclass(frozen=True)
class Limits:
    """The bounds of one message kind (see ``msgpack_prescan``)."""

    max_bytes: int
    max_len: int
    max_str: int = 4096
    max_depth: int = 8


def decode(decoder: msgspec.msgpack.Decoder[T], data: Any, limits: Limits, error: type[E], what: str) -> T:
    """``data`` decoded by ``decoder`` after the pre-scan; raises ``error("<what> ...: why")`` and nothing else."""
    try:
        raw = bytes(data)
        msgpack_prescan(
            raw,
            max_bytes=limits.max_bytes,
            max_len=limits.max_len,
            max_str=limits.max_str,
            max_depth=limits.max_depth,
        )
        return decoder.decode(raw)
    except Exception as exc:  # noqa: BLE001 - untrusted input: one error type, whatever the decoder raised
        detail = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        raise error(f"{what}: {detail}") from None
