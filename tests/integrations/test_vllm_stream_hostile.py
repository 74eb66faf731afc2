"""Concurrent push's capability against hostile API clients, through vLLM 0.33's real Scheduler and, for
the end-to-end proof, real workers and NIXL transfers.

- Scheduler only (fast): a decode request's concurrent-push params (``hkv_stream`` and the prefill address) are
  checked once and never raise: malformed capabilities and fields, a host outside the peer networks, a
  capability used twice, a pull engine; each such request is handed to the workers as a refusal naming why.
  On the prefill, a malformed or duplicate capability only means that request does not stream.
- Engines (GQA, TP 1, push): a second decode engine presenting a capability the first one already registered
  is refused by the prefill (a capability joins one prefill request to the first decode engine presenting
  it); its request fails alone after its wait, none of the victim's KV is written into it, and the victim's
  request lands byte-exact.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_harness import CONTENT_TOKENS, Engine, EngineSpec, build, prompt, run_until, side_channel_ports, stream_params

os.environ.setdefault("HYBRID_KV_SECRET", "hybrid-kv-vllm-connector-tests-secret")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

CAP = "0123456789abcdef0123456789abcdef"
GOOD = {
    "do_remote_prefill": True,
    "hkv_stream": CAP,
    "remote_engine_id": "prefill",
    "remote_host": "10.1.2.3",
    "remote_port": 5600,
    "tp_size": 1,
}


def _scheduler(model_dirs: dict[str, str], mode: str, extra: tuple[tuple[str, Any], ...] = ()) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    known = (("peer_engines", "prefill@10.1.2.3:5600"),)  # GOOD's prefill engine
    spec = EngineSpec("decode", "gqa", model_dirs["gqa"], 1, mode, 5700, extra=(*known, *extra))
    vc, kv_cfg, _ = build(spec)
    vc.cache_config.num_gpu_blocks = kv_cfg.num_blocks
    return Scheduler(
        vllm_config=vc,
        kv_cache_config=kv_cfg,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=spec.logical_block_size,
    )


def _request(rid: str, params: Any, max_tokens: int = 2) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, 50256)
    req = Request(request_id=rid, prompt_token_ids=prompt(1, 100), sampling_params=sp, pooling_params=None)
    req.kv_transfer_params = params
    return req


def test_hostile_stream_params_are_refused_and_never_raise(model_dirs: dict[str, str]) -> None:
    sched = _scheduler(model_dirs, "push", (("peer_networks", "10.0.0.0/8"),))
    hostile = {
        "short": dict(GOOD, hkv_stream=CAP[:-2]),
        "upper": dict(GOOD, hkv_stream=CAP.upper()),
        "int": dict(GOOD, hkv_stream=7),
        "no_host": {k: v for k, v in GOOD.items() if k != "remote_host"},
        "port_text": dict(GOOD, remote_port="5600"),
        "tp_zero": dict(GOOD, tp_size=0),
        "outside": dict(GOOD, remote_host="192.168.0.1", hkv_stream="1" * 32),
        "host_name": dict(GOOD, remote_host="evil.example", hkv_stream="2" * 32),
        # a closed port on a real prefill's host: not a known peer engine, so never dialled (it held a control lane)
        "unknown_port": dict(GOOD, remote_port=5601, hkv_stream="3" * 32),
        "unknown_engine": dict(GOOD, remote_engine_id="other", hkv_stream="4" * 32),
        "ok": dict(GOOD),
        "reused": dict(GOOD),  # the same capability a second time on this decode
    }
    for name, params in hostile.items():
        sched.add_request(_request(name, dict(params)))
    recv = sched.schedule().kv_connector_metadata.recv
    assert set(recv) == set(hostile)
    assert recv["ok"].refused is None and recv["ok"].cap == bytes.fromhex(CAP)
    ok = recv["ok"]
    assert (ok.remote_engine_id, ok.remote_host, ok.remote_port) == ("prefill", "10.1.2.3", 5600)
    assert recv["ok"].remote_block_ids == [] and recv["ok"].grant == b""
    for name in set(hostile) - {"ok"}:
        assert recv[name].refused, name
        assert recv[name].cap == b"" and recv[name].remote_engine_id == "", name
    assert "malformed" in recv["short"].refused and "malformed" in recv["upper"].refused
    assert "outside the allowed peer networks" in recv["outside"].refused
    assert "outside the allowed peer networks" in recv["host_name"].refused
    assert "already used" in recv["reused"].refused
    assert "not a known peer engine" in recv["unknown_port"].refused
    assert "not a known peer engine" in recv["unknown_engine"].refused


def test_stream_params_need_push_mode(model_dirs: dict[str, str]) -> None:
    sched = _scheduler(model_dirs, "pull")
    sched.add_request(_request("r", dict(GOOD)))
    (req,) = sched.schedule().kv_connector_metadata.recv.values()
    assert req.refused and "needs push mode" in req.refused


def test_a_prefill_streams_only_requests_with_a_sound_unique_capability(model_dirs: dict[str, str]) -> None:
    sched = _scheduler(model_dirs, "push")
    for rid, cap in [("bad", "xyz"), ("first", CAP), ("dup", CAP), ("other", "f" * 32), ("none", None)]:
        params: dict[str, Any] = {"do_remote_decode": True}
        if cap is not None:
            params["hkv_stream"] = cap
        sched.add_request(_request(rid, params, max_tokens=1))
    stream = sched.schedule().kv_connector_metadata.stream
    assert set(stream) == {"first", "other"}  # one step computes every prompt here: their last prefill step
    assert stream["first"].cap == bytes.fromhex(CAP) and any(stream["first"].block_ids)


def test_streaming_off_leaves_the_capability_to_the_whole_push(model_dirs: dict[str, str]) -> None:
    """``stream: false``: no request streams, and a finished request's lease still carries its capability (a
    concurrent decode's registration then gets the whole push)."""
    from hybrid_kv.connector_core.config import ConnectorConfig

    assert ConnectorConfig.resolve({"mode": "push"}, env={}).stream is True
    assert ConnectorConfig.resolve({"mode": "push"}, env={"HYBRID_KV_STREAM": "0"}).stream is False
    sched = _scheduler(model_dirs, "push", (("stream", False),))
    sched.add_request(_request("p-0", {"do_remote_decode": True, "hkv_stream": CAP}, max_tokens=1))
    assert sched.schedule().kv_connector_metadata.stream == {}
    conn = sched.connector.scheduler
    req = sched.requests["p-0"]
    from vllm.v1.request import RequestStatus

    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = conn.request_finished(req, sched.kv_cache_manager.get_block_ids("p-0"))
    assert delay and params is not None
    assert sched.schedule().kv_connector_metadata.send["p-0"].cap == bytes.fromhex(CAP)


