"""The side channel's server: one background thread answering ``meta`` and ``ctrl`` requests (the protocol and its
limits are in ``side_channel``)."""

from __future__ import annotations

import logging
import threading

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import ChannelError
from . import curve
from .side_channel import (
    HANDSHAKE_FAILED_EVENTS,
    HANDSHAKE_TIMEOUT_MS,
    KIND_CTRL,
    KIND_META,
    MAX_CONTROL_BYTES,
    MAX_LOGGED_PEERS,
    MAX_NAME_BYTES,
    MAX_RANK_DIGITS,
    MAX_REASON_BYTES,
    MAX_REQUEST_FRAME_BYTES,
    PROTOCOL,
    REQUEST_ID_BYTES,
    SERVER_RCVHWM,
    STATUS_ERR,
    STATUS_OK,
    TICK_MS,
    ControlFn,
    MetaFn,
)

__all__ = ["SideChannelServer"]

log = logging.getLogger("hybrid_kv.transport")


class _Refused(ChannelError):
    """A request the server refuses before it reaches the owner's callbacks (private: it never leaves the server)."""


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
                ready = dict(poller.poll(TICK_MS))
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
            monitor = sock.get_monitor_socket(HANDSHAKE_FAILED_EVENTS)
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
            return self._reply(request_id, STATUS_ERR, [str(exc).encode()])
        try:
            if kind == KIND_META:
                payload, nixl_md = self._meta(int(arg))
                return self._reply(request_id, STATUS_OK, [payload, nixl_md])
            self._on_control(sender, arg)
            return self._reply(request_id, STATUS_OK, [])
        except Exception as exc:  # the peer gets the reason; the server keeps serving
            return self._reply(request_id, STATUS_ERR, [f"{type(exc).__name__}: {exc}".encode()])

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
        if kind == KIND_META:
            if not (0 < len(arg) <= MAX_RANK_DIGITS and arg.isdigit()):
                raise _Refused(f"malformed request: rank must be 1 to {MAX_RANK_DIGITS} ASCII digits")
        elif kind == KIND_CTRL:
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
        if status == STATUS_ERR:
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
