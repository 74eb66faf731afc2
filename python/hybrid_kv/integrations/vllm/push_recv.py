"""``PushRecv``: the decode side of push: register the request's blocks, await the writers, and never let vLLM
reuse blocks a prefill may still write.

Each decode rank sends its block ids (``PushReg``, or ``StreamReg`` for a concurrent push) to the prefill ranks it
pairs with, each registration carrying ``until``: the wall-clock time at which the decode stops waiting
(``push_registration_timeout_s`` from now). A prefill rank answers with ``PushPlan`` (whether it writes here); the
rank then awaits exactly the writers' done-notices, until ``until`` plus ``LEASE_MARGIN_S``.

The guarantee: a prefill posts nothing for a registration with less than ``LEASE_MARGIN_S + MIN_PUSH_S`` left
before ``until``, and its WRITEs' deadline ends ``LEASE_MARGIN_S`` before it (``push_send``). So whenever this
rank gives a request up before its writers said they are done (a registration never acknowledged, which may still
have arrived; a writer that failed while another may still write; a deadline), the request fails but its blocks
stay held (``held``) until ``until + LEASE_MARGIN_S`` has passed: only then is it reported to vLLM, which may then
reuse the blocks. Failing early is fine; freeing early is not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..._core import handshake_target_ranks
from ...connector_core import control
from ...connector_core.control import worker_name
from ...connector_core.leases import LEASE_MARGIN_S
from ...transport import TransferError
from ...transport.courier import Delivery
from ...verify import algorithm, payload_mem_type, push_check
from .metadata import BlockIds, RecvReq
from .state import Job, Registered

__all__ = ["PushRecv"]

log = logging.getLogger("hybrid_kv.integrations.vllm.worker")


@dataclass
class PushWait:
    """A registered request awaiting its prefill ranks' plans."""

    req: RecvReq
    names: dict[str, int]  # writer name (NIXL agent) -> prefill rank
    until: float  # wall clock: the registrations' end
    answered: set[int] = field(default_factory=set)
    writers: set[str] = field(default_factory=set)
    # verified: writer -> (its payload, its coalesce setting, its block ids of the request)
    payloads: dict[str, tuple[bytes, bool, BlockIds]] = field(default_factory=dict)

    @property
    def free_at(self) -> float:
        """Monotonic time after which no write for this request can land any more."""
        return time.monotonic() + (self.until - time.time()) + LEASE_MARGIN_S


