"""The handshake side channel: a small authenticated ZeroMQ request/reply protocol with timeouts everywhere.

A server (ROUTER, serviced by one background thread) answers two kinds of request:

* ``meta``: ``get_meta(rank)`` -> two opaque frames, the hybrid-kv handshake payload and the NIXL
  agent metadata, plus the serving endpoint's name (its NIXL agent name);
* ``ctrl``: an opaque control payload (push mode: decode registers a request's block ids with
  prefill), queued for the owner and acknowledged at once.

Frames (ROUTER identity omitted)::

    request: [PROTOCOL, kind, nonce, sent_at, sender_name, arg, mac]   arg = rank (ASCII) | control payload
    reply:   [PROTOCOL, nonce, b"ok",  server_name, *body, mac]         body = [payload, nixl_md] | []
             [PROTOCOL, nonce, b"err", server_name, reason, mac]

``nonce`` is 16 fresh random bytes per call, echoed by the reply; ``sent_at`` the sender's wall clock
(big-endian float64 seconds); ``mac`` the HMAC-SHA256 tag of every other frame (see ``auth``), or empty
when both sides run without a secret. A server with a secret answers a request that fails
authentication, is malformed, or is a replay with an ``err`` reply (``server_name`` empty), logs it once
per peer address under ``hybrid_kv.transport``, and never passes it to ``meta`` or ``on_control``. A
client with a secret refuses any reply whose tag does not verify.

Sizes are bounded: the ROUTER drops (disconnects) a peer sending any frame over ``MAX_REQUEST_FRAME_BYTES``
before buffering it, each field has its own limit, and clients refuse reply frames over
``MAX_REPLY_FRAME_BYTES``. Clients use a fresh DEALER socket per call and wait with ``poll``; nothing
blocks forever.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import zmq

from .auth import MAC_BYTES, NONCE_BYTES, REPLY, REQUEST, ReplayGuard, resolve_secret, tag, verify

__all__ = [
    "MAX_CONTROL_BYTES",
    "MAX_NAME_BYTES",
    "MAX_REPLY_FRAME_BYTES",
    "MAX_REQUEST_FRAME_BYTES",
    "PROTOCOL",
    "ChannelError",
    "MetaReply",
    "SideChannelServer",
    "fetch_meta",
    "fetch_named_meta",
    "fetch_reply",
    "send_control",
]

PROTOCOL = b"hkv-sc/2"

MAX_CONTROL_BYTES = 1 << 20
"""The largest control payload accepted (1 MiB); larger ones are refused before they are sent or buffered."""

MAX_REQUEST_FRAME_BYTES = MAX_CONTROL_BYTES
"""ZeroMQ ``MAXMSGSIZE`` of the server socket: a peer sending a larger frame is disconnected by ZeroMQ
before the frame is buffered (no reply is possible then)."""

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

_META = b"meta"
_CTRL = b"ctrl"
_OK = b"ok"
_ERR = b"err"
_TICK_MS = 50  # how often the server thread checks for shutdown
_MAX_RANK_DIGITS = 9

log = logging.getLogger("hybrid_kv.transport")

MetaFn = Callable[[int], tuple[bytes, bytes]]
ControlFn = Callable[[str, bytes], None]


class ChannelError(Exception):
    """A side-channel call failed (timeout, protocol mismatch, authentication, a limit, or an error from the peer)."""


class MetaReply(NamedTuple):
    """A ``meta`` reply: the serving endpoint's (authenticated) name, its payload and its NIXL metadata."""

    name: str
    payload: bytes
    nixl_md: bytes


class _Refused(Exception):
    """A request the server refuses before it reaches the owner's callbacks (reason, whether to log it)."""

    def __init__(self, reason: str, logged: bool = True) -> None:
        super().__init__(reason)
        self.logged = logged


