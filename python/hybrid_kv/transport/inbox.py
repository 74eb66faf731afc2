"""``Inbox``: the NIXL notifications an endpoint receives, turned into passive-side events.

Each transfer a peer posts to us carries one done-notice (see ``notifications``); a peer's request
has landed once all its notices arrived. Until then the indices seen are kept per ``(sender,
request_id)``; ``forget()`` drops a sender's partial sets when that peer goes down or is dropped,
since the missing notices will never come. Completed requests nobody awaits yet are remembered (up
to ``LANDED_MEMORY``) for a later ``expect()``.
"""

from __future__ import annotations

import collections

from . import notifications
from .agent import Agent
from .inflight import InFlight
from .requests import RemoteEvent

__all__ = ["LANDED_MEMORY", "Inbox"]

LANDED_MEMORY = 4096  # passive completions remembered for a later expect()


class Inbox:
    """Done/fail notices from peers, and the partial and unclaimed completions they imply.

    Args:
        agent: the endpoint's NIXL agent, whose notifications ``drain()`` reads.
        requests: the endpoint's requests (passive ones complete or fail here) and event sink.
    """

    def __init__(self, agent: Agent, requests: InFlight) -> None:
        self._agent = agent
        self._requests = requests
        self._parts: dict[tuple[str, str], set[int]] = {}
        self._landed: collections.OrderedDict[str, set[str]] = collections.OrderedDict()

    def drain(self) -> None:
        """Read every new NIXL notification (this also progresses the passive side, NIXL notes §4.3)."""
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
                    events.remote_failed.append(RemoteEvent(sender, notice.request_id, notice.reason))
                    self._requests.passive_failed(notice.request_id, sender, notice.reason)

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

    def _on_part(self, sender: str, notice: notifications.Notice) -> None:
        key = (sender, notice.request_id)
        parts = self._parts.setdefault(key, set())
        parts.add(notice.index)
        if len(parts) < notice.count:
            return
        del self._parts[key]
        self._requests.events.remote_done.append(RemoteEvent(sender, notice.request_id))
        if not self._requests.passive_landed(notice.request_id, sender):
            self._landed.setdefault(notice.request_id, set()).add(sender)
            while len(self._landed) > LANDED_MEMORY:
                self._landed.popitem(last=False)
