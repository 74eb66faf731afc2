"""Streaming push: a prefill rank posts each layer's KV while the request's last prefill forward still runs.

Written once for the vLLM connector's workers and the streaming benchmark (no vLLM import).

The pieces, from the forward's hooks to NIXL:

- ``ForwardHooks`` turns vLLM's per-layer hooks into stage releases. At each ``save_kv_layer(L)`` it looks up
  (in a dict built once from the Rust ``StreamSchedule``) how many stages are final once ``L``'s hook fired;
  ``wait_for_save`` releases the rest (stages whose last layer is an SSM layer after the last hook). Hooks must
  arrive in forward order: one that comes earlier than a hook already seen means the order assumption does not
  hold here, and nothing more is released before ``wait_for_save``.
- ``StreamPoster`` is the one thread that posts: the forward only records a CUDA event (on CUDA: the layer's
  kernels were only launched) and queues the release; the poster waits for the event, then releases the
  stages on the endpoint (``Endpoint.release``, under the endpoint's lock, so the worker's ``poll`` and the
  poster never call into the NIXL agent at the same time). While streamed transfers are in flight it also
  progresses the endpoint every ``PROGRESS_S`` (transports that move bytes in software, UCX over TCP, move them
  only while someone does), leaving the events for the worker's next ``poll``.

The forward thread never waits: a hook costs a dict lookup, an event record and a queue put.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ._core import StreamSchedule
from .transport import Endpoint, RequestHandle

__all__ = ["PROGRESS_S", "ForwardHooks", "Stream", "StreamPoster"]

log = logging.getLogger("hybrid_kv.streaming")

PROGRESS_S = 0.002
"""How often the poster progresses the endpoint while streamed transfers are in flight and nothing is queued."""


@dataclass
class Stream:
    """One prefill request streaming (or that tried to) this step: what was posted and what ended."""

    request_id: str  # the prefill's request id
    key: str  # the id posted on the endpoint (the decode's request id, as its notices name it)
    cap: bytes
    block_ids: list[list[int]]
    handle: RequestHandle | None  # None: nothing to write (the decode has no blocks for it here)
    ended: bool = False  # its transfers all ended (done or failed)
    leased: bool = False  # the scheduler finished (or aborted) the request: its blocks wait for this stream
    failed: str | None = None


class ForwardHooks:
    """Which stages each layer hook of the current forward releases (see the module docs).

    Args:
        schedule: this worker's stream schedule (its region table's).
        name: the worker, for logs.
    """

    def __init__(self, schedule: StreamSchedule, name: str) -> None:
        self.num_stages = schedule.num_stages
        self._hooks = {layer: (pos, n) for pos, (layer, n) in enumerate(schedule.hooks)}
        self.name = name
        self.active: list[Stream] = []
        self._released = 0
        self._pos = -1
        self._broken = False
        self.out_of_order = 0  # forwards whose hooks came out of order

    @property
    def released(self) -> int:
        """Stages this forward's hooks released so far."""
        return self._released

    def begin(self, streams: list[Stream]) -> None:
        """A forward that streams ``streams`` starts (nothing released yet)."""
        self.active = streams
        self._released, self._pos, self._broken = 0, -1, False

    def on_hook(self, layer: str) -> int | None:
        """The number of stages final once ``layer``'s hook fired, when it releases more; else ``None``."""
        hook = self._hooks.get(layer)
        if hook is None or not self.active:
            return None  # a layer that is not ours (another group, a layer sharing another's cache)
        pos, n = hook
        if pos < self._pos and not self._broken:
            self._broken = True
            self.out_of_order += 1
            log.warning(
                "hybrid-kv %s: save hook of %s came after a later layer's: the rest of this forward's KV is posted "
                "at its end",
                self.name,
                layer,
            )
        self._pos = max(self._pos, pos)
        if self._broken or n <= self._released:
            return None
        self._released = n
        return n

    def end(self) -> list[Stream]:
        """The forward ended: its streams, whose every stage may now be released (then none is active)."""
        out, self.active = self.active, []
        return out


@dataclass
class _Job:
    event: Any  # a CUDA event to wait for, or None
    releases: list[tuple[Stream, int]]
    queued: float = field(default_factory=time.perf_counter)


class StreamPoster:
    """The thread that releases streamed stages on ``ep`` once their layer's kernels finished.

    ``delays`` collects each release's delay after its hook (seconds: CUDA event wait plus queueing).
    """

    def __init__(self, ep: Endpoint, name: str) -> None:
        self._ep = ep
        self._q: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._live: dict[str, RequestHandle] = {}  # streamed requests with transfers posted, maybe unfinished
        self.delays: list[float] = []
        self._thread = threading.Thread(target=self._run, name=f"hkv-stream-{name}", daemon=True)
        self._thread.start()

    def submit(self, event: Any, releases: list[tuple[Stream, int]]) -> None:
        """Release, once ``event`` (a CUDA event, or ``None``) completed, each stream's stages below the count."""
        self._q.put(_Job(event, releases))

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(5.0)

    def _run(self) -> None:
        while True:
            try:
                job = self._q.get(timeout=PROGRESS_S if self._live else None)
            except queue.Empty:
                self._progress()
                continue
            if job is None:
                return
            self._post(job)

    def _post(self, job: _Job) -> None:
        if job.event is not None:
            try:
                job.event.synchronize()  # the layer's kernels finished writing its KV (releases the GIL)
            except Exception as exc:  # noqa: BLE001 - never post bytes not known to be written
                log.error("hybrid-kv: waiting for a layer's CUDA event failed: %s; its KV is not posted", exc)
                for stream, _ in job.releases:
                    stream.failed = stream.failed or f"CUDA event failed: {exc}"
                    self._cancel(stream)
                return
        self.delays.append(time.perf_counter() - job.queued)
        for stream, n in job.releases:
            if stream.handle is None or stream.failed is not None:
                continue
            try:
                if self._ep.release(stream.key, n):
                    self._live[stream.key] = stream.handle
            except Exception as exc:  # noqa: BLE001 - a closed endpoint, a bug: the request's deadline fails it
                log.error("hybrid-kv: releasing stages of %s failed: %s", stream.request_id, exc)

    def _cancel(self, stream: Stream) -> None:
        try:
            self._ep.cancel(stream.key, stream.failed or "cancelled")
        except Exception as exc:  # noqa: BLE001 - a closed endpoint failed it already
            log.debug("hybrid-kv: cancelling %s: %s", stream.request_id, exc)

    def _progress(self) -> None:
        try:
            self._ep.progress()
        except Exception as exc:  # noqa: BLE001 - the endpoint closed under us: stop progressing it
            log.debug("hybrid-kv: progressing streamed transfers stopped: %s", exc)
            self._live.clear()
            return
        for key in [k for k, h in self._live.items() if h.finished]:
            del self._live[key]
