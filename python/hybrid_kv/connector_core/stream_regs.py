"""``StreamRegs``: a prefill worker's concurrent-push registrations that wait for their request, bounded by bytes
and shared fairly between decode engines.

A decode's ``StreamReg`` names the prefill request by the router's capability and often arrives before the
request even started here, so it waits. Its block ids come from the decode's request, and API clients choose
capabilities freely, so a decode engine's clients can make it send registrations for requests that never come.
What is kept is therefore bounded in count (``MAX_STREAM_REGS``) and in bytes (``MAX_STREAM_REG_BYTES``, kept in
wire form), and shared: when full, a new registration evicts the earliest-expiring one of the engine holding the
most (count and bytes each measured against its fair share, the bound divided by the engines holding any), so any
engine can always keep its share however many engines there are (each data-parallel rank is an engine of its
own). A registration is dropped once too little of its decode's wait (``until``) is left to push anything
(``expire_before``), or after ``ttl_s``.

One registration per capability is kept (the first; later ones from the same engine's other ranks are ignored,
another engine's refused), until the request's last prefill step takes it to stream (``take``), or its lease
adopts it as its push registration, or it expires.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from .control import StreamReg, decode

__all__ = ["MAX_STREAM_REG_BYTES", "MAX_STREAM_REGS", "StreamRegs"]

log = logging.getLogger("hybrid_kv.connector_core.stream_regs")

MAX_STREAM_REGS = 4096
"""Most registrations kept for requests not leased or streaming here yet."""
MAX_STREAM_REG_BYTES = 64 << 20
"""Most bytes of them kept (their wire size plus a fixed overhead each)."""
MAX_GONE = 1 << 16
"""Capabilities whose registration expired, remembered (16 bytes each) so their request's blocks are freed at once."""
OVERHEAD_BYTES = 256


@dataclass(eq=False)
class _Kept:
    cap: bytes
    engine: str
    expiry: float  # monotonic
    raw: bytes

    @property
    def size(self) -> int:
        return len(self.raw) + OVERHEAD_BYTES


