"""``Courier``: an endpoint's control messages, delivered by one thread, in order per destination, none
waiting behind another destination.

Each destination (address and endpoint meant) has its own queue and, while it has messages, one connection on
which up to ``WINDOW`` messages are in flight at once (the server acknowledges each; the side channel's ROUTER
reads one connection's requests in order). One thread polls every connection: a destination that never answers
holds only its own messages, so a healthy peer's message leaves at once whatever others do.

A destination that refuses the connection (nothing listens: a dead or restarting peer) ends each attempt at
once instead of waiting its time out, so a message to a dead peer is reported lost within milliseconds.

Every message has an absolute deadline (monotonic) and an attempt budget: attempt ``i`` of ``n`` waits
``2**i / (2**n - 1)`` of ``timeout_s`` (as ``Endpoint.send_control``), never past the deadline. An attempt not
acknowledged in time closes the connection, and its message (with the messages sent after it, which the closed
connection can no longer acknowledge) is sent again, in order, on a fresh one. An unacknowledged message may
have arrived: receivers must treat every message idempotently. A message whose deadline passes while it waits in
its queue is dropped, never sent. A refusal (an error answer, a failed CURVE handshake: the peer is not a member)
is not retried.

The owner learns what happened through ``take()``: every message that was not delivered, and every delivered
message it gave a ``tag``. Nothing here calls back into the owner's code.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

import zmq

from ..errors import ChannelError
from . import curve
from .channel_client import close_client, handshake_failed, open_client
from .seconds import MAX_SECONDS, check_seconds
from .side_channel import REQUEST_ID_BYTES, control_frames, parse_reply, reply_request_id

__all__ = ["MAX_ATTEMPTS", "MAX_DESTINATIONS", "WINDOW", "Courier", "Delivery"]

log = logging.getLogger("hybrid_kv.transport")

WINDOW = 32
"""Messages in flight on one destination's connection (below the server's per-connection ``SERVER_RCVHWM``)."""
MAX_DESTINATIONS = 1024
"""Destinations with messages queued or in flight at once; a message to one more is refused at once."""
MAX_QUEUED = 65536
"""Messages queued in all (new ones past it are refused at once)."""
MAX_QUEUED_BYTES = 256 << 20
"""Bytes of the messages queued in all (new ones past it are refused at once)."""
MAX_ATTEMPTS = 5
"""Most attempts per message."""
IDLE_CLOSE_S = 10.0
"""A destination's connection is closed once nothing was sent on it for this long."""
_TICK_S = 0.05  # the longest poll: checks deadlines and closing


class Delivery(NamedTuple):
    """What became of a message: ``delivered`` (acknowledged by the endpoint meant) or not, and why."""

    tag: Hashable | None
    delivered: bool
    to: str
    address: str
    reason: str = ""


@dataclass
class _Letter:
    payload: bytes
    tag: Hashable | None
    deadline: float  # monotonic: neither sent nor retried after it
    unit: float  # attempt i waits unit * 2**i
    attempts: int
    attempt: int = 0  # attempts made so far
    request_id: bytes = b""
    ack_by: float = 0.0  # monotonic: the current attempt's end


@dataclass
class _Destination:
    address: str
    to: str
    queue: collections.deque[_Letter] = field(default_factory=collections.deque)
    flying: dict[bytes, _Letter] = field(default_factory=dict)  # request id -> letter, in send order
    sock: zmq.Socket[bytes] | None = None
    monitor: zmq.Socket[bytes] | None = None
    last_used: float = 0.0
    refused: bool = False  # the last connection attempt was refused


