"""``Outbox``: a worker's control messages, handed to its endpoint's courier with a deadline and a tag each.

The courier (``transport.courier``) delivers off the step thread, in order per destination, retrying an
unacknowledged message on a fresh connection within ``handshake_timeout_s`` (``ATTEMPTS`` attempts), and never
sends a message whose deadline passed. Every control message is idempotent where it lands (a release counts its
sender once, a repeated registration, renewal or claim is the same one, a repeated answer or plan is refused as
already seen), so a retry of a message that did arrive does no harm.

``take`` returns what became of the tagged messages and of every message that was not delivered (logged here
once per destination and reason, and counted): the roles then fail exactly the requests that wait on a lost one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterable

from ...transport import Endpoint
from ...transport.courier import Delivery
from .stats import HybridKvStats

__all__ = ["ATTEMPTS", "Outbox"]

log = logging.getLogger("hybrid_kv.integrations.vllm.delivery")

ATTEMPTS = 3
"""Attempts per message within its timeout (1/7, 2/7 and 4/7 of it)."""
MAX_LOGGED = 1024
"""Distinct (destination, reason) pairs whose loss is logged; later ones are only counted."""


class Outbox:
    """Control messages of worker ``name`` over ``ep``'s courier; ``timeout_s``: all attempts of one message."""

    def __init__(self, ep: Endpoint, name: str, timeout_s: float, stats: HybridKvStats) -> None:
        self._courier = ep.courier
        self.name = name
        self.timeout_s = timeout_s
        self._stats = stats
        self._logged: set[tuple[str, str]] = set()

    def send(
        self,
        messages: Iterable[tuple[str, bytes, str]],
        *,
        tag: Hashable | None = None,
        deadline: float | None = None,
    ) -> None:
        """Queue ``messages`` (``(address, payload, the endpoint meant)``), each reported by ``take`` with ``tag``
        when delivered (only if ``tag`` is set) or lost; ``deadline`` (monotonic): never sent after it (default: the
        timeout from now). Returns at once."""
        t0 = time.perf_counter()
        timeout = self.timeout_s
        if deadline is not None:
            timeout = max(1e-3, min(timeout, deadline - time.monotonic()))
        for address, payload, to in messages:
            self._courier.send(address, payload, to, timeout_s=timeout, attempts=ATTEMPTS, tag=tag)
        self._stats.add_time("worker_control_s", time.perf_counter() - t0)

    def take(self) -> list[Delivery]:
        """What became of messages since the last call (lost ones logged and counted as ``num_lost_controls``)."""
        out = self._courier.take()
        for d in out:
            if d.delivered:
                continue
            self._stats.count("num_lost_controls")
            reason = d.reason.rsplit(": ", 1)[-1]
            if (d.address, reason) not in self._logged and len(self._logged) < MAX_LOGGED:
                self._logged.add((d.address, reason))
                log.warning(
                    "hybrid-kv %s: control message to %s (%s) not delivered: %s", self.name, d.to, d.address, d.reason
                )
        return out

    def pending(self) -> int:
        return self._courier.pending()
