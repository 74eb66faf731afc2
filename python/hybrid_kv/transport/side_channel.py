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

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import zmq
from zmq.utils.monitor import parse_monitor_message

from . import curve
from .auth import resolve_secret

__all__ = [
    "MAX_CONTROL_BYTES",
    "MAX_NAME_BYTES",
    "MAX_REPLY_FRAME_BYTES",
    "MAX_REQUEST_FRAME_BYTES",
    "PROTOCOL",
    "ChannelError",
    "ChannelTimeout",
    "MetaReply",
    "SideChannelServer",
    "fetch_meta",
    "fetch_named_meta",
    "fetch_reply",
    "send_control",
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

_META = b"meta"
_CTRL = b"ctrl"
_OK = b"ok"
_ERR = b"err"
_TICK_MS = 50  # how often the server thread checks for shutdown
_MAX_RANK_DIGITS = 9
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)

log = logging.getLogger("hybrid_kv.transport")

MetaFn = Callable[[int], tuple[bytes, bytes]]
ControlFn = Callable[[str, bytes], None]


class ChannelError(Exception):
    """A side-channel call failed (timeout, protocol mismatch, authentication, a limit, or an error from the peer)."""


class ChannelTimeout(ChannelError):
    """No reply within the call's timeout: the request may or may not have reached the server."""


class MetaReply(NamedTuple):
    """A ``meta`` reply: the serving endpoint's (authenticated) name, its payload and its NIXL metadata."""

    name: str
    payload: bytes
    nixl_md: bytes


class _Refused(Exception):
    """A request the server refuses before it reaches the owner's callbacks."""


