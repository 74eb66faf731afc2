"""A transfer NIXL will not cancel keeps its request's blocks from vLLM until NIXL lets it go: vLLM 0.33's real
Scheduler and workers, real NIXL, pull mode.

NIXL cancels a transfer when its handle is released; when it cannot (the release raises, the handle is kept), the
READ may still land. The decode used to report such a request failed at once: vLLM then recomputed into (or reused)
blocks a late READ could still write, and the decode told the prefill to free the blocks it was reading. Now the
worker holds the request until NIXL released the transfer, and reports it then.
"""

from __future__ import annotations

import os
import time

from vllm_harness import CONTENT_TOKENS, Engine, EngineSpec, prompt, run_until, side_channel_ports

os.environ.setdefault("HYBRID_KV_SECRET", "hybrid-kv-vllm-connector-tests-secret")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

TRANSFER_TIMEOUT_S = 1.0


def test_a_read_nixl_will_not_cancel_holds_its_request_until_nixl_releases_it(model_dirs: dict[str, str]) -> None:
    p_port, d_port = side_channel_ports(2)
    p = Engine.start(EngineSpec("prefill", "gqa", model_dirs["gqa"], 1, "pull", p_port))
    extra = (("transfer_timeout_s", TRANSFER_TIMEOUT_S),)
    d = Engine.start(EngineSpec("decode", "gqa", model_dirs["gqa"], 1, "pull", d_port, extra=extra))
    try:
        p.add("p-0", prompt(0, 300), {"do_remote_decode": True}, 0)
        p.fills["p-0"] = (0, CONTENT_TOKENS)
        run_until([p], lambda: "p-0" in p.outputs)
        d.workers.call("stick", True)
        d.add("d-0", prompt(0, 300), dict(p.outputs["p-0"]), 0)
        # well past the READ's deadline: its request failed in the worker, with the READ still "in flight"
        until = time.monotonic() + 5 * TRANSFER_TIMEOUT_S + 2
        run_until([p, d], lambda: time.monotonic() > until, timeout_s=60)
        assert "d-0" not in d.outputs, "reported to vLLM while a READ of it may still land"
        assert d.counter("num_failed_transfers") == 0
        d.workers.call("stick", False)  # NIXL lets the READ go
        run_until([p, d], lambda: "d-0" in d.outputs, timeout_s=60)
        assert d.counter("num_failed_transfers") == 1  # reported as a failed load (vLLM recomputed it)
    finally:
        p.close()
        d.close()