def test_a_second_decode_engine_cannot_take_a_registered_capability(model_dirs: dict[str, str]) -> None:
    from vllm.v1.engine import FinishReason

    p_port, d_port, e_port = side_channel_ports(3)
    p = Engine.start(EngineSpec("prefill", "gqa", model_dirs["gqa"], 1, "push", p_port, layerwise=True))
    known = (("peer_engines", f"prefill@127.0.0.1:{p_port}"),)
    d = Engine.start(EngineSpec("decode", "gqa", model_dirs["gqa"], 1, "push", d_port, extra=known))
    wait = (("push_registration_timeout_s", 10.0),)
    e = Engine.start(EngineSpec("decode2", "gqa", model_dirs["gqa"], 1, "push", e_port, extra=(*wait, *known)))
    finish = e.finish_reasons
    try:
        e.workers.call("mark")
        d.add("d-0", prompt(0, 300), stream_params(p, CAP), 0)
        run_until([d, p], lambda: all(k >= 1 and "decode" in links for k, links in p.workers.call("stream_state")))
        # an API client of the second decode engine presents the victim's capability
        e.add("e-0", prompt(0, 300), stream_params(p, CAP), 0)
        run_until([e, p], lambda: any("e-0" in m.recv for m in e.metas))
        for _ in range(10):
            e.step()
            p.step()
        p.add("p-0", prompt(0, 300), {"do_remote_decode": True, "hkv_stream": CAP}, 0)
        p.fills["p-0"] = (0, CONTENT_TOKENS)
        run_until([p, d, e], lambda: "d-0" in d.outputs and "e-0" in finish and p.idle(), timeout_s=120)
        assert finish["e-0"] == FinishReason.ERROR  # its wait for a push ran out: a failed load
        for problem, _ in e.workers.call("verify", []):
            assert problem is None, f"the second decode's memory changed: {problem}"
        from vllm_harness import verify_moved

        assert verify_moved(p, d, [(0, dict(p.outputs["p-0"]))]) > 0
        assert sum(s.get("num_streamed_requests", 0) for s in p.stats) == 1
    finally:
        for x in (p, d, e):
            x.close()
