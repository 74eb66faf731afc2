"""``Inbox``: the NIXL notifications an endpoint receives, turned into passive-side events.

Each transfer a peer posts to us carries one done-notice (see ``notifications``); a peer's request
has landed once all its notices arrived. Until then the indices seen are kept per ``(sender,
request_id)``; ``forget()`` drops a sender's partial sets when that peer goes down or is dropped,
since the missing notices will never come. A sender that is not a connected peer (the passive side of
pull mode) can die mid-request unseen, so a partial set still incomplete ``PARTIAL_TTL_S`` after its
first notice is given up and reported like a failure notice. Completed requests nobody awaits yet are
remembered (up to ``LANDED_MEMORY``) for a later ``expect()``.
"""

from __future__ import annotations

import collections
import time

from . import notifications
from .agent import Agent
from .inflight import InFlight
from .requests import RemoteEvent

__all__ = ["LANDED_MEMORY", "PARTIAL_TTL_S", "Inbox"]

LANDED_MEMORY = 4096  # passive completions remembered for a later expect()
PARTIAL_TTL_S = 600.0  # a sender's partial done-notices for a request are given up this long after the first


class Inbox:
    """Done/fail notices from peers, and the partial and unclaimed completions they imply.

    Args:
        agent: the endpoint's NIXL agent, whose notifications ``drain()`` reads.
        requests: the endpoint's requests (passive ones complete or fail here) and event sink.
    """

    def __init__(self, agent: Agent, requests: InFlight) -> None:
        self._agent = agent
        self._requests = requests
        self._parts: dict[tuple[str, str], tuple[float, set[int]]] = {}  # (first notice's time, indices)
        self._landed: collections.OrderedDict[str, set[str]] = collections.OrderedDict()
        self._next_expiry = 0.0

    def drain(self) -> None:
        """Read every new NIXL notification (this also progresses the passive side)."""
        events = self._requests.events
        for raw_sender, msgs in self._agent.nixl.get_new_notifs().items():
            sender = raw_sender.decode() if isinstance(raw_sender, bytes) else str(raw_sender)
            for msg in msgs:
                notice = notifications.parse(msg)
                if notice is None:
                    events.notifs.append((sender, msg))
                elif notice.kind == "done":
                    self._on_part(sender, notice)
                else:
                    self._parts.pop((sender, notice.request_id), None)
                    self._failed(sender, notice.request_id, notice.reason)
        self._expire(time.monotonic())

    def take_landed(self, request_id: str) -> set[str]:
        """The senders that already landed everything for ``request_id``, forgotten here."""
        return self._landed.pop(request_id, set())

    def forget(self, sender: str) -> None:
        """Drop the partially received done-notices of agent ``sender`` (it went down or was dropped)."""
        for key in [k for k in self._parts if k[0] == sender]:
            del self._parts[key]

    def partial(self) -> set[tuple[str, str]]:
        """The ``(sender, request_id)`` pairs with some but not all done-notices received."""
        return set(self._parts)

    def _failed(self, sender: str, request_id: str, reason: str) -> None:
        self._requests.events.remote_failed.append(RemoteEvent(sender, request_id, reason))
        self._requests.passive_failed(request_id, sender, reason)

    def _expire(self, now: float) -> None:
        """Give up partial sets older than ``PARTIAL_TTL_S`` (checked every eighth of it)."""
        if now < self._next_expiry:
            return
        self._next_expiry = now + PARTIAL_TTL_S / 8
        for (sender, request_id), (first, parts) in list(self._parts.items()):
            if now - first >= PARTIAL_TTL_S:
                del self._parts[(sender, request_id)]
                reason = (
                    f"gave up: {len(parts)} done-notice(s) from {sender!r} arrived and the rest did not "
                    f"within {PARTIAL_TTL_S:g} s of the first"
                )
                self._failed(sender, request_id, reason)

    def _on_part(self, sender: str, notice: notifications.Notice) -> None:
        key = (sender, notice.request_id)
        _, parts = self._parts.setdefault(key, (time.monotonic(), set()))
        parts.add(notice.index)
        if len(parts) < notice.count:
            return
        del self._parts[key]
        self._requests.events.remote_done.append(RemoteEvent(sender, notice.request_id))
        if not self._requests.passive_landed(notice.request_id, sender):
            self._landed.setdefault(notice.request_id, set()).add(sender)
            while len(self._landed) > LANDED_MEMORY:
                self._landed.popitem(last=False)