class SideChannelServer:
    """Serves ``meta`` and ``ctrl`` requests on ``address`` from one background thread, in its own ZeroMQ context
    (whose ZAP handler, run by the same thread, admits only the deployment's clients).

    Args:
        address: a ZeroMQ endpoint to bind, e.g. ``"tcp://127.0.0.1:0"`` (port 0 = any free port).
        meta: called from the server thread with the requested rank; returns
            ``(payload, nixl_metadata)``. An exception is sent back to the peer as the reason.
        on_control: called from the server thread with ``(sender, payload)`` for each authenticated control
            message; an exception refuses the message and is sent back as the reason.
        name: this endpoint's name, sent in every reply; requests meant for another name are refused.
        key: the deployment secret (``None``: no CURVE, unauthenticated and in the clear, both ways).

    Raises:
        ChannelError: the address cannot be bound, or this libzmq has no CURVE.
    """

    def __init__(self, address: str, meta: MetaFn, on_control: ControlFn, *, name: str, key: bytes | None) -> None:
        try:
            self._keys = curve.derive_keys(key) if key is not None else None
        except ValueError as exc:
            raise ChannelError(str(exc)) from None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._meta = meta
        self._on_control = on_control
        self._name = name.encode()
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
        """Stop the server thread, which closes its sockets and its context (idempotent)."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self, address: str) -> None:
        sockets: list[zmq.Socket[bytes]] = []
        try:
            sock, zap, monitor = self._open(address, sockets)
        except zmq.ZMQError as exc:
            self._bind_error = exc
            self._shut(sockets)
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        for s in sockets:
            poller.register(s, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_TICK_MS))
                if zap is not None and zap in ready:
                    self._admit_peer(zap)
                if monitor is not None and monitor in ready:
                    self._log_handshake(monitor)
                if sock in ready:
                    frames = sock.recv_multipart(copy=False)
                    reply = self._handle([f.bytes for f in frames[1:]], _peer_address(frames[0]))
                    sock.send_multipart([frames[0].bytes, *reply], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # peer vanished mid-send: the owner is shutting down
        finally:
            self._shut(sockets)

    def _open(
        self, address: str, sockets: list[zmq.Socket[bytes]]
    ) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None, zmq.Socket[bytes] | None]:
        """The ROUTER (bound), and with CURVE its ZAP handler socket (bound first) and its handshake monitor."""
        zap = monitor = None
        if self._keys is not None:
            zap = self._ctx.socket(zmq.REP)
            sockets.append(zap)
            zap.setsockopt(zmq.LINGER, 0)
            zap.bind(curve.ZAP_ENDPOINT)
        sock = self._ctx.socket(zmq.ROUTER)
        sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_FRAME_BYTES)
        sock.setsockopt(zmq.RCVHWM, SERVER_RCVHWM)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
        if self._keys is not None:
            curve.make_server(sock, self._keys)
            monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
            sockets.append(monitor)
        sock.bind(address)
        self._bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return sock, zap, monitor

    def _shut(self, sockets: list[zmq.Socket[bytes]]) -> None:
        for s in sockets:
            s.close(linger=0)
        self._ctx.term()

    def _admit_peer(self, zap: zmq.Socket[bytes]) -> None:
        """Answer one ZAP request: admit only the deployment's CURVE client key."""
        assert self._keys is not None
        reply, refusal = curve.zap_reply(zap.recv_multipart(), self._keys)
        zap.send_multipart(reply)
        if refusal is not None:
            peer, _, reason = refusal.partition(": ")
            self._log_refusal(peer, f"a connection from {peer}", reason)

    def _log_handshake(self, monitor: zmq.Socket[bytes]) -> None:
        """Log a failed CURVE handshake once per protocol error (libzmq does not tell the peer's address)."""
        event = parse_monitor_message(monitor.recv_multipart())
        if event["event"] != zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            return  # refused by the ZAP handler (which logged it, with the address), or the peer hung up
        value = int(event["value"])
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            reason = "it does not speak CURVE (a peer without the secret, or not a hybrid-kv side channel)"
        else:
            reason = f"its CURVE handshake failed (protocol error {value:#x}): its HYBRID_KV_SECRET differs"
        self._log_refusal(f"protocol error {value}", "a connection", reason)

    def _handle(self, frames: list[bytes], peer: str) -> list[bytes]:
        """The reply to one request (never raises)."""
        request_id = frames[2][:REQUEST_ID_BYTES] if len(frames) > 2 else b""
        try:
            kind, sender, arg = self._admit(frames)
        except _Refused as exc:
            self._log_refusal(peer, f"a request from {peer}", str(exc))
            return self._reply(request_id, _ERR, [str(exc).encode()])
        try:
            if kind == _META:
                payload, nixl_md = self._meta(int(arg))
                return self._reply(request_id, _OK, [payload, nixl_md])
            self._on_control(sender, arg)
            return self._reply(request_id, _OK, [])
        except Exception as exc:  # the peer gets the reason; the server keeps serving
            return self._reply(request_id, _ERR, [f"{type(exc).__name__}: {exc}".encode()])

    def _admit(self, frames: list[bytes]) -> tuple[bytes, str, bytes]:
        """Check a request's shape, limits and destination; returns ``(kind, sender, arg)``."""
        if not frames or frames[0] != PROTOCOL:
            seen = frames[0][:32] if frames else b""
            raise _Refused(f"incompatible side-channel protocol {seen!r}, expected {PROTOCOL!r}")
        if len(frames) != 6:
            raise _Refused(f"malformed request: {len(frames)} frames, expected 6")
        _, kind, request_id, to, sender, arg = frames
        if len(request_id) != REQUEST_ID_BYTES:
            raise _Refused(f"malformed request: request id of {len(request_id)} bytes, expected {REQUEST_ID_BYTES}")
        if len(sender) > MAX_NAME_BYTES or len(to) > MAX_NAME_BYTES:
            raise _Refused(f"malformed request: an endpoint name longer than {MAX_NAME_BYTES} bytes")
        if to and to != self._name:
            raise _Refused(f"request meant for {_shown(to)}, this endpoint is {_shown(self._name)}")
        if kind == _META:
            if not (0 < len(arg) <= _MAX_RANK_DIGITS and arg.isdigit()):
                raise _Refused(f"malformed request: rank must be 1 to {_MAX_RANK_DIGITS} ASCII digits")
        elif kind == _CTRL:
            if len(arg) > MAX_CONTROL_BYTES:
                raise _Refused(f"control payload of {len(arg)} bytes exceeds the limit of {MAX_CONTROL_BYTES}")
        else:
            raise _Refused(f"unknown request kind {kind[:16]!r}")
        try:
            name = sender.decode("utf-8")
        except UnicodeDecodeError:
            raise _Refused("malformed request: sender name is not UTF-8") from None
        return kind, name, arg

    def _reply(self, request_id: bytes, status: bytes, body: list[bytes]) -> list[bytes]:
        if status == _ERR:
            body = [body[0][:MAX_REASON_BYTES]]
        return [PROTOCOL, request_id, status, self._name, *body]

    def _log_refusal(self, once: str, what: str, reason: str) -> None:
        """Log a refusal once per ``once`` (a peer address or a kind of failure; at most ``MAX_LOGGED_PEERS``)."""
        if once in self._logged or len(self._logged) >= MAX_LOGGED_PEERS:
            return
        self._logged.add(once)
        log.warning("side channel %s refused %s: %s (not logged again)", self._bound, what, reason)


