"""The worker half: registers the KV caches, dispatches control messages, drives progress, reports completion.

Each worker owns one endpoint, so one NIXL agent and one registration of its KV cache: it serves its handshake
metadata on its side channel, receives notices and control messages, and posts transfers. The protocols live in
one module per role, all sharing the ``state.Registered`` state built at registration:

- ``links``: links to peer engines (handshakes in the background, dead or restarted peers linked again);
- ``pull`` (decode, pull): claim each request's lease (``claims``), READ, release;
- ``claim_server`` (prefill, pull): answer claims, with digests when asked;
- ``push_recv`` (decode, push): register blocks, await the writers, hold failed requests' blocks until no write
  can land;
- ``push_send`` (prefill, push): WRITE finished requests into registered decode blocks;
- ``stream_send`` (prefill, concurrent push): post each layer's KV during the last prefill forward;
- ``leases`` (prefill): leases, early messages and concurrent-push registrations, bounded.

Control messages go out through the endpoint's courier (``outbox``): off the step, in order per destination,
retried, each with a deadline. Reading order for a newcomer: this file, then ``state``, ``links``, ``pull`` and
``claim_server``, then the push modules. Nothing here raises into vLLM for any input: every hook turns what goes
wrong into a failed request and a log line.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from ..._core import StreamSchedule, compat_hash
from ...claims import instance_of
from ...connector_core import control
from ...connector_core.config import ConnectorConfig
from ...connector_core.control import worker_name
from ...connector_core.leases import LeaseBook
from ...connector_core.params import parse_networks
from ...connector_core.tickets import TicketKey
from ...transport import Endpoint, TransferError
from ...transport.auth import resolve_secret
from ...verify import Digester, MirrorCache
from .claim_server import ClaimServer
from .layout import compat_factors, engine_facts, page_facts, rank_table
from .links import Links
from .metadata import HybridKvMetadata
from .outbox import Outbox
from .pull import PullRecv
from .push_recv import PushRecv
from .push_send import PushSend
from .responder import Responder
from .state import Completion, Job, Registered
from .stats import HybridKvStats
from .stream_send import StreamSend

__all__ = ["WorkerHalf"]

log = logging.getLogger("hybrid_kv.integrations.vllm.worker")


class WorkerHalf:
    """The connector's worker half (one per TP worker). vLLM calls every method from its worker thread; between
    its steps, while requests are in flight, the ``Responder`` thread progresses the worker. Both hold ``lock``
    while they touch the worker's state, so it is never touched by two threads at once (the per-layer streaming
    hooks touch only the forward's hooks and the poster's queue, and take no lock)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, engine_id: str, cfg: ConnectorConfig) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.cfg = cfg
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.engine_id = engine_id
        pc = vllm_config.parallel_config
        self.tp_size = int(pc.tensor_parallel_size)
        self.tp_rank = int(get_tensor_model_parallel_rank()) if self.tp_size > 1 else 0
        self.port = cfg.worker_port(int(getattr(pc, "data_parallel_index", 0) or 0), self.tp_size, self.tp_rank)
        self.name = worker_name(engine_id, self.tp_rank)
        self.stats = HybridKvStats()
        self.completion = Completion(self.name, len(kv_cache_config.transfer_groups), self.stats)
        self.reg: Registered | None = None  # set by register_kv_caches
        # a claim that comes before this worker was told of its lease is confirmed from the ticket it carries
        tickets = TicketKey(resolve_secret(None, insecure=cfg.insecure, required=True, what=f"worker {self.name!r}"))
        self.leases = LeaseBook(
            self.name, stream_ttl_s=cfg.push_registration_timeout_s, tickets=tickets, engine_id=engine_id
        )
        self.links: Links | None = None
        self.pull: PullRecv | None = None
        self.claims: ClaimServer | None = None
        self.push_recv: PushRecv | None = None
        self.push_send: PushSend | None = None
        self.stream: StreamSend | None = None
        self.lock = threading.RLock()
        self.responder: Responder | None = None  # started by register_kv_caches
        # posted jobs that failed with a transfer NIXL would not cancel: reported once NIXL released it
        self.unsettled: dict[str, tuple[Job, TransferError]] = {}

    # ------------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        cfg = self.cfg
        mc = self.vllm_config.model_config
        total_heads = 1 if getattr(mc, "use_mla", False) else int(mc.get_total_num_kv_heads())
        # what vLLM applied (the layout it allocated with, the registered layers' backends), as NixlConnector reads
        # it, and what its CPU attention kernels store inside a page
        names = list(kv_caches)
        kv_layout, attn_backend = engine_facts(self.vllm_config, names)
        kv_layout, whole_pages_isas = page_facts(self.vllm_config, names, kv_layout, attn_backend)
        table, geometry = rank_table(
            kv_caches,
            self.kv_cache_config,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            total_num_kv_heads=total_heads,
            kv_layout=kv_layout,
        )
        factors = compat_factors(self.vllm_config, cfg.mode, attn_backend, geometry.kernel_block_size, whole_pages_isas)
        info = {
            "engine_id": self.engine_id,
            "agent_metadata": [],
            "kv_layout": kv_layout,
            "attn_backend": attn_backend,
            "transfer_mode": cfg.mode,
            "compat_hash": compat_hash(json.dumps(factors, sort_keys=True)),
            "prefix_caching": bool(self.vllm_config.cache_config.enable_prefix_caching),
        }
        payload = table.handshake_payload(info)
        if cfg.ucx_tls:
            os.environ["UCX_TLS"] = cfg.ucx_tls
        ep = Endpoint(
            self.name,
            table.registration(),
            {"whole": table.local_rows()},
            mem_type=geometry.mem_type,
            metadata_provider={self.tp_rank: payload},
            listen=f"tcp://{cfg.side_channel_host}:{self.port}",
            insecure=cfg.insecure,
            # a child process answers handshakes even while this worker's main thread spins with the GIL
            side_channel="process" if cfg.side_channel_process else "thread",
        )
        reg = self.reg = Registered(
            name=self.name,
            engine_id=self.engine_id,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            port=self.port,
            cfg=cfg,
            table=table,
            geometry=geometry,
            ep=ep,
            payload=payload,
            instance=instance_of(ep.metadata),
            digester=Digester(table, list(kv_caches.values())),
            mirrors=MirrorCache(payload),
            stats=self.stats,
            completion=self.completion,
            outbox=Outbox(ep, self.name, cfg.handshake_timeout_s, self.stats),
            refused=control.Refusals(self.name),
            networks=parse_networks(cfg.peer_networks),
        )
        self.links = Links(reg)
        self.pull = PullRecv(reg, self.links)
        self.claims = ClaimServer(reg, self.leases)
        self.push_recv = PushRecv(reg)
        self.push_send = PushSend(reg, self.leases, self.links)
        whole = (
            "" if whole_pages_isas is None else f" moved whole (CPU attention ISA {','.join(sorted(whole_pages_isas))})"
        )
        log.info(
            "hybrid-kv worker %s: %d regions, %d blocks of %d tokens (%d-token kernel blocks), %s pages%s, "
            "side channel %s",
            self.name,
            table.num_regions,
            geometry.num_logical_blocks,
            geometry.logical_block_size,
            geometry.kernel_block_size,
            kv_layout,
            whole,
            ep.address,
        )
        if cfg.mode == "push" and cfg.stream:
            self._init_streaming(reg)
        self.responder = Responder(self.name, self.lock, self._busy, self._progress)
        log.debug("hybrid-kv worker %s: registered in %.1f ms", self.name, (time.perf_counter() - t0) * 1e3)

    def _init_streaming(self, reg: Registered) -> None:
        """The stream schedule of this rank's table and the poster thread; without them (logged) every request is
        pushed whole."""
        assert self.links is not None
        try:
            schedule = StreamSchedule(reg.table)
        except Exception as exc:  # noqa: BLE001 - streaming is an optimisation: push whole instead
            log.warning("hybrid-kv %s: no stream schedule (%s): requests are pushed whole", self.name, exc)
            return
        self.stream = StreamSend(reg, self.leases, self.links, schedule)
        log.info(
            "hybrid-kv worker %s: streaming push in %d stages at %d layer hooks (last: %s)",
            self.name,
            schedule.num_stages,
            len(schedule.hooks),
            schedule.stage_hooks[-1] or "end of the forward",
        )

    # ------------------------------------------------------------------ what tests and the harness look at

    @property
    def server(self) -> Endpoint | None:
        """The worker's endpoint (``None`` before registration)."""
        return None if self.reg is None else self.reg.ep

    @property
    def hooks(self) -> Any:
        """This forward's streaming hooks (``None`` without streaming)."""
        return None if self.stream is None else self.stream.hooks

    @property
    def after_digest(self) -> Any:
        return None if self.claims is None else self.claims.after_digest

    @after_digest.setter
    def after_digest(self, fn: Any) -> None:  # tests: fault injection right after this prefill rank digested
        if self.claims is not None:
            self.claims.after_digest = fn

    # ------------------------------------------------------------------ per step

    def begin_step(self, meta: HybridKvMetadata) -> None:
        """Before this step's forward (``bind_connector_metadata``): start streaming the requests whose last prefill
        chunk it computes and whose decode registered in time. Never raises, never waits on a peer."""
        if self.stream is None or (not meta.stream and not self.stream.hooks.active):
            return
        with self.lock:
            t0 = time.perf_counter()
            try:
                if meta.stream:
                    self._progress()  # registrations that arrived since the last step
                self.stream.begin_step(meta)
            except Exception as exc:  # noqa: BLE001 - never raise into vLLM's step: those requests push whole
                log.error("hybrid-kv %s: starting this step's streams failed: %s", self.name, exc)
            self.stats.add_time("worker_s", time.perf_counter() - t0)

    def start_load_kv(self, meta: HybridKvMetadata) -> None:
        """Lease this step's finished prefill requests, and load (pull) or register (push) its decode requests.
        Never blocks on a peer: a request whose peer engine is not yet connected waits for the background
        handshake."""
        with self.lock:
            t0 = time.perf_counter()
            try:
                self._start(meta)
            except Exception as exc:  # noqa: BLE001 - a defect must fail requests, never the engine
                log.exception("hybrid-kv %s: start_load_kv failed: %s", self.name, exc)
            self.stats.add_time("worker_s", time.perf_counter() - t0)
        if self.responder is not None and (meta.send or meta.recv):
            self.responder.kick()

    def _start(self, meta: HybridKvMetadata) -> None:
        for rid, send in meta.send.items():
            if self.stream is None or not self.stream.leased(rid, send):
                for early in self.leases.add(rid, send):
                    self._on_control(early.sender, early.payload, only=rid)
        for rid in meta.stream_ended:
            if self.stream is None or not self.stream.leased(rid, None):
                self.completion.sent(rid)  # it never streamed here: nothing was posted for it
        for rid in meta.aborted:
            self.leases.drop(rid)
        if self.reg is None or self.links is None:
            for req in meta.recv.values():
                self.completion.recv_failed(req.request_id, req.local_block_ids)
            return
        self.links.poll()
        for req in meta.recv.values():
            if req.release_only:
                self.completion.release_only.add(req.request_id)
            if req.refused is not None:  # its kv_transfer_params were refused: it fails alone, as a failed load
                self.stats.count("num_refused_tickets")
                log.error("hybrid-kv %s: request %s cannot load: %s", self.name, req.request_id, req.refused)
                self.completion.recv_failed(req.request_id, req.local_block_ids)
            elif self.cfg.mode == "pull":
                assert self.pull is not None
                self.pull.start(req)
            else:
                assert self.push_recv is not None
                self.push_recv.start(req)
        self._after()

    def save_layer(self, layer: str) -> None:
        """vLLM's ``save_kv_layer``: release the stages this layer's hook proves final (the forward never waits)."""
        if self.stream is None:
            return
        try:
            self.stream.save_layer(layer)
        except Exception as exc:  # noqa: BLE001 - never raise into the forward: the rest goes at its end
            log.error("hybrid-kv %s: streaming at layer %s failed: %s", self.name, layer, exc)

    def end_forward(self) -> None:
        """vLLM's ``wait_for_save``: release every remaining stage of this forward's streams (returns at once)."""
        if self.stream is None:
            return
        try:
            self.stream.end_forward()
        except Exception as exc:  # noqa: BLE001 - never raise into vLLM's step: the deadline fails them
            log.error("hybrid-kv %s: releasing the rest of this forward's streams failed: %s", self.name, exc)

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call; never raises."""
        with self.lock:
            t0 = time.perf_counter()
            try:
                self._progress()
            except Exception as exc:  # noqa: BLE001 - a defect must fail requests, never the engine
                log.exception("hybrid-kv %s: progress failed: %s", self.name, exc)
            out = self.completion.take()
            self.stats.add_time("worker_s", time.perf_counter() - t0)
            return out

    def take_invalid_blocks(self) -> set[int]:
        with self.lock:
            return self.completion.take_invalid_blocks()

    def take_stats(self) -> HybridKvStats | None:
        with self.lock:
            stats = self.stats.clone_and_reset()
        return None if stats.is_empty() and not stats.data["worker_s"] else stats

    def shutdown(self) -> None:
        """Close the endpoint (every link's handles with it); a handshake still running is awaited (it has
        deadlines; a prepared link holds no NIXL handle)."""
        if self.responder is not None:
            self.responder.close()
        if self.stream is not None:
            self.stream.close()
        if self.links is not None:
            self.links.close()
        if self.reg is not None:
            self.reg.ep.close()  # the courier with it: messages still queued are dropped

    # ------------------------------------------------------------------ progress and dispatch

    def _busy(self) -> bool:
        """Whether a peer may be waiting on this worker: leases a decode may claim and read, requests posted or
        awaited, loads waiting for claims, registrations or held blocks, control messages in flight or arrived (a
        claim may come before this worker is told of its lease, which vLLM does only at its next step)."""
        reg = self.reg
        if reg is None:
            return False
        return bool(
            len(self.leases)
            or self.leases.ahead_count()
            or reg.inflight
            or (self.pull is not None and self.pull.waits)
            or (self.push_recv is not None and (self.push_recv.waits or self.push_recv.held))
            or reg.outbox.pending()
            or reg.ep.controls_waiting()
            or self.unsettled
        )

    def _progress(self) -> None:
        reg = self.reg
        if reg is None or self.links is None:
            return
        self.links.poll()
        t0 = time.perf_counter()
        ev = reg.ep.poll()
        self.stats.add_time("worker_poll_s", time.perf_counter() - t0)
        if ev.side_channel_restarted:
            self.stats.count("num_side_channel_restarts")
        for c in ev.control:
            self._on_control(c.sender, c.payload)
        for rid in ev.done:
            self._finish(rid, None)
        for err in ev.failed:
            if err.request_id is not None:
                self._finish(err.request_id, err)
        for rid in ev.settled:
            if rid in self.unsettled:
                job, err = self.unsettled.pop(rid)
                job.owner.finish(job, err)
        for d in reg.outbox.take():
            if self.pull is not None:
                self.pull.on_delivery(d)
            if self.push_recv is not None:
                self.push_recv.on_delivery(d)
        for rid, expired in self.leases.take_due():
            if expired:
                log.warning("hybrid-kv %s: lease of %s expired before its decode engine released it", self.name, rid)
                self.stats.count("num_expired_leases")
            self.completion.sent(rid)
        for early, waiting in self.leases.early.expire():
            self._on_expired(early.sender, early.payload, waiting)
        if self.pull is not None:
            self.pull.expire()
        if self.push_recv is not None:
            self.push_recv.expire()
        self._after()

    def _after(self) -> None:
        """What a step's work leaves to do at its end: pushes now due, and this step's claims and answers sent."""
        if self.cfg.mode == "push" and self.push_send is not None:
            self.push_send.match()
        if self.pull is not None:
            self.pull.flush()
        if self.claims is not None:
            self.claims.flush()

    def _finish(self, key: str, err: TransferError | None) -> None:
        """A job ended: its owner is told now, or, for a posted job that failed with a transfer NIXL would not
        cancel (it may still land in, or read from, the request's blocks), once NIXL released it."""
        reg = self.reg
        job = None if reg is None else reg.inflight.pop(key, None)
        if job is None:
            return
        if err is not None and not err.settled and job.handle is not None:
            log.error(
                "hybrid-kv %s: %s failed with a transfer NIXL would not cancel; its blocks stay held until NIXL "
                "releases it: %s",
                self.name,
                job.request_id,
                err,
            )
            self.unsettled[key] = (job, err)
            return
        job.owner.finish(job, err)

    def _on_control(self, sender: str, payload: bytes, only: str | None = None) -> None:
        """A control message (``control``): typed and bounded, bound to its sender and to its ticket's grant;
        anything else is refused and logged, never raised (``only``: a message kept early, applied for the one
        request whose lease came)."""
        reg = self.reg
        if reg is None:
            return
        try:
            msg = control.decode(payload)
        except control.ControlError as exc:
            reg.refused(sender, str(exc))
            return
        try:
            self._dispatch(sender, msg, payload, only)
        except Exception as exc:  # noqa: BLE001 - a defect must refuse the message, never fail the engine
            log.exception("hybrid-kv %s: control message from %r failed: %s", self.name, sender, exc)

    def _dispatch(self, sender: str, msg: control.Control, payload: bytes, only: str | None) -> None:
        reg = self.reg
        assert reg is not None and self.links is not None
        if isinstance(msg, control.PushPlan):
            if self.push_recv is not None:
                self.push_recv.on_plan(sender, msg)
        elif isinstance(msg, control.ClaimAnswers):
            if self.pull is not None:
                self.pull.on_answers(sender, msg)
        elif isinstance(msg, control.Claim):
            if self.claims is not None:
                self.claims.on_claim(sender, msg, payload, only)
        else:
            reason = self.leases.on_message(sender, msg, payload)
            if reason is not None:
                reg.refused(sender, reason)
                return
            if isinstance(msg, control.PushReg | control.StreamReg):
                rank = control.rank_of(sender, msg.engine, msg.tp)
                if rank is not None and self.links.stale(msg.engine, rank, msg.instance):
                    self.links.drop(msg.engine, f"rank {rank} is a new instance ({msg.instance})")
            if isinstance(msg, control.StreamReg) and self.stream is not None and any(msg.ids):
                self.stream.prelink(msg)

    def _on_expired(self, sender: str, payload: bytes, waiting: set[str]) -> None:
        """An early message whose lease never came: a claim is refused for the requests it still waited for."""
        try:
            msg = control.decode(payload)
        except control.ControlError:
            return
        if isinstance(msg, control.Claim) and self.claims is not None:
            self.claims.on_expired(sender, payload, waiting)
