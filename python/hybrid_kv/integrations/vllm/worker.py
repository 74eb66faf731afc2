"""The worker half: registers the KV caches, handshakes with peer engines, moves requests over NIXL.

Each worker owns one endpoint, so one NIXL agent and one registration of its KV cache: it serves the
handshake metadata on its side channel, receives notices and control messages, and posts transfers. Each peer
engine it posts to (pull: the decode READs from prefill engines; push: the prefill WRITEs into decode engines)
adds only a link (``hybrid_kv.peer_link``): that engine's ``PeerPlan`` local tables as a scope of the endpoint,
and its ranks as peers. Handshakes run in the background (``hybrid_kv.link_pool``): at most one per engine, at
most ``max_concurrent_handshakes`` engines at once, each retried within the waiting requests' deadline.

Completion, in both modes, is reported over the side channel (authenticated control messages, delivered off
the step by ``delivery``: in order per peer, each retried; a lost digest ask or push registration fails its
request at once):

- pull: after its READs for a request finished (or failed, or there was nothing to read), each decode rank
  sends ``release`` to every prefill rank it handshakes with; a prefill rank frees the request's blocks once
  all its consumers released it, or when the lease expires;
- push: each decode rank sends ``push_reg`` (its block ids) to the prefill ranks it handshakes with; a prefill
  rank, once the request finished on its side and a registration arrived, plans and WRITEs, then tells every
  decode rank it handshakes with whether it writes to it (``push_plan``); a decode rank then awaits exactly
  the writers' done-notices.

Verified transfers (setting ``verify``, ``hybrid_kv.verify``; the decode's scheduler marks the requests): in
pull, a decode rank asks each prefill rank it reads from for its digest (``verify_ask``: the prefill digests
its side of the request's moves, rebuilt from the decode's payload and ids and its own lease's ids, while it
holds the lease) and posts the READ once every answer came; once the READ is done it digests what landed and
a mismatch fails the request. In push, the registration asks for it: each writer digests its side before
posting, the digest rides in its done-notices and its payload in its ``push_plan``, and the decode checks once
the bytes landed. A failed check is a failed load (``kv_load_failure_policy``); nothing raises into vLLM.
A verified concurrent push is not streamed (its digest must be of final bytes): it is pushed whole.

Concurrent push (streaming): the decode's ``stream_reg`` names the prefill request by the router's capability
and arrives while the prefill runs. In the step that computes the request's last prefill chunk (``begin_step``,
before the forward) a prefill rank holding its registration and a connected link plans the whole request once,
cut into the stream schedule's stages (``PeerPlan.plan_staged``), posts it as one staged request, sends
``push_plan`` at once, and releases each stage as the forward's layer hooks prove it final
(``hybrid_kv.streaming``); the decode sees it done when every stage landed, and any failure fails the whole
request on both sides. A request whose registration or link is not there in time is pushed whole once it
finished.
"""

from __future__ import annotations

import collections
import hmac
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..._core import RegionTable, StreamSchedule, compat_hash, handshake_target_ranks
from ...link_pool import LinkPool
from ...peer_link import PeerLink, PreparedLink, attach_link, prepare_link, target_addresses
from ...streaming import ForwardHooks, Stream, StreamPoster
from ...transport import Endpoint, RequestHandle, Transfer, TransferError
from ...verify import (
    Digester,
    MirrorCache,
    algorithm,
    compare,
    initiator_digests,
    payload_mem_type,
    peer_digest,
)
from . import control
from .config import ConnectorConfig
from .delivery import ControlDelivery
from .layout import RankGeometry, compat_factors, engine_facts, rank_table
from .leases import EARLY_TTL_S, MAX_EARLY, LeaseBook, renewal_until
from .metadata import BlockIds, HybridKvMetadata, RecvReq, SendLease, StreamSend
from .params import host_allowed, parse_networks
from .stats import HybridKvStats

__all__ = ["WorkerHalf"]

log = logging.getLogger("hybrid_kv.integrations.vllm.worker")

LEASE_MARGIN_S = 1.0
"""Pull: a read must end this long before the prefill's ``lease_expires_at`` (wall clock, so it also absorbs
clock skew between hosts up to this much); a read ending later may have read blocks the prefill engine had
already freed and reused, and fails (vLLM then applies its ``kv_load_failure_policy``). Concurrent push: the
prefill's writes end (or fail) this long before the decode's ``StreamReg.until``."""

MIN_PUSH_S = 1.0
"""Concurrent push: a registration whose decode stops waiting sooner than this (plus the margin) is not written
to any more (the decode is about to fail the request and may reuse its blocks)."""


def _push_deadline(until: float | None, timeout_s: float) -> float | None:
    """A push's deadline: ``timeout_s``, ending ``LEASE_MARGIN_S`` before the decode's ``until`` (wall clock) when
    it has one; ``None`` when too little of that is left to write anything."""
    if until is None:
        return timeout_s
    left = until - time.time() - LEASE_MARGIN_S
    return min(timeout_s, left) if left >= MIN_PUSH_S else None


@dataclass
class _Inflight:
    """A request this worker posted (or awaits): what to report when it ends."""

    request_id: str  # the vLLM request id on this engine
    role: str  # "recv" (decode) or "send" (prefill, push)
    link: PeerLink | None
    transfers: list[Transfer]
    t_post: float
    handle: RequestHandle | None  # the posted request (its ``stats`` are NIXL's telemetry); None when awaited
    ids: int  # descriptor ids handed to NIXL (before its merge of ids consecutive on both sides)
    local_ids: BlockIds = field(default_factory=list)
    # (address, control, endpoint meant) to send when it ends
    release: list[tuple[str, bytes, str]] = field(default_factory=list)
    lease_expires_at: float | None = None  # pull: the prefill's lease on the blocks read (wall clock)


def worker_name(engine_id: str, tp_rank: int) -> str:
    """The endpoint (NIXL agent) name of worker ``tp_rank`` of engine ``engine_id``: side-channel requests name
    the endpoint they are meant for, and every other endpoint refuses them."""
    return f"{engine_id}-tp{tp_rank}"


def _lease_over(expires_at: float | None) -> bool:
    """Whether a prefill lease ending at ``expires_at`` (wall clock) is over, less ``LEASE_MARGIN_S``."""
    return expires_at is not None and time.time() > expires_at - LEASE_MARGIN_S


