"""The side channel's client calls: fetch a peer's metadata, deliver a control message, and the connection helpers
the courier shares (the protocol and its limits are in ``side_channel``)."""

from __future__ import annotations

import os
import threading
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import ChannelError, ChannelTimeout
from . import curve
from .auth import resolve_secret
from .side_channel import (
    HANDSHAKE_FAILED_EVENTS,
    KIND_CTRL,
    KIND_META,
    MAX_CONTROL_BYTES,
    MAX_REPLY_FRAME_BYTES,
    REQUEST_ID_BYTES,
    TICK_MS,
    MetaReply,
    parse_reply,
    request_frames,
)

__all__ = [
    "close_client",
    "fetch_named_meta",
    "fetch_reply",
    "handshake_failed",
    "open_client",
    "send_control",
]


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
    name, body = _call(ctx, address, KIND_META, sender, str(rank).encode("ascii"), timeout_s, stop, key, to)
    if len(body) != 2:
        raise ChannelError(f"malformed meta reply from {address}: {len(body)} frames, expected 2")
    return MetaReply(name, body[0], body[1])


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
    ``fetch_named_meta`` returns it; hand it to ``Endpoint.connect(..., reply=...)`` to connect from it without fetching
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
    name, _ = _call(ctx, address, KIND_CTRL, sender, payload, timeout_s, None, key, to)
    return name


def _client_key(secret: bytes | str | None, insecure: bool = False) -> bytes | None:
    try:
        return resolve_secret(secret, insecure=insecure, required=True, what="side-channel client")
    except ValueError as exc:
        raise ChannelError(str(exc)) from None


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
        monitor = sock.get_monitor_socket(HANDSHAKE_FAILED_EVENTS | (zmq.EVENT_CONNECT_RETRIED if refusals else 0))
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


def handshake_failed(monitor: zmq.Socket[bytes], address: str, *, keyed: bool) -> ChannelError | None:
    """The error for the failed-handshake event waiting on ``monitor`` (``open_client``'s); ``None`` when the event
    was a refused connection attempt (``refusals``)."""
    event = parse_monitor_message(monitor.recv_multipart())
    if event["event"] == zmq.EVENT_CONNECT_RETRIED:
        return None
    why = _handshake_failure(event["event"], int(event["value"]), keyed=keyed)
    return ChannelError(f"peer at {address} failed authentication: {why}")


def _try_send(sock: zmq.Socket[bytes], frames: list[bytes]) -> bool:
    """Queue ``frames`` without blocking; whether ZeroMQ took them."""
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


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
        poller = zmq.Poller()
        poller.register(monitor, zmq.POLLIN)
        # sent once ZeroMQ takes it: a connection whose handshake just failed has no pipe to queue on (EAGAIN)
        # until it reconnects, and the monitor then says why
        unsent = not _try_send(sock, frames)
        poller.register(sock, zmq.POLLIN | zmq.POLLOUT if unsent else zmq.POLLIN)
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise ChannelTimeout(f"no reply from {address} within {timeout_s:g} s")
            if stop is not None and stop.is_set():
                raise ChannelError("side-channel call cancelled: endpoint closing")
            ready = dict(poller.poll(min(left_ms, TICK_MS)))
            if monitor in ready:
                err = handshake_failed(monitor, address, keyed=keys is not None)
                if err is not None:
                    raise err
            if unsent and ready.get(sock, 0) & zmq.POLLOUT and _try_send(sock, frames):
                unsent = False
                poller.modify(sock, zmq.POLLIN)
            if ready.get(sock, 0) & zmq.POLLIN:
                return parse_reply(address, sock.recv_multipart(), request_id, to)
    except zmq.ZMQError as exc:
        raise ChannelError(f"side channel to {address} failed: {exc}") from exc
    finally:
        if sock is not None:
            close_client(sock, monitor)
