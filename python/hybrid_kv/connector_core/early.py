"""``EarlyBox``: control messages that came before the lease they name, kept in wire form and bounded by bytes.

A decode can be quicker than the prefill worker's next step, so a release, renewal, push registration or claim
may arrive before its lease does. Such a message is kept as the bytes it came in (a decoded message of 32 K block
ids takes about 25 times its wire size as Python objects), with the requests it still waits for, until a lease
takes it or ``EARLY_TTL_S`` passes. At most ``MAX_EARLY`` messages and ``MAX_EARLY_BYTES`` bytes are kept: past
either, the oldest is dropped first (logged, counted). What expires is handed back (``expire``) so that a
claim still waiting can be answered with a refusal instead of silence.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["EARLY_TTL_S", "MAX_EARLY", "MAX_EARLY_BYTES", "EarlyBox", "EarlyMessage"]

log = logging.getLogger("hybrid_kv.connector_core.early")

EARLY_TTL_S = 60.0
"""How long a control message for a request not (yet) leased here is kept."""
MAX_EARLY = 4096
"""Most such messages kept (all senders together)."""
MAX_EARLY_BYTES = 64 << 20
"""Most bytes of such messages kept (their wire size plus a fixed overhead each)."""
OVERHEAD_BYTES = 512
"""What one kept message costs beyond its payload (counted against ``MAX_EARLY_BYTES``)."""


@dataclass(eq=False)  # kept messages are told apart by identity
class EarlyMessage:
    """A kept message: who sent it, its bytes, and the requests it still waits for."""

    expiry: float  # monotonic
    sender: str
    payload: bytes
    waiting: set[str]

    @property
    def size(self) -> int:
        return len(self.payload) + OVERHEAD_BYTES + sum(len(r) for r in self.waiting)


class EarlyBox:
    """Early messages of one prefill worker (``name``, for logs); ``clock`` is monotonic."""

    def __init__(self, name: str, clock: Callable[[], float]) -> None:
        self.name = name
        self._clock = clock
        self._messages: collections.deque[EarlyMessage] = collections.deque()
        self._by_req: dict[str, list[EarlyMessage]] = {}
        self.bytes = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._messages)

    def keep(self, sender: str, payload: bytes, waiting: set[str]) -> None:
        """Keep ``payload`` (from ``sender``) until a lease of one of ``waiting`` arrives, or it expires."""
        msg = EarlyMessage(self._clock() + EARLY_TTL_S, sender, bytes(payload), set(waiting))
        self._messages.append(msg)
        self.bytes += msg.size
        for rid in msg.waiting:
            self._by_req.setdefault(rid, []).append(msg)
        while len(self._messages) > MAX_EARLY or self.bytes > MAX_EARLY_BYTES:
            self._forget(self._messages[0])
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1024 == 0:
                log.warning(
                    "hybrid-kv %s: %d control messages for requests not leased here dropped (at most %d messages "
                    "and %d MiB kept)",
                    self.name,
                    self.dropped,
                    MAX_EARLY,
                    MAX_EARLY_BYTES >> 20,
                )

    def take(self, rid: str) -> list[EarlyMessage]:
        """The messages waiting for ``rid`` (its lease arrived), in arrival order; a message waiting for other
        requests too stays kept for them."""
        found = self._by_req.pop(rid, [])
        for msg in found:
            old = msg.size
            msg.waiting.discard(rid)
            self.bytes -= old - msg.size
            if not msg.waiting:
                self._forget(msg)
        return found

    def expire(self) -> list[tuple[EarlyMessage, set[str]]]:
        """Forget the messages whose time is up; returns each with the requests it still waited for."""
        now = self._clock()
        out = []
        while self._messages and self._messages[0].expiry <= now:
            msg = self._messages[0]
            waiting = set(msg.waiting)
            self._forget(msg)
            out.append((msg, waiting))
        return out

    def _forget(self, msg: EarlyMessage) -> None:
        try:
            self._messages.remove(msg)
        except ValueError:
            return
        self.bytes -= msg.size
        for rid in msg.waiting:
            kept = self._by_req.get(rid)
            if kept is not None:
                kept[:] = [m for m in kept if m is not msg]
                if not kept:
                    del self._by_req[rid]
        msg.waiting = set()