def _shown(name: bytes) -> str:
    return repr(name[:64].decode("utf-8", "replace"))


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return "unknown peer"


def _handshake_failure(event: int, value: int, *, keyed: bool) -> str:
    """Why a client's ZMTP handshake failed, from its monitor event."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"it refused our CURVE key (ZAP status {value}): its HYBRID_KV_SECRET differs"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        if keyed:
            return "it does not speak CURVE (no secret, insecure, or not a hybrid-kv side channel)"
        return "it requires CURVE (the deployment's HYBRID_KV_SECRET) and this side has none (insecure)"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"the CURVE handshake failed (protocol error {value:#x}): its HYBRID_KV_SECRET differs"
    return "its ZMTP handshake failed (no detail: it hung up, or it does not speak the same security mechanism)"


def fetch_named_meta(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    rank: int,
    sender: str,
    timeout_s: float,
    stop: threading.Event | None = None,
    *,
    key: bytes | None,
    to: str | None = None,
) -> MetaReply:
    """Ask the server at ``address`` for rank ``rank``'s metadata; the reply names the serving endpoint.

    ``stop`` aborts the wait early (used when the owner shuts down). ``key`` is the deployment secret
    (``None``: unauthenticated, in the clear). ``to``: the name of the endpoint meant (it refuses the request
    if it has another name, and a reply from another name is refused).

    Raises:
        ChannelError: no reply within ``timeout_s``, a failed handshake or authentication, a protocol mismatch,
            a limit exceeded, an error from the peer, or ``stop``.
    """
    name, body = _call(ctx, address, _META, sender, str(rank).encode("ascii"), timeout_s, stop, key, to)
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
    to: str | None = None,
) -> tuple[bytes, bytes]:
    """Ask the server at ``address`` for rank ``rank``'s ``(payload, nixl_metadata)``.

    The secret is ``secret`` or else ``$HYBRID_KV_SECRET`` (one of them is required).

    Raises:
        ChannelError: as ``fetch_named_meta``, or no secret.
    """
    reply = fetch_reply(ctx, address, rank, sender, timeout_s, stop, secret=secret, to=to)
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
    to: str | None = None,
    insecure: bool = False,
) -> MetaReply:
    """Ask the server at ``address`` for rank ``rank``'s whole reply (name, payload, NIXL metadata), as
    ``fetch_meta`` does; hand it to ``Endpoint.connect(..., reply=...)`` to connect from it without fetching
    again, so the connection is bound to the very bytes planned from.

    ``secret`` (``None``: ``HYBRID_KV_SECRET``) authenticates the fetch; ``insecure=True`` fetches from an
    ``Endpoint(insecure=True)`` without one (``secret`` must then be ``None``).

    Raises:
        ChannelError: as ``fetch_named_meta``, or no secret (and not ``insecure``).
    """
    key = _client_key(secret, insecure)
    return fetch_named_meta(ctx, address, rank, sender, timeout_s, stop, key=key, to=to)


def send_control(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    payload: bytes,
    sender: str,
    timeout_s: float,
    *,
    key: bytes | None,
    to: str | None = None,
) -> str:
    """Deliver one control payload to the server at ``address``; returns the (authenticated) name that acknowledged it.

    ``to``: the name of the endpoint meant; any other refuses the message before acting on it.

    Raises:
        ChannelError: a payload over ``MAX_CONTROL_BYTES``, no acknowledgement within ``timeout_s``, a failed
            handshake or authentication, a protocol mismatch, or an error from the peer (e.g. its queue is full,
            or it is not ``to``).
    """
    if len(payload) > MAX_CONTROL_BYTES:
        raise ChannelError(f"control payload of {len(payload)} bytes exceeds the limit of {MAX_CONTROL_BYTES}")
    name, _ = _call(ctx, address, _CTRL, sender, payload, timeout_s, None, key, to)
    return name


def _client_key(secret: bytes | str | None, insecure: bool = False) -> bytes | None:
    try:
        return resolve_secret(secret, insecure=insecure, required=True, what="side-channel client")
    except ValueError as exc:
        raise ChannelError(str(exc)) from None


def _server_name(address: str, raw: bytes) -> str:
    try:
        if 0 < len(raw) <= MAX_NAME_BYTES:
            return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    raise ChannelError(f"malformed reply from {address}: server name must be 1 to {MAX_NAME_BYTES} bytes of UTF-8")


def _encode_name(name: str, what: str) -> bytes:
    raw = name.encode()
    if len(raw) > MAX_NAME_BYTES:
        raise ChannelError(f"{what} of {len(raw)} bytes exceeds the limit of {MAX_NAME_BYTES}")
    return raw


def open_client(
    ctx: zmq.Context[zmq.Socket[bytes]], address: str, keys: curve.CurveKeys | None, *, refusals: bool = False
) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A fresh client connection to ``address``: a DEALER (CURVE client when ``keys``) and the monitor that reports
    a failed handshake at once (``refusals``: also each refused or failed connection attempt, ZeroMQ's
    ``EVENT_CONNECT_RETRIED``). The caller closes both (``close_client``)."""
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_FRAME_BYTES)
        if keys is not None:
            curve.make_client(sock, keys)
        monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED | (zmq.EVENT_CONNECT_RETRIED if refusals else 0))
    except BaseException:
        sock.close(linger=0)
        raise
    try:
        sock.connect(address)
    except BaseException:
        close_client(sock, monitor)
        raise
    return sock, monitor