class SideChannelServer:
    """Serves ``meta`` and ``ctrl`` requests on ``address`` from one background thread.

    Args:
        ctx: the ZeroMQ context to use.
        address: a ZeroMQ endpoint to bind, e.g. ``"tcp://127.0.0.1:0"`` (port 0 = any free port).
        meta: called from the server thread with the requested rank; returns
            ``(payload, nixl_metadata)``. An exception is sent back to the peer as the reason.
        on_control: called from the server thread with ``(sender, payload)`` for each authenticated control
            message; an exception refuses the message and is sent back as the reason.
        name: this endpoint's name, sent in every authenticated reply.
        key: the shared secret (``None``: unauthenticated, both ways).

    Raises:
        ChannelError: the address cannot be bound.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        meta: MetaFn,
        on_control: ControlFn,
        *,
        name: str,
        key: bytes | None,
    ) -> None:
        self._ctx = ctx
        self._meta = meta
        self._on_control = on_control
        self._name = name.encode()
        self._key = key
        self._guard = ReplayGuard()
        self._logged: set[str] = set()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._bound: str | None = None
        self._bind_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(address,), name="hkv-side-channel", daemon=True)
        self._thread.start()
        if not self._ready.wait(10.0):
            raise ChannelError(f"side channel did not bind {address} within 10 s")
        if self._bind_error is not None:
            raise ChannelError(f"cannot bind side channel to {address}: {self._bind_error}") from self._bind_error

    @property
    def address(self) -> str:
        """The bound address peers connect to (with the actual port)."""
        assert self._bound is not None
        return self._bound

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the server thread and close its socket (idempotent)."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self, address: str) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_FRAME_BYTES)
        sock.setsockopt(zmq.RCVHWM, SERVER_RCVHWM)
        try:
            sock.bind(address)
            self._bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._bind_error = exc
            sock.close()
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(_TICK_MS, zmq.POLLIN):
                    frames = sock.recv_multipart(copy=False)
                    peer = _peer_address(frames[0])
                    reply = self._handle([f.bytes for f in frames[1:]], peer)
                    sock.send_multipart([frames[0].bytes, *reply], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # context terminated or peer vanished mid-send: the owner is shutting down
        finally:
            sock.close(linger=0)

    def _handle(self, frames: list[bytes], peer: str) -> list[bytes]:
        """The reply to one request (never raises)."""
        nonce = frames[2][:NONCE_BYTES] if len(frames) > 2 else b""
        try:
            kind, sender, arg = self._admit(frames)
        except _Refused as exc:
            if exc.logged:
                self._log_refusal(peer, str(exc))
            return self._reply(nonce, _ERR, [str(exc).encode()], named=False)
        try:
            if kind == _META:
                payload, nixl_md = self._meta(int(arg))
                return self._reply(nonce, _OK, [payload, nixl_md])
            self._on_control(sender, arg)
            return self._reply(nonce, _OK, [])
        except Exception as exc:  # the peer gets the reason; the server keeps serving
            return self._reply(nonce, _ERR, [f"{type(exc).__name__}: {exc}".encode()])

    def _admit(self, frames: list[bytes]) -> tuple[bytes, str, bytes]:
        """Check a request's shape, limits, tag and freshness; returns ``(kind, sender, arg)``."""
        if not frames or frames[0] != PROTOCOL:
            seen = frames[0][:32] if frames else b""
            raise _Refused(f"incompatible side-channel protocol {seen!r}, expected {PROTOCOL!r}")
        if len(frames) != 7:
            raise _Refused(f"malformed request: {len(frames)} frames, expected 7")
        _, kind, nonce, sent_at, sender, arg, mac = frames
        if len(nonce) != NONCE_BYTES or len(sent_at) != 8 or len(mac) > MAC_BYTES:
            raise _Refused("malformed request: bad nonce, timestamp or MAC length")
        if len(sender) > MAX_NAME_BYTES:
            raise _Refused(f"malformed request: sender name of {len(sender)} bytes exceeds {MAX_NAME_BYTES}")
        if kind == _META:
            if not (0 < len(arg) <= _MAX_RANK_DIGITS and arg.isdigit()):
                raise _Refused(f"malformed request: rank must be 1 to {_MAX_RANK_DIGITS} ASCII digits")
        elif kind == _CTRL:
            if len(arg) > MAX_CONTROL_BYTES:  # unreachable while MAXMSGSIZE bounds every frame; kept as the rule
                raise _Refused(f"control payload of {len(arg)} bytes exceeds the limit of {MAX_CONTROL_BYTES}")
        else:
            raise _Refused(f"unknown request kind {kind[:16]!r}")
        if self._key is not None:
            if not verify(self._key, REQUEST, frames[:6], mac):
                raise _Refused("request failed authentication (missing or wrong MAC: check HYBRID_KV_SECRET)")
            (when,) = struct.unpack(">d", sent_at)
            stale = self._guard.check(nonce, when, time.time())
            if stale is not None:
                raise _Refused(stale)
        try:
            name = sender.decode("utf-8")
        except UnicodeDecodeError:
            raise _Refused("malformed request: sender name is not UTF-8") from None
        return kind, name, arg

    def _reply(self, nonce: bytes, status: bytes, body: list[bytes], named: bool = True) -> list[bytes]:
        if status == _ERR:
            body = [body[0][:MAX_REASON_BYTES]]
        frames = [PROTOCOL, nonce, status, self._name if named else b"", *body]
        return [*frames, tag(self._key, REPLY, frames) if self._key is not None else b""]

    def _log_refusal(self, peer: str, reason: str) -> None:
        """Log a refused request once per peer address (at most ``MAX_LOGGED_PEERS`` addresses)."""
        if peer in self._logged or len(self._logged) >= MAX_LOGGED_PEERS:
            return
        self._logged.add(peer)
        log.warning("side channel %s refused a request from %s: %s (not logged again)", self._bound, peer, reason)


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return "unknown peer"


