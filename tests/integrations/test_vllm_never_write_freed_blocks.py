"""A decode never lets vLLM reuse blocks a prefill may still write: its whole pool is compared before and after.

vLLM 0.33's real Scheduler and workers, Kimi-Linear, push mode, real NIXL. A TCP relay sits between the decode and
the prefill's side channel:

- it drops every acknowledgement (the CURVE handshake passes, every message reaches the prefill, no reply comes
  back): the decode's concurrent-push registration counts as lost although the prefill holds it, and the prefill
  streams into the decode's blocks when its request runs. The decode fails the request early but reports it to
  vLLM (which frees its blocks) only once the registration's deadline and the margin passed;
- it delivers every message late (after the decode stopped waiting): a sequential push's registration reaches the
  prefill after its ``until``, and the prefill writes nothing.

In both, the test marks the decode's whole pool when vLLM got the request back and checks that not one byte
changed after it, however the prefill went on. On the old code (a registration without a deadline; a failed
request reported at once) the first wrote 81,604 bytes and the second 57,122 bytes into the released blocks.
"""

from __future__ import annotations

import os
import time

from tcp_relay import TcpRelay
from tickets_helper import reissue
from vllm_harness import CONTENT_TOKENS, Engine, EngineSpec, prompt, run_until, side_channel_ports, stream_params

os.environ.setdefault("HYBRID_KV_SECRET", "hybrid-kv-vllm-connector-tests-secret")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

HANDSHAKE_S = 2.0  # all attempts of one control message: a registration with no acknowledgement is lost after it
WAIT_S = 12.0  # push_registration_timeout_s: the registration's until, from when the decode sent it


def _unchanged_since_mark(d: Engine) -> None:
    for problem, _ in d.workers.call("verify", []):
        assert problem is None, f"the decode's pool changed after vLLM got the request back: {problem}"


def test_a_registration_whose_acknowledgement_was_lost_is_never_written_after_the_decode_gave_up(
    model_dirs: dict[str, str],
) -> None:
    from vllm.v1.engine import FinishReason

    p_port, d_port = side_channel_ports(2)
    p = Engine.start(EngineSpec("prefill", "kimi", model_dirs["kimi"], 1, "push", p_port, layerwise=True))
    relay = TcpRelay(("127.0.0.1", p_port), lambda n: 0.0, drop_replies=True)
    extra = (
        ("push_registration_timeout_s", WAIT_S),
        ("handshake_timeout_s", HANDSHAKE_S),
        ("peer_engines", f"prefill@127.0.0.1:{relay.port}"),
    )
    d = Engine.start(EngineSpec("decode", "kimi", model_dirs["kimi"], 1, "push", d_port, extra=extra))
    try:
        cap = os.urandom(16).hex()
        t0 = time.monotonic()
        d.add("d-0", prompt(0, 300), dict(stream_params(p, cap), remote_port=relay.port), 0)
        # the prefill holds the registration (every attempt reached it) and links to the decode
        run_until([d, p], lambda: all(k >= 1 and "decode" in links for k, links in p.workers.call("stream_state")))
        # the decode gave up on it (no acknowledgement came) before the prefill's request even runs
        run_until([d, p], lambda: d.counter("num_lost_controls") >= 1, timeout_s=30)
        p.add("p-0", prompt(0, 300), {"do_remote_decode": True, "hkv_stream": cap}, 0)
        p.fills["p-0"] = (0, CONTENT_TOKENS)
        run_until([p, d], lambda: "d-0" in d.finish_reasons, timeout_s=60)
        reported = time.monotonic() - t0
        d.workers.call("mark")  # vLLM has the blocks back from here: nothing may write them any more
        run_until([p, d], lambda: "p-0" in p.outputs and p.idle(), timeout_s=60)
        for _ in range(5):
            d.step()
        _unchanged_since_mark(d)
        assert d.finish_reasons["d-0"] == FinishReason.ERROR
        assert relay.dropped_replies >= 1 and p.counter("num_streamed_requests") == 1  # it did write, into held blocks
        assert reported >= WAIT_S, f"reported after {reported:.1f} s, before its registration's deadline"
    finally:
        relay.close()
        p.close()
        d.close()


def test_a_registration_that_arrives_after_the_decode_stopped_waiting_is_not_written(
    model_dirs: dict[str, str],
) -> None:
    from vllm.v1.engine import FinishReason

    p_port, d_port = side_channel_ports(2)
    p = Engine.start(EngineSpec("prefill", "kimi", model_dirs["kimi"], 1, "push", p_port))
    late_s = 6.0
    relay = TcpRelay(("127.0.0.1", p_port), lambda n: 0.0, delay_requests=late_s)
    wait = 3.0
    extra = (("push_registration_timeout_s", wait), ("handshake_timeout_s", HANDSHAKE_S))
    d = Engine.start(EngineSpec("decode", "kimi", model_dirs["kimi"], 1, "push", d_port, extra=extra))
    try:
        p.add("p-0", prompt(0, 300), {"do_remote_decode": True}, 0)
        p.fills["p-0"] = (0, CONTENT_TOKENS)
        run_until([p], lambda: "p-0" in p.outputs)
        d.add("d-0", prompt(0, 300), reissue(dict(p.outputs["p-0"]), port=relay.port), 0)
        run_until([p, d], lambda: "d-0" in d.finish_reasons, timeout_s=60)
        d.workers.call("mark")  # vLLM has the blocks back from here
        # the registrations reach the prefill only now, after their until: it frees its blocks and writes nothing
        until = time.monotonic() + late_s + 5
        run_until([p, d], lambda: time.monotonic() > until, timeout_s=60)
        _unchanged_since_mark(d)
        assert d.finish_reasons["d-0"] == FinishReason.ERROR
        assert relay.delayed_requests >= 1 and p.counter("num_late_registrations") >= 1 and p.idle()
        assert p.counter("num_expired_leases") == 0  # freed at once, not held for its lease
    finally:
        relay.close()
        p.close()
        d.close()
