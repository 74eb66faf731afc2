"""Streaming push with vLLM 0.33's real Scheduler and real NIXL transfers between worker processes: the
router sends each request to the decode and the prefill engine at once with one capability; the prefill
workers run the request's last prefill forward layer by layer (``EngineSpec.layerwise``: each layer writes its
KV, then vLLM's ``save_kv_layer`` hook for attention layers) and post each layer's KV as its hook proves it
final. Every byte of every decode worker is checked, which catches a stage posted before its layer ran (the
bytes would be the blocks' old garbage) and an SSM state posted after an early chunk (an intermediate value).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from vllm_harness import (
    CONTENT_TOKENS,
    Engine,
    EngineSpec,
    prompt,
    route_concurrent,
    run_until,
    side_channel_ports,
    stream_params,
    verify_moved,
)

os.environ.setdefault("HYBRID_KV_SECRET", "hybrid-kv-vllm-connector-tests-secret")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

LAYER_S = 0.01  # each layer's compute time: the poster posts a stage while later layers still run


def _pair(model_dirs: dict[str, str], model: str, p_tp: int, d_tp: int, **p_kw: Any) -> tuple[Engine, Engine]:
    p_port, d_port = side_channel_ports(2)
    p = Engine.start(
        EngineSpec("prefill", model, model_dirs[model], p_tp, "push", p_port, layerwise=True, layer_s=LAYER_S, **p_kw)
    )
    try:
        known = (("peer_engines", f"prefill@127.0.0.1:{p_port}"),)  # a concurrent push names only known engines
        d = Engine.start(EngineSpec("decode", model, model_dirs[model], d_tp, "push", d_port, extra=known))
    except BaseException:
        p.close()
        raise
    return p, d


def _finish_statuses(engine: Engine) -> dict[str, Any]:
    """The status each request of ``engine`` is finished with through ``Scheduler.finish_requests`` (the failed-load
    path of ``kv_load_failure_policy``), recorded by a spy from now on."""
    statuses: dict[str, Any] = {}
    orig = engine.scheduler.finish_requests

    def spy(ids: Any, status: Any) -> Any:
        for rid in [ids] if isinstance(ids, str) else ids:
            statuses[rid] = status
        return orig(ids, status)

    engine.scheduler.finish_requests = spy
    return statuses


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)])
def test_kimi_linear_streams_every_layer_byte_exact(model_dirs: dict[str, str], p_tp: int, d_tp: int) -> None:
    """Hybrid MLA + KDA in shared HMA tensors, heterogeneous TP both ways: every stage is released by a layer
    hook during the forward (the tiny model's last layer is MLA), and every byte lands."""
    p, d = _pair(model_dirs, "kimi", p_tp, d_tp)
    try:
        reqs = route_concurrent(p, d, [300, 517, 64])
        assert verify_moved(p, d, reqs) > 0
        assert p.counter("num_streamed_requests") == 3 * p_tp
        assert p.counter("num_stream_fallbacks") == 0 and p.counter("num_failed_transfers") == 0
        # one layerwise forward per prefill worker streamed; its hooks released every stage (none left to the end)
        assert p.released and all(n == total for n, total in p.released), p.released
    finally:
        p.close()
        d.close()


def test_gqa_streams_byte_exact(model_dirs: dict[str, str]) -> None:
    """Attention only (GQA heads split over two decode ranks): one stage per layer."""
    p, d = _pair(model_dirs, "gqa", 1, 2)
    try:
        reqs = route_concurrent(p, d, [300, 64])
        assert verify_moved(p, d, reqs) > 0
        assert p.counter("num_streamed_requests") == 2
        assert p.released == [(2, 2)]
    finally:
        p.close()
        d.close()


def test_chunked_prefill_streams_in_the_last_chunk_only(model_dirs: dict[str, str]) -> None:
    """A prompt computed in several chunks: earlier chunks leave an intermediate SSM state (and part of the
    attention pages); the request streams in the step of its last chunk only, and the decode holds the final
    state and every page."""
    p, d = _pair(model_dirs, "kimi", 1, 1, max_batched_tokens=256)
    try:
        reqs = route_concurrent(p, d, [700])
        assert verify_moved(p, d, reqs) > 0
        forwards = [m for m in p.metas if m.stream]
        assert len(forwards) == 1, "streamed in exactly one step: the last chunk's"
        assert p.counter("num_streamed_requests") == 1
    finally:
        p.close()
        d.close()


def test_a_failed_early_stage_fails_exactly_that_request(model_dirs: dict[str, str]) -> None:
    """The first stage's transfer of one request fails on the wire while later layers still run: that request
    fails on both sides (the decode's fails as a failed load; later stages are never posted), the other
    request of the same forward lands byte-exact, and the prefill frees every block."""
    from vllm.v1.request import RequestStatus

    p, d = _pair(model_dirs, "kimi", 1, 1)
    try:
        p.fail = {"d-1"}
        statuses = _finish_statuses(d)
        for i, n in enumerate([300, 517]):
            d.add(f"d-{i}", prompt(i, n), stream_params(p, f"{i + 1:032x}"), i)
        run_until([d, p], lambda: all(k >= 2 and "decode" in links for k, links in p.workers.call("stream_state")))
        for i, n in enumerate([300, 517]):
            p.add(f"p-{i}", prompt(i, n), {"do_remote_decode": True, "hkv_stream": f"{i + 1:032x}"}, i)
            p.fills[f"p-{i}"] = (i, CONTENT_TOKENS)
        run_until([p, d], lambda: {"d-0", "d-1"} <= set(d.outputs) and p.idle())
        assert p.counter("num_failed_transfers") == 1
        assert statuses.get("d-1") == RequestStatus.FINISHED_ERROR, statuses  # kv_load_failure_policy "fail"
        assert "d-0" not in statuses
        ok = [(0, dict(p.outputs["p-0"]))]
        # only d-0's blocks are compared; verify_moved also checks the prefill freed every block
        recv = {rid: r for meta in d.metas for rid, r in meta.recv.items()}
        assert recv["d-1"].cap and recv["d-0"].cap
        checked = verify_moved(p, d, ok)
        assert checked > 0
    finally:
        p.close()
        d.close()


def test_a_registration_after_the_forward_is_pushed_whole(model_dirs: dict[str, str]) -> None:
    """The decode registers only after the prefill finished (it was slow to get the request): the prefill
    pushes it whole from the same registration, matched to its lease by the capability."""
    p, d = _pair(model_dirs, "kimi", 1, 1)
    try:
        cap = os.urandom(16).hex()
        p.add("p-0", prompt(0, 300), {"do_remote_decode": True, "hkv_stream": cap}, 0)
        p.fills["p-0"] = (0, CONTENT_TOKENS)
        run_until([p], lambda: "p-0" in p.outputs)
        d.add("d-0", prompt(0, 300), stream_params(p, cap), 0)
        run_until([p, d], lambda: "d-0" in d.outputs and p.idle())
        assert verify_moved(p, d, [(0, dict(p.outputs["p-0"]))]) > 0
        assert p.counter("num_stream_fallbacks") == 1 and p.counter("num_streamed_requests") == 0
    finally:
        p.close()
        d.close()


def test_a_decode_that_stopped_waiting_gets_nothing_written(model_dirs: dict[str, str]) -> None:
    """The decode's registration says until when it waits; once it gave up (its request failed, its blocks free
    for reuse) the prefill writes nothing into them, streamed or whole, when its request finally runs."""
    from vllm.v1.request import RequestStatus

    p_port, d_port = side_channel_ports(2)
    p = Engine.start(EngineSpec("prefill", "kimi", model_dirs["kimi"], 1, "push", p_port, layerwise=True))
    wait = (("push_registration_timeout_s", 4.0), ("peer_engines", f"prefill@127.0.0.1:{p_port}"))
    d = Engine.start(EngineSpec("decode", "kimi", model_dirs["kimi"], 1, "push", d_port, extra=wait))
    statuses = _finish_statuses(d)
    try:
        d.workers.call("mark")
        cap = os.urandom(16).hex()
        d.add("d-0", prompt(0, 300), stream_params(p, cap), 0)
        run_until([d, p], lambda: all(k >= 1 and "decode" in links for k, links in p.workers.call("stream_state")))
        run_until([d, p], lambda: "d-0" in d.outputs)
        assert statuses.get("d-0") == RequestStatus.FINISHED_ERROR  # its wait ran out: a failed load
        p.add("p-0", prompt(0, 300), {"do_remote_decode": True, "hkv_stream": cap}, 0)
        p.fills["p-0"] = (0, CONTENT_TOKENS)
        run_until([p, d], lambda: "p-0" in p.outputs and p.idle())
        for _ in range(5):
            d.step()
        for problem, _ in d.workers.call("verify", []):
            assert problem is None, f"the decode's memory changed after it stopped waiting: {problem}"
        assert p.counter("num_streamed_requests") == 0 and p.counter("num_stream_fallbacks") == 1
        assert p.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == p.kv_cfg.num_blocks - 1
    finally:
        p.close()
        d.close()