class WorkerHalf:
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
        self.num_groups = len(kv_cache_config.transfer_groups)
        self.stats = HybridKvStats()
        self.table: RegionTable | None = None
        self.geometry: RankGeometry | None = None
        self.server: Endpoint | None = None
        self.payload = b""
        self.links: dict[str, PeerLink] = {}
        self.inflight: dict[str, _Inflight] = {}  # keyed by the id posted/awaited on the endpoint
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self._release_only: set[str] = set()  # requests vLLM no longer knows: never reported (``RecvReq.release_only``)
        self.invalid_blocks: set[int] = set()
        # prefill side: leased requests and what decode engines said about them (``leases``)
        self.leases = LeaseBook(self.name, stream_ttl_s=cfg.push_registration_timeout_s)
        # prefill side, streaming: the schedule, this forward's hooks, the poster thread, streams by request id
        self.schedule: StreamSchedule | None = None
        self.hooks: ForwardHooks | None = None
        self.poster: StreamPoster | None = None
        self.streams: dict[str, Stream] = {}
        self._cuda = False
        self._refused = control.Refusals(self.name)
        self._networks = parse_networks(cfg.peer_networks)
        self._renewing: set[str] = set()  # decode requests whose lease renewal is being sent
        # decode side, push: partners still to answer, senders that write, by local request id
        self.push_wait: dict[str, dict[str, Any]] = {}
        # handshakes run in the background, one per engine, a bounded number at once; requests wait for them here
        self._handshakes: LinkPool[PreparedLink] = LinkPool(self.name, cfg.max_concurrent_handshakes)
        self._waiting: dict[str, list[tuple[float, RecvReq | str]]] = {}  # engine -> (deadline, request)
        # control messages (releases, registrations, plans, digest asks) go out on their own threads, in order
        # per peer, each retried (``delivery``); a lost one that a request waits on fails that request
        self.controls = ControlDelivery(self.name, cfg.handshake_timeout_s)
        # verified transfers: the digester of this rank's memory, mirrors of initiators' plans, the algorithm per
        # peer engine; decode (pull) requests waiting for their prefill ranks' digests; prefill asks that came
        # before their lease (kept ``EARLY_TTL_S``, at most ``MAX_EARLY``)
        self.digester: Digester | None = None
        self.mirrors: MirrorCache | None = None
        self._algos: dict[str, str] = {}
        self.verify_wait: dict[str, dict[str, Any]] = {}
        self._early_asks: collections.deque[tuple[float, str, control.VerifyAsk]] = collections.deque()
        self.after_digest: Callable[[str, BlockIds], None] | None = None  # tests: fault injection after a digest

    # ------------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        mc = self.vllm_config.model_config
        total_heads = 1 if getattr(mc, "use_mla", False) else int(mc.get_total_num_kv_heads())
        self.table, self.geometry = rank_table(
            kv_caches, self.kv_cache_config, tp_rank=self.tp_rank, tp_size=self.tp_size, total_num_kv_heads=total_heads
        )
        # what vLLM applied (the layout it allocated with, the registered layers' backends), as NixlConnector reads it
        kv_layout, attn_backend = engine_facts(self.vllm_config, list(kv_caches))
        factors = compat_factors(self.vllm_config, self.cfg.mode, attn_backend)
        info = {
            "engine_id": self.engine_id,
            "agent_metadata": [],
            "kv_layout": kv_layout,
            "attn_backend": attn_backend,
            "transfer_mode": self.cfg.mode,
            "compat_hash": compat_hash(json.dumps(factors, sort_keys=True)),
            "prefix_caching": bool(self.vllm_config.cache_config.enable_prefix_caching),
        }
        self.payload = self.table.handshake_payload(info)
        self.digester = Digester(self.table, list(kv_caches.values()))
        self.mirrors = MirrorCache(self.payload)
        if self.cfg.ucx_tls:
            os.environ["UCX_TLS"] = self.cfg.ucx_tls
        self.server = Endpoint(
            self.name,
            self.table.registration(),
            {"whole": self.table.local_rows()},
            mem_type=self.geometry.mem_type,
            metadata_provider={self.tp_rank: self.payload},
            listen=f"tcp://{self.cfg.side_channel_host}:{self.port}",
            insecure=self.cfg.insecure,
            # a child process answers handshakes even while this worker's main thread spins with the GIL
            side_channel="process" if self.cfg.side_channel_process else "thread",
        )
        log.info(
            "hybrid-kv worker %s: %d regions, %d blocks of %d tokens (%d-token kernel blocks), side channel %s",
            self.name,
            self.table.num_regions,
            self.geometry.num_logical_blocks,
            self.geometry.logical_block_size,
            self.geometry.kernel_block_size,
            self.server.address,
        )
        if self.cfg.mode == "push" and self.cfg.stream:
            self._init_streaming()
        log.debug("hybrid-kv worker %s: registered in %.1f ms", self.name, (time.perf_counter() - t0) * 1e3)

    def _init_streaming(self) -> None:
        """The stream schedule of this rank's table (which layer hook makes which layers' KV final) and the
        poster thread; without them (logged) every request is pushed whole."""
        assert self.table is not None and self.server is not None and self.geometry is not None
        try:
            self.schedule = StreamSchedule(self.table)
        except Exception as exc:  # noqa: BLE001 - streaming is an optimisation: push whole instead
            log.warning("hybrid-kv %s: no stream schedule (%s): requests are pushed whole", self.name, exc)
            return
        self.hooks = ForwardHooks(self.schedule, self.name)
        self.poster = StreamPoster(self.server, self.name)
        self._cuda = self.geometry.mem_type == "VRAM"
        log.info(
            "hybrid-kv worker %s: streaming push in %d stages at %d layer hooks (last: %s)",
            self.name,
            self.schedule.num_stages,
            len(self.schedule.hooks),
            self.schedule.stage_hooks[-1] or "end of the forward",
        )

    # ------------------------------------------------------------------ handshake

    def _address(self, host: str, port: int, rank: int) -> str:
        return f"tcp://{host}:{port + rank}"

    def _handshake(self, engine_id: str, host: str, port: int, tp_size: int, deadline: float) -> PreparedLink:
        """Fetch and plan a link to peer engine ``engine_id`` (a handshake thread; no NIXL, no shared state).

        Each target rank's reply is fetched once and planned from exactly those payload bytes (one decode in
        Rust: ``PeerPlan(own_payload=...)``); the link is connected from the same replies on the worker's thread
        (``_poll_handshakes``). A fetch gets ``handshake_timeout_s`` per attempt and is tried again while
        ``deadline`` (the waiting requests' ``transfer_timeout_s``) allows, so this always ends.
        """
        assert self.table is not None
        return prepare_link(
            self.table,
            self.payload,
            target_addresses(host, port, self.tp_rank, self.tp_size, tp_size),
            self.cfg.mode,
            sender=self.name,
            timeout_s=self.cfg.handshake_timeout_s,
            deadline=deadline,
            coalesce=self.cfg.coalesce,
            engine_id=engine_id,
            expected_tp_size=tp_size,
            names={r: worker_name(engine_id, r) for r in handshake_target_ranks(self.tp_rank, self.tp_size, tp_size)},
        )

    def _link(self, engine_id: str, host: str, port: int, tp_size: int, job: RecvReq | str) -> PeerLink | None:
        """The link to ``engine_id`` if its handshake is done; else start it (once) in the background, park
        ``job`` (a decode request to load, or a prefill request to push) until it ends, and return ``None``."""
        link = self.links.get(engine_id)
        if link is not None:
            return link
        if engine_id not in self._handshakes:
            log.info(
                "hybrid-kv %s: handshake with %s (%s:%d, TP %d) started", self.name, engine_id, host, port, tp_size
            )
            deadline = time.monotonic() + self.cfg.transfer_timeout_s
            self._handshakes.submit(engine_id, self._handshake, engine_id, host, port, tp_size, deadline)
        waiting = self._waiting.setdefault(engine_id, [])
        if all(j != job for _, j in waiting):
            waiting.append((time.monotonic() + self.cfg.transfer_timeout_s, job))
        return None

    def _poll_handshakes(self) -> None:
        """Adopt finished handshakes and run the requests that waited for them; a failed handshake fails
        exactly the requests waiting for it (the next request to that engine starts a new one). A request
        that waited longer than ``transfer_timeout_s`` fails too, so none waits forever."""
        for engine_id, fut in self._handshakes.take_done():
            waiting = [j for _, j in self._waiting.pop(engine_id, [])]
            try:
                link = self._attach(fut.result())
            except Exception as exc:  # noqa: BLE001 - a failed handshake fails its requests, never the step
                self.stats.count("num_failed_handshakes")
                log.error("hybrid-kv %s: handshake with %s failed: %s", self.name, engine_id, exc)
                for job in waiting:
                    self._job_failed(job, f"handshake with {engine_id} failed: {exc}")
                continue
            self.links[engine_id] = link
            for job in waiting:
                if isinstance(job, RecvReq):
                    self._load(job)
                # push jobs stay in ``push_regs``: ``_match_pushes`` finds the link now
        now = time.monotonic()
        for engine_id, parked in list(self._waiting.items()):
            late = [j for deadline, j in parked if now >= deadline]
            if late:
                self._waiting[engine_id] = [(d, j) for d, j in parked if now < d]
                for job in late:
                    self._job_failed(job, f"handshake with {engine_id} not done within {self.cfg.transfer_timeout_s} s")
        self._renew_parked()

    def _renew_parked(self) -> None:
        """Decode side: ask the prefill to extend the lease of requests still waiting for their handshake
        (``control.Renew``, carrying the ticket's grant, never past its ``max_lease_expires_at``), so a slow
        first handshake to a new peer does not outlive the lease. Sent on the control thread; the request's
        lease is moved only once every prefill rank it reads from acknowledged."""
        wall = time.time()
        for parked in self._waiting.values():
            for _, job in parked:
                if not isinstance(job, RecvReq) or job.request_id in self._renewing:
                    continue
                until = renewal_until(job.lease_expires_at, job.max_lease_expires_at, wall, self.cfg.lease_s)
                if until is not None:
                    self._renewing.add(job.request_id)
                    first = handshake_target_ranks(self.tp_rank, self.tp_size, job.remote_tp_size)[0]
                    lane = self._address(job.remote_host, job.remote_port, first)
                    self.controls.run(lane, self._renew_now, job, until)

    def _renew_now(self, job: RecvReq, until: float) -> None:
        """Send ``job``'s renewal to each prefill rank it reads from (control thread); logged, never raised."""
        try:
            assert self.server is not None
            msg = control.encode(control.Renew(req=job.remote_request_id, grant=job.grant, until=until))
            for r in handshake_target_ranks(self.tp_rank, self.tp_size, job.remote_tp_size):
                self.server.send_control(
                    self._address(job.remote_host, job.remote_port, r),
                    msg,
                    self.cfg.handshake_timeout_s,
                    expected_name=worker_name(job.remote_engine_id, r),
                    attempts=self.controls.attempts,
                )
            job.lease_expires_at = until
            self.stats.count("num_lease_renewals")
            left = until - time.time()
            log.info("hybrid-kv %s: lease of %s renewed to %.1f s from now", self.name, job.request_id, left)
        except Exception as exc:  # noqa: BLE001 - a lost renewal leaves the lease as it was
            job.max_lease_expires_at = None  # tried once: an unreachable prefill never holds the control thread again
            log.warning("hybrid-kv %s: renewing the lease of %s failed: %s", self.name, job.request_id, exc)
        finally:
            self._renewing.discard(job.request_id)

    def _attach(self, prepared: PreparedLink) -> PeerLink:
        """Connect a prepared link on the worker's endpoint (its thread): the engine's tables become its own scope."""
        assert self.server is not None
        t0 = time.perf_counter()
        link = attach_link(self.server, prepared, prepared.engine_id, timeout_s=self.cfg.handshake_timeout_s)
        assert self.table is not None
        peer_mem = [payload_mem_type(r.payload) for r in prepared.replies.values()]
        self._algos[prepared.engine_id] = algorithm(self.table.mem_type, *peer_mem)
        log.info(
            "hybrid-kv %s: connected to %s ranks %s (tp ratio %d) in %.1f ms",
            self.name,
            link.engine_id,
            link.targets,
            link.plan.tp_ratio,
            (time.perf_counter() - t0) * 1e3,
        )
        return link

    def _job_failed(self, job: RecvReq | str, reason: str) -> None:
        if isinstance(job, RecvReq) and job.release_only:
            log.warning("hybrid-kv %s: prefill blocks of %s not released: %s", self.name, job.request_id, reason)
            self._release_only.discard(job.request_id)
        elif isinstance(job, RecvReq):
            log.error("hybrid-kv %s: request %s cannot load: %s", self.name, job.request_id, reason)
            self._recv_failed(job.request_id, job.local_block_ids, None)
        else:
            log.error("hybrid-kv %s: push of %s failed: %s", self.name, job, reason)
            self.leases.drop(job)
            self.stats.count("num_failed_transfers")
            self._sent(job)

    # ------------------------------------------------------------------ per step

    def start_load_kv(self, meta: HybridKvMetadata) -> None:
        """Lease this step's finished prefill requests, and load (pull) or register (push) its decode requests.

        Never blocks on a peer: a request whose peer engine is not yet connected waits for the background
        handshake and is posted on a later step (``get_finished`` or the next ``start_load_kv``).
        """
        t0 = time.perf_counter()
        for rid, send in meta.send.items():
            if rid in self.streams:
                self._stream_leased(rid, send)
            else:
                self.leases.add(rid, send)
        for rid in meta.stream_ended:
            if rid in self.streams:
                self._stream_leased(rid, None)
            else:
                self._sent(rid)  # it never streamed here: nothing was posted for it
        for rid in meta.aborted:
            self.leases.drop(rid)
        self._poll_handshakes()
        for req in meta.recv.values():
            if req.release_only:
                self._release_only.add(req.request_id)
            if req.refused is not None:  # its kv_transfer_params were refused: it fails alone, as a failed load
                self.stats.count("num_refused_tickets")
                self._job_failed(req, f"kv_transfer_params refused: {req.refused}")
            elif self.cfg.mode == "pull":
                link = self._link(req.remote_engine_id, req.remote_host, req.remote_port, req.remote_tp_size, req)
                if link is not None:
                    self._load(req)
            else:
                try:
                    self._start_push_recv(req)
                except Exception as exc:  # noqa: BLE001 - report, never crash a step
                    self._job_failed(req, str(exc))
        if self.cfg.mode == "push":
            self._match_pushes()
        self.stats.add_time("worker_s", time.perf_counter() - t0)

    def _load(self, req: RecvReq) -> None:
        """Plan and post a pull request whose link is ready; any error fails exactly this request."""
        try:
            self._start_pull(req, self.links[req.remote_engine_id])
        except Exception as exc:  # noqa: BLE001 - report, never crash a step
            self._job_failed(req, str(exc))

    def _start_pull(self, req: RecvReq, link: PeerLink) -> None:
        consumers = max(1, self.tp_size // req.remote_tp_size)
        release = control.encode(control.Release(req=req.remote_request_id, grant=req.grant, consumers=consumers))
        releases = [(link.addresses[r], release, worker_name(link.engine_id, r)) for r in link.targets]
        transfers: list[Transfer] = []
        if any(req.local_block_ids) and any(req.remote_block_ids):
            transfers = link.transfers(req.local_block_ids, req.remote_block_ids)
        if not transfers:
            self.finished_recving.add(req.request_id)
            self._send_controls(link.ep, releases)
            return
        if _lease_over(req.lease_expires_at):
            raise TransferError(f"the prefill engine's lease on {req.remote_request_id!r} expired before the read")
        if req.verify:
            self._ask_digests(req, link, transfers, releases)
            return
        self._post_pull(req, link, transfers, releases, None)

    def _post_pull(
        self,
        req: RecvReq,
        link: PeerLink,
        transfers: list[Transfer],
        releases: list[tuple[str, bytes, str]],
        check: Callable[[], str | None] | None,
    ) -> None:
        ids = req.local_block_ids
        self._post(req.request_id, "recv", link, transfers, "READ", self.cfg.transfer_timeout_s, ids, check=check)
        job = self.inflight[req.request_id]
        job.release = releases
        job.lease_expires_at = req.lease_expires_at

    def _post(
        self,
        rid: str,
        role: str,
        link: PeerLink,
        transfers: list[Transfer],
        op: Any,
        timeout: float,
        ids: BlockIds,
        *,
        digests: dict[Any, int] | None = None,
        check: Callable[[], str | None] | None = None,
    ) -> None:
        t0 = time.perf_counter()
        handle = link.ep.post(rid, transfers, op, timeout, digests=digests, check=check)
        self.stats.add_time("worker_post_s", time.perf_counter() - t0)
        nids = sum(int(t.local_ids.size) for t in transfers)
        self.inflight[rid] = _Inflight(rid, role, link, transfers, time.perf_counter(), handle, nids, ids)

    # ------------------------------------------------------------------ verified transfers

    def _ask_digests(
        self, req: RecvReq, link: PeerLink, transfers: list[Transfer], releases: list[tuple[str, bytes, str]]
    ) -> None:
        """Pull, ``verify``: ask every prefill rank this rank reads from for its digest of the request; the READ
        is posted once all answered (``_on_verify_answer``), or the request fails at ``transfer_timeout_s``."""
        algo = self._algos.get(link.engine_id, "xxh3")
        ask = control.VerifyAsk(
            req=req.remote_request_id,
            grant=req.grant,
            d_req=req.request_id,
            ids=req.local_block_ids,
            payload=self.payload,
            coalesce=self.cfg.coalesce,
            algo=algo,
            host=self.cfg.advertise_host,
            port=self.port,
        )
        names = {worker_name(link.engine_id, r): r for r in link.targets}
        self.verify_wait[req.request_id] = {
            "req": req,
            "link": link,
            "transfers": transfers,
            "releases": releases,
            "names": names,
            "answers": {},
            "algo": algo,
            "deadline": time.monotonic() + self.cfg.transfer_timeout_s,
        }
        msg = control.encode(ask)
        self._send_controls(link.ep, [(link.addresses[r], msg, name) for name, r in names.items()], req.request_id)

    def _awaited(
        self, waits: dict[str, dict[str, Any]], rid: str, sender: str, seen: str, what: str
    ) -> tuple[dict[str, Any], int] | None:
        """``(wait, rank)`` when ``sender`` is a prefill rank that request ``rid``'s wait in ``waits`` expects and that
        has not answered yet (``wait[seen]``); else the message is refused (logged) and ``None``."""
        wait = waits.get(rid)
        if wait is None:
            self._refused(sender, f"{what} for {rid!r}, which awaits none")
            return None
        rank = wait["names"].get(sender)
        if rank is None:
            self._refused(sender, f"{what} for {rid!r} from a sender that is not a prefill rank it awaits")
            return None
        if rank in wait[seen]:  # a repeat (its sender may send again when an ack was late): the first counts
            self._refused(sender, f"{what} for {rid!r} repeated; the first one counts")
            return None
        return wait, int(rank)

    def _on_verify_answer(self, sender: str, msg: control.VerifyAnswer) -> None:
        """A prefill rank's digest for one of our pull requests: only the ranks asked answer, once each; the READ
        is posted when all did."""
        found = self._awaited(self.verify_wait, msg.d_req, sender, "answers", "digest")
        if found is None:
            return
        wait, rank = found
        wait["answers"][rank] = (int(msg.digest, 16) if msg.digest else None, msg.error)
        if len(wait["answers"]) < len(wait["names"]):
            return
        del self.verify_wait[msg.d_req]
        req, link = wait["req"], wait["link"]
        try:
            missing = {r: err for r, (d, err) in wait["answers"].items() if d is None}
            if missing:  # nothing to compare with: fail now instead of reading
                self.stats.count("num_digest_mismatches")
                raise TransferError(f"no digest from prefill ranks {missing} (nothing read)")
            if _lease_over(req.lease_expires_at):
                raise TransferError(f"the prefill engine's lease on {req.remote_request_id!r} expired before the read")
            check = self._pull_check(link, wait["transfers"], wait["answers"], wait["algo"])
            self._post_pull(req, link, wait["transfers"], wait["releases"], check)
        except Exception as exc:  # noqa: BLE001 - report, never crash a step
            self._verify_failed(wait, str(exc))

    def _verify_failed(self, wait: dict[str, Any], reason: str) -> None:
        """A pull request that will not be read (its digests are missing or unusable): it fails, and its prefill
        ranks are told to free its blocks."""
        self._job_failed(wait["req"], reason)
        self._send_controls(wait["link"].ep, wait["releases"])

    def _pull_check(
        self, link: PeerLink, transfers: list[Transfer], answers: dict[int, tuple[int | None, str]], algo: str
    ) -> Callable[[], str | None]:
        """The check run once a verified READ is done: this rank's digest of what landed against each prefill
        rank's answer; a mismatch is the request's failure reason."""

        def check() -> str | None:
            assert self.digester is not None
            self.stats.count("num_verified_transfers")
            mine = initiator_digests(self.digester, link.plan, transfers, link.rank_of, algo)
            for peer, d in mine.items():
                p_rank = link.rank_of(peer)
                theirs, error = answers.get(p_rank, (None, "no answer"))
                reason = compare(d, theirs, p_rank, self.tp_rank)
                if reason is not None:
                    self.stats.count("num_digest_mismatches")
                    return reason + (f" ({error})" if error else "")
            return None

        return check

    def _push_check(self, wait: dict[str, Any]) -> Callable[[dict[str, int | None]], str | None]:
        """Push, ``verify``: the decode's check once the writers' bytes landed: each writer's digest (from its
        done-notices) against this rank's digest of its side of the writer's moves, rebuilt from the payload its
        ``push_plan`` carried."""

        def check(digests: dict[str, int | None]) -> str | None:
            assert self.digester is not None and self.mirrors is not None and self.table is not None
            self.stats.count("num_verified_transfers")
            for sender, theirs in sorted(digests.items()):
                payload, coalesce = wait["payloads"].get(sender, (b"", True))
                p_rank = wait["names"][sender]
                mirror = self.mirrors.get(payload, coalesce)
                algo = algorithm(self.table.mem_type, payload_mem_type(payload))
                mine = self.digester.digest(mirror.moves(wait["remote_ids"], wait["ids"]), "remote", algo)
                reason = compare(mine, theirs, p_rank, self.tp_rank)
                if reason is not None:
                    self.stats.count("num_digest_mismatches")
                    return reason
            return None

        return check

    def _on_verify_ask(self, sender: str, msg: control.VerifyAsk) -> None:
        """Prefill, pull: digest this rank's side of a leased request's moves with the asking decode rank and
        answer it. Bound to the lease's grant and holder like every lease message; the ids of this side are the
        lease's own; an ask before its lease waits (bounded)."""
        lease = self.leases.leases.get(msg.req)
        if lease is None:
            self._early_asks.append((time.monotonic() + EARLY_TTL_S, sender, msg))
            while len(self._early_asks) > MAX_EARLY:
                self._early_asks.popleft()
            return
        if not hmac.compare_digest(lease.grant, msg.grant):
            self._refused(sender, f"digest ask for {msg.req!r} carries another grant than its ticket's")
            return
        engine = sender.rpartition("-tp")[0] or sender
        if lease.holder is not None and lease.holder != engine:
            self._refused(sender, f"digest ask for {msg.req!r} from engine {engine!r}; the lease is held by another")
            return
        if not host_allowed(msg.host, self._networks):
            self._refused(sender, f"digest ask for {msg.req!r} answers to {msg.host!r}, outside the peer networks")
            return
        lease.holder = engine
        assert self.mirrors is not None and self.digester is not None and self.server is not None
        digest, nbytes, moves, error = peer_digest(
            self.mirrors, self.digester, msg.payload, msg.coalesce, msg.ids, lease.block_ids, msg.algo
        )
        if self.after_digest is not None:
            self.after_digest(msg.req, lease.block_ids)
        answer = control.encode(
            control.VerifyAnswer(d_req=msg.d_req, digest=digest, bytes=nbytes, moves=moves, error=error)
        )
        self._send_controls(self.server, [(f"tcp://{msg.host}:{msg.port}", answer, sender)])

    def _verify_progress(self) -> None:
        """Answer asks whose lease arrived; fail pull requests whose digests did not come in time."""
        now = time.monotonic()
        if self._early_asks:
            early, self._early_asks = self._early_asks, collections.deque()
            for until, sender, ask in early:
                if ask.req in self.leases.leases:
                    self._on_verify_ask(sender, ask)
                elif until > now:
                    self._early_asks.append((until, sender, ask))
        for rid, wait in list(self.verify_wait.items()):
            if now >= wait["deadline"]:
                del self.verify_wait[rid]
                missing = sorted(set(wait["names"].values()) - set(wait["answers"]))
                self._verify_failed(wait, f"no digest from prefill ranks {missing} within the transfer timeout")

    def _send_controls(self, ep: Endpoint, messages: list[tuple[str, bytes, str]], waiting: str | None = None) -> None:
        """Queue control messages (``(address, payload, the endpoint meant)``) for delivery off the step
        (``delivery``); ``waiting``: the request that fails at once if one of them is never acknowledged."""
        t0 = time.perf_counter()
        if messages:
            self.controls.send(ep, messages, waiting)
        self.stats.add_time("worker_control_s", time.perf_counter() - t0)

    def _on_lost_controls(self) -> None:
        """Fail the requests waiting on a control message that was never acknowledged (a digest ask: no answer
        can come; a push registration: no push can come), now rather than at their deadlines."""
        for rid, why in self.controls.take_lost():
            self.stats.count("num_lost_controls")
            if rid is None:
                continue
            wait = self.verify_wait.pop(rid, None)
            if wait is not None:
                self._verify_failed(wait, why)
            wait = self.push_wait.pop(rid, None)
            if wait is not None:
                self._push_failed(rid, wait, why)

    def _push_failed(self, rid: str, wait: dict[str, Any], reason: str) -> None:
        """A push request whose writers will not write (``push_wait`` entry ``wait``, already removed) fails."""
        log.error("hybrid-kv %s: request %s cannot load: %s", self.name, rid, reason)
        self._recv_failed(rid, wait["ids"], None)

    # ------------------------------------------------------------------ push

    def _start_push_recv(self, req: RecvReq) -> None:
        """Decode side of push: register our blocks with the prefill ranks we pair with, then await them."""
        assert self.server is not None
        targets = list(handshake_target_ranks(self.tp_rank, self.tp_size, req.remote_tp_size))
        ids = req.local_block_ids if any(req.local_block_ids) else []
        host, port = self.cfg.advertise_host, self.port - self.tp_rank
        reg: control.PushReg | control.StreamReg
        wait_s = self.cfg.push_registration_timeout_s
        if req.cap:  # a concurrent push: the prefill request is named by the router's capability
            reg = control.StreamReg(
                cap=req.cap,
                d_req=req.request_id,
                ids=ids,
                engine=self.engine_id,
                host=host,
                port=port,
                tp=self.tp_size,
                until=time.time() + wait_s,  # the prefill writes nothing after it (push_wait's deadline below)
                verify=req.verify,
            )
        else:
            reg = control.PushReg(
                p_req=req.remote_request_id,
                grant=req.grant,
                d_req=req.request_id,
                ids=ids,
                engine=self.engine_id,
                host=host,
                port=port,
                tp=self.tp_size,
                verify=req.verify,
            )
        msg = control.encode(reg)
        regs = [
            (self._address(req.remote_host, req.remote_port, r), msg, worker_name(req.remote_engine_id, r))
            for r in targets
        ]
        if not reg.ids:
            self._send_controls(self.server, regs)
            self.finished_recving.add(req.request_id)
            return
        self.push_wait[req.request_id] = {
            "partners": len(targets),
            "names": control.writer_names(req.remote_engine_id, targets, self.engine_id),  # name -> rank
            "answered": set(),  # ranks
            "writers": set(),  # names (NIXL agents) that write
            "ids": req.local_block_ids,
            "deadline": time.monotonic() + wait_s,
            "verify": req.verify,
            "remote_ids": req.remote_block_ids,
            "payloads": {},  # verified: writer name -> (its payload, its coalesce setting)
        }
        self._send_controls(self.server, regs, req.request_id)

    def _on_push_plan(self, sender: str, msg: control.PushPlan) -> None:
        """A prefill rank's answer to our registration: only the ranks we registered with answer, once each,
        and the request completes only from the NIXL agents that said they write (``expect(writers=)``)."""
        rid = msg.d_req
        found = self._awaited(self.push_wait, rid, sender, "answered", "push plan")
        if found is None:
            return
        wait, rank = found
        wait["answered"].add(rank)
        if msg.writes:
            wait["writers"].add(sender)
            wait["payloads"][sender] = (msg.payload, msg.coalesce)
        if len(wait["answered"]) < wait["partners"]:
            return
        del self.push_wait[rid]
        if not wait["writers"]:
            self.finished_recving.add(rid)
            return
        assert self.server is not None
        check = self._push_check(wait) if wait["verify"] else None
        left = max(1.0, wait["deadline"] - time.monotonic())
        self.server.expect(rid, left, writers=wait["writers"], check=check)
        self.inflight[rid] = _Inflight(rid, "recv", None, [], time.perf_counter(), None, 0, wait["ids"])

    def _match_pushes(self) -> None:
        """Prefill side of push: WRITE every request that finished here and has a decode registration."""
        for p_req, lease, reg in self.leases.registered():
            local_ids, d_req = lease.block_ids, reg.d_req
            try:
                if not any(reg.ids):
                    self._sent(p_req)
                    continue
                if not host_allowed(reg.host, self._networks):
                    raise TransferError(f"decode host {reg.host!r} is outside the allowed peer networks")
                deadline = _push_deadline(lease.push_until, self.cfg.transfer_timeout_s)
                if deadline is None:  # the decode stopped waiting (or is about to): its blocks are not ours
                    log.warning("hybrid-kv %s: %s's decode %s stopped waiting; not pushed", self.name, p_req, d_req)
                    self._sent(p_req)
                    continue
                link = self._link(reg.engine, reg.host, reg.port, reg.tp, p_req)
                if link is None:
                    continue  # handshake in the background; pushed on a later step
                self.leases.drop(p_req)
                transfers = link.transfers(local_ids, reg.ids)
                writers = {link.rank_of(t.peer) for t in transfers}
                digests = None
                if transfers and reg.verify:  # the decode checks: digest this side before posting
                    assert self.digester is not None
                    algo = self._algos.get(link.engine_id, "xxh3")
                    mine = initiator_digests(self.digester, link.plan, transfers, link.rank_of, algo)
                    digests = {peer: d.digest for peer, d in mine.items()}
                if transfers:
                    self._post(d_req, "send", link, transfers, "WRITE", deadline, local_ids, digests=digests)
                    self.inflight[d_req].request_id = p_req
                else:
                    self._sent(p_req)
                payload = self.payload if reg.verify else b""
                plans = {
                    r: control.encode(
                        control.PushPlan(d_req=d_req, writes=r in writers, payload=payload, coalesce=self.cfg.coalesce)
                    )
                    for r in link.targets
                }
                self._send_controls(
                    link.ep, [(link.addresses[r], plans[r], worker_name(link.engine_id, r)) for r in link.targets]
                )
            except Exception as exc:  # noqa: BLE001 - a failed push frees the blocks and is counted
                self._job_failed(p_req, f"to {d_req}: {exc}")

    # ------------------------------------------------------------------ streaming push (prefill side)

    def begin_step(self, meta: HybridKvMetadata) -> None:
        """Before this step's forward (``bind_connector_metadata``): start streaming the requests whose last
        prefill chunk it computes and whose decode registered in time. Never raises, never waits on a peer."""
        if self.hooks is not None and self.hooks.active:
            self.end_forward()  # the previous forward's wait_for_save never came: release what it left
        if not meta.stream or self.hooks is None or self.server is None:
            return
        t0 = time.perf_counter()
        try:
            self._progress()  # registrations that arrived since the last step
            started = []
            for rid, send in meta.stream.items():
                stream = self._start_stream(rid, send)
                if stream is not None and stream.handle is not None:
                    started.append(stream)
            self.hooks.begin(started)
        except Exception as exc:  # noqa: BLE001 - never raise into vLLM's step: those requests push whole
            log.error("hybrid-kv %s: starting this step's streams failed: %s", self.name, exc)
        self.stats.add_time("worker_s", time.perf_counter() - t0)

    def _start_stream(self, rid: str, send: StreamSend) -> Stream | None:
        """Plan and post ``rid`` staged if its registration and link are ready; else ``None`` (it is pushed
        whole once it finished, from the same registration)."""
        assert self.schedule is not None and self.server is not None
        reg = self.leases.stream_reg(send.cap)
        deadline = None if reg is None else _push_deadline(reg.until, self.cfg.transfer_timeout_s)
        if reg is None or deadline is None or not any(reg.ids) or not host_allowed(reg.host, self._networks):
            self.stats.count("num_stream_fallbacks")
            return None  # no live registration (or nothing to write, or a refused host: the lease path says why)
        if reg.verify:  # a digest is of final bytes: a verified request is pushed whole, digests in its notices
            return None
        link = self.links.get(reg.engine)
        if link is None:
            self._prelink(reg)
            self.stats.count("num_stream_fallbacks")
            return None
        self.leases.take_stream(send.cap)
        stream = Stream(rid, reg.d_req, send.cap, send.block_ids, None)
        self.streams[rid] = stream
        try:
            stages = link.staged_transfers(send.block_ids, reg.ids, self.schedule)
            transfers = [t for stage in stages for t in stage]
            writers = {link.rank_of(t.peer) for t in transfers}
            if transfers:
                order = [k for k, stage in enumerate(stages) for _ in stage]
                t0 = time.perf_counter()
                stream.handle = link.ep.post(reg.d_req, transfers, "WRITE", deadline, stages=order)
                self.stats.add_time("worker_post_s", time.perf_counter() - t0)
                nids = sum(int(t.local_ids.size) for t in transfers)
                now = time.perf_counter()
                self.inflight[reg.d_req] = _Inflight(
                    rid, "stream", link, transfers, now, stream.handle, nids, send.block_ids
                )
                self.stats.count("num_streamed_requests")
            else:
                stream.ended = True
            plans = [
                (link.addresses[r], control.encode(control.PushPlan(d_req=reg.d_req, writes=r in writers)), r)
                for r in link.targets
            ]
            self._send_controls(link.ep, [(a, m, worker_name(link.engine_id, r)) for a, m, r in plans])
        except Exception as exc:  # noqa: BLE001 - this request fails alone (its decode times out waiting)
            log.error("hybrid-kv %s: streaming %s to %s failed: %s", self.name, rid, reg.d_req, exc)
            self.stats.count("num_failed_transfers")
            stream.failed, stream.ended = str(exc), True
            return None
        return stream

    def _prelink(self, reg: control.StreamReg) -> None:
        """Start the handshake with a registering decode engine now, so its link is there by the request's last
        prefill step (no request waits on it: one that finds no link is pushed whole)."""
        if reg.engine in self.links or reg.engine in self._handshakes or not host_allowed(reg.host, self._networks):
            return
        log.info(
            "hybrid-kv %s: handshake with %s (%s:%d, TP %d) started", self.name, reg.engine, reg.host, reg.port, reg.tp
        )
        deadline = time.monotonic() + self.cfg.transfer_timeout_s
        self._handshakes.submit(reg.engine, self._handshake, reg.engine, reg.host, reg.port, reg.tp, deadline)

    def save_layer(self, layer: str) -> None:
        """vLLM's ``save_kv_layer``: release the stages this layer's hook proves final (on CUDA once its kernels
        ran, waited for on the poster thread). The forward never waits here."""
        hooks = self.hooks
        if hooks is None or not hooks.active:
            return
        try:
            n = hooks.on_hook(layer)
            if n is not None and self.poster is not None:
                self.poster.submit(self._event(), [(s, n) for s in hooks.active])
        except Exception as exc:  # noqa: BLE001 - never raise into the forward: the rest goes at its end
            log.error("hybrid-kv %s: streaming at layer %s failed: %s", self.name, layer, exc)

    def end_forward(self) -> None:
        """vLLM's ``wait_for_save``: release every remaining stage of this forward's streams (returns at once)."""
        hooks = self.hooks
        if hooks is None or not hooks.active:
            return
        try:
            streams = hooks.end()
            if self.poster is not None:
                self.poster.submit(self._event(), [(s, hooks.num_stages) for s in streams])
        except Exception as exc:  # noqa: BLE001 - never raise into vLLM's step: the deadline fails them
            log.error("hybrid-kv %s: releasing the rest of this forward's streams failed: %s", self.name, exc)

    def _event(self) -> Any:
        """A CUDA event recorded on the current stream (the layer's kernels), or ``None`` on CPU."""
        if not self._cuda:
            return None
        import torch

        ev = torch.cuda.Event()  # type: ignore[no-untyped-call, unused-ignore]
        ev.record()
        return ev

    def _stream_leased(self, rid: str, send: SendLease | None) -> None:
        """The scheduler finished (``send``) or aborted (``None``) streamed request ``rid``: its blocks wait for
        the stream. Blocks that changed since its last step (never expected) fail it."""
        stream = self.streams[rid]
        stream.leased = True
        if send is not None and send.block_ids != stream.block_ids and stream.handle is not None and not stream.ended:
            log.error("hybrid-kv %s: %s finished with other blocks than it streamed from; failing it", self.name, rid)
            stream.failed = "blocks changed after streaming"
            if self.server is not None:
                self.server.cancel(stream.key, stream.failed)  # reported by the next poll: the stream then ends
        if stream.ended:
            self._end_stream(rid)

    def _end_stream(self, rid: str) -> None:
        stream = self.streams.pop(rid)
        self.leases.end_stream(stream.cap)
        self._sent(rid)

    # ------------------------------------------------------------------ completion

    def _sent(self, p_req: str) -> None:
        self.leases.drop(p_req)
        self.finished_sending.add(p_req)

    def _recv_failed(self, rid: str, local_ids: BlockIds, failed: Any, link: PeerLink | None = None) -> None:
        self.stats.count("num_failed_transfers")
        self.finished_recving.add(rid)
        if self.num_groups == 1:
            # one group: block ids name blocks uniquely, so vLLM recomputes from the first failed block
            self.invalid_blocks.update(self._failed_blocks(local_ids, failed, link))
        else:
            self.failed_recving.add(rid)  # several groups: vLLM recomputes the request

    def _failed_blocks(self, local_ids: BlockIds, failed: Any, link: PeerLink | None) -> set[int]:
        """The request's blocks whose bytes are not known to have landed (all of them without details): each failed
        transfer's local descriptors mapped to logical blocks per group by the Rust core (``PeerPlan.failed_blocks``:
        unit, split, SSM, chunk and whole-state rows, padded pages), intersected with the request's ids."""
        all_ids = {b for g in local_ids for b in g}
        if not failed or link is None:
            return all_ids
        hit: set[int] = set()
        try:
            for f in failed:
                per_group = link.plan.failed_blocks(f.local_key, np.asarray(f.local_ids, dtype=np.int32))
                for ids, blocks in zip(local_ids, per_group, strict=True):
                    hit.update(np.intersect1d(np.asarray(ids, dtype=np.uint64), blocks).tolist())
        except Exception as exc:  # noqa: BLE001 - never raised into get_finished: then every block is invalid
            log.error("hybrid-kv %s: mapping failed descriptors to blocks failed: %s", self.name, exc)
            return all_ids
        return hit or all_ids

    def _on_control(self, sender: str, payload: bytes) -> None:
        """A control message (``control``): typed and bounded, bound to its sender and to its ticket's grant;
        anything else is refused and logged, never raised."""
        try:
            msg = control.decode(payload)
        except control.ControlError as exc:
            self._refused(sender, str(exc))
            return
        if isinstance(msg, control.PushPlan):
            self._on_push_plan(sender, msg)
            return
        if isinstance(msg, control.VerifyAnswer):
            self._on_verify_answer(sender, msg)
            return
        if isinstance(msg, control.VerifyAsk):
            self._on_verify_ask(sender, msg)
            return
        reason = self.leases.on_message(sender, msg)
        if reason is not None:
            self._refused(sender, reason)
        elif isinstance(msg, control.StreamReg) and self.cfg.mode == "push" and any(msg.ids):
            self._prelink(msg)

    def _progress(self) -> None:
        self._poll_handshakes()
        if self.server is not None:
            t0 = time.perf_counter()
            ev = self.server.poll()
            self.stats.add_time("worker_poll_s", time.perf_counter() - t0)
            for c in ev.control:
                self._on_control(c.sender, c.payload)
            for rid in ev.done:
                self._finish(rid, None)
            for err in ev.failed:
                if err.request_id is not None:
                    self._finish(err.request_id, err)
        if self.cfg.mode == "push":
            self._match_pushes()
        self._on_lost_controls()
        self._verify_progress()
        for rid, expired in self.leases.take_due():
            if expired:
                log.warning("hybrid-kv %s: lease of %s expired before its decode engine released it", self.name, rid)
                self.stats.count("num_expired_leases")
            self._sent(rid)
        now = time.monotonic()
        for rid, wait in list(self.push_wait.items()):
            if now >= wait["deadline"]:
                del self.push_wait[rid]
                self._push_failed(rid, wait, "no push within the registration timeout")

    def _finish(self, key: str, err: TransferError | None) -> None:
        job = self.inflight.pop(key, None)
        if job is None:
            return
        if err is None and job.role == "recv" and _lease_over(job.lease_expires_at):
            # the bytes may come from blocks the prefill engine freed and reused: not a valid load
            err = TransferError(f"read of {job.request_id!r} ended after the prefill engine's lease expired")
        if err is None and job.handle is not None:  # NIXL's telemetry of the request's transfers
            tel = job.handle.stats
            self.stats.record_transfer(tel.bytes, tel.descriptors, job.ids, tel.post_s, tel.transfer_s)
        if job.role == "stream":
            stream = self.streams.get(job.request_id)
            if err is not None:
                log.error("hybrid-kv %s: streaming %s failed: %s", self.name, job.request_id, err)
                self.stats.count("num_failed_transfers")
            if stream is not None:
                stream.ended = True
                if stream.leased:
                    self._end_stream(job.request_id)
            return
        if job.role == "recv":
            if err is None:
                self.finished_recving.add(job.request_id)
            else:
                log.error("hybrid-kv %s: loading %s failed: %s", self.name, job.request_id, err)
                self._recv_failed(job.request_id, job.local_ids, err.failed, job.link)
            if job.link is not None and job.release:
                self._send_controls(job.link.ep, job.release)
        else:
            if err is not None:
                log.error("hybrid-kv %s: pushing %s failed: %s", self.name, job.request_id, err)
                self.stats.count("num_failed_transfers")
            self._sent(job.request_id)

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        t0 = time.perf_counter()
        self._progress()
        if self._release_only:  # their releases were sent (or failed): vLLM has nothing to hear of them
            gone = self._release_only & (self.finished_recving | self.failed_recving)
            self.finished_recving -= gone
            self.failed_recving -= gone
            self._release_only -= gone
        out = (self.finished_sending, self.finished_recving, self.failed_recving)
        self.finished_sending, self.finished_recving, self.failed_recving = set(), set(), set()
        self.stats.add_time("worker_s", time.perf_counter() - t0)
        return out

    def take_invalid_blocks(self) -> set[int]:
        out, self.invalid_blocks = self.invalid_blocks, set()
        return out

    def take_stats(self) -> HybridKvStats | None:
        stats = self.stats.clone_and_reset()
        return None if stats.is_empty() and not stats.data["worker_s"] else stats

    def shutdown(self) -> None:
        """Close the endpoint (every link's handles with it); a handshake still running is awaited (it has
        deadlines; a prepared link holds no NIXL handle)."""
        if self.poster is not None:
            self.poster.close()
        self._handshakes.shutdown()
        self.controls.shutdown()  # the messages being sent have their deadlines
        self.links.clear()
        if self.server is not None:
            self.server.close()
            self.server = None