class Courier:
    """Delivers control messages of endpoint ``name`` over side channels keyed by ``key`` (the deployment secret;
    ``None``: insecure), from one thread of its own. ``send`` never blocks; ``take`` collects the outcomes."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], name: str, key: bytes | None) -> None:
        self.name = name
        self._ctx = ctx
        self._keys = curve.derive_keys(key) if key is not None else None
        self._incoming: collections.deque[tuple[str, str, _Letter]] = collections.deque()
        self._done: collections.deque[Delivery] = collections.deque()
        self._dests: dict[tuple[str, str], _Destination] = {}
        self._queued = 0  # letters accepted and not yet delivered or lost (any thread reads it)
        self._queued_bytes = 0
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name=f"hkv-courier-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ owner's side (any thread)

    def send(
        self,
        address: str,
        payload: bytes,
        to: str,
        *,
        timeout_s: float,
        deadline: float | None = None,
        attempts: int = 1,
        tag: Hashable | None = None,
    ) -> None:
        """Queue ``payload`` for the endpoint named ``to`` at ``address``; returns at once.

        ``timeout_s``: the time all attempts share (finite, positive); ``deadline`` (monotonic): nothing is sent
        or retried after it (default: now plus ``timeout_s``). A message refused here (closed courier, full
        queue, oversize payload) is reported lost by the next ``take()``.

        Raises:
            ValueError: ``attempts`` outside 1 to ``MAX_ATTEMPTS``, or a timeout or deadline that is not a finite
                positive number.
        """
        if not 1 <= attempts <= MAX_ATTEMPTS:
            raise ValueError(f"attempts must be 1 to {MAX_ATTEMPTS}, got {attempts}")
        timeout_s = check_seconds(timeout_s, "timeout_s")
        now = time.monotonic()
        end = now + timeout_s if deadline is None else deadline
        if not now - MAX_SECONDS < end < now + MAX_SECONDS:  # NaN and infinities fail both comparisons
            raise ValueError(f"deadline must be a finite monotonic time, got {deadline!r}")
        letter = _Letter(payload, tag, min(end, now + timeout_s), timeout_s / (2**attempts - 1), attempts)
        if self._stop.is_set():
            self._done.append(Delivery(tag, False, to, address, "courier closed"))
            return
        if self._queued >= MAX_QUEUED or self._queued_bytes + len(payload) > MAX_QUEUED_BYTES:
            why = f"{self._queued} control messages ({self._queued_bytes} bytes) already queued"
            self._done.append(Delivery(tag, False, to, address, f"{why}; at most {MAX_QUEUED}, {MAX_QUEUED_BYTES} B"))
            return
        self._count(1, len(payload))
        self._incoming.append((address, to, letter))
        self._wake()

    def take(self) -> list[Delivery]:
        """Outcomes since the last call: every message not delivered, and every tagged one delivered."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def pending(self) -> int:
        """Messages accepted and not yet delivered or lost."""
        return self._queued

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop delivering (what is queued or in flight is reported lost) and close every connection."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        self._thread.join(timeout_s)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # full (a wake-up is pending already) or closed

    # ------------------------------------------------------------------ the courier's thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._admit()
                now = time.monotonic()
                for dest in list(self._dests.values()):
                    self._expire(dest, now)
                    self._fill(dest, now)
                    if dest.sock is not None and not dest.flying and now - dest.last_used > IDLE_CLOSE_S:
                        self._disconnect(dest)
                    if dest.sock is None and not dest.queue and not dest.flying:
                        del self._dests[(dest.address, dest.to)]
                self._poll(now)
        except Exception:  # noqa: BLE001 - a defect here must not leave senders waiting forever
            log.exception("courier of %r stopped", self.name)
        finally:
            self._stop.set()
            for dest in list(self._dests.values()):
                self._fail_all(dest, "courier closed")
            self._dests.clear()
            self._admit()  # what came in meanwhile is lost too

    def _admit(self) -> None:
        while self._incoming:
            address, to, letter = self._incoming.popleft()
            if self._stop.is_set():
                self._lost(address, to, letter, "courier closed")
                continue
            dest = self._dests.get((address, to))
            if dest is None:
                if len(self._dests) >= MAX_DESTINATIONS:
                    self._lost(address, to, letter, f"{MAX_DESTINATIONS} destinations already have messages queued")
                    continue
                dest = self._dests[(address, to)] = _Destination(address, to)
            dest.queue.append(letter)

    def _expire(self, dest: _Destination, now: float) -> None:
        """Drop queued messages whose deadline passed; retry or give up attempts not acknowledged in time."""
        while dest.queue and dest.queue[0].deadline <= now:
            self._lost(dest.address, dest.to, dest.queue.popleft(), "its deadline passed while it was queued")
        late = [r for r, letter in dest.flying.items() if letter.ack_by <= now]
        if not late:
            return
        # the connection is closed (a fresh one for the next attempt): nothing on it can be acknowledged any more,
        # so every message in flight goes back to the queue's front, in the order it was sent
        flying = list(dest.flying.values())
        self._disconnect(dest)
        for letter in reversed(flying):
            if letter.ack_by > now:  # not timed out itself: its attempt is given back
                letter.attempt -= 1
            if letter.attempt >= letter.attempts or letter.deadline <= now:
                tries = f" ({letter.attempts} attempts)" if letter.attempts > 1 else ""
                total = letter.unit * (2**letter.attempts - 1)
                why = f"connection refused{tries}" if dest.refused else f"no acknowledgement within {total:g} s{tries}"
                self._lost(dest.address, dest.to, letter, why)
            else:
                dest.queue.appendleft(letter)

    def _fill(self, dest: _Destination, now: float) -> None:
        """Send queued messages while the destination's window allows."""
        while dest.queue and len(dest.flying) < WINDOW:
            letter = dest.queue[0]
            if letter.deadline <= now:
                dest.queue.popleft()
                self._lost(dest.address, dest.to, letter, "its deadline passed while it was queued")
                continue
            try:
                if dest.sock is None:
                    dest.sock, dest.monitor = open_client(self._ctx, dest.address, self._keys, refusals=True)
                    dest.refused = False
                    dest.last_used = now  # a new connection is not idle (its first send may wait for its pipe)
                letter.request_id = os.urandom(REQUEST_ID_BYTES)
                frames = control_frames(letter.request_id, self.name, letter.payload, dest.to)
                dest.sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:  # no pipe yet (a connection being remade): sent at a later pass, or lost at its deadline
                break
            except (ChannelError, zmq.ZMQError) as exc:
                dest.queue.popleft()
                self._lost(dest.address, dest.to, letter, f"{type(exc).__name__}: {exc}")
                continue
            dest.queue.popleft()
            letter.ack_by = min(letter.deadline, now + letter.unit * 2**letter.attempt)
            letter.attempt += 1
            dest.flying[letter.request_id] = letter
            dest.last_used = now

    def _poll(self, now: float) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        owners: dict[zmq.Socket[bytes], tuple[_Destination, bool]] = {}
        wait = _TICK_S
        for dest in self._dests.values():
            if dest.sock is not None:
                poller.register(dest.sock, zmq.POLLIN)
                owners[dest.sock] = (dest, False)
                if dest.monitor is not None:
                    poller.register(dest.monitor, zmq.POLLIN)
                    owners[dest.monitor] = (dest, True)
            for letter in dest.flying.values():
                wait = min(wait, letter.ack_by - now)
            if dest.queue:
                wait = min(wait, dest.queue[0].deadline - now)
        ready = dict(poller.poll(int(max(0.0, wait) * 1000)))
        if self._wake_r in ready:
            try:
                os.read(self._wake_r, 4096)
            except OSError:
                pass
        for sock in ready:
            owner = owners.get(sock)
            if owner is None:
                continue
            dest, is_monitor = owner
            if dest.sock is None:
                continue  # closed while handling an earlier socket of this poll
            if is_monitor:
                assert dest.monitor is not None
                err = handshake_failed(dest.monitor, dest.address, keyed=self._keys is not None)
                if err is None:  # the connection was refused: these attempts end now (retried on a fresh one)
                    dest.refused = True
                    for letter in dest.flying.values():
                        letter.ack_by = min(letter.ack_by, now)
                    continue
                self._disconnect(dest)
                self._fail_all(dest, str(err))
            else:
                self._read_replies(dest)

    def _read_replies(self, dest: _Destination) -> None:
        assert dest.sock is not None
        while dest.sock is not None:
            try:
                reply = dest.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                self._disconnect(dest)
                self._fail_all(dest, f"side channel to {dest.address} failed: {exc}")
                return
            rid = reply_request_id(reply)
            letter = dest.flying.pop(rid, None) if rid is not None else None
            if letter is None:
                continue  # a late reply to an attempt already given up on, or noise
            try:
                parse_reply(dest.address, reply, letter.request_id, dest.to)
            except ChannelError as exc:
                self._lost(dest.address, dest.to, letter, str(exc))
                continue
            self._count(-1, -len(letter.payload))
            if letter.tag is not None:
                self._done.append(Delivery(letter.tag, True, dest.to, dest.address))

    def _disconnect(self, dest: _Destination) -> None:
        if dest.sock is not None:
            close_client(dest.sock, dest.monitor)
        dest.sock = dest.monitor = None
        dest.flying = {}

    def _fail_all(self, dest: _Destination, reason: str) -> None:
        for letter in [*dest.flying.values(), *dest.queue]:
            self._lost(dest.address, dest.to, letter, reason)
        dest.flying, dest.queue = {}, collections.deque()

    def _count(self, n: int, nbytes: int) -> None:
        with self._count_lock:
            self._queued += n
            self._queued_bytes += nbytes

    def _lost(self, address: str, to: str, letter: _Letter, reason: str) -> None:
        self._count(-1, -len(letter.payload))
        self._done.append(Delivery(letter.tag, False, to, address, f"control message to {address} failed: {reason}"))