class PushRecv:
    """Push requests of one registered decode worker ``reg`` (its step thread only)."""

    def __init__(self, reg: Registered) -> None:
        self.reg = reg
        self.waits: dict[str, PushWait] = {}
        self.held: dict[str, tuple[float, BlockIds]] = {}  # failed, blocks held until then (monotonic)

    def start(self, req: RecvReq) -> None:
        """Register ``req``'s blocks with the prefill ranks it pairs with, then await them; never raises."""
        reg = self.reg
        try:
            targets = list(handshake_target_ranks(reg.tp_rank, reg.tp_size, req.remote_tp_size))
            ids = req.local_block_ids if any(req.local_block_ids) else []
            host, port = reg.cfg.advertise_host, reg.port - reg.tp_rank
            until = time.time() + reg.cfg.push_registration_timeout_s
            common = dict(
                d_req=req.request_id, ids=ids, engine=reg.engine_id, host=host, port=port, tp=reg.tp_size, until=until
            )
            msg: control.PushReg | control.StreamReg
            if req.cap:  # a concurrent push: the prefill request is named by the router's capability
                msg = control.StreamReg(cap=req.cap, verify=req.verify, instance=reg.instance, **common)  # type: ignore[arg-type]
            else:
                msg = control.PushReg(
                    p_req=req.remote_request_id,
                    grant=req.grant,
                    verify=req.verify,
                    instance=reg.instance,
                    **common,  # type: ignore[arg-type]
                )
            payload = control.encode(msg)
            regs = [
                (reg.address(req.remote_host, req.remote_port, r), payload, worker_name(req.remote_engine_id, r))
                for r in targets
            ]
            if not ids:  # nothing to receive: the prefill only learns that it may free its blocks
                reg.outbox.send(regs)
                reg.completion.received(req.request_id)
                return
            names = {worker_name(req.remote_engine_id, r): r for r in targets}
            self.waits[req.request_id] = PushWait(req, names, until)
            # a registration is of no use after its ``until``: never sent (or retried) later
            reg.outbox.send(regs, tag=("reg", req.request_id), deadline=time.monotonic() + (until - time.time()))
        except Exception as exc:  # noqa: BLE001 - nothing was sent: it fails at once
            log.error("hybrid-kv %s: request %s cannot load: %s", reg.name, req.request_id, exc)
            reg.completion.recv_failed(req.request_id, req.local_block_ids)

    def on_plan(self, sender: str, msg: control.PushPlan) -> None:
        """A prefill rank's answer to our registration: only the ranks registered with answer, once each, and the
        request completes only from the NIXL agents that said they write."""
        wait = self.waits.get(msg.d_req)
        rank = None if wait is None else wait.names.get(sender)
        if wait is None or rank is None:
            self.reg.refused(sender, f"push plan for {msg.d_req!r}, which awaits none from this sender")
            return
        if rank in wait.answered:  # a repeat (its sender may send again when an ack was late): the first counts
            return
        wait.answered.add(rank)
        if msg.writes:
            wait.writers.add(sender)
            wait.payloads[sender] = (msg.payload, msg.coalesce, msg.ids)
        if len(wait.answered) < len(wait.names):
            return
        del self.waits[msg.d_req]
        rid = wait.req.request_id
        if not wait.writers:
            self.reg.completion.received(rid)
            return
        check = self._check(wait) if wait.req.verify else None
        left = max(0.0, wait.until - time.time()) + LEASE_MARGIN_S
        try:
            self.reg.ep.expect(rid, left, writers=wait.writers, check=check)
        except Exception as exc:  # noqa: BLE001 - a duplicate id or a closed endpoint: fail, blocks held
            self._give_up(wait, f"awaiting its writers failed: {exc}")
            return
        self.reg.inflight[rid] = Job(self, rid, None, [], None, 0, wait.req.local_block_ids, extra=wait)

    def finish(self, job: Job, err: TransferError | None) -> None:
        """The awaited request ended: done (every writer's notices came), or failed (held while writes may land)."""
        wait: PushWait = job.extra
        if err is None:
            self.reg.completion.received(job.request_id)
            return
        self._give_up(wait, str(err), settled=err.settled)

    def on_delivery(self, d: Delivery) -> None:
        """A registration never acknowledged: no plan may come, so the request fails now (its blocks held)."""
        if not d.delivered and isinstance(d.tag, tuple) and d.tag[0] == "reg":
            wait = self.waits.pop(d.tag[1], None)
            if wait is not None:
                self._give_up(wait, d.reason)

    def expire(self) -> None:
        """Fail requests whose writers did not answer in time; report failed requests whose blocks are free now."""
        now_wall = time.time()
        for rid, wait in list(self.waits.items()):
            if now_wall >= wait.until:
                del self.waits[rid]
                self._give_up(wait, "no push within the registration timeout")
        now = time.monotonic()
        for rid, (free_at, ids) in list(self.held.items()):
            if now >= free_at:
                del self.held[rid]
                self.reg.completion.recv_failed(rid, ids)

    def _give_up(self, wait: PushWait, reason: str, settled: bool = False) -> None:
        """``wait``'s request failed: logged now, reported (its blocks freed) once no write can land any more:
        at once when ``settled`` (every writer landed or said it failed), else at the registration's end."""
        rid = wait.req.request_id
        self.waits.pop(rid, None)
        if settled:
            log.error(
                "hybrid-kv %s: request %s cannot load: %s (no write of it is in flight)", self.reg.name, rid, reason
            )
            self.reg.completion.recv_failed(rid, wait.req.local_block_ids)
            return
        free_at = wait.free_at
        log.error(
            "hybrid-kv %s: request %s cannot load: %s (its blocks are held %.1f s more, until no write can land)",
            self.reg.name,
            rid,
            reason,
            max(0.0, free_at - time.monotonic()),
        )
        self.reg.stats.count("num_held_requests")
        self.held[rid] = (free_at, wait.req.local_block_ids)

    def _check(self, wait: PushWait) -> Callable[[dict[str, int | None]], str | None]:
        """Push, ``verify``: the decode's check once the writers' bytes landed (``verify.push_check``): the moves
        rebuilt from each writer's ``PushPlan`` (a concurrent push's remote ids are the writer's word)."""
        reg = self.reg

        def writer(sender: str) -> tuple[int, bytes, bool, BlockIds]:
            payload, coalesce, their_ids = wait.payloads.get(sender, (b"", True, []))
            return wait.names[sender], payload, coalesce, wait.req.remote_block_ids or their_ids

        def counted(reason: str | None) -> None:
            reg.stats.count("num_verified_transfers")
            if reason is not None:
                reg.stats.count("num_digest_mismatches")

        return push_check(
            reg.mirrors,
            reg.digester,
            writer,
            wait.req.local_block_ids,
            reg.tp_rank,
            lambda payload: algorithm(reg.table.mem_type, payload_mem_type(payload)),
            on_result=counted,
        )
