"""The handshake side channel: a small ZeroMQ request/reply protocol with timeouts everywhere.

A server (ROUTER, serviced by one background thread) answers two kinds of request:

* ``meta``: ``get_meta(rank)`` -> two opaque frames, the hybrid-kv handshake payload and the NIXL
  agent metadata;
* ``ctrl``: an opaque control payload (push mode: decode registers a request's block ids with
  prefill), queued for the owner and acknowledged at once.

Frames (ROUTER identity omitted)::

    request: [PROTOCOL, kind, msg_id, sender_name, arg]      arg = rank (ASCII) | control payload
    reply:   [PROTOCOL, msg_id, b"ok",  *body]               body = [payload, nixl_md] | []
             [PROTOCOL, msg_id, b"err", reason]

Clients use a fresh DEALER socket per call and wait with ``poll``; nothing blocks forever.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import zmq

__all__ = ["PROTOCOL", "ChannelError", "SideChannelServer", "fetch_meta", "send_control"]

PROTOCOL = b"hkv-sc/1"
_META = b"meta"
_CTRL = b"ctrl"
_OK = b"ok"
_ERR = b"err"
_TICK_MS = 50  # how often the server thread checks for shutdown

MetaFn = Callable[[int], tuple[bytes, bytes]]
ControlFn = Callable[[str, bytes], None]


class ChannelError(Exception):
    """A side-channel call failed (timeout, protocol mismatch or an error reported by the peer)."""


class SideChannelServer:
    """Serves ``meta`` and ``ctrl`` requests on ``address`` from one background thread.

    Args:
        ctx: the ZeroMQ context to use.
        address: a ZeroMQ endpoint to bind, e.g. ``"tcp://127.0.0.1:0"`` (port 0 = any free port).
        meta: called from the server thread with the requested rank; returns
            ``(payload, nixl_metadata)``. An exception is sent back to the peer as the reason.
        on_control: called from the server thread with ``(sender, payload)`` for each control message.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str, meta: MetaFn, on_control: ControlFn) -> None:
        self._ctx = ctx
        self._meta = meta
        self._on_control = on_control
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
                    frames = sock.recv_multipart()
                    reply = self._handle(frames[1:])
                    sock.send_multipart([frames[0], *reply], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # context terminated or peer vanished mid-send: the owner is shutting down
        finally:
            sock.close(linger=0)

    def _handle(self, frames: list[bytes]) -> list[bytes]:
        msg_id = frames[2] if len(frames) > 2 else b""
        if len(frames) != 5 or frames[0] != PROTOCOL:
            seen = frames[0][:32] if frames else b""
            return [
                PROTOCOL,
                msg_id,
                _ERR,
                f"incompatible side-channel protocol {seen!r}, expected {PROTOCOL!r}".encode(),
            ]
        _, kind, _, sender, arg = frames
        try:
            if kind == _META:
                payload, nixl_md = self._meta(int(arg.decode("ascii")))
                return [PROTOCOL, msg_id, _OK, payload, nixl_md]
            if kind == _CTRL:
                self._on_control(sender.decode("utf-8", "replace"), arg)
                return [PROTOCOL, msg_id, _OK]
            return [PROTOCOL, msg_id, _ERR, f"unknown request kind {kind!r}".encode()]
        except Exception as exc:  # the peer gets the reason; the server keeps serving
            return [PROTOCOL, msg_id, _ERR, f"{type(exc).__name__}: {exc}".encode()]


def fetch_meta(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    rank: int,
    sender: str,
    timeout_s: float,
    stop: threading.Event | None = None,
) -> tuple[bytes, bytes]:
    """Ask the server at ``address`` for rank ``rank``'s ``(payload, nixl_metadata)``.

    ``stop`` aborts the wait early (used when the owner shuts down).

    Raises:
        ChannelError: no reply within ``timeout_s``, a protocol mismatch, an error from the peer, or ``stop``.
    """
    body = _call(ctx, address, _META, sender, str(rank).encode("ascii"), timeout_s, stop)
    if len(body) != 2:
        raise ChannelError(f"malformed meta reply from {address}: {len(body)} frames, expected 2")
    return body[0], body[1]


def send_control(
    ctx: zmq.Context[zmq.Socket[bytes]], address: str, payload: bytes, sender: str, timeout_s: float
) -> None:
    """Deliver one control payload to the server at ``address`` and wait for its acknowledgement.

    Raises:
        ChannelError: no acknowledgement within ``timeout_s``, a protocol mismatch, or an error from the peer.
    """
    _call(ctx, address, _CTRL, sender, payload, timeout_s)


def _call(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    kind: bytes,
    sender: str,
    arg: bytes,
    timeout_s: float,
    stop: threading.Event | None = None,
) -> list[bytes]:
    deadline = time.monotonic() + timeout_s
    msg_id = os.urandom(8)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart([PROTOCOL, kind, msg_id, sender.encode(), arg], zmq.NOBLOCK)
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise ChannelError(f"no reply from {address} within {timeout_s:g} s")
            if stop is not None and stop.is_set():
                raise ChannelError("side-channel call cancelled: endpoint closing")
            if not sock.poll(min(left_ms, _TICK_MS), zmq.POLLIN):
                continue
            reply = sock.recv_multipart()
            if len(reply) < 3:
                raise ChannelError(f"malformed reply from {address}: {len(reply)} frames")
            if reply[0] != PROTOCOL:
                raise ChannelError(
                    f"incompatible side-channel protocol from {address}: {reply[0][:32]!r}, expected {PROTOCOL!r}"
                )
            if reply[1] != msg_id:
                continue  # a stale reply to an earlier call on a reused connection
            if reply[2] != _OK:
                reason = reply[3].decode("utf-8", "replace") if len(reply) > 3 else "no reason given"
                raise ChannelError(f"peer at {address} answered with an error: {reason}")
            return reply[3:]
    except zmq.ZMQError as exc:
        raise ChannelError(f"side channel to {address} failed: {exc}") from exc
    finally:
        sock.close(linger=0)
