"""``ControlDelivery``: a worker's control messages, sent off its step, in order per peer, each retried.

A control message is a side-channel round trip, which no step waits for. Each destination address hashes to
one of ``LANES`` lanes (one thread each), so messages to one peer rank keep their order while a slow or dead
peer holds up only the messages that share its lane, not every peer's. A message not acknowledged is sent
again on a fresh connection within the same ``timeout_s`` (``Endpoint.send_control(attempts=)``): every
control message is idempotent where it lands (a release counts its sender once, a repeated registration,
renewal or digest ask is the same one; a repeated answer or plan is refused as already seen).

A message never acknowledged is logged and reported by ``take_lost``, with the request that waits on it when
the caller named one: a decode request whose digest ask or push registration was lost then fails at once,
instead of at its transfer deadline. Lost releases and plans need no one told: the prefill's lease, or the
decode's deadline, covers them.
"""

from __future__ import annotations

import collections
import logging
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...transport import Endpoint

__all__ = ["ATTEMPTS", "LANES", "ControlDelivery", "Lost"]

log = logging.getLogger("hybrid_kv.integrations.vllm.delivery")

LANES = 4
"""Threads sending a worker's control messages; one destination's messages always take the same one."""
ATTEMPTS = 3
"""Attempts per message within its timeout (1/7, 2/7 and 4/7 of it)."""

Lost = tuple[str | None, str]
"""A message never acknowledged: ``(the request waiting on it or None, why)``."""


class ControlDelivery:
    """Control messages of worker ``name``: ``send`` queues them, ``take_lost`` drains the undelivered ones."""

    def __init__(self, name: str, timeout_s: float, lanes: int = LANES, attempts: int = ATTEMPTS) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.attempts = attempts
        self._lanes = [ThreadPoolExecutor(1, thread_name_prefix=f"hkv-control-{name}-{i}") for i in range(lanes)]
        self._lost: collections.deque[Lost] = collections.deque()  # appended by lanes, drained by the worker

    def send(self, ep: Endpoint, messages: list[tuple[str, bytes, str]], waiting: str | None = None) -> None:
        """Queue ``messages`` (``(address, payload, the endpoint meant)``); ``waiting``: the request that fails if
        any of them is lost. Returns at once."""
        for address, payload, to in messages:
            self.run(address, self._deliver, ep, address, payload, to, waiting)

    def run(self, address: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on ``address``'s lane (in order with the messages queued to it)."""
        self._lanes[zlib.crc32(address.encode()) % len(self._lanes)].submit(fn, *args)

    def take_lost(self) -> list[Lost]:
        """The messages found undelivered since the last call."""
        out = []
        while self._lost:
            out.append(self._lost.popleft())
        return out

    def shutdown(self) -> None:
        """Drop what is queued; wait for the messages being sent (each has its deadline)."""
        for lane in self._lanes:
            lane.shutdown(wait=False, cancel_futures=True)
        for lane in self._lanes:
            lane.shutdown(wait=True)

    def _deliver(self, ep: Endpoint, address: str, payload: bytes, to: str, waiting: str | None) -> None:
        try:
            ep.send_control(address, payload, self.timeout_s, expected_name=to, attempts=self.attempts)
        except Exception as exc:  # noqa: BLE001 - reported to the worker's step, never raised on a lane
            log.warning("hybrid-kv %s: control message to %s (%s) not delivered: %s", self.name, to, address, exc)
            self._lost.append((waiting, f"control message to {to} not delivered: {exc}"))
