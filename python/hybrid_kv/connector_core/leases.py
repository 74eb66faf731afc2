"""``LeaseBook``: a prefill worker's leased requests and what decode engines said about them, bounded.

A finished prefill request's blocks are leased to one decode engine (``SendLease``: the grant its ticket
carries). Control messages (``control``) act on a lease only when they carry its grant: a ``Claim``
(``claims``) makes the first engine to claim it its holder and is answered ``ok`` only while the lease has more
than ``LEASE_MARGIN_S`` left, a ``Release`` counts its sender once (the blocks are freed once ``consumers``
ranks released), a ``Renew`` moves the expiry out, never past ``max_extension_s`` beyond the lease, and the first
``PushReg`` sent by a rank of the engine it names is the request's registration. Once one decode engine claimed,
released, renewed or registered, messages from workers of another engine are refused (a ticket is used by one
decode engine). A lease that ended is remembered a while (``MAX_ENDED``), so a claim for it is refused at once.

Messages may arrive before their lease does (the decode can be quicker than this worker's next step): they wait
in wire form in the ``early.EarlyBox`` (bounded by count and bytes) and are handed back when the lease comes.

Concurrent push: a decode's ``StreamReg`` names the prefill request by the capability the router gave both
requests (``params.STREAM_FIELD``); ``stream_regs.StreamRegs`` keeps it until the request's last prefill step
takes it to stream (``take_stream``), or its lease (``SendLease.cap``) adopts it as its push registration.
Nothing else is kept: at most one lease per request the scheduler leased, the early box, the registrations and
one capability per request streaming.
"""

from __future__ import annotations

import collections
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..claims import ClaimEntry
from .control import Control, PushReg, Release, Renew, StreamReg, rank_of
from .early import EarlyBox, EarlyMessage
from .requests import BlockIds, SendLease
from .stream_regs import StreamRegs
from .tickets import TicketError, TicketKey

__all__ = ["LEASE_MARGIN_S", "MAX_ENDED", "MIN_PUSH_S", "Lease", "LeaseBook", "push_deadline", "renewal_until"]

log = logging.getLogger("hybrid_kv.connector_core.leases")

LEASE_MARGIN_S = 1.0
"""Pull: a read must end this long before the prefill's lease ends (wall clock, so it also absorbs clock skew
between hosts up to this much), and a claim is confirmed only with more than this left. Push: the prefill's
writes end (or fail) this long before the decode's registration's ``until``, and the decode frees its blocks no
earlier than this long after it."""
MIN_PUSH_S = 1.0
"""Push: a registration whose decode stops waiting sooner than this (plus the margin) is not written to."""
MAX_ENDED = 1 << 16
"""Ended leases remembered (request ids), so that a late or replayed claim is refused at once."""
MAX_CLAIMED_AHEAD = 1 << 16
"""Leases confirmed from their ticket before this worker was told of them, remembered until it is (or their
ticket's latest end)."""


def push_deadline(until: float | None, timeout_s: float, now: float | None = None) -> float | None:
    """A push's deadline (seconds from ``now``, wall clock): ``timeout_s``, ending ``LEASE_MARGIN_S`` before the
    decode's ``until``; ``None`` when too little of that is left to write anything (or there is no ``until``)."""
    if until is None:
        return None
    left = until - (time.time() if now is None else now) - LEASE_MARGIN_S
    return min(timeout_s, left) if left >= MIN_PUSH_S else None


def renewal_until(expires_at: float | None, max_expires_at: float | None, now: float, lease_s: float) -> float | None:
    """Decode side: the lease end to ask for (``Renew.until``) for a request still waiting for its handshake,
    or ``None`` when no renewal is due (more than half of ``lease_s`` left, the ticket's maximum reached, or
    the lease already over: the prefill may have freed the blocks). Wall-clock times."""
    if expires_at is None or max_expires_at is None or not now < expires_at < max_expires_at:
        return None
    if expires_at - now > lease_s / 2:
        return None
    return min(max_expires_at, now + lease_s)


