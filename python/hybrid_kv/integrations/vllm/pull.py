"""``PullRecv``: the decode side of pull: claim each request's lease, READ it, release the prefill's blocks.

For each request with a verified ticket, once the link to its prefill engine is up (``links``), the rank plans
its transfers and claims the lease from every prefill rank it reads from (``claims``: one ``Claim`` per prefill
rank per step for all the requests started in it). The READ is posted only once every rank answered ``ok``, so
the rank never reads blocks the prefill no longer holds for it (a replayed ticket, an ended lease), and it must
end ``LEASE_MARGIN_S`` before the earliest lease end the answers gave. With ``verify`` each prefill rank answers
``ok`` at once and sends its digest in a second answer while the READ runs; once the READ landed this rank digests
what landed and compares, waiting for a digest still on its way (the transport asks the check again at every poll,
until the transfer timeout), before the request is reported done.
When the READ ended (or failed, or there was nothing to read), a ``Release`` goes to every prefill rank it
claimed from. A claim refused, lost (never acknowledged) or unanswered within ``transfer_timeout_s`` fails the
request alone (vLLM's ``kv_load_failure_policy``).

A request still waiting for its handshake renews its lease (``control.Renew``, up to the ticket's latest end), so
a slow first handshake does not lose the blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..._core import handshake_target_ranks
from ...claims import ClaimAnswers, ClaimBatcher, ClaimEntry, claim_messages
from ...connector_core import control
from ...connector_core.control import worker_name
from ...connector_core.leases import LEASE_MARGIN_S, renewal_until
from ...peer_link import PeerLink
from ...transport import CheckVerdict, Transfer, TransferError
from ...transport.courier import Delivery
from ...verify import pull_check
from .links import Links, Parked
from .metadata import RecvReq
from .state import Job, Registered

__all__ = ["PullRecv"]

log = logging.getLogger("hybrid_kv.integrations.vllm.worker")


@dataclass
class Answer:
    """A prefill rank's claim answer: ok, why not, its lease's end (wall clock), and its digest (``follows``: still
    on its way)."""

    ok: bool
    error: str
    expires_at: float
    digest: int | None
    follows: bool = False


def lease_over(expires_at: float | None) -> bool:
    """Whether a prefill lease ending at ``expires_at`` (wall clock) is over, less ``LEASE_MARGIN_S``."""
    return expires_at is not None and time.time() > expires_at - LEASE_MARGIN_S


@dataclass
class PullWait:
    """A request whose claims are out: the ranks asked (name -> rank), those it reads from (whose digests a verified
    request compares) and what each answered."""

    req: RecvReq
    link: PeerLink
    transfers: list[Transfer]
    names: dict[str, int]
    read: set[int]
    deadline: float  # monotonic
    algo: str
    answers: dict[int, Answer] = field(default_factory=dict)
    queued: float = field(default_factory=time.perf_counter)


class PullRecv:
    """Pull requests of one registered decode worker ``reg`` (its step thread only)."""

    def __init__(self, reg: Registered, links: Links) -> None:
        self.reg = reg
        self.links = links
        self.waits: dict[str, PullWait] = {}  # decode request id -> its claims
        self.digests_due: dict[str, PullWait] = {}  # decode request id -> its claims, READ posted, a digest to come
        self._claims = ClaimBatcher()
        self._renewing: dict[str, tuple[int, float, RecvReq]] = {}  # request -> (acks due, lease end asked, it)

    # ------------------------------------------------------------------ starting

    def start(self, req: RecvReq) -> None:
        """Load ``req`` (a release-only request only releases); never raises."""
        if req.release_only:
            self._send_releases(req, handshake_target_ranks(self.reg.tp_rank, self.reg.tp_size, req.remote_tp_size))
            self.reg.completion.received(req.request_id)
            return
        parked = Parked(
            req.request_id,
            time.monotonic() + self.reg.cfg.transfer_timeout_s,
            lambda link: self._claim(req, link),
            lambda why: self.fail(req, why),
            extra=req,
        )
        link = self.links.link(req.remote_engine_id, req.remote_host, req.remote_port, req.remote_tp_size, parked)
        if link is not None:
            self._claim(req, link)

    def _claim(self, req: RecvReq, link: PeerLink) -> None:
        """Plan ``req`` and queue its claims (sent by ``flush``); any error fails exactly this request."""
        try:
            transfers: list[Transfer] = []
            if any(req.local_block_ids) and any(req.remote_block_ids):
                transfers = link.transfers(req.local_block_ids, req.remote_block_ids)
            if not transfers:
                self.reg.completion.received(req.request_id)
                self._send_releases(req, link.targets)
                return
            if lease_over(req.lease_expires_at):
                raise TransferError(f"the prefill engine's lease on {req.remote_request_id!r} expired before the read")
            names = {worker_name(link.engine_id, r): r for r in link.targets}
            ids = req.local_block_ids if req.verify else []
            entry = ClaimEntry(req.remote_request_id, req.grant, req.request_id, ids, req.verify, req.ticket)
            # every rank holding the request confirms its lease; only those it reads from owe a digest
            plain = ClaimEntry(req.remote_request_id, req.grant, req.request_id, [], False, req.ticket)
            read = {link.rank_of(t.peer) for t in transfers}
            for name, r in names.items():
                self._claims.add(link.addresses[r], name, entry if r in read else plain)
            algo = self.links.algos.get(link.engine_id, "xxh3")
            deadline = time.monotonic() + self.reg.cfg.transfer_timeout_s
            self.waits[req.request_id] = PullWait(req, link, transfers, names, read, deadline, algo)
        except Exception as exc:  # noqa: BLE001 - report, never crash a step
            self.fail(req, str(exc))

    def flush(self) -> None:
        """Send the claims queued this step: one message per prefill rank (more if they would not fit one)."""
        if not self._claims:
            return
        reg = self.reg
        for (address, to), entries in self._claims.take().items():
            waits = [self.waits[e.d_req] for e in entries if e.d_req in self.waits]
            algo = waits[0].algo if waits else "xxh3"
            for msg in claim_messages(
                entries, reg.engine_id, reg.cfg.advertise_host, reg.port, reg.payload, reg.cfg.coalesce, algo
            ):
                rids = tuple(e.d_req for e in entries)
                reg.outbox.send([(address, msg, to)], tag=("claim", rids))

    # ------------------------------------------------------------------ answers

    def on_answers(self, sender: str, msg: ClaimAnswers) -> None:
        """A prefill rank's claim answers: only the ranks asked answer, once each (and once more with the digest
        they said follows); the READ is posted once all answered ``ok``."""
        for res in msg.results:
            wait = self.waits.get(res.d_req) or self.digests_due.get(res.d_req)
            rank = None if wait is None else wait.names.get(sender)
            if wait is None or rank is None:
                self.reg.refused(sender, f"claim answer for {res.d_req!r}, which awaits none from this sender")
                continue
            digest = int(res.digest, 16) if res.digest else None
            prev = wait.answers.get(rank)
            if prev is not None:  # a repeat (its sender may send again when an ack was late), or the digest owed
                if prev.follows and res.ok and not res.follows:
                    prev.digest, prev.error, prev.follows = digest, res.error, False
                continue
            if wait is not self.waits.get(res.d_req):  # a first answer after the READ was posted: none is due
                continue
            engine = wait.link.engine_id
            if res.ok and self.links.stale(engine, rank, msg.instance):
                self.links.drop(engine, f"rank {rank} is a new instance ({msg.instance})")
            if self.links.links.get(engine) is not wait.link:
                # the rank restarted since we linked (or the link was dropped meanwhile): link again, then claim
                # again (the instance answering holds the lease for this engine: it answers the same)
                del self.waits[res.d_req]
                self.start(wait.req)
                continue
            wait.answers[rank] = Answer(res.ok, res.error, res.expires_at, digest, res.ok and res.follows)
            if len(wait.answers) == len(wait.names):
                del self.waits[res.d_req]
                self._read(wait)

    def _read(self, wait: PullWait) -> None:
        self.reg.stats.record_claim(time.perf_counter() - wait.queued)
        req = wait.req
        refused = {r: a.error for r, a in wait.answers.items() if not a.ok}
        if refused:
            self.reg.stats.count("num_refused_claims")
            self.fail(req, f"prefill ranks refused the claim: {refused}", wait.link, claimed=False)
            return
        missing = {
            r: a.error
            for r, a in wait.answers.items()
            if req.verify and r in wait.read and a.digest is None and not a.follows
        }
        if missing:  # nothing to compare with: fail now instead of reading
            self.reg.stats.count("num_digest_mismatches")
            self.fail(req, f"no digest from prefill ranks {missing} (nothing read)", wait.link)
            return
        ends = [a.expires_at for a in wait.answers.values()]
        expires_at = min(ends) if ends else req.lease_expires_at
        if lease_over(expires_at):
            self.fail(req, f"the prefill engine's lease on {req.remote_request_id!r} ends too soon to read", wait.link)
            return
        check = self._check(wait) if req.verify else None
        reg = self.reg
        try:
            t0 = time.perf_counter()
            handle = wait.link.ep.post(req.request_id, wait.transfers, "READ", reg.cfg.transfer_timeout_s, check=check)
            reg.stats.add_time("worker_post_s", time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - report, never crash a step
            self.fail(req, str(exc), wait.link)
            return
        if any(a.follows for a in wait.answers.values()):
            self.digests_due[req.request_id] = wait
        nids = sum(int(t.local_ids.size) for t in wait.transfers)
        extra = (req, expires_at)
        reg.inflight[req.request_id] = Job(
            self, req.request_id, wait.link, wait.transfers, handle, nids, req.local_block_ids, extra=extra
        )

    def _check(self, wait: PullWait) -> Callable[[], str | None | CheckVerdict]:
        """The check run once a verified READ is done: this rank's digest of what landed against each prefill
        rank's (from its second claim answer, waited for); a mismatch is the request's failure reason."""
        stats = self.reg.stats

        def theirs(rank: int) -> tuple[int | None, str] | None:
            a = wait.answers.get(rank)
            if a is None:
                return None, "no answer"
            return None if a.follows else (a.digest, a.error)

        def counted(reason: str | None) -> None:
            stats.count("num_verified_transfers")
            if reason is not None:
                stats.count("num_digest_mismatches")

        link = wait.link
        return pull_check(
            self.reg.digester,
            link.plan,
            wait.transfers,
            link.rank_of,
            wait.algo,
            theirs,
            self.reg.tp_rank,
            on_result=counted,
        )

    # ------------------------------------------------------------------ endings

    def finish(self, job: Job, err: TransferError | None) -> None:
        """The READ of ``job`` ended (``err``: how it failed)."""
        req, expires_at = job.extra
        self.digests_due.pop(job.request_id, None)
        if err is None and lease_over(expires_at):
            # the bytes may come from blocks the prefill engine freed and reused: not a valid load
            err = TransferError(f"read of {job.request_id!r} ended after the prefill engine's lease expired")
        if err is None:
            job.record(self.reg.stats)
            self.reg.completion.received(job.request_id)
        else:
            log.error("hybrid-kv %s: loading %s failed: %s", self.reg.name, job.request_id, err)
            self.reg.completion.recv_failed(job.request_id, job.local_ids, err.failed, job.link)
        if job.link is not None:
            self._send_releases(req, job.link.targets)

    def fail(self, req: RecvReq, reason: str, link: PeerLink | None = None, *, claimed: bool = True) -> None:
        """``req`` cannot load (nothing of it is posted): it fails alone; the prefill ranks it claimed from are
        told to free its blocks (``claimed``: its claims may have been confirmed)."""
        self.waits.pop(req.request_id, None)
        self.digests_due.pop(req.request_id, None)
        log.error("hybrid-kv %s: request %s cannot load: %s", self.reg.name, req.request_id, reason)
        self.reg.completion.recv_failed(req.request_id, req.local_block_ids)
        if claimed and link is not None and req.grant:
            self._send_releases(req, link.targets)

    def on_delivery(self, d: Delivery) -> None:
        """A claim message that was never acknowledged: no answer can come, so its requests fail now; a renewal's
        acknowledgement (or loss)."""
        kind = d.tag[0] if isinstance(d.tag, tuple) else None
        if kind == "claim" and not d.delivered:
            for rid in d.tag[1]:  # type: ignore[index]
                wait = self.waits.pop(rid, None)
                if wait is not None:
                    self.fail(wait.req, d.reason, wait.link)
        elif kind == "renew":
            self._on_renewed(d)

    def expire(self) -> None:
        """Fail requests whose claims were not all answered within ``transfer_timeout_s``; renew the leases of
        requests still waiting for their handshake."""
        now = time.monotonic()
        for wait in list(self.waits.values()):
            if now >= wait.deadline:
                missing = sorted(set(wait.names.values()) - set(wait.answers))
                self.fail(
                    wait.req, f"no claim answer from prefill ranks {missing} within the transfer timeout", wait.link
                )
        self._renew_parked()

    # ------------------------------------------------------------------ releases and renewals

    def _send_releases(self, req: RecvReq, ranks: list[int]) -> None:
        if not req.grant:
            return
        consumers = max(1, self.reg.tp_size // req.remote_tp_size)
        msg = control.encode(control.Release(req=req.remote_request_id, grant=req.grant, consumers=consumers))
        self.reg.outbox.send(
            (self.reg.address(req.remote_host, req.remote_port, r), msg, worker_name(req.remote_engine_id, r))
            for r in ranks
        )

    def _renew_parked(self) -> None:
        """Ask the prefill to extend the lease of requests still waiting for their handshake (``control.Renew``,
        carrying the ticket's grant, never past its ``max_lease_expires_at``); the request's lease moves only once
        every prefill rank it reads from acknowledged."""
        reg = self.reg
        wall = time.time()
        for p in self.links.parked():
            req = p.extra
            if not isinstance(req, RecvReq) or req.request_id in self._renewing or not req.grant:
                continue
            until = renewal_until(req.lease_expires_at, req.max_lease_expires_at, wall, reg.cfg.lease_s)
            if until is None:
                continue
            ranks = handshake_target_ranks(reg.tp_rank, reg.tp_size, req.remote_tp_size)
            self._renewing[req.request_id] = (len(ranks), until, req)
            msg = control.encode(control.Renew(req=req.remote_request_id, grant=req.grant, until=until))
            reg.outbox.send(
                (
                    (reg.address(req.remote_host, req.remote_port, r), msg, worker_name(req.remote_engine_id, r))
                    for r in ranks
                ),
                tag=("renew", req.request_id),
            )

    def _on_renewed(self, d: Delivery) -> None:
        rid = d.tag[1]  # type: ignore[index]
        due = self._renewing.get(rid)
        if due is None:
            return
        left, until, req = due
        if not d.delivered:  # a lost renewal leaves the lease as it was; never tried again for this request
            del self._renewing[rid]
            req.max_lease_expires_at = None
            log.warning("hybrid-kv %s: renewing the lease of %s failed: %s", self.reg.name, rid, d.reason)
            return
        if left > 1:
            self._renewing[rid] = (left - 1, until, req)
            return
        del self._renewing[rid]
        req.lease_expires_at = until
        self.reg.stats.count("num_lease_renewals")
        log.info("hybrid-kv %s: lease of %s renewed to %.1f s from now", self.reg.name, rid, until - time.time())