def fetch_named_meta(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    rank: int,
    sender: str,
    timeout_s: float,
    stop: threading.Event | None = None,
    *,
    key: bytes | None,
) -> MetaReply:
    """Ask the server at ``address`` for rank ``rank``'s metadata; the reply names the serving endpoint.

    ``stop`` aborts the wait early (used when the owner shuts down). ``key`` is the shared secret
    (``None``: unauthenticated).

    Raises:
        ChannelError: no reply within ``timeout_s``, a protocol mismatch, a failed authentication, a limit
            exceeded, an error from the peer, or ``stop``.
    """
    name, body = _call(ctx, address, _META, sender, str(rank).encode("ascii"), timeout_s, stop, key)
    if len(body) != 2:
        raise ChannelError(f"malformed meta reply from {address}: {len(body)} frames, expected 2")
    return MetaReply(name, body[0], body[1])


def fetch_meta(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    rank: int,
    sender: str,
    timeout_s: float,
    stop: threading.Event | None = None,
    *,
    secret: bytes | str | None = None,
) -> tuple[bytes, bytes]:
    """Ask the server at ``address`` for rank ``rank``'s ``(payload, nixl_metadata)``.

    The secret is ``secret`` or else ``$HYBRID_KV_SECRET`` (one of them is required).

    Raises:
        ChannelError: as ``fetch_named_meta``, or no secret.
    """
    reply = fetch_reply(ctx, address, rank, sender, timeout_s, stop, secret=secret)
    return reply.payload, reply.nixl_md


def fetch_reply(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    rank: int,
    sender: str,
    timeout_s: float,
    stop: threading.Event | None = None,
    *,
    secret: bytes | str | None = None,
) -> MetaReply:
    """Ask the server at ``address`` for rank ``rank``'s whole reply (name, payload, NIXL metadata), as
    ``fetch_meta`` does; hand it to ``Endpoint.connect(..., reply=...)`` to connect from it without fetching
    again, so the connection is bound to the very bytes planned from.

    Raises:
        ChannelError: as ``fetch_named_meta``, or no secret.
    """
    return fetch_named_meta(ctx, address, rank, sender, timeout_s, stop, key=_client_key(secret))


