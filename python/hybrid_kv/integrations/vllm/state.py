"""What every part of a worker shares once its KV caches are registered: ``Registered``, ``Completion``, ``Job``.

Threads: every field here, and every field of the roles built on it (``pull``, ``claim_server``, ``push_recv``,
``push_send``, ``stream_send``, ``links``), is read and written only under the worker's lock
(``WorkerHalf.lock``): by vLLM's worker thread in its hooks, and by the worker's ``Responder`` between steps. The
other threads a worker runs own nothing here: the handshake threads (``link_pool``) return prepared links, the
courier (``transport.courier``) returns delivery outcomes, the stream poster (``streaming``) releases stages
through the endpoint's lock; their results are taken in ``WorkerHalf._progress``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..._core import RegionTable
from ...connector_core.config import ConnectorConfig
from ...connector_core.control import Refusals
from ...peer_link import rank_address
from ...transport import Endpoint, RequestHandle, Transfer, TransferError
from .layout import RankGeometry
from .metadata import BlockIds
from .outbox import Outbox
from .stats import HybridKvStats

if TYPE_CHECKING:
    from ...connector_core.params import IpNetwork
    from ...peer_link import PeerLink
    from ...verify import Digester, MirrorCache

__all__ = ["Completion", "Job", "JobOwner", "Registered"]

log = logging.getLogger("hybrid_kv.integrations.vllm.worker")


class Completion:
    """What the worker reports to vLLM at its next ``get_finished``: requests done sending or receiving, failed
    loads, and blocks to recompute."""

    def __init__(self, name: str, num_groups: int, stats: HybridKvStats) -> None:
        self.name = name
        self.num_groups = num_groups
        self.stats = stats
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.invalid_blocks: set[int] = set()
        self.release_only: set[str] = set()  # requests vLLM no longer knows (``RecvReq.release_only``): never reported

    def sent(self, p_req: str) -> None:
        """A prefill request's blocks may be freed."""
        self.finished_sending.add(p_req)

    def received(self, rid: str) -> None:
        """A decode request's KV landed (or there was nothing to load)."""
        self.finished_recving.add(rid)

    def recv_failed(self, rid: str, local_ids: BlockIds, failed: Any = None, link: PeerLink | None = None) -> None:
        """A decode request's load failed: with one group, vLLM recomputes from the first block not known to have
        landed (``failed``: the failed transfers, mapped to blocks through ``link``'s plan); with several, it
        recomputes the request."""
        self.stats.count("num_failed_transfers")
        self.finished_recving.add(rid)
        if self.num_groups == 1:
            self.invalid_blocks.update(self._failed_blocks(local_ids, failed, link))
        else:
            self.failed_recving.add(rid)

    def take(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call; requests that only
        released a prefill's blocks are left out (vLLM does not know them)."""
        if self.release_only:
            gone = self.release_only & (self.finished_recving | self.failed_recving)
            self.finished_recving -= gone
            self.failed_recving -= gone
            self.release_only -= gone
        out = (self.finished_sending, self.finished_recving, self.failed_recving)
        self.finished_sending, self.finished_recving, self.failed_recving = set(), set(), set()
        return out

    def take_invalid_blocks(self) -> set[int]:
        out, self.invalid_blocks = self.invalid_blocks, set()
        return out

    def _failed_blocks(self, local_ids: BlockIds, failed: Any, link: PeerLink | None) -> set[int]:
        """The request's blocks whose bytes are not known to have landed (all of them without details): each failed
        transfer's local descriptors mapped to logical blocks per group by the Rust core (``PeerPlan.failed_blocks``),
        intersected with the request's ids."""
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


@dataclass
class Registered:
    """A worker after ``register_kv_caches``: its memory, endpoint and the state every role shares."""

    name: str
    engine_id: str
    tp_rank: int
    tp_size: int
    port: int
    cfg: ConnectorConfig
    table: RegionTable
    geometry: RankGeometry
    ep: Endpoint
    payload: bytes
    instance: str  # this rank's ``claims.instance_of``
    digester: Digester
    mirrors: MirrorCache
    stats: HybridKvStats
    completion: Completion
    outbox: Outbox
    refused: Refusals
    networks: tuple[IpNetwork, ...] | None
    inflight: dict[str, Job] = field(default_factory=dict)  # by the id posted or awaited on the endpoint

    def address(self, host: str, port: int, rank: int) -> str:
        """Side-channel address of rank ``rank`` of an engine whose TP rank 0 listens on ``host:port``."""
        return rank_address(host, port, rank)


class JobOwner(Protocol):
    """The role that posted (or awaits) a job, told once when it ends."""

    def finish(self, job: Job, err: TransferError | None) -> None: ...


@dataclass
class Job:
    """A request this worker posted (or awaits) on its endpoint: what to report when it ends, and to whom."""

    owner: JobOwner
    request_id: str  # the vLLM request id on this engine
    link: PeerLink | None
    transfers: list[Transfer]
    handle: RequestHandle | None  # the posted request (its ``stats`` are NIXL's telemetry); None when awaited
    ids: int  # descriptor ids handed to NIXL (before its merge of ids consecutive on both sides)
    local_ids: BlockIds = field(default_factory=list)
    t_post: float = field(default_factory=time.perf_counter)
    extra: Any = None  # what the owner needs when it ends

    def record(self, stats: HybridKvStats) -> None:
        """Count the job's NIXL telemetry (a posted job that completed)."""
        if self.handle is not None:
            tel = self.handle.stats
            stats.record_transfer(tel.bytes, tel.descriptors, self.ids, tel.post_s, tel.transfer_s)
