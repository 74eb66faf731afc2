"""The handshake side channel: a small ZeroMQ request/reply protocol, encrypted and authenticated with CURVE.

A server (ROUTER, serviced by one background thread) answers two kinds of request:

* ``meta``: ``get_meta(rank)`` -> two opaque frames, the hybrid-kv handshake payload and the NIXL
  agent metadata, plus the serving endpoint's name (its NIXL agent name);
* ``ctrl``: an opaque control payload (push mode: decode registers a request's block ids with
  prefill), queued for the owner and acknowledged at once.

Frames (ROUTER identity omitted)::

    request: [PROTOCOL, kind, request_id, to, sender_name, arg]   arg = rank (ASCII) | control payload
    reply:   [PROTOCOL, request_id, b"ok",  server_name, *body]    body = [payload, nixl_md] | []
             [PROTOCOL, request_id, b"err", server_name, reason]

``request_id`` is 16 fresh random bytes per call, echoed by the reply; ``to`` the name of the endpoint the
request is meant for (empty: whichever serves the address, for a first contact). A server refuses a request
meant for another endpoint, so a message delivered to the wrong server is never acted on, and a client
refuses a reply from an endpoint other than the one it named.

Security (with the deployment's secret; see ``curve``): every connection is a ZeroMQ CURVE connection whose
keys derive from the secret. A server admits only clients holding the deployment's client key (its ZAP
handler, run by the server's own thread) and a client only completes the handshake with a server holding the
deployment's server key, so a peer without the secret is disconnected inside the ZMTP handshake, before any
application frame is buffered, in either direction: it gets no reply at all, and it cannot make either side
buffer a message. Every frame is then encrypted and authenticated under keys fresh for that connection: the
NIXL metadata never crosses the network in the clear, and a captured message cannot be read, changed, or
replayed into any connection. Nothing depends on clocks: a request that waited in a queue is answered like any
other. Refused handshakes are logged under ``hybrid_kv.transport`` once per peer address (ZAP refusals) or
once per kind of failure; a client reports why its handshake failed at once (``failed authentication``)
instead of waiting for its timeout. ``insecure`` endpoints (no secret) speak the same frames in the clear.

Sizes are bounded: ``MAXMSGSIZE`` makes ZeroMQ drop (disconnect) a peer sending any frame over
``MAX_REQUEST_FRAME_BYTES`` (server) or ``MAX_REPLY_FRAME_BYTES`` (client) before buffering it, the handshake's
commands are bounded the same way, and each field has its own limit. ZeroMQ has no bound on the number of frames
of one message: a secret holder can still make a peer buffer without limit (see ARCHITECTURE.md). Clients use
a fresh DEALER socket per call and wait with ``poll``; nothing blocks forever.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import zmq

from ..errors import ChannelError

__all__ = [
    "HANDSHAKE_FAILED_EVENTS",
    "HANDSHAKE_TIMEOUT_MS",
    "KIND_CTRL",
    "KIND_META",
    "MAX_CONTROL_BYTES",
    "MAX_LOGGED_PEERS",
    "MAX_NAME_BYTES",
    "MAX_RANK_DIGITS",
    "MAX_REASON_BYTES",
    "MAX_REPLY_FRAME_BYTES",
    "MAX_REQUEST_FRAME_BYTES",
    "PROTOCOL",
    "REQUEST_ID_BYTES",
    "SERVER_RCVHWM",
    "STATUS_ERR",
    "STATUS_OK",
    "TICK_MS",
    "ControlFn",
    "MetaFn",
    "MetaReply",
    "control_frames",
    "encode_name",
    "parse_reply",
    "reply_request_id",
    "request_frames",
    "server_name",
]

PROTOCOL = b"hkv-sc/3"

MAX_CONTROL_BYTES = 1 << 20
"""The largest control payload accepted (1 MiB); larger ones are refused before they are sent or buffered."""

MAX_REQUEST_FRAME_BYTES = MAX_CONTROL_BYTES + 64
"""ZeroMQ ``MAXMSGSIZE`` of the server socket (a control payload plus CURVE's per-frame overhead): a peer
sending a larger frame, or a larger handshake command, is disconnected by ZeroMQ before it is buffered."""

MAX_REPLY_FRAME_BYTES = 64 << 20
"""The largest reply frame a client accepts (ZeroMQ ``MAXMSGSIZE`` of its socket): handshake payloads
and NIXL metadata (about 44 B per registered region) stay far below it."""

MAX_NAME_BYTES = 256
"""The longest endpoint name (UTF-8) sent or accepted on the side channel."""

MAX_REASON_BYTES = 2048
"""Error reasons are cut to this many bytes, both sent and received."""

MAX_LOGGED_PEERS = 1024
"""Distinct peer addresses whose refused requests are logged; later ones are not (the log stays bounded)."""

SERVER_RCVHWM = 64
"""Messages the server socket queues per connection before it stops reading from that peer."""

HANDSHAKE_TIMEOUT_MS = 5000
"""A connection that has not completed its ZMTP (CURVE) handshake within this time is closed by the server."""

REQUEST_ID_BYTES = 16
"""Length of a request's random id (echoed by its reply)."""

KIND_META = b"meta"
"""A request for one rank's handshake payload and NIXL metadata."""
KIND_CTRL = b"ctrl"
"""A request delivering one control payload."""
STATUS_OK = b"ok"
STATUS_ERR = b"err"

TICK_MS = 50
"""How often a waiting thread (the server's, or a client's) checks for shutdown."""

MAX_RANK_DIGITS = 9
"""The longest rank (ASCII digits) a ``meta`` request may ask for."""

HANDSHAKE_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
"""The ZeroMQ monitor events of a failed ZMTP (CURVE) handshake."""

MetaFn = Callable[[int], tuple[bytes, bytes]]
"""The server's ``meta`` callback: ``rank -> (payload, nixl_metadata)``."""
ControlFn = Callable[[str, bytes], None]
"""The server's ``ctrl`` callback: ``(sender, payload)``."""


class MetaReply(NamedTuple):
    """A ``meta`` reply: the serving endpoint's (authenticated) name, its payload and its NIXL metadata."""

    name: str
    payload: bytes
    nixl_md: bytes


def server_name(address: str, raw: bytes) -> str:
    try:
        if 0 < len(raw) <= MAX_NAME_BYTES:
            return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    raise ChannelError(f"malformed reply from {address}: server name must be 1 to {MAX_NAME_BYTES} bytes of UTF-8")


def encode_name(name: str, what: str) -> bytes:
    raw = name.encode()
    if len(raw) > MAX_NAME_BYTES:
        raise ChannelError(f"{what} of {len(raw)} bytes exceeds the limit of {MAX_NAME_BYTES}")
    return raw


def control_frames(request_id: bytes, sender: str, payload: bytes, to: str | None) -> list[bytes]:
    """The frames of one control request (payload and names checked against their limits; raises
    ``ChannelError``)."""
    if len(payload) > MAX_CONTROL_BYTES:
        raise ChannelError(f"control payload of {len(payload)} bytes exceeds the limit of {MAX_CONTROL_BYTES}")
    return request_frames(KIND_CTRL, request_id, sender, payload, to)


def request_frames(kind: bytes, request_id: bytes, sender: str, arg: bytes, to: str | None) -> list[bytes]:
    """The frames of one request (names checked against ``MAX_NAME_BYTES``; raises ``ChannelError``)."""
    sender_b = encode_name(sender, "endpoint name")
    to_b = encode_name(to, "destination name") if to is not None else b""
    return [PROTOCOL, kind, request_id, to_b, sender_b, arg]


def reply_request_id(reply: list[bytes]) -> bytes | None:
    """The request id a reply echoes, or ``None`` when it is not a reply of this protocol."""
    return reply[1] if len(reply) >= 4 and reply[0] == PROTOCOL else None


def parse_reply(address: str, reply: list[bytes], request_id: bytes, to: str | None) -> tuple[str, list[bytes]]:
    """``(server name, body)`` of ``reply`` to request ``request_id``; raises ``ChannelError`` for a reply of
    another protocol or request, an error answer, or a server that is not ``to``."""
    if not reply or reply[0] != PROTOCOL:
        seen = reply[0][:32] if reply else b""
        raise ChannelError(f"incompatible side-channel protocol from {address}: {seen!r}, expected {PROTOCOL!r}")
    if len(reply) < 4 or reply[1] != request_id:
        raise ChannelError(f"malformed reply from {address}: {len(reply)} frames, or another request's id")
    name = server_name(address, reply[3])
    if reply[2] != STATUS_OK:
        reason = reply[4][:MAX_REASON_BYTES].decode("utf-8", "replace") if len(reply) > 4 else "(none)"
        raise ChannelError(f"peer at {address} answered with an error: {reason}")
    if to is not None and name != to:
        raise ChannelError(f"peer at {address} answered as {name!r}, expected {to!r}")
    return name, reply[4:]
