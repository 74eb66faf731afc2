"""The ``hybrid-kv demo``: prefill and decode ranks as separate processes, real NIXL transfers, every byte checked.

* :mod:`.content` defines what the KV caches hold (one logical model, cut per rank as docs/byte-layouts.md says);
* :mod:`.worker` is one rank's process: torch pools, region table, NIXL endpoint, handshake, transfers;
* :mod:`.run` starts the ranks, hands out requests, and collects timings and the verdict.
"""

from .run import DemoConfig, DemoResult, run_demo

__all__ = ["DemoConfig", "DemoResult", "run_demo"]