def send_control(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    payload: bytes,
    sender: str,
    timeout_s: float,
    *,
    key: bytes | None,
) -> str:
    """Deliver one control payload to the server at ``address``; returns the (authenticated) name that acknowledged it.

    Raises:
        ChannelError: a payload over ``MAX_CONTROL_BYTES``, no acknowledgement within ``timeout_s``, a
            protocol mismatch, a failed authentication, or an error from the peer (e.g. its queue is full).
    """
    if len(payload) > MAX_CONTROL_BYTES:
        raise ChannelError(f"control payload of {len(payload)} bytes exceeds the limit of {MAX_CONTROL_BYTES}")
    name, _ = _call(ctx, address, _CTRL, sender, payload, timeout_s, None, key)
    return name


def _client_key(secret: bytes | str | None) -> bytes | None:
    try:
        return resolve_secret(secret, insecure=False, required=True, what="side-channel client")
    except ValueError as exc:
        raise ChannelError(str(exc)) from None


def _server_name(address: str, raw: bytes) -> str:
    try:
        if 0 < len(raw) <= MAX_NAME_BYTES:
            return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    raise ChannelError(f"malformed reply from {address}: server name must be 1 to {MAX_NAME_BYTES} bytes of UTF-8")


def _call(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    kind: bytes,
    sender: str,
    arg: bytes,
    timeout_s: float,
    stop: threading.Event | None,
    key: bytes | None,
) -> tuple[str, list[bytes]]:
    """One request and its verified reply: ``(server name, body)``."""
    sender_b = sender.encode()
    if len(sender_b) > MAX_NAME_BYTES:
        raise ChannelError(f"endpoint name of {len(sender_b)} bytes exceeds the limit of {MAX_NAME_BYTES}")
    deadline = time.monotonic() + timeout_s
    nonce = os.urandom(NONCE_BYTES)
    request = [PROTOCOL, kind, nonce, struct.pack(">d", time.time()), sender_b, arg]
    request.append(tag(key, REQUEST, request) if key is not None else b"")
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_FRAME_BYTES)
    try:
        sock.connect(address)
        sock.send_multipart(request, zmq.NOBLOCK)
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise ChannelError(f"no reply from {address} within {timeout_s:g} s")
            if stop is not None and stop.is_set():
                raise ChannelError("side-channel call cancelled: endpoint closing")
            if not sock.poll(min(left_ms, _TICK_MS), zmq.POLLIN):
                continue
            reply = sock.recv_multipart()
            if reply[0] != PROTOCOL:
                raise ChannelError(
                    f"incompatible side-channel protocol from {address}: {reply[0][:32]!r}, expected {PROTOCOL!r}"
                )
            if len(reply) < 5:
                raise ChannelError(f"malformed reply from {address}: {len(reply)} frames")
            if key is not None and not verify(key, REPLY, reply[:-1], reply[-1]):
                why = "its reply carries no MAC" if not reply[-1] else "its reply's MAC does not match our secret"
                raise ChannelError(f"peer at {address} failed authentication ({why})")
            if reply[1] != nonce:
                continue  # not the reply to this call (an old one replayed): ignore it
            if reply[2] != _OK:
                reason = reply[4][:MAX_REASON_BYTES].decode("utf-8", "replace")
                raise ChannelError(f"peer at {address} answered with an error: {reason}")
            return _server_name(address, reply[3]), reply[4:-1]
    except zmq.ZMQError as exc:
        raise ChannelError(f"side channel to {address} failed: {exc}") from exc
    finally:
        sock.close(linger=0)
