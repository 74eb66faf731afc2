"""Per-transfer statistics: vLLM's KV-connector stats hook (``KVConnectorStats``) and Prometheus metrics.

A worker records one observation per request it moved, from NIXL's telemetry of the request's transfers
(``RequestHandle.stats``: bytes moved, descriptors NIXL posted after merging ids consecutive on both sides,
time NIXL spent posting, the longest transfer's post-to-completion time) plus the descriptor ids the planner
handed NIXL, and counts failed transfers, failed handshakes and expired leases; vLLM ships the ``data``
dict to its stats logger, which aggregates workers, logs ``reduce()`` and feeds
``HybridKvPromMetrics.observe``. Metric names follow vLLM's NIXL connector (``vllm:nixl_*`` there,
``vllm:hybrid_kv_*`` here).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

__all__ = ["SERIES", "COUNTERS", "HybridKvPromMetrics", "HybridKvStats"]

SERIES = ("xfer_time_s", "post_time_s", "bytes", "descriptors", "ids", "claim_time_s")
COUNTERS = (
    "num_failed_transfers",
    "num_failed_handshakes",
    "num_expired_leases",
    "num_refused_tickets",
    "num_lease_renewals",
    "num_verified_transfers",
    "num_digest_mismatches",
    "num_streamed_requests",
    "num_stream_fallbacks",
    "num_lost_controls",
    "num_refused_claims",
    "num_held_requests",
    "num_late_registrations",
    "num_dropped_links",
    "num_side_channel_restarts",
)
# Time spent in the connector's hooks (for overhead reports): the scheduler half, the worker half, and three
# parts of the worker half: ``Endpoint.post`` (checks and NIXL's posting), control messages to peers (one
# side-channel round trip each), ``Endpoint.poll`` (NIXL progress and notifications)
TIMERS = ("scheduler_s", "worker_s", "worker_post_s", "worker_control_s", "worker_poll_s")


def _empty() -> dict[str, Any]:
    return {**{k: [] for k in SERIES}, **{k: 0 for k in COUNTERS}, **{k: 0.0 for k in TIMERS}}


@dataclass
class HybridKvStats(KVConnectorStats):  # type: ignore[misc, unused-ignore]  # vLLM is untyped where it is not installed
    """Observations since the last ``get_kv_connector_stats()`` (serializable: ``data`` is plain lists/numbers)."""

    data: dict[str, Any] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        for k, v in _empty().items():
            self.data.setdefault(k, v)

    def reset(self) -> None:
        self.data = _empty()

    def record_transfer(self, nbytes: int, descriptors: int, ids: int, post_s: float, xfer_s: float) -> None:
        """One request moved: NIXL's telemetry (``nbytes``, ``descriptors`` posted, ``post_s``, ``xfer_s``) and
        the descriptor ``ids`` it was handed."""
        self.data["bytes"].append(int(nbytes))
        self.data["descriptors"].append(int(descriptors))
        self.data["ids"].append(int(ids))
        self.data["post_time_s"].append(float(post_s))
        self.data["xfer_time_s"].append(float(xfer_s))

    def record_claim(self, seconds: float) -> None:
        """A pull request's lease claims were answered ``seconds`` after they were queued (the round trip before its
        READ)."""
        self.data["claim_time_s"].append(float(seconds))

    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` to counter ``key`` (one of ``COUNTERS``)."""
        self.data[key] += n

    def add_time(self, key: str, seconds: float) -> None:
        """Add ``seconds`` of Python time to timer ``key`` (one of ``TIMERS``)."""
        self.data[key] += seconds

    def clone_and_reset(self) -> HybridKvStats:
        out = HybridKvStats(data=copy.deepcopy(self.data))
        self.reset()
        return out

    def is_empty(self) -> bool:
        return not self.data["bytes"] and not any(self.data[k] for k in COUNTERS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty() or any(other.data.get(k) for k in TIMERS):
            for k in SERIES:
                self.data[k].extend(other.data.get(k, []))
            for k in (*COUNTERS, *TIMERS):
                self.data[k] += other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        n = len(self.data["bytes"])
        total = sum(self.data["bytes"])
        xfer = sum(self.data["xfer_time_s"])
        out: dict[str, int | float] = {
            "num_successful_transfers": n,
            **{k: self.data[k] for k in COUNTERS},
        }
        if n:
            out.update(
                {
                    "avg_xfer_time_ms": round(xfer / n * 1e3, 3),
                    "avg_post_time_ms": round(sum(self.data["post_time_s"]) / n * 1e3, 3),
                    "avg_mb_per_transfer": round(total / n / 2**20, 3),
                    "throughput_mb_s": round(total / 2**20 / xfer, 3) if xfer > 0 else 0.0,
                    "avg_num_descriptors": round(sum(self.data["descriptors"]) / n, 1),
                    "avg_num_ids": round(sum(self.data["ids"]) / n, 1),
                }
            )
        return out


class HybridKvPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc, unused-ignore]  # vLLM is untyped where it is not installed
    """``vllm:hybrid_kv_*`` histograms and counters, one child per engine label set."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        times = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
        hist = {
            "xfer_time_s": ("vllm:hybrid_kv_xfer_time_seconds", "Transfer time of a request (post to done).", times),
            "post_time_s": ("vllm:hybrid_kv_post_time_seconds", "Time to post a request's transfers.", times),
            "bytes": ("vllm:hybrid_kv_bytes_transferred", "Bytes moved per request.", [2**i for i in range(11, 35, 2)]),
            "claim_time_s": (
                "vllm:hybrid_kv_claim_time_seconds",
                "Lease claim round trip of a pull request (its claims queued to the last answer, before the READ).",
                times,
            ),
            "descriptors": (
                "vllm:hybrid_kv_num_descriptors",
                "Descriptors NIXL posted per request (after merging ids consecutive on both sides).",
                [10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 50000],
            ),
        }
        counters = {
            "num_failed_transfers": ("vllm:hybrid_kv_num_failed_transfers", "Failed hybrid-kv transfers."),
            "num_failed_handshakes": ("vllm:hybrid_kv_num_failed_handshakes", "Failed hybrid-kv handshakes."),
            "num_expired_leases": (
                "vllm:hybrid_kv_num_kv_expired_reqs",
                "Prefill requests whose blocks were freed by lease expiry, not by the decode's completion.",
            ),
            "num_refused_tickets": (
                "vllm:hybrid_kv_num_refused_tickets",
                "Decode requests whose kv_transfer_params (ticket) were refused: forged, malformed, expired, reused.",
            ),
            "num_lease_renewals": (
                "vllm:hybrid_kv_num_lease_renewals",
                "Prefill leases a decode renewed while its handshake was still running.",
            ),
            "num_verified_transfers": (
                "vllm:hybrid_kv_num_verified_transfers",
                "Decode requests whose end-to-end transfer digests were compared (setting verify).",
            ),
            "num_digest_mismatches": (
                "vllm:hybrid_kv_num_digest_mismatches",
                "Decode requests failed because a transfer digest differed (corrupted or stale bytes).",
            ),
            "num_streamed_requests": (
                "vllm:hybrid_kv_num_streamed_requests",
                "Prefill requests whose KV was pushed layer by layer during their last prefill forward.",
            ),
            "num_stream_fallbacks": (
                "vllm:hybrid_kv_num_stream_fallbacks",
                "Prefill requests with a stream capability pushed whole (no decode registration or link in time).",
            ),
            "num_lost_controls": (
                "vllm:hybrid_kv_num_lost_controls",
                "Control messages to peers never acknowledged after every attempt (a request waiting on one fails).",
            ),
            "num_refused_claims": (
                "vllm:hybrid_kv_num_refused_claims",
                "Pull requests failed because a prefill refused the lease claim (ended, held by another engine).",
            ),
            "num_held_requests": (
                "vllm:hybrid_kv_num_held_requests",
                "Failed push requests whose blocks were held until no write could land any more.",
            ),
            "num_late_registrations": (
                "vllm:hybrid_kv_num_late_registrations",
                "Push registrations that came after their decode stopped waiting (nothing written).",
            ),
            "num_dropped_links": (
                "vllm:hybrid_kv_num_dropped_links",
                "Links to a dead or restarted peer engine dropped (linked again on the next request).",
            ),
            "num_side_channel_restarts": (
                "vllm:hybrid_kv_num_side_channel_restarts",
                "Side-channel processes restarted after they died.",
            ),
        }
        self._hist = {
            k: self._make(self._histogram_cls(name=n, documentation=d, buckets=b, labelnames=labelnames))
            for k, (n, d, b) in hist.items()
        }
        self._counters = {
            k: self._make(self._counter_cls(name=n, documentation=d, labelnames=labelnames))
            for k, (n, d) in counters.items()
        }

    def _make(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, children in self._hist.items():
            for value in transfer_stats_data.get(key, ()):
                children[engine_idx].observe(value)
        for key, children in self._counters.items():
            n = transfer_stats_data.get(key, 0)
            if n:
                children[engine_idx].inc(n)
