"""``HybridKvConnector``: the class vLLM instantiates (``kv_connector``/``kv_connector_module_path``).

It forwards the scheduler hooks to ``SchedulerHalf`` and the worker hooks to ``WorkerHalf``; loads complete
asynchronously (between steps), saves are the decode's READs (pull) or the prefill's WRITEs (push), so
``wait_for_layer_load`` has nothing to do per layer. In push mode a request whose decode registered during the
prefill streams: ``bind_connector_metadata`` (before the forward) starts it, ``save_kv_layer`` releases what
each attention layer's hook proves final and ``wait_for_save`` the rest, none of them waiting (``hybrid_kv.streaming``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ...connector_core.config import ConnectorConfig
from .layout import prefer_ds_conv_layout
from .logs import attach_to_vllm
from .metadata import HybridKvMetadata
from .plugin import register as register_with_vllm
from .scheduler import SchedulerHalf
from .stats import HybridKvPromMetrics, HybridKvStats
from .worker import WorkerHalf

__all__ = ["HybridKvConnector"]

log = logging.getLogger("hybrid_kv.integrations.vllm")
attach_to_vllm()  # hybrid_kv records go to vLLM's log stream, in every process that loads the connector
prefer_ds_conv_layout()  # before vLLM starts the engine processes (they inherit it): SSM conv states in DS

# vLLM's MultiConnector rebuilds its sub-connectors' stats by name from vLLM's connector registry, ignoring
# kv_connector_module_path: without a registration, an engine whose MultiConnector wraps this connector dies at its
# first stats record. Registered here (any process that loads the connector through its module path) and by the
# vLLM general plugin ``plugin.register`` (every vLLM process, where the wheel is installed).
register_with_vllm()


class HybridKvConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc, unused-ignore]  # vLLM is untyped where it is not installed
    """A KV connector for disaggregated prefill/decode built on hybrid-kv's planner and NIXL transport."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        attach_to_vllm()  # again: vLLM may have reconfigured its logging since the import
        ktc = vllm_config.kv_transfer_config
        self.cfg = ConnectorConfig.resolve(ktc.kv_connector_extra_config)
        engine_id = ktc.engine_id
        if not engine_id:
            raise ValueError("hybrid-kv needs kv_transfer_config.engine_id")
        self.scheduler: SchedulerHalf | None = None
        self.worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerHalf(vllm_config, kv_cache_config, engine_id, self.cfg)
        else:
            self.worker = WorkerHalf(vllm_config, kv_cache_config, engine_id, self.cfg)

    # ------------------------------------------------------------------ class-level hooks

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Heads-major pages (``LBHNC``) so a head range is contiguous (docs/byte-layouts.md); MLA has one head."""
        mc = getattr(vllm_config, "model_config", None)
        return None if mc is not None and getattr(mc, "use_mla", False) else "LBHNC"

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HybridKvStats:
        return HybridKvStats(data=data) if data is not None else HybridKvStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any
    ) -> HybridKvPromMetrics:
        return HybridKvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ scheduler side

    def _sched(self) -> SchedulerHalf:
        assert self.scheduler is not None, "scheduler hook called on a worker connector"
        return self.scheduler

    def on_new_request(self, request: Any) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> HybridKvMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(self._kv_cache_config.transfer_group_ids)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    # ------------------------------------------------------------------ worker side

    def _work(self) -> WorkerHalf:
        assert self.worker is not None, "worker hook called on the scheduler connector"
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._work().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, HybridKvMetadata):
            self.worker.begin_step(connector_metadata)  # before the forward (start_load_kv may come after it)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, HybridKvMetadata):
            self._work().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.end_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._work().get_finished()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._work().get_finished()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_invalid_blocks()

    def get_kv_connector_stats(self) -> HybridKvStats | None:
        if self.worker is not None:
            return self.worker.take_stats()
        return None

    def shutdown(self) -> None:
        if self.worker is not None:
            t0 = time.perf_counter()
            self.worker.shutdown()
            log.debug("hybrid-kv worker shut down in %.1f ms", (time.perf_counter() - t0) * 1e3)
