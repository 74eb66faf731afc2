"""``Inbox``: the NIXL notifications an endpoint receives, turned into passive-side events.

Each transfer a peer posts to us carries one done-notice (see ``notifications``); a peer's request
has landed once all its notices arrived. Until then the indices seen are kept per ``(sender,
request_id)``; ``forget()`` drops a sender's partial sets when that peer goes down or is dropped,
since the missing notices will never come. A sender that is not a connected peer (the passive side of
pull mode) can die mid-request unseen, so a partial set still incomplete ``PARTIAL_TTL_S`` after its
first notice is given up and reported like a failure notice. Completed requests nobody awaits yet are
remembered (up to ``LANDED_MEMORY``) for a later ``expect()``, with the digest their notices carried (a
verified request's notices to one peer all carry the sender's digest of the rank pair; one set whose notices
disagree is kept as ``INCONSISTENT``, which no digest equals), and so are failures nobody awaits yet (up to
``LANDED_MEMORY`` too): a push sender's fail-notice can overtake the side-channel message that makes the
receiver ``expect()`` the request, which then fails at once instead of waiting for its deadline.

Notices are untrusted (any agent that loaded our metadata can send them): ``notifications.parse`` bounds
each one, a sender holds at most ``MAX_PARTIAL_PER_SENDER`` partial sets and all senders together
``MAX_PARTIAL`` (a notice past either is dropped and logged), each set is a bitmask of at most
``notifications.MAX_NOTICE_COUNT`` indices, and a notice whose count differs from its set's is dropped. A
passive request awaited from named writers (``expect_from``) completes and fails only by their notices:
anyone else's are dropped.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

from . import notifications
from .agent import Agent
from .inflight import InFlight
from .requests import RemoteEvent

__all__ = ["INCONSISTENT", "LANDED_MEMORY", "MAX_PARTIAL", "MAX_PARTIAL_PER_SENDER", "PARTIAL_TTL_S", "Inbox"]

log = logging.getLogger("hybrid_kv.transport.inbox")

LANDED_MEMORY = 4096  # passive completions (and failures) remembered for a later expect()
MAX_EARLY_FAILED_SENDERS = 16  # senders whose early fail-notice for one request is remembered
PARTIAL_TTL_S = 600.0  # a sender's partial done-notices for a request are given up this long after the first
MAX_PARTIAL_PER_SENDER = 1024  # requests one sender may have partly landed at once
MAX_PARTIAL = 16384  # the same, all senders together
INCONSISTENT = -1
"""The digest of a done-set whose notices carried different digests (or some none): never a sender's digest."""


