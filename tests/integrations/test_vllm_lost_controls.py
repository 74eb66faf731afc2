"""Control messages over a lossy side channel: a decode's digest ask (``verify``) whose acknowledgement is lost.

Real engines once stalled for minutes on exactly this: one decode rank's digest ask went unacknowledged, and the
request waited for an answer that could not come until its transfer deadline. Now an unacknowledged message is
sent again on a fresh connection (``delivery``), and a request whose ask is lost for good fails at once.

vLLM 0.33's real Scheduler and workers, GQA, TP 1, pull, ``verify: all``, a 60 s transfer deadline. The decode
reaches the prefill's side channel through a TCP relay in this process (the ticket names it, re-issued with the
deployment's key, as the prefill would if it advertised that address). Connection 1 is the handshake's metadata
fetch; connection 2 is the first attempt to deliver the digest ask.
"""

from __future__ import annotations

import os
import time

from tcp_relay import TcpRelay
from tickets_helper import reissue
from vllm_harness import CONTENT_TOKENS, Engine, EngineSpec, prompt, run_until, side_channel_ports, verify_moved

os.environ.setdefault("HYBRID_KV_SECRET", "hybrid-kv-vllm-connector-tests-secret")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

HANDSHAKE_S = 3.0  # handshake_timeout_s: every attempt to deliver one control message within it
TRANSFER_S = 60.0  # transfer_timeout_s: where a request with a lost ask used to fail


def _pair(gqa_dir: str, held: set[int] | None) -> tuple[Engine, Engine, TcpRelay, dict[str, object]]:
    """A prefill and a verifying decode; the relay loses connections ``held`` (every one after the first when
    ``None``). Returns the engines, the relay and the prefill's own ``kv_transfer_params`` of request 0."""
    p_port, d_port = side_channel_ports(2)
    extra = (("verify", "all"), ("handshake_timeout_s", HANDSHAKE_S), ("transfer_timeout_s", TRANSFER_S))
    p = Engine.start(EngineSpec("prefill", "gqa", gqa_dir, 1, "pull", p_port, extra=extra))
    d = Engine.start(EngineSpec("decode", "gqa", gqa_dir, 1, "pull", d_port, extra=extra))
    relay = TcpRelay(("127.0.0.1", p_port), lambda n: 0.0 if n == 1 or (held is not None and n not in held) else None)
    p.add("p-0", prompt(0, 300), {"do_remote_decode": True}, 0)
    p.fills["p-0"] = (0, CONTENT_TOKENS)
    run_until([p], lambda: "p-0" in p.outputs)
    return p, d, relay, dict(p.outputs["p-0"])


def test_an_ask_whose_ack_was_lost_is_sent_again_and_the_request_lands(model_dirs: dict[str, str]) -> None:
    from vllm.v1.engine import FinishReason

    p, d, relay, params = _pair(model_dirs["gqa"], held={2})
    try:
        d.add("d-0", prompt(0, 300), reissue(dict(params), port=relay.port), 0)
        run_until([p, d], lambda: "d-0" in d.finish_reasons and p.idle(), timeout_s=90)
        assert d.finish_reasons["d-0"] != FinishReason.ERROR
        assert relay.accepted >= 3  # the handshake, the lost attempt, the one acknowledged (then the release)
        assert d.counter("num_lost_controls") == 0 and d.counter("num_verified_transfers") == 1
        assert d.counter("num_digest_mismatches") == 0
        assert p.counter("num_expired_leases") == 0  # the release came through the relay too
        verify_moved(p, d, [(0, params)])  # every byte landed, nothing else changed, the prefill freed its blocks
    finally:
        relay.close()
        p.close()
        d.close()


def test_a_request_whose_ask_is_lost_fails_at_once(model_dirs: dict[str, str]) -> None:
    from vllm.v1.engine import FinishReason

    p, d, relay, params = _pair(model_dirs["gqa"], held=None)
    try:
        t0 = time.monotonic()
        d.add("d-0", prompt(0, 300), reissue(dict(params), port=relay.port), 0)
        run_until([p, d], lambda: "d-0" in d.finish_reasons, timeout_s=TRANSFER_S)
        elapsed = time.monotonic() - t0
        assert d.finish_reasons["d-0"] == FinishReason.ERROR
        assert elapsed < TRANSFER_S / 3, f"failed after {elapsed:.1f} s: at its transfer deadline, not at once"
        assert d.counter("num_lost_controls") >= 1 and d.counter("num_failed_transfers") == 1
        assert d.counter("num_verified_transfers") == 0  # nothing was read
        assert relay.accepted >= 1 + 3  # the handshake, then three attempts of the ask
    finally:
        relay.close()
        p.close()
        d.close()