class StreamRegs:
    """Registrations of one prefill worker (``name``, for logs); ``clock`` monotonic, ``wall`` the wall clock.

    ``expire_before``: seconds before a registration's ``until`` (wall clock) at which it is no use any more.
    """

    def __init__(
        self,
        name: str,
        clock: Callable[[], float],
        wall: Callable[[], float],
        ttl_s: float,
        expire_before: float,
        max_regs: int = MAX_STREAM_REGS,
        max_bytes: int = MAX_STREAM_REG_BYTES,
    ) -> None:
        self.name = name
        self._clock, self._wall = clock, wall
        self.ttl_s, self.expire_before = ttl_s, expire_before
        self.max_regs, self.max_bytes = max_regs, max_bytes
        self._by_cap: dict[bytes, _Kept] = {}
        self._by_engine: dict[str, dict[bytes, _Kept]] = {}
        self._bytes_of: dict[str, int] = {}
        self._heap: list[tuple[float, int, _Kept]] = []
        self._seq = itertools.count()
        self.bytes = 0
        self.evicted = 0
        self._gone: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._by_cap)

    def engine_of(self, cap: bytes) -> str | None:
        kept = self._by_cap.get(cap)
        return None if kept is None else kept.engine

    def offer(self, msg: StreamReg, raw: bytes) -> str | None:
        """Keep ``msg`` (``raw``: its wire bytes) for its capability; the reason it is refused, or ``None``."""
        what = f"stream registration for capability {msg.cap.hex()[:8]}..."
        now = self._clock()
        self._expire(now)
        kept = self._by_cap.get(msg.cap)
        if kept is not None:
            return None if kept.engine == msg.engine else f"{what} from {msg.engine!r}; {kept.engine!r} was first"
        expiry = min(now + self.ttl_s, now + (msg.until - self._wall()) - self.expire_before)
        if expiry <= now:
            return f"{what}: its decode stops waiting in {msg.until - self._wall():.1f} s, too soon to push"
        new = _Kept(msg.cap, msg.engine, expiry, bytes(raw))
        if new.size > self.max_bytes // max(1, len(self._by_engine | {msg.engine: {}})):
            return f"{what}: {new.size} bytes, more than an engine's share of {self.max_bytes} bytes"
        while len(self._by_cap) >= self.max_regs or self.bytes + new.size > self.max_bytes:
            victim = self._heaviest(msg.engine, new.size)
            if victim is None:
                return (
                    f"{what} refused: engine {msg.engine!r} holds its share of the {len(self._by_cap)} registrations "
                    f"({self.bytes} bytes) kept; at most {self.max_regs} and {self.max_bytes} bytes, shared by engine"
                )
            self._remove(victim)
            self.evicted += 1
            if self.evicted == 1 or self.evicted % 1024 == 0:
                log.warning(
                    "hybrid-kv %s: %d stream registrations evicted to keep each decode engine's share (latest: %r's)",
                    self.name,
                    self.evicted,
                    victim.engine,
                )
        self._add(new)
        return None

    def get(self, cap: bytes) -> StreamReg | None:
        """The registration kept for ``cap`` (left kept), if live."""
        kept = self._by_cap.get(cap)
        if kept is None or kept.expiry <= self._clock():
            return None
        return self._decode(kept)

    def pop(self, cap: bytes) -> StreamReg | None:
        """Take ``cap``'s registration (no longer kept), if live."""
        kept = self._by_cap.get(cap)
        if kept is None:
            return None
        self._remove(kept)
        return None if kept.expiry <= self._clock() else self._decode(kept)

    def expire(self) -> None:
        self._expire(self._clock())

    def gone(self, cap: bytes) -> bool:
        """Whether ``cap``'s registration expired here: its decode stopped waiting, so nothing will be written."""
        return cap in self._gone

    def usage(self, engine: str) -> tuple[int, int]:
        """``(registrations, bytes)`` kept for ``engine``."""
        return len(self._by_engine.get(engine, {})), self._bytes_of.get(engine, 0)

    # ------------------------------------------------------------------ internals

    def _decode(self, kept: _Kept) -> StreamReg | None:
        try:
            msg = decode(kept.raw)
        except Exception:  # noqa: BLE001 - it decoded once when it came; never raise for it
            return None
        return msg if isinstance(msg, StreamReg) else None

    def _heaviest(self, newcomer: str, size: int) -> _Kept | None:
        """What goes to make room for a registration of ``newcomer`` (``size`` bytes): the earliest-expiring one of
        ``newcomer`` itself when it would exceed its fair share (count or bytes: the bound divided by the engines
        holding any), else that of the engine most over its share; ``None`` when nothing can go."""
        engines = set(self._by_engine) | {newcomer}
        share_n, share_b = self.max_regs / len(engines), self.max_bytes / len(engines)

        def load(engine: str) -> float:
            n, b = self.usage(engine)
            if engine == newcomer:
                n, b = n + 1, b + size
            return max(n / share_n, b / share_b)

        pick = newcomer if load(newcomer) > 1.0 else max(self._by_engine, key=load, default=None)
        mine = self._by_engine.get(pick) if pick is not None else None
        return min(mine.values(), key=lambda k: k.expiry) if mine else None

    def _add(self, kept: _Kept) -> None:
        self._by_cap[kept.cap] = kept
        self._by_engine.setdefault(kept.engine, {})[kept.cap] = kept
        self._bytes_of[kept.engine] = self._bytes_of.get(kept.engine, 0) + kept.size
        self.bytes += kept.size
        heapq.heappush(self._heap, (kept.expiry, next(self._seq), kept))

    def _remove(self, kept: _Kept) -> None:
        if self._by_cap.get(kept.cap) is not kept:
            return
        del self._by_cap[kept.cap]
        mine = self._by_engine[kept.engine]
        del mine[kept.cap]
        self._bytes_of[kept.engine] -= kept.size
        if not mine:
            del self._by_engine[kept.engine], self._bytes_of[kept.engine]
        self.bytes -= kept.size

    def _expire(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            _, _, kept = heapq.heappop(self._heap)
            if self._by_cap.get(kept.cap) is kept:
                self._remove(kept)
                self._gone[kept.cap] = None
                while len(self._gone) > MAX_GONE:
                    self._gone.popitem(last=False)
