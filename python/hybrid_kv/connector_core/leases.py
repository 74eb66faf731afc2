"""``LeaseBook``: a prefill worker's leased requests and what decode engines said about them, bounded.

A finished prefill request's blocks are leased to one decode engine (``SendLease``: the grant its ticket
carries). Control messages (``control``) act on a lease only when they carry its grant: a ``Release`` counts
its sender once (the blocks are freed once ``consumers`` ranks released), a ``Renew`` moves the expiry out,
never past ``max_extension_s`` beyond the lease, and the first ``PushReg`` sent by a rank of the engine it
names is the request's registration. Once one decode engine released, renewed or registered, messages from
workers of another engine are refused (a ticket is used by one decode engine).

Messages may arrive before their lease does (the decode can be quicker than this worker's next step):
they wait up to ``EARLY_TTL_S``, at most ``MAX_EARLY`` of them (the oldest dropped first), and are then
checked against the lease like any other.

Concurrent push: a decode's ``StreamReg`` names the prefill request by the capability the router gave both
requests (``params.STREAM_FIELD``), and it arrives before the request ends here, often before it even
started. One registration per capability is kept (the first; later ones from the same engine's other ranks
are ignored, any other engine's refused) until the request's last prefill step takes it to stream
(``take_stream``), or its lease (``SendLease.cap``) adopts it as its push registration, or ``stream_ttl_s``
passes. At most ``MAX_STREAM_REGS`` are kept, ``MAX_STREAM_REGS_PER_ENGINE`` per decode engine: past that a new
one is refused (one engine's clients cannot crowd out another's). Nothing else is kept: state is at most one
lease per request the scheduler leased, ``MAX_EARLY`` messages, ``MAX_STREAM_REGS`` registrations and one
capability per request streaming.
"""

from __future__ import annotations

import collections
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .control import Control, PushReg, Release, Renew, StreamReg, rank_of
from .metadata import BlockIds, SendLease

__all__ = [
    "EARLY_TTL_S",
    "MAX_EARLY",
    "MAX_STREAM_REGS",
    "MAX_STREAM_REGS_PER_ENGINE",
    "Lease",
    "LeaseBook",
    "renewal_until",
]

log = logging.getLogger("hybrid_kv.integrations.vllm.leases")

EARLY_TTL_S = 60.0
"""How long a control message for a request not (yet) leased here is kept."""
MAX_EARLY = 4096
"""Most such messages kept (all senders together)."""
MAX_STREAM_REGS = 4096
"""Most concurrent-push registrations kept for requests not leased (or streaming) here yet."""
MAX_STREAM_REGS_PER_ENGINE = 1024
"""The same, per decode engine."""


def renewal_until(expires_at: float | None, max_expires_at: float | None, now: float, lease_s: float) -> float | None:
    """Decode side: the lease end to ask for (``Renew.until``) for a request still waiting for its handshake,
    or ``None`` when no renewal is due (more than half of ``lease_s`` left, the ticket's maximum reached, or
    the lease already over: the prefill may have freed the blocks). Wall-clock times."""
    if expires_at is None or max_expires_at is None or not now < expires_at < max_expires_at:
        return None
    if expires_at - now > lease_s / 2:
        return None
    return min(max_expires_at, now + lease_s)


def _engine_of(sender: str) -> str:
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
    push_until: float | None = None  # a concurrent push's registration: the decode waits until then (wall)