def close_client(sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes] | None) -> None:
    """Close a connection made by ``open_client`` (never raises)."""
    try:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
    except zmq.ZMQError:
        pass
    sock.close(linger=0)


def control_frames(request_id: bytes, sender: str, payload: bytes, to: str | None) -> list[bytes]:
    """The frames of one control request (payload and names checked against their limits; raises
    ``ChannelError``)."""
    if len(payload) > MAX_CONTROL_BYTES:
        raise ChannelError(f"control payload of {len(payload)} bytes exceeds the limit of {MAX_CONTROL_BYTES}")
    return request_frames(_CTRL, request_id, sender, payload, to)


def request_frames(kind: bytes, request_id: bytes, sender: str, arg: bytes, to: str | None) -> list[bytes]:
    """The frames of one request (names checked against ``MAX_NAME_BYTES``; raises ``ChannelError``)."""
    sender_b = _encode_name(sender, "endpoint name")
    to_b = _encode_name(to, "destination name") if to is not None else b""
    return [PROTOCOL, kind, request_id, to_b, sender_b, arg]


def handshake_failed(monitor: zmq.Socket[bytes], address: str, *, keyed: bool) -> ChannelError | None:
    """The error for the failed-handshake event waiting on ``monitor`` (``open_client``'s); ``None`` when the event
    was a refused connection attempt (``refusals``)."""
    event = parse_monitor_message(monitor.recv_multipart())
    if event["event"] == zmq.EVENT_CONNECT_RETRIED:
        return None
    why = _handshake_failure(event["event"], int(event["value"]), keyed=keyed)
    return ChannelError(f"peer at {address} failed authentication: {why}")


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
    name = _server_name(address, reply[3])
    if reply[2] != _OK:
        reason = reply[4][:MAX_REASON_BYTES].decode("utf-8", "replace") if len(reply) > 4 else "(none)"
        raise ChannelError(f"peer at {address} answered with an error: {reason}")
    if to is not None and name != to:
        raise ChannelError(f"peer at {address} answered as {name!r}, expected {to!r}")
    return name, reply[4:]


def _call(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    kind: bytes,
    sender: str,
    arg: bytes,
    timeout_s: float,
    stop: threading.Event | None,
    key: bytes | None,
    to: str | None,
) -> tuple[str, list[bytes]]:
    """One request and its reply over a fresh connection: ``(server name, body)``."""
    request_id = os.urandom(REQUEST_ID_BYTES)
    frames = request_frames(kind, request_id, sender, arg, to)
    try:
        keys = curve.derive_keys(key) if key is not None else None
    except ValueError as exc:
        raise ChannelError(str(exc)) from None
    deadline = time.monotonic() + timeout_s
    sock: zmq.Socket[bytes] | None = None
    monitor: zmq.Socket[bytes] | None = None
    try:
        sock, monitor = open_client(ctx, address, keys)
        sock.send_multipart(frames, zmq.NOBLOCK)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise ChannelTimeout(f"no reply from {address} within {timeout_s:g} s")
            if stop is not None and stop.is_set():
                raise ChannelError("side-channel call cancelled: endpoint closing")
            ready = dict(poller.poll(min(left_ms, _TICK_MS)))
            if monitor in ready:
                err = handshake_failed(monitor, address, keyed=keys is not None)
                if err is not None:
                    raise err
            if sock in ready:
                return parse_reply(address, sock.recv_multipart(), request_id, to)
    except zmq.ZMQError as exc:
        raise ChannelError(f"side channel to {address} failed: {exc}") from exc
    finally:
        if sock is not None:
            close_client(sock, monitor)
