"""hybrid-kv's vLLM connector under a slow peer, a failed handshake and a prefill engine killed after the
handshake, with vLLM 0.33's real Scheduler and real NIXL transfers between processes; the per-request
metrics (NIXL telemetry) are checked against the bytes each request really owns, and fed through vLLM's
Prometheus hook into a real prometheus_client registry.

- the handshake runs on a background thread: while the prefill workers are stopped (SIGSTOP), the decode
  steps stay short and its requests wait; once they resume, every byte lands;
- a handshake that fails (no engine at the advertised address) fails exactly its request: vLLM's default
  ``kv_load_failure_policy`` ("fail") finishes it with an error, and "recompute" reschedules it from token 0;
  the other request of the same step lands byte-exact;
- a prefill engine killed after its handshake: its request fails, the other prefill engine's request in the
  same step lands byte-exact, and the failed request wrote nothing.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from harness_memory import CONTENT_TOKENS, Content, Memory
from harness_models import KB, EngineSpec, build
from tickets_helper import reissue
from vllm_harness import Engine, prompt, run_until, side_channel_ports

os.environ.setdefault("HYBRID_KV_SECRET", "hybrid-kv-vllm-connector-tests-secret")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

STEP_BOUND_S = 5.0
"""The longest decode step (scheduler + every worker's hooks) while a handshake is stuck: a step that waited for
the stuck peer would last the handshake timeout (10 s); a loaded machine has stalled a step for 2.5 s."""


class Outputs:
    """What vLLM's scheduler does: tokens scheduled per step (a spy on ``schedule``), finish reasons (the
    engine's)."""

    def __init__(self, engine: Engine) -> None:
        self.finish = engine.finish_reasons
        self.scheduled: list[dict[str, int]] = []
        orig_schedule = engine.scheduler.schedule

        def schedule() -> Any:
            so = orig_schedule()
            self.scheduled.append(dict(so.num_scheduled_tokens))
            return so

        engine.scheduler.schedule = schedule


def _prefill(p: Engine, names: list[str], lengths: list[int], first: int) -> dict[str, dict[str, Any]]:
    """Run prefill requests ``names`` (content indices from ``first``) and return their kv_transfer_params."""
    for k, (name, n) in enumerate(zip(names, lengths, strict=True)):
        p.add(name, prompt(first + k, n), {"do_remote_decode": True}, first + k)
        p.fills[name] = (first + k, CONTENT_TOKENS)
    run_until([p], lambda: all(n in p.outputs for n in names))
    return {n: dict(p.outputs[n]) for n in names}


def _checks(p_spec: EngineSpec, d: Engine, rids: list[str], index: dict[str, int]) -> list[Any]:
    """The harness's ``verify`` arguments for decode requests ``rids`` (what must have landed)."""
    from hybrid_kv.integrations.vllm.layout import transfer_group_kinds

    recv = {rid: r for meta in d.metas for rid, r in meta.recv.items()}
    kinds = transfer_group_kinds(d.kv_cfg)
    out = []
    for rid in rids:
        r = recv[rid]
        moved = None
        for g, kind in enumerate(kinds):
            if kind != "ssm":
                moved = min(
                    len(r.remote_block_ids[g]) * p_spec.logical_block_size,
                    len(r.local_block_ids[g]) * d.spec.logical_block_size,
                )
        out.append((r.local_block_ids, index[rid], CONTENT_TOKENS, moved))
    return out


def _verify(d: Engine, checks: list[Any]) -> None:
    for problem, nbytes in d.workers.call("verify", checks):
        assert problem is None, problem
        assert nbytes > 0


@functools.cache
def _rank_memory(spec: EngineSpec, rank: int) -> Memory:
    """Rank ``rank``'s KV memory of engine ``spec``, allocated in this process exactly as its worker did
    (vLLM's planner and ``allocate_kv_cache``): the same views at the same offsets."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    vc, kv_cfg, specs = build(spec)
    kernel = [
        KB if isinstance(g.kv_cache_spec, MLAAttentionSpec) or spec.model == "gqa" else g.kv_cache_spec.block_size
        for g in kv_cfg.kv_cache_groups
    ]
    with set_current_vllm_config(vc):
        caches = allocate_kv_cache(kv_cfg, torch.device("cpu"), KVCacheLayout[vc.cache_config.kv_cache_layout], kernel)
    return Memory(caches, kv_cfg, specs, spec.tp, rank)


def kv_bytes(spec: EngineSpec, rank: int, check: Any) -> int:
    """The bytes a request owns on one decode rank: every byte the harness's expected-memory writer sets for
    it (written over a buffer of 0s and one of 1s: a byte is the request's iff both agree), independent of
    the connector, the planner and NIXL."""
    import torch

    mem = _rank_memory(spec, rank)
    ids, index, tokens, moved = check
    bufs = []
    for fill in (0, 1):
        buf = torch.full_like(mem.flat, fill)
        mem.write(buf, ids, Content(spec.seed, index, tokens), moved)
        bufs.append(buf.numpy())
    return int(np.count_nonzero(bufs[0] == bufs[1]))


def _series(engine: Engine) -> dict[str, Any]:
    """The engine's workers' stats (``HybridKvStats.data``), aggregated as vLLM's stats logger does."""
    from hybrid_kv.integrations.vllm import HybridKvConnector

    total = HybridKvConnector.build_kv_connector_stats()
    for data in engine.stats:
        total.aggregate(HybridKvConnector.build_kv_connector_stats(data=data))
    return dict(total.data)


def _prometheus(engine: Engine, data: dict[str, Any]) -> Any:
    """``data`` observed through the connector's ``build_prom_metrics`` into a fresh registry."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from hybrid_kv.integrations.vllm import HybridKvConnector

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Gauge, Counter, Histogram)}
    prom = HybridKvConnector.build_prom_metrics(engine.vc, types, ["engine"], {0: ["0"]})
    prom.observe(data, 0)
    return reg


def _check_metrics(d: Engine, expected_bytes: list[int], failed: int) -> None:
    """Per request moved: NIXL's bytes = the request's KV bytes on that rank, 0 < descriptors <= ids."""
    data = _series(d)
    assert sorted(data["bytes"]) == sorted(expected_bytes)
    assert len(data["descriptors"]) == len(data["ids"]) == len(expected_bytes)
    for desc, ids in zip(data["descriptors"], data["ids"], strict=True):
        assert 0 < desc <= ids
    assert all(t > 0 for t in data["xfer_time_s"]) and all(t >= 0 for t in data["post_time_s"])
    assert data["num_failed_transfers"] == failed
    reg = _prometheus(d, data)
    labels = {"engine": "0"}
    assert reg.get_sample_value("vllm:hybrid_kv_bytes_transferred_sum", labels) == sum(expected_bytes)
    assert reg.get_sample_value("vllm:hybrid_kv_bytes_transferred_count", labels) == len(expected_bytes)
    assert reg.get_sample_value("vllm:hybrid_kv_num_descriptors_sum", labels) == sum(data["descriptors"])
    assert reg.get_sample_value("vllm:hybrid_kv_xfer_time_seconds_count", labels) == len(expected_bytes)
    assert reg.get_sample_value("vllm:hybrid_kv_num_failed_transfers_total", labels) == failed


def _signal(engine: Engine, sig: int) -> None:
    for proc in engine.workers.procs:
        assert proc.pid is not None
        os.kill(proc.pid, sig)


def test_slow_handshake_does_not_block_steps(model_dirs: dict[str, str]) -> None:
    """Prefill TP 1 -> decode TP 2 (Kimi-Linear, pull): the prefill workers stop answering for 3 s while
    the decode's first requests to them are scheduled; every decode step stays under ``STEP_BOUND_S``,
    the requests wait (WAITING_FOR_REMOTE_KVS), then land byte-exact once the prefill resumes."""
    from vllm.v1.request import RequestStatus

    p_port, d_port = side_channel_ports(2)
    p = Engine.start(EngineSpec("prefill", "kimi", model_dirs["kimi"], 1, "pull", p_port))
    d = Engine.start(EngineSpec("decode", "kimi", model_dirs["kimi"], 2, "pull", d_port))
    try:
        params = _prefill(p, ["p-0", "p-1"], [300, 517], 0)
        for i in range(2):
            d.add(f"d-{i}", prompt(i, [300, 517][i]), params[f"p-{i}"], i)
        _signal(p, signal.SIGSTOP)
        try:
            end = time.monotonic() + 3.0
            steps = []
            while time.monotonic() < end:
                t0 = time.perf_counter()
                d.step()
                steps.append(time.perf_counter() - t0)
            for rid in ("d-0", "d-1"):
                assert d.scheduler.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS
            assert not d.outputs
        finally:
            _signal(p, signal.SIGCONT)
        assert len(steps) >= 3 and max(steps) < STEP_BOUND_S, steps
        run_until([p, d], lambda: all(f"d-{i}" in d.outputs for i in range(2)) and p.idle())
        checks = _checks(p.spec, d, ["d-0", "d-1"], {"d-0": 0, "d-1": 1})
        _verify(d, checks)
        _check_metrics(d, [kv_bytes(d.spec, r, c) for c in checks for r in range(d.spec.tp)], failed=0)
        assert _series(d)["num_failed_handshakes"] == 0
        for problem, _ in p.workers.call("verify", []):
            assert problem is None, f"prefill memory changed: {problem}"
        assert p.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == p.kv_cfg.num_blocks - 1
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_handshake_fails_exactly_its_request(model_dirs: dict[str, str], policy: str) -> None:
    """Prefill TP 2 -> decode TP 1 (Kimi-Linear, pull). In one decode step, one request comes from the real
    prefill engine and one names an engine nobody serves: the latter's handshake fails within its deadline
    and vLLM's scheduler handles exactly that request per ``kv_load_failure_policy`` (the default, "fail":
    finished with an error; "recompute": back to WAITING from token 0, then computed locally); the other
    lands byte-exact and the prefill engine frees its blocks."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus

    p_port, d_port, ghost_port = side_channel_ports(3)
    p = Engine.start(EngineSpec("prefill", "kimi", model_dirs["kimi"], 2, "pull", p_port))
    # the ghost's handshake fails after 3 attempts of this; the real prefill's claims must be acknowledged within
    # it too (1.5 s was missed beside two busy processes and a build: d-0's claim was lost, d-0 failed)
    d_spec = EngineSpec("decode", "kimi", model_dirs["kimi"], 1, "pull", d_port, extra=(("handshake_timeout_s", 5.0),))
    d = Engine.start(d_spec)
    if policy != "fail":
        d.vc.kv_transfer_config.kv_load_failure_policy = policy
        d.scheduler.recompute_kv_load_failures = True  # what Scheduler.__init__ derives from the policy
    assert d.vc.kv_transfer_config.kv_load_failure_policy == policy
    outputs = Outputs(d)
    try:
        params = _prefill(p, ["p-0", "p-1"], [300, 517], 0)
        # a ticket the prefill's key signs, naming an engine nobody serves (only a secret holder can make one)
        ghost = reissue(params["p-1"], engine_id="ghost", port=ghost_port, request_id="g-1")
        d.add("d-0", prompt(0, 300), params["p-0"], 0)
        d.add("d-ghost", prompt(1, 517), ghost, 1)
        reset = None  # the step after which vLLM marked d-ghost's load failed with nothing computed
        t0 = time.monotonic()
        while "d-ghost" not in outputs.finish:
            d.step()
            p.step()
            req = d.scheduler.requests.get("d-ghost")
            if reset is None and req is not None and "d-ghost" in d.scheduler.failed_recving_kv_req_ids:
                assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req.num_computed_tokens == 0
                reset = len(outputs.scheduled)
            assert time.monotonic() - t0 < 60, "the failed handshake hung the request"
        if policy == "fail":
            assert outputs.finish["d-ghost"] == FinishReason.ERROR
            assert not any("d-ghost" in s for s in outputs.scheduled)  # never computed
        else:
            assert reset is not None and outputs.finish["d-ghost"] != FinishReason.ERROR
            # recomputed from token 0: the whole prompt scheduled in the step after the failure
            assert outputs.scheduled[reset].get("d-ghost") == 517
        run_until([p, d], lambda: "d-0" in d.outputs and "p-0" not in p.scheduler.requests)
        assert outputs.finish["d-0"] != FinishReason.ERROR
        checks = _checks(p.spec, d, ["d-0"], {"d-0": 0})
        _verify(d, checks)
        data = _series(d)
        assert data["num_failed_handshakes"] == 1 and data["num_failed_transfers"] == 1
        _check_metrics(d, [kv_bytes(d.spec, 0, checks[0])], failed=1)
        # p-1 was never read: its lease is what frees it; p-0 was released by the decode
        assert "p-1" in p.scheduler.requests
        assert p.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() < p.kv_cfg.num_blocks - 1
    finally:
        p.close()
        d.close()


def _two_prefills_one_killed(
    model_dirs: dict[str, str], model: str, d_tp: int, d_extra: tuple[tuple[str, Any], ...] = ()
) -> tuple[Engine, Engine, Engine, Outputs, list[Any]]:
    """Prefill engines A and B (TP 1) and a decode engine: each prefill moves one request (handshakes done),
    then prefills another, B's worker is killed, and the decode schedules both new requests (``d-a1`` from A,
    ``d-b1`` from B) in one step and runs until both finished. Returns the engines, the decode's outputs spy
    and the verify arguments of the first round."""
    a_port, b_port, d_port = side_channel_ports(3)
    a = Engine.start(EngineSpec("prefill-a", model, model_dirs[model], 1, "pull", a_port))
    b = Engine.start(EngineSpec("prefill-b", model, model_dirs[model], 1, "pull", b_port))
    d = Engine.start(EngineSpec("decode", model, model_dirs[model], d_tp, "pull", d_port, extra=d_extra))
    outputs = Outputs(d)
    pa = _prefill(a, ["a-0"], [300], 0)
    pb = _prefill(b, ["b-0"], [517], 1)
    d.add("d-a0", prompt(0, 300), pa["a-0"], 0)
    d.add("d-b0", prompt(1, 517), pb["b-0"], 1)
    run_until([a, b, d], lambda: {"d-a0", "d-b0"} <= set(d.outputs) and a.idle() and b.idle())
    first = _checks(a.spec, d, ["d-a0", "d-b0"], {"d-a0": 0, "d-b0": 1})
    pa = _prefill(a, ["a-1"], [517], 2)
    pb = _prefill(b, ["b-1"], [300], 3)
    d.workers.call("mark")  # what landed so far is the baseline: the rest must be exactly a-1
    _signal(b, signal.SIGKILL)
    for proc in b.workers.procs:
        proc.join(10)
        assert not proc.is_alive()
    d.add("d-a1", prompt(2, 517), pa["a-1"], 2)
    d.add("d-b1", prompt(3, 300), pb["b-1"], 3)
    return a, b, d, outputs, first


def test_prefill_killed_fails_exactly_its_request(model_dirs: dict[str, str]) -> None:
    """Kimi-Linear (several KV-cache groups, so failures are whole requests: ``failed_recving``), prefill
    TP 1 -> decode TP 2, pull: B's request fails (finished with an error, vLLM's default policy) and wrote
    nothing, A's request of the same step lands byte-exact; the failure is counted in the stats and in
    Prometheus."""
    from vllm.v1.engine import FinishReason

    a, b, d, outputs, first = _two_prefills_one_killed(model_dirs, "kimi", 2, (("transfer_timeout_s", 10.0),))
    try:
        # each decode rank fails d-b1 on its own (its claim to the dead prefill is refused): wait for both
        done = lambda: {"d-a1", "d-b1"} <= set(d.outputs) and a.idle()  # noqa: E731
        run_until([a, d], lambda: done() and d.counter("num_failed_transfers") >= d.spec.tp, timeout_s=90)
        assert outputs.finish["d-b1"] == FinishReason.ERROR
        assert outputs.finish["d-a1"] != FinishReason.ERROR
        checks = _checks(a.spec, d, ["d-a1"], {"d-a1": 2})
        _verify(d, checks)  # a-1 landed, and d-b1's blocks (like every other byte) are unchanged
        # the stats: 2 decode ranks x (2 first requests + a-1) moved, one failure per decode rank
        moved = [kv_bytes(d.spec, r, c) for c in [*first, *checks] for r in range(d.spec.tp)]
        _check_metrics(d, moved, failed=d.spec.tp)
        for problem, _ in a.workers.call("verify", []):
            assert problem is None, f"prefill memory changed: {problem}"
    finally:
        a.close()
        b.close()
        d.close()


def test_prefill_killed_single_group_reports_exact_blocks(model_dirs: dict[str, str]) -> None:
    """A pure-MLA model (one KV-cache group: failures are block ids, ``get_block_ids_with_load_errors``),
    TP 1 everywhere, ``kv_load_failure_policy`` "recompute": the invalid blocks reported are exactly
    ``d-b1``'s blocks, vLLM's scheduler resets its ``num_computed_tokens`` to its first invalid block (block
    0: nothing of it landed) and recomputes it locally; ``d-a1`` lands byte-exact in the same step."""
    from vllm.v1.engine import FinishReason

    a, b, d, outputs, _ = _two_prefills_one_killed(model_dirs, "mla", 1, (("transfer_timeout_s", 10.0),))
    d.vc.kv_transfer_config.kv_load_failure_policy = "recompute"
    d.scheduler.recompute_kv_load_failures = True  # what Scheduler.__init__ derives from the policy
    try:
        invalid: list[set[int]] = []
        orig = d.scheduler.update_from_output

        def spy(so: Any, mro: Any) -> Any:
            kv = mro.kv_connector_output
            if kv is not None and kv.invalid_block_ids:
                invalid.append(set(kv.invalid_block_ids))
                (blocks_b1,) = d.scheduler.kv_cache_manager.get_block_ids("d-b1")
                (blocks_a1,) = d.scheduler.kv_cache_manager.get_block_ids("d-a1")
                assert set(kv.invalid_block_ids) == set(blocks_b1) and not set(blocks_a1) & set(blocks_b1)
            res = orig(so, mro)
            if kv is not None and kv.invalid_block_ids:
                req = d.scheduler.requests["d-b1"]
                assert req.num_computed_tokens == 0  # block 0 is its first invalid block
                assert "d-b1" in d.scheduler.failed_recving_kv_req_ids
            return res

        d.scheduler.update_from_output = spy
        run_until([a, d], lambda: {"d-a1", "d-b1"} <= set(d.outputs) and a.idle(), timeout_s=90)
        assert len(invalid) == 1
        assert outputs.finish["d-a1"] != FinishReason.ERROR and outputs.finish["d-b1"] != FinishReason.ERROR
        assert any(s.get("d-b1") == 300 for s in outputs.scheduled)  # recomputed from token 0
        _verify(d, _checks(a.spec, d, ["d-a1"], {"d-a1": 2}))
        assert _series(d)["num_failed_transfers"] == 1
    finally:
        a.close()
        b.close()
        d.close()


def test_expired_lease_is_a_load_failure(model_dirs: dict[str, str]) -> None:
    """Kimi-Linear, prefill TP 1 (lease 6 s) -> decode TP 2, pull. A request the decode schedules only after
    the prefill's lease on its blocks expired (the prefill freed them, so they may hold another request's KV)
    fails instead of landing whatever the blocks hold now: vLLM's default policy finishes it with an error. A
    fresh request of the same step lands byte-exact; the prefill counted one expired lease."""
    from vllm.v1.engine import FinishReason

    p_port, d_port = side_channel_ports(2)
    p = Engine.start(EngineSpec("prefill", "kimi", model_dirs["kimi"], 1, "pull", p_port, extra=(("lease_s", 6.0),)))
    d = Engine.start(EngineSpec("decode", "kimi", model_dirs["kimi"], 2, "pull", d_port))
    outputs = Outputs(d)
    try:
        old = _prefill(p, ["p-old"], [517], 0)["p-old"]
        assert old["lease_expires_at"] > time.time()
        run_until([p], lambda: "p-old" not in p.scheduler.requests, timeout_s=30)  # freed by lease expiry
        assert sum(s["num_expired_leases"] for s in p.stats) == 1
        new = _prefill(p, ["p-new"], [300], 1)["p-new"]
        d.add("d-old", prompt(0, 517), old, 0)
        d.add("d-new", prompt(1, 300), new, 1)
        run_until([p, d], lambda: {"d-old", "d-new"} <= set(d.outputs) and p.idle())
        assert outputs.finish["d-old"] == FinishReason.ERROR
        assert outputs.finish["d-new"] != FinishReason.ERROR
        checks = _checks(p.spec, d, ["d-new"], {"d-new": 1})
        _verify(d, checks)  # d-new landed; d-old read nothing
        _check_metrics(d, [kv_bytes(d.spec, r, checks[0]) for r in range(d.spec.tp)], failed=d.spec.tp)
    finally:
        p.close()
        d.close()


def test_a_request_vllms_api_server_rejected_frees_the_prefill_blocks_at_once(model_dirs: dict[str, str]) -> None:
    """A decode request that vLLM's API server rejected before it reached the engine (an error response, e.g. a
    full queue): vLLM then adds a stand-in aborted at once, with a one-token prompt and the request's
    ``kv_transfer_params`` (``AsyncLLM.notify_kv_transfer_request_rejected``), so the connector can release the
    prefill's blocks. GQA, TP 1, pull, a 60 s lease: the prefill frees the blocks of its 10-block request within
    seconds, where a release bounded by the stand-in's prompt (2 blocks) was refused and the blocks stayed held
    until the lease ran out. A second stand-in for the same ticket releases nothing (the ticket is spent) and is
    not counted as a refused ticket."""
    from vllm.v1.request import RequestStatus

    p_port, d_port = side_channel_ports(2)
    lease = (("lease_s", 60.0),)
    p = Engine.start(EngineSpec("prefill", "gqa", model_dirs["gqa"], 1, "pull", p_port, extra=lease))
    d = Engine.start(EngineSpec("decode", "gqa", model_dirs["gqa"], 1, "pull", d_port, extra=lease))
    try:
        params = _prefill(p, ["p-0"], [300], 0)["p-0"]
        assert len(params["remote_block_ids"][0]) == 10 and "p-0" in p.scheduler.requests  # leased
        t0 = time.monotonic()
        for name in ("stand-in", "stand-in-again"):
            d.add(name, [0], dict(params), 0)  # what notify_kv_transfer_request_rejected submits
            d.scheduler.finish_requests([name], RequestStatus.FINISHED_ABORTED)
        run_until([p, d], lambda: p.idle() and d.idle(), timeout_s=30)
        assert time.monotonic() - t0 < 15  # released, not expired (60 s)
        free = p.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        assert free == p.kv_cfg.num_blocks - 1
        assert p.counter("num_expired_leases") == 0
        assert d.counter("num_refused_tickets") == 0
    finally:
        p.close()
        d.close()