class LeaseBook:
    """Leases of one prefill worker (``name``, for logs); ``clock`` is monotonic, ``wall`` the wall clock."""

    def __init__(
        self,
        name: str,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        stream_ttl_s: float = EARLY_TTL_S,
    ) -> None:
        self.name = name
        self._clock = clock
        self._wall = wall
        self.stream_ttl_s = stream_ttl_s
        self.leases: dict[str, Lease] = {}
        self._early: collections.deque[tuple[float, str, Release | Renew | PushReg]] = collections.deque()
        self._early_dropped = 0
        self._by_cap: dict[bytes, str] = {}  # capability -> leased request
        self._regs: collections.OrderedDict[bytes, tuple[float, StreamReg]] = collections.OrderedDict()
        self._regs_per_engine: collections.Counter[str] = collections.Counter()
        self._streaming: dict[bytes, str] = {}  # capability -> engine, of requests streaming now

    def __len__(self) -> int:
        return len(self.leases)

    def early_count(self) -> int:
        return len(self._early)

    def stream_reg_count(self) -> int:
        """Concurrent-push registrations kept for requests not leased or streaming here yet."""
        return len(self._regs)

    def add(self, rid: str, send: SendLease) -> None:
        """Lease request ``rid``'s blocks (this step's metadata), then apply the messages that came early."""
        now = self._clock()
        lease = Lease(send.block_ids, send.grant, now + send.lease_s, now + send.lease_s + send.max_extension_s)
        self.leases[rid] = lease
        if send.cap and send.cap not in self._streaming:
            lease.cap = send.cap
            self._by_cap[send.cap] = rid
            got = self._pop_reg(send.cap)
            if got is not None:
                self._register(rid, lease, got)
        early = [m for m in self._early if self._req_of(m[2]) == rid]
        if early:
            self._early = collections.deque(m for m in self._early if self._req_of(m[2]) != rid)
            for _, sender, msg in early:
                self.on_message(sender, msg)

    def drop(self, rid: str) -> None:
        """Forget ``rid`` (aborted, freed or pushed)."""
        lease = self.leases.pop(rid, None)
        if lease is not None and lease.cap:
            self._by_cap.pop(lease.cap, None)

    def on_message(self, sender: str, msg: Control) -> str | None:
        """Apply a control message from authenticated ``sender``; the reason it was refused, or ``None``."""
        if isinstance(msg, StreamReg):
            return self._on_stream_reg(sender, msg)
        if not isinstance(msg, Release | Renew | PushReg):  # verification messages are the worker's
            return f"{type(msg).__name__} is not a message for a prefill lease"
        rid = self._req_of(msg)
        lease = self.leases.get(rid)
        if lease is None:
            self._keep_early(sender, msg)
            return None
        if not hmac.compare_digest(lease.grant, msg.grant):
            return f"{type(msg).__name__} for {rid!r} carries another grant than its ticket's"
        engine = msg.engine if isinstance(msg, PushReg) else _engine_of(sender)
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
        return None

    def take_due(self) -> list[tuple[str, bool]]:
        """Requests whose blocks may be freed now: ``(rid, expired)`` (``expired``: no full release in time).
        A registered push request is not freed here (the push frees it) unless it is still here at the lease's
        maximum (``max_extension_s`` past its end: this worker's own handshake to the decode may be running)."""
        now = self._clock()
        out = []
        for rid, lease in list(self.leases.items()):
            if lease.consumers and len(lease.released) >= lease.consumers and lease.push is None:
                out.append((rid, False))
            elif now >= (lease.expiry if lease.push is None else lease.max_expiry):  # a registered push is ours
                out.append((rid, True))
            else:
                continue
            self.drop(rid)
        self._expire_early(now)
        return out

    def registered(self) -> list[tuple[str, Lease, PushReg]]:
        """Leased requests with a push registration (push mode)."""
        return [(rid, lease, lease.push) for rid, lease in self.leases.items() if lease.push is not None]

    # ------------------------------------------------------------------ concurrent push

    def stream_reg(self, cap: bytes) -> StreamReg | None:
        """The registration kept for capability ``cap`` (not taken), if any."""
        got = self._regs.get(cap)
        return None if got is None or got[0] <= self._clock() else got[1]

    def take_stream(self, cap: bytes) -> StreamReg | None:
        """Take ``cap``'s registration to stream its request now: later registrations from another engine are
        refused until ``end_stream``."""
        reg = self.stream_reg(cap)
        if reg is not None:
            self._pop_reg(cap)
            self._streaming[cap] = reg.engine
        return reg

    def end_stream(self, cap: bytes) -> None:
        """The request streaming with ``cap`` ended (its transfers and its lease)."""
        self._streaming.pop(cap, None)

    def _on_stream_reg(self, sender: str, msg: StreamReg) -> str | None:
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
        now = self._clock()
        self._expire_regs(now)
        kept = self._regs.get(msg.cap)
        if kept is not None:
            return None if kept[1].engine == msg.engine else f"{what} from {msg.engine!r}; {kept[1].engine!r} was first"
        if len(self._regs) >= MAX_STREAM_REGS or self._regs_per_engine[msg.engine] >= MAX_STREAM_REGS_PER_ENGINE:
            return (
                f"{what} refused: {len(self._regs)} kept ({self._regs_per_engine[msg.engine]} of engine "
                f"{msg.engine!r}; at most {MAX_STREAM_REGS}, {MAX_STREAM_REGS_PER_ENGINE} per engine)"
            )
        self._regs[msg.cap] = (now + self.stream_ttl_s, msg)
        self._regs_per_engine[msg.engine] += 1
        return None

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
            )
        return None

    def _pop_reg(self, cap: bytes) -> StreamReg | None:
        got = self._regs.pop(cap, None)
        if got is None:
            return None
        self._uncount(got[1].engine)
        return None if got[0] <= self._clock() else got[1]

    def _uncount(self, engine: str) -> None:
        self._regs_per_engine[engine] -= 1
        if self._regs_per_engine[engine] <= 0:
            del self._regs_per_engine[engine]

    def _expire_regs(self, now: float) -> None:
        while self._regs:  # one TTL for all: insertion order is expiry order
            cap, (expiry, reg) = next(iter(self._regs.items()))
            if expiry > now:
                break
            del self._regs[cap]
            self._uncount(reg.engine)

    # ------------------------------------------------------------------ early messages

    @staticmethod
    def _req_of(msg: Release | Renew | PushReg) -> str:
        return msg.p_req if isinstance(msg, PushReg) else msg.req

    def _keep_early(self, sender: str, msg: Release | Renew | PushReg) -> None:
        now = self._clock()
        self._expire_early(now)
        self._early.append((now + EARLY_TTL_S, sender, msg))
        if len(self._early) > MAX_EARLY:
            self._early.popleft()
            self._early_dropped += 1
            if self._early_dropped == 1 or self._early_dropped % 1024 == 0:
                log.warning(
                    "hybrid-kv %s: %d control messages for requests not leased here dropped (at most %d kept)",
                    self.name,
                    self._early_dropped,
                    MAX_EARLY,
                )

    def _expire_early(self, now: float) -> None:
        while self._early and self._early[0][0] <= now:
            self._early.popleft()
        self._expire_regs(now)