def engine_of(sender: str) -> str:
    """The engine part of a worker name ``<engine>-tp<rank>``."""
    head, sep, _ = sender.rpartition("-tp")
    return head if sep else sender


@dataclass
class Lease:
    block_ids: BlockIds
    grant: bytes
    expiry: float  # monotonic
    max_expiry: float  # monotonic: renewals stop here
    consumers: int = 0  # ranks that must release (0: no release yet)
    released: set[str] = field(default_factory=set)
    holder: str | None = None  # the decode engine acting on this lease (the first that did)
    push: PushReg | None = None
    renewals: int = 0
    cap: bytes = b""  # the request's concurrent-push capability
    push_until: float | None = None  # push: the decode waits until then (wall clock); nothing is written later
    given_up: bool = False  # its concurrent-push decode stopped waiting before it finished: free it at once


class LeaseBook:
    """Leases of one prefill worker (``name``, for logs); ``clock`` is monotonic, ``wall`` the wall clock."""

    def __init__(
        self,
        name: str,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        stream_ttl_s: float = 60.0,
        tickets: TicketKey | None = None,
        engine_id: str | None = None,
    ) -> None:
        self.name = name
        self._tickets = tickets if tickets is not None and tickets.signed else None
        self.engine_id = engine_id
        self._ahead: collections.OrderedDict[str, tuple[str, bytes, float]] = collections.OrderedDict()
        self._clock = clock
        self._wall = wall
        self.leases: dict[str, Lease] = {}
        self.early = EarlyBox(name, clock)
        self.regs = StreamRegs(name, clock, wall, stream_ttl_s, LEASE_MARGIN_S + MIN_PUSH_S)
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._by_cap: dict[bytes, str] = {}  # capability -> leased request
        self._streaming: dict[bytes, str] = {}  # capability -> engine, of requests streaming now

    def __len__(self) -> int:
        return len(self.leases)

    def ahead_count(self) -> int:
        """Leases confirmed from their ticket before this worker was told of them: a decode may be reading them now,
        so the worker must progress NIXL (past their ticket's latest end they are forgotten)."""
        self._forget_ahead(self._clock())
        return len(self._ahead)

    def _forget_ahead(self, now: float) -> None:
        """Drop leases confirmed ahead past their ticket's latest end, and the oldest past ``MAX_CLAIMED_AHEAD``."""
        while len(self._ahead) > MAX_CLAIMED_AHEAD or (self._ahead and next(iter(self._ahead.values()))[2] <= now):
            self._ahead.popitem(last=False)

    def early_count(self) -> int:
        return len(self.early)

    def stream_reg_count(self) -> int:
        """Concurrent-push registrations kept for requests not leased or streaming here yet."""
        return len(self.regs)

    def add(self, rid: str, send: SendLease) -> list[EarlyMessage]:
        """Lease request ``rid``'s blocks (this step's metadata); returns the messages that came early for it (the
        caller applies them as if they came now)."""
        now = self._clock()
        lease = Lease(send.block_ids, send.grant, now + send.lease_s, now + send.lease_s + send.max_extension_s)
        self.leases[rid] = lease
        self._ended.pop(rid, None)
        ahead = self._ahead.pop(rid, None)
        if ahead is not None and hmac.compare_digest(ahead[1], send.grant):
            lease.holder = ahead[0]  # confirmed from its ticket before this worker was told of it
        if send.cap and send.cap not in self._streaming:
            lease.cap = send.cap
            self._by_cap[send.cap] = rid
            got = self.regs.pop(send.cap)
            if got is not None:
                self._register(rid, lease, got)
            elif self.regs.gone(send.cap):  # its decode registered and stopped waiting: nothing will be written
                log.warning("hybrid-kv %s: %s's decode stopped waiting before it finished; not pushed", self.name, rid)
                lease.given_up = True
        return self.early.take(rid)

    def drop(self, rid: str) -> None:
        """Forget ``rid`` (aborted, freed or pushed): a later claim for it is refused."""
        lease = self.leases.pop(rid, None)
        if lease is None:
            return
        if lease.cap:
            self._by_cap.pop(lease.cap, None)
        self._ended[rid] = None
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)

    def on_message(self, sender: str, msg: Control, raw: bytes) -> str | None:
        """Apply a control message from authenticated ``sender`` (``raw``: its wire bytes, kept if it is early);
        the reason it was refused, or ``None``."""
        if isinstance(msg, StreamReg):
            return self._on_stream_reg(sender, msg, raw)
        if not isinstance(msg, Release | Renew | PushReg):
            return f"{type(msg).__name__} is not a message for a prefill lease"
        rid = msg.p_req if isinstance(msg, PushReg) else msg.req
        lease = self.leases.get(rid)
        if lease is None:
            self.early.keep(sender, raw, {rid})
            return None
        if not hmac.compare_digest(lease.grant, msg.grant):
            return f"{type(msg).__name__} for {rid!r} carries another grant than its ticket's"
        engine = msg.engine if isinstance(msg, PushReg) else engine_of(sender)
        if isinstance(msg, PushReg) and rank_of(sender, msg.engine, msg.tp) is None:
            return f"push registration for {rid!r} names engine {msg.engine!r} (TP {msg.tp}) but comes from {sender!r}"
        if lease.holder is not None and lease.holder != engine:
            return f"{type(msg).__name__} for {rid!r} from engine {engine!r}; the lease is held by {lease.holder!r}"
        lease.holder = engine
        if isinstance(msg, Release):
            lease.consumers = max(lease.consumers, msg.consumers)
            if len(lease.released) < lease.consumers:
                lease.released.add(sender)
        elif isinstance(msg, Renew):
            now = self._clock()
            until = min(lease.max_expiry, now + (msg.until - self._wall()))
            if until > lease.expiry:
                lease.expiry = until
                lease.renewals += 1
        elif lease.push is None:
            lease.push = msg
            lease.push_until = msg.until
        return None

    def claim(self, engine: str, entry: ClaimEntry) -> Lease | str | None:
        """Confirm ``entry``'s lease for decode engine ``engine``: the lease (now held by ``engine``), the reason it
        is refused, or ``None`` when it is not leased here yet (the caller keeps the claim early)."""
        lease = self.leases.get(entry.req)
        if lease is None:
            if entry.req in self._ended:
                return f"no lease of {entry.req!r} here: it ended"
            return self._claim_ahead(engine, entry) if entry.ticket and self._tickets is not None else None
        if not hmac.compare_digest(lease.grant, entry.grant):
            return f"claim of {entry.req!r} carries another grant than its ticket's"
        if lease.holder is not None and lease.holder != engine:
            return f"claim of {entry.req!r} from engine {engine!r}; the lease is held by {lease.holder!r}"
        left = lease.expiry - self._clock()
        if left <= LEASE_MARGIN_S:
            return f"the lease of {entry.req!r} ends in {max(0.0, left):.1f} s, too soon to read"
        lease.holder = engine
        return lease

    def _claim_ahead(self, engine: str, entry: ClaimEntry) -> Lease | str:
        """Confirm a lease this worker has not been told of yet from its ticket, which this engine's scheduler
        signed when it finished the request (its blocks stay held until this worker frees them): the claim's grant
        and request must be the ticket's, the ticket this engine's, with more than ``LEASE_MARGIN_S`` left. The
        engine claiming it becomes its holder when the lease comes (``add``)."""
        assert self._tickets is not None
        try:
            ticket = self._tickets.open(entry.ticket)
        except TicketError as exc:
            return f"claim of {entry.req!r}: {exc}"
        if ticket.request_id != entry.req or not hmac.compare_digest(ticket.grant, entry.grant):
            return f"claim of {entry.req!r} carries another request's ticket"
        if self.engine_id is not None and ticket.engine_id != self.engine_id:
            return f"claim of {entry.req!r} carries engine {ticket.engine_id!r}'s ticket"
        ahead = self._ahead.get(entry.req)
        if ahead is not None and ahead[0] != engine:
            return f"claim of {entry.req!r} from engine {engine!r}; the lease is held by {ahead[0]!r}"
        left = ticket.expires_at - self._wall()
        if left <= LEASE_MARGIN_S:
            return f"the lease of {entry.req!r} ends in {max(0.0, left):.1f} s, too soon to read"
        now = self._clock()
        self._ahead[entry.req] = (engine, ticket.grant, now + (ticket.max_expires_at - self._wall()))
        self._forget_ahead(now)
        return Lease(ticket.block_ids, ticket.grant, now + left, now + left, holder=engine)

    def expires_at(self, lease: Lease) -> float:
        """``lease``'s end on the wall clock (what a decode compares its read's end with)."""
        return self._wall() + (lease.expiry - self._clock())

    def take_due(self) -> list[tuple[str, bool]]:
        """Requests whose blocks may be freed now: ``(rid, expired)`` (``expired``: no full release in time).
        A registered push request is not freed here (the push frees it) unless it is still here at the lease's
        maximum (``max_extension_s`` past its end: this worker's own handshake to the decode may be running)."""
        now = self._clock()
        out = []
        for rid, lease in list(self.leases.items()):
            if lease.consumers and len(lease.released) >= lease.consumers and lease.push is None:
                out.append((rid, False))
            elif lease.given_up and lease.push is None:
                out.append((rid, False))
            elif now >= (lease.expiry if lease.push is None else lease.max_expiry):  # a registered push is ours
                out.append((rid, True))
            else:
                continue
            self.drop(rid)
        self.regs.expire()
        return out

    def registered(self) -> list[tuple[str, Lease, PushReg]]:
        """Leased requests with a push registration (push mode)."""
        return [(rid, lease, lease.push) for rid, lease in self.leases.items() if lease.push is not None]

    # ------------------------------------------------------------------ concurrent push

    def stream_reg(self, cap: bytes) -> StreamReg | None:
        """The registration kept for capability ``cap`` (not taken), if any."""
        return self.regs.get(cap)

    def take_stream(self, cap: bytes) -> StreamReg | None:
        """Take ``cap``'s registration to stream its request now: later registrations from another engine are
        refused until ``end_stream``."""
        reg = self.regs.pop(cap)
        if reg is not None:
            self._streaming[cap] = reg.engine
        return reg

    def end_stream(self, cap: bytes) -> None:
        """The request streaming with ``cap`` ended (its transfers and its lease)."""
        self._streaming.pop(cap, None)

    def _on_stream_reg(self, sender: str, msg: StreamReg, raw: bytes) -> str | None:
        what = f"stream registration for capability {msg.cap.hex()[:8]}..."
        if rank_of(sender, msg.engine, msg.tp) is None:
            return f"{what} names engine {msg.engine!r} (TP {msg.tp}) but comes from {sender!r}"
        engine = self._streaming.get(msg.cap)
        if engine is not None:  # its request streams to the engine that registered first
            return None if engine == msg.engine else f"{what} from engine {msg.engine!r}; it streams to {engine!r}"
        rid = self._by_cap.get(msg.cap)
        lease = None if rid is None else self.leases.get(rid)
        if rid is not None and lease is not None:
            return self._register(rid, lease, msg)
        return self.regs.offer(msg, raw)

    def _register(self, rid: str, lease: Lease, msg: StreamReg) -> str | None:
        """``msg`` as the push registration of leased request ``rid`` (whole-request push)."""
        if lease.holder is not None and lease.holder != msg.engine:
            return f"stream registration for {rid!r} from engine {msg.engine!r}; the lease is held by {lease.holder!r}"
        lease.holder = msg.engine
        if lease.push is None:
            lease.push_until = msg.until
            lease.push = PushReg(
                p_req=rid,
                grant=lease.grant,
                d_req=msg.d_req,
                ids=msg.ids,
                engine=msg.engine,
                host=msg.host,
                port=msg.port,
                tp=msg.tp,
                until=msg.until,
                verify=msg.verify,
                instance=msg.instance,
            )
        return None
