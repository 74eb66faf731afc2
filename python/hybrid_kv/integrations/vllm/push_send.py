"""``PushSend``: the prefill side of push: WRITE each finished request into the decode blocks registered for it.

A leased request with a registration (``PushReg``, or a ``StreamReg`` its lease adopted) is planned and posted once
this worker's link to the decode engine is up, then every decode rank it pairs with is told whether this rank
writes to it (``PushPlan``). Nothing is posted for a registration whose decode stops waiting within
``LEASE_MARGIN_S + MIN_PUSH_S`` (``until``, wall clock), and the WRITEs' deadline ends ``LEASE_MARGIN_S`` before
it, so no byte lands after the decode may have given its blocks back (``push_recv``). With ``verify`` this rank
digests its side before posting; the digest rides in its done-notices and its payload and ids in its
``PushPlan``, from which the decode rebuilds the moves.
"""

from __future__ import annotations

import logging
import time

from ...connector_core import control
from ...connector_core.control import worker_name
from ...connector_core.leases import LeaseBook, push_deadline
from ...connector_core.params import host_allowed
from ...transport import TransferError
from ...verify import initiator_digests
from .links import Links, Parked
from .state import Job, Registered

__all__ = ["PushSend"]

log = logging.getLogger("hybrid_kv.integrations.vllm.worker")


class PushSend:
    """Whole-request pushes of one registered prefill worker ``reg`` (its step thread only)."""

    def __init__(self, reg: Registered, leases: LeaseBook, links: Links) -> None:
        self.reg = reg
        self.leases = leases
        self.links = links

    def match(self) -> None:
        """WRITE every request that finished here and has a decode registration (its link permitting)."""
        reg = self.reg
        for p_req, lease, push in self.leases.registered():
            try:
                if not any(push.ids):
                    self._done(p_req)
                    continue
                if not host_allowed(push.host, reg.networks):
                    raise TransferError(f"decode host {push.host!r} is outside the allowed peer networks")
                deadline = push_deadline(lease.push_until, reg.cfg.transfer_timeout_s)
                if deadline is None:  # the decode stopped waiting (or is about to): its blocks are not ours
                    log.warning("hybrid-kv %s: %s's decode %s stopped waiting; not pushed", reg.name, p_req, push.d_req)
                    reg.stats.count("num_late_registrations")
                    self._done(p_req)
                    continue
                parked = Parked(
                    p_req,
                    time.monotonic() + reg.cfg.transfer_timeout_s,
                    lambda link: None,  # ``match`` finds the link at its next call
                    lambda why, p_req=p_req: self.fail(p_req, why),  # type: ignore[misc]
                )
                link = self.links.link(push.engine, push.host, push.port, push.tp, parked)
                if link is None:
                    continue  # handshake in the background; pushed on a later step
                self.leases.drop(p_req)
                transfers = link.transfers(lease.block_ids, push.ids)
                writers = {link.rank_of(t.peer) for t in transfers}
                if transfers:
                    digests = None
                    if push.verify:  # the decode checks: digest this side before posting
                        algo = self.links.algos.get(link.engine_id, "xxh3")
                        mine = initiator_digests(reg.digester, link.plan, transfers, link.rank_of, algo)
                        digests = {peer: d.digest for peer, d in mine.items()}
                    t0 = time.perf_counter()
                    handle = link.ep.post(push.d_req, transfers, "WRITE", deadline, digests=digests)
                    reg.stats.add_time("worker_post_s", time.perf_counter() - t0)
                    nids = sum(int(t.local_ids.size) for t in transfers)
                    reg.inflight[push.d_req] = Job(self, p_req, link, transfers, handle, nids, lease.block_ids)
                else:
                    reg.completion.sent(p_req)
                verify = push.verify
                plans = {
                    r: control.encode(
                        control.PushPlan(
                            d_req=push.d_req,
                            writes=r in writers,
                            payload=reg.payload if verify else b"",
                            coalesce=reg.cfg.coalesce,
                            ids=lease.block_ids if verify else [],
                        )
                    )
                    for r in link.targets
                }
                reg.outbox.send(
                    ((link.addresses[r], plans[r], worker_name(link.engine_id, r)) for r in link.targets),
                    deadline=time.monotonic() + deadline,
                )
            except Exception as exc:  # noqa: BLE001 - a failed push frees the blocks and is counted
                self.fail(p_req, f"to {push.d_req}: {exc}")

    def finish(self, job: Job, err: TransferError | None) -> None:
        """The WRITEs of ``job`` ended: the prefill request's blocks may be freed either way."""
        if err is None:
            job.record(self.reg.stats)
        else:
            log.error("hybrid-kv %s: pushing %s failed: %s", self.reg.name, job.request_id, err)
            self.reg.stats.count("num_failed_transfers")
        self.reg.completion.sent(job.request_id)

    def fail(self, p_req: str, reason: str) -> None:
        """Nothing of ``p_req`` is posted and nothing will be: its blocks may be freed."""
        log.error("hybrid-kv %s: push of %s failed: %s", self.reg.name, p_req, reason)
        self.reg.stats.count("num_failed_transfers")
        self._done(p_req)

    def _done(self, p_req: str) -> None:
        self.leases.drop(p_req)
        self.reg.completion.sent(p_req)
