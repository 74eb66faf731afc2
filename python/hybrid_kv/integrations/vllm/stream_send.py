"""``StreamSend``: the prefill side of a concurrent push: post each layer's KV while the last prefill forward runs.

In the step that computes a request's last prefill chunk (``begin_step``, before the forward) a rank holding its
decode's ``StreamReg`` and a live link to that decode engine plans the whole request once, cut into the stream
schedule's stages (``PeerPlan.plan_staged``), posts it as one staged request (nothing is sent yet), sends
``PushPlan`` at once, and releases each stage as the forward's layer hooks prove it final (``hybrid_kv.streaming``):
``save_layer`` per attention layer, ``end_forward`` for the rest. The staged request's deadline ends
``LEASE_MARGIN_S`` before the registration's ``until``. A request whose registration or link is not there in time
(or that is verified: a digest must be of final bytes) is pushed whole once it finished (``push_send``). Its
blocks stay held until what was posted for it ended, however it ends (``leased``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..._core import StreamSchedule
from ...connector_core import control
from ...connector_core.control import worker_name
from ...connector_core.leases import LeaseBook, push_deadline
from ...connector_core.params import host_allowed
from ...streaming import ForwardHooks, Stream, StreamPoster
from ...transport import TransferError
from .links import Links
from .metadata import HybridKvMetadata, SendLease
from .metadata import StreamSend as StreamSendReq
from .state import Job, Registered

__all__ = ["StreamSend"]

log = logging.getLogger("hybrid_kv.integrations.vllm.worker")


class StreamSend:
    """Streaming pushes of one registered prefill worker ``reg``: the schedule, this forward's hooks, the poster
    thread, and the streams by prefill request id (step thread, but for the poster's own queue)."""

    def __init__(self, reg: Registered, leases: LeaseBook, links: Links, schedule: StreamSchedule) -> None:
        self.reg = reg
        self.leases = leases
        self.links = links
        self.schedule = schedule
        self.hooks = ForwardHooks(schedule, reg.name)
        self.poster = StreamPoster(reg.ep, reg.name)
        self.streams: dict[str, Stream] = {}
        self._cuda = reg.geometry.mem_type == "VRAM"

    def begin_step(self, meta: HybridKvMetadata) -> None:
        """Start streaming the requests whose last prefill chunk this step computes and whose decode registered."""
        if self.hooks.active:
            self.end_forward()  # the previous forward's wait_for_save never came: release what it left
        started = []
        for rid, send in meta.stream.items():
            stream = self._start(rid, send)
            if stream is not None and stream.handle is not None:
                started.append(stream)
        self.hooks.begin(started)

    def _start(self, rid: str, send: StreamSendReq) -> Stream | None:
        """Plan and post ``rid`` staged if its registration and link are ready; else ``None`` (it is pushed whole
        once it finished, from the same registration)."""
        reg = self.reg
        msg = self.leases.stream_reg(send.cap)
        deadline = None if msg is None else push_deadline(msg.until, reg.cfg.transfer_timeout_s)
        if msg is None or deadline is None or not any(msg.ids) or not host_allowed(msg.host, reg.networks):
            reg.stats.count("num_stream_fallbacks")
            return None  # no live registration (or nothing to write, or a refused host: the lease path says why)
        if msg.verify:  # a digest is of final bytes: a verified request is pushed whole, digests in its notices
            return None
        link = self.links.get(msg.engine)
        if link is None:
            self.prelink(msg)
            reg.stats.count("num_stream_fallbacks")
            return None
        self.leases.take_stream(send.cap)
        stream = Stream(rid, msg.d_req, send.cap, send.block_ids, None)
        self.streams[rid] = stream
        try:
            stages = link.staged_transfers(send.block_ids, msg.ids, self.schedule)
            transfers = [t for stage in stages for t in stage]
            writers = {link.rank_of(t.peer) for t in transfers}
            if transfers:
                order = [k for k, stage in enumerate(stages) for _ in stage]
                t0 = time.perf_counter()
                stream.handle = link.ep.post(msg.d_req, transfers, "WRITE", deadline, stages=order)
                reg.stats.add_time("worker_post_s", time.perf_counter() - t0)
                nids = sum(int(t.local_ids.size) for t in transfers)
                reg.inflight[msg.d_req] = Job(self, rid, link, transfers, stream.handle, nids, send.block_ids)
                reg.stats.count("num_streamed_requests")
            else:
                stream.ended = True
            plans = [
                (link.addresses[r], control.encode(control.PushPlan(d_req=msg.d_req, writes=r in writers)), r)
                for r in link.targets
            ]
            reg.outbox.send(
                ((a, m, worker_name(link.engine_id, r)) for a, m, r in plans), deadline=time.monotonic() + deadline
            )
        except Exception as exc:  # noqa: BLE001 - this request fails alone (its decode times out waiting)
            log.error("hybrid-kv %s: streaming %s to %s failed: %s", reg.name, rid, msg.d_req, exc)
            reg.stats.count("num_failed_transfers")
            stream.failed, stream.ended = str(exc), True
            return None
        return stream

    def prelink(self, msg: control.StreamReg) -> None:
        """Start the handshake with a registering decode engine now, so its link is there by the request's last
        prefill step (no request waits on it: one that finds no link is pushed whole)."""
        if msg.engine in self.links or not host_allowed(msg.host, self.reg.networks):
            return
        self.links.link(msg.engine, msg.host, msg.port, msg.tp)

    def save_layer(self, layer: str) -> None:
        """vLLM's ``save_kv_layer``: release the stages this layer's hook proves final (on CUDA once its kernels
        ran, waited for on the poster thread). The forward never waits here."""
        if not self.hooks.active:
            return
        n = self.hooks.on_hook(layer)
        if n is not None:
            self.poster.submit(self._event(), [(s, n) for s in self.hooks.active])

    def end_forward(self) -> None:
        """vLLM's ``wait_for_save``: release every remaining stage of this forward's streams (returns at once)."""
        if not self.hooks.active:
            return
        streams = self.hooks.end()
        self.poster.submit(self._event(), [(s, self.hooks.num_stages) for s in streams])

    def _event(self) -> Any:
        """A CUDA event recorded on the current stream (the layer's kernels), or ``None`` on CPU."""
        if not self._cuda:
            return None
        import torch

        ev = torch.cuda.Event()  # type: ignore[no-untyped-call, unused-ignore]
        ev.record()
        return ev

    def leased(self, rid: str, send: SendLease | None) -> bool:
        """The scheduler finished (``send``) or aborted (``None``) request ``rid``: whether it streamed here (its
        blocks then wait for the stream). Blocks that changed since its last step (never expected) fail it."""
        stream = self.streams.get(rid)
        if stream is None:
            return False
        stream.leased = True
        if send is not None and send.block_ids != stream.block_ids and stream.handle is not None and not stream.ended:
            log.error(
                "hybrid-kv %s: %s finished with other blocks than it streamed from; failing it", self.reg.name, rid
            )
            stream.failed = "blocks changed after streaming"
            self.reg.ep.cancel(stream.key, stream.failed)  # reported by the next poll: the stream then ends
        if stream.ended:
            self._end(rid)
        return True

    def finish(self, job: Job, err: TransferError | None) -> None:
        """A streamed request's transfers ended."""
        if err is None:
            job.record(self.reg.stats)
        else:
            log.error("hybrid-kv %s: streaming %s failed: %s", self.reg.name, job.request_id, err)
            self.reg.stats.count("num_failed_transfers")
        stream = self.streams.get(job.request_id)
        if stream is not None:
            stream.ended = True
            if stream.leased:
                self._end(job.request_id)

    def _end(self, rid: str) -> None:
        stream = self.streams.pop(rid)
        self.leases.end_stream(stream.cap)
        self.leases.drop(rid)
        self.reg.completion.sent(rid)

    def close(self) -> None:
        self.poster.close()