class Inbox:
    """Done/fail notices from peers, and the partial and unclaimed completions they imply.

    Args:
        agent: the endpoint's NIXL agent, whose notifications ``drain()`` reads.
        requests: the endpoint's requests (passive ones complete or fail here) and event sink.
    """

    def __init__(self, agent: Agent, requests: InFlight) -> None:
        self._agent = agent
        self._requests = requests
        # (sender, request id) -> [first notice's time, count, bitmask of the indices seen, digest]
        self._parts: dict[tuple[str, str], list[Any]] = {}
        self._per_sender: collections.Counter[str] = collections.Counter()
        # request id -> {sender: digest its notices carried (None: none)}
        self._landed: collections.OrderedDict[str, dict[str, int | None]] = collections.OrderedDict()
        # request id -> {sender: reason} of fail-notices that came before anything awaited the request
        self._failed_early: collections.OrderedDict[str, dict[str, str]] = collections.OrderedDict()
        self._writers: dict[str, tuple[float, frozenset[str]]] = {}  # request id -> (until, its only writers)
        self._dropped: collections.Counter[str] = collections.Counter()  # notices dropped, by reason
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
                    continue
                writers = self._writers.get(notice.request_id)
                if writers is not None and sender not in writers[1]:
                    self._drop(
                        f"{notice.kind}-notice for {notice.request_id!r} from {sender!r}, not one of its writers"
                    )
                elif notice.kind == "done":
                    self._on_part(sender, notice)
                else:
                    self._pop_part((sender, notice.request_id))
                    self._failed(sender, notice.request_id, notice.reason)
        self._expire(time.monotonic())

    def take_landed(self, request_id: str) -> dict[str, int | None]:
        """The senders that already landed everything for ``request_id`` (with the digest their notices
        carried), forgotten here."""
        return self._landed.pop(request_id, {})

    def take_failed(self, request_id: str, writers: frozenset[str] | None = None) -> tuple[str, str] | None:
        """A ``(sender, reason)`` fail-notice for ``request_id`` that arrived before anything awaited it (from one
        of ``writers`` when given), forgotten here with the request's others."""
        early = self._failed_early.pop(request_id, {})
        return next(((s, r) for s, r in early.items() if writers is None or s in writers), None)

    def expect_from(self, request_id: str, writers: frozenset[str], deadline_s: float) -> dict[str, int | None]:
        """Accept notices for ``request_id`` only from agents ``writers`` until its deadline (plus a second);
        returns those of them that already landed everything for it, with their digests."""
        self._writers[request_id] = (time.monotonic() + deadline_s + 1.0, writers)
        for key in [k for k in self._parts if k[1] == request_id and k[0] not in writers]:
            self._pop_part(key)
        return {s: d for s, d in self.take_landed(request_id).items() if s in writers}

    def forget(self, sender: str) -> None:
        """Drop the partially received done-notices of agent ``sender`` (it went down or was dropped)."""
        for key in [k for k in self._parts if k[0] == sender]:
            self._pop_part(key)

    def partial(self) -> set[tuple[str, str]]:
        """The ``(sender, request_id)`` pairs with some but not all done-notices received."""
        return set(self._parts)

    def _failed(self, sender: str, request_id: str, reason: str) -> None:
        self._requests.events.remote_failed.append(RemoteEvent(sender, request_id, reason))
        if not self._requests.passive_failed(request_id, sender, reason):
            early = self._failed_early.setdefault(request_id, {})
            self._failed_early.move_to_end(request_id)
            if len(early) < MAX_EARLY_FAILED_SENDERS:
                early.setdefault(sender, reason)
            while len(self._failed_early) > LANDED_MEMORY:
                self._failed_early.popitem(last=False)

    def _expire(self, now: float) -> None:
        """Give up partial sets older than ``PARTIAL_TTL_S`` (checked every eighth of it)."""
        if now < self._next_expiry:
            return
        self._next_expiry = now + PARTIAL_TTL_S / 8
        for rid in [r for r, (until, _) in self._writers.items() if until <= now]:
            del self._writers[rid]
        for (sender, request_id), (first, _, mask, _) in list(self._parts.items()):
            if now - first >= PARTIAL_TTL_S:
                self._pop_part((sender, request_id))
                reason = (
                    f"gave up: {int(mask).bit_count()} done-notice(s) from {sender!r} arrived and the rest did not "
                    f"within {PARTIAL_TTL_S:g} s of the first"
                )
                self._failed(sender, request_id, reason)

    def _pop_part(self, key: tuple[str, str]) -> None:
        if self._parts.pop(key, None) is not None:
            self._per_sender[key[0]] -= 1
            if self._per_sender[key[0]] <= 0:
                del self._per_sender[key[0]]

    def _drop(self, what: str) -> None:
        """Log a dropped notice: the first of each kind of reason, then every 1024th."""
        kind = what.split(" ", 1)[0]
        self._dropped[kind] += 1
        n = self._dropped[kind]
        if n == 1 or n % 1024 == 0:
            log.warning("hybrid-kv inbox: dropped %s (%d such so far)", what, n)

    def _on_part(self, sender: str, notice: notifications.Notice) -> None:
        key = (sender, notice.request_id)
        part = self._parts.get(key)
        if part is None:
            if notice.count > 1 and (
                self._per_sender[sender] >= MAX_PARTIAL_PER_SENDER or len(self._parts) >= MAX_PARTIAL
            ):
                self._drop(f"done-notice for {notice.request_id!r} from {sender!r}: too many partly landed requests")
                return
            part = [time.monotonic(), notice.count, 0, notice.digest]
            if notice.count > 1:
                self._parts[key] = part
                self._per_sender[sender] += 1
        elif part[1] != notice.count:
            self._drop(f"done-notice for {notice.request_id!r} from {sender!r}: count {notice.count}, was {part[1]}")
            return
        elif part[3] != notice.digest:
            part[3] = INCONSISTENT
        part[2] = int(part[2]) | (1 << notice.index)
        if int(part[2]).bit_count() < notice.count:
            return
        self._pop_part(key)
        self._requests.events.remote_done.append(RemoteEvent(sender, notice.request_id))
        digest = part[3]
        if not self._requests.passive_landed(notice.request_id, sender, digest):
            self._landed.setdefault(notice.request_id, {})[sender] = digest
            while len(self._landed) > LANDED_MEMORY:
                self._landed.popitem(last=False)
