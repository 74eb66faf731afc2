"""``LinkPool``: handshakes with peer engines in the background, never one behind another engine's.

At most one handshake per peer engine is in flight, and at most ``max_concurrent`` engines handshake at once
(each holds a thread while it waits on the network); a handshake past that bound waits for a free slot and a
warning says so. An engine whose host never answers therefore holds one slot for its own timeout, not the
handshakes of every other engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

__all__ = ["LinkPool"]

log = logging.getLogger("hybrid_kv.link_pool")

T = TypeVar("T")


class LinkPool(Generic[T]):
    """Background handshakes keyed by peer engine.

    Args:
        name: who handshakes (thread names and log lines).
        max_concurrent: the most engines handshaking at once (at least 1).
    """

    def __init__(self, name: str, max_concurrent: int) -> None:
        if max_concurrent < 1:
            raise ValueError(f"{name}: max_concurrent handshakes must be at least 1, got {max_concurrent}")
        self.name = name
        self.max_concurrent = max_concurrent
        self._executor = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix=f"hkv-handshake-{name}")
        self._by_engine: dict[str, Future[T]] = {}

    def __contains__(self, engine_id: object) -> bool:
        """Whether a handshake with ``engine_id`` is in flight (running, queued, or done and not yet taken)."""
        return engine_id in self._by_engine

    def __len__(self) -> int:
        return len(self._by_engine)

    def submit(self, engine_id: str, fn: Callable[..., T], *args: Any) -> bool:
        """Start ``fn(*args)`` as the handshake with ``engine_id``; ``False`` (nothing started) if one is in flight."""
        if engine_id in self._by_engine:
            return False
        busy = sum(not f.done() for f in self._by_engine.values())
        if busy >= self.max_concurrent:
            log.warning(
                "hybrid-kv %s: %d handshakes in flight (max_concurrent_handshakes = %d); the handshake with %s "
                "waits for one of them to end (still waiting: %s)",
                self.name,
                busy,
                self.max_concurrent,
                engine_id,
                ", ".join(sorted(e for e, f in self._by_engine.items() if not f.done())),
            )
        self._by_engine[engine_id] = self._executor.submit(fn, *args)
        return True

    def take_done(self) -> list[tuple[str, Future[T]]]:
        """The handshakes that ended since the last call (result or exception), removed from the pool."""
        done = [(e, f) for e, f in self._by_engine.items() if f.done()]
        for engine_id, _ in done:
            del self._by_engine[engine_id]
        return done

    def shutdown(self) -> list[tuple[str, Future[T]]]:
        """Cancel queued handshakes, wait for running ones (they have deadlines) and return every ended one."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        ended = [(e, f) for e, f in self._by_engine.items() if not f.cancelled()]
        self._by_engine.clear()
        return ended
