"""Streaming push in real engines: the Qwen3-Next-shaped hybrid (GDN linear attention + full attention),
hybrid-kv push with the router sending each request to the decode and the prefill at once (``route_concurrent``,
one fresh capability per request), with streaming on (``hybrid-kv-push-stream``) and off
(``hybrid-kv-push-nostream``: the same routing, every request pushed whole after its prefill; a control pair,
started with ``HYBRID_KV_ENGINE_CONTROLS=1``).

- tokens and logprobs equal the single engine computing the same split (``test_hybrid.py``'s reference: the
  prefill runs chunked prefill with ``--max-num-batched-tokens CHUNK``, so prompts of ``k*CHUNK + 1`` tokens
  stream in the step of their last chunk);
- the prefill streamed the requests (``vllm:hybrid_kv_num_streamed_requests``) or, without streaming, did not;
- the decode's time to first token with and without streaming, recorded (not asserted: on a 2-core machine
  without a GPU the prefill's layers are CPU work, so a stage posted early competes with later layers for the
  cores instead of overlapping them; the in-process benchmark ``benches/stream_push.py`` measures the overlap
  with the CPU idle during compute, as under a GPU);
- a request whose first stage's transfer fails (NIXL error injected by the streaming prefill's connector class,
  ``faulty_connector.py``, for requests marked ``fail-early``) while its later layers still run fails alone:
  the decode answers it with an error, a request sent beside it is answered right, and the engines keep
  serving.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import RESULTS, RUNNING
from engine import EngineError
from faulty_connector import FAIL_MARK
from pd import PdPair, connectors, max_delta, pair_fixture_body, prompt
from proxy import route_concurrent
from test_hybrid import CHUNK, ENGINE_ARGS, LENGTHS, LOGPROB_TOL, MAX_TOKENS, MODEL, PREFILL_ARGS

HEAD_START_S = 0.5  # the decode request leaves first: on a loaded 2-core machine its registration needs the time
TTFT_REQUESTS = 4
STREAMED = "vllm:hybrid_kv_num_streamed_requests_total"  # Prometheus counters end in _total


@pytest.fixture(scope="module", params=connectors("hybrid-kv-push-stream", "hybrid-kv-push-nostream"))
def pair(request: pytest.FixtureRequest, models_root: Path, logs_root: Path) -> Iterator[PdPair]:
    yield from pair_fixture_body(
        MODEL, request.param, models_root, logs_root, RUNNING, extra_args=ENGINE_ARGS, prefill_args=PREFILL_ARGS
    )


def _warm(pair: PdPair) -> None:
    """A first concurrent request: the prefill connects to the decode (registration-triggered handshake)."""
    route_concurrent(pair.prefill, pair.decode, prompt(5, CHUNK + 1), 2, head_start_s=HEAD_START_S)


def test_concurrent_push_tokens_equal_single_engine(pair: PdPair) -> None:
    _warm(pair)
    before = pair.prefill.metric(STREAMED)
    rows = []
    for i, n in enumerate(LENGTHS):
        p = prompt(30 + i, n)
        ref = pair.reference(p, MAX_TOKENS)
        out = route_concurrent(pair.prefill, pair.decode, p, MAX_TOKENS, head_start_s=HEAD_START_S)
        rows.append((n, out, ref))
        RESULTS.setdefault("tokens", []).append(
            {
                "model": MODEL,
                "connector": pair.connector,
                "prompt_len": n,
                "equal_fresh_ref": out.tokens == ref.fresh_tokens,
                "max_logprob_delta": max_delta(out.logprobs, ref.fresh_logprobs)
                if len(out.logprobs) == len(ref.fresh_logprobs)
                else None,
            }
        )
    streamed = pair.prefill.metric(STREAMED) - before
    RESULTS.setdefault("streamed", []).append({"connector": pair.connector, "streamed": streamed, "of": len(LENGTHS)})
    for n, out, ref in rows:
        assert out.tokens == ref.fresh_tokens, f"prompt of {n}: decode {out.tokens} != single {ref.fresh_tokens}"
        assert max_delta(out.logprobs, ref.fresh_logprobs) <= LOGPROB_TOL
    if pair.connector.endswith("-stream"):
        assert streamed >= 1, "no request streamed (registrations all late?)"
    else:
        assert streamed == 0


def test_decode_time_to_first_token(pair: PdPair) -> None:
    """Recorded for the closing note (see the module docs for why it is not asserted)."""
    _warm(pair)
    times = []
    for i in range(TTFT_REQUESTS):
        out = route_concurrent(pair.prefill, pair.decode, prompt(60 + i, 3 * CHUNK + 1), 1, head_start_s=HEAD_START_S)
        times.append(out.decode_s)
    RESULTS.setdefault("ttft", []).append(
        {
            "connector": pair.connector,
            "prompt_len": 3 * CHUNK + 1,
            "median_s": round(statistics.median(times), 3),
            "all_s": [round(t, 3) for t in times],
        }
    )


def test_a_failed_early_stage_fails_only_its_request(pair: PdPair) -> None:
    if not pair.connector.endswith("-stream"):
        pytest.skip("the fault is injected by the streaming pair's prefill connector")
    _warm(pair)
    good_prompt, bad_prompt = prompt(90, 2 * CHUNK + 1), prompt(91, 2 * CHUNK + 1)
    ref = pair.reference(good_prompt, MAX_TOKENS)
    before = pair.prefill.metric(STREAMED)
    errors: list[BaseException] = []

    def bad() -> None:
        try:
            route_concurrent(
                pair.prefill, pair.decode, bad_prompt, MAX_TOKENS, head_start_s=HEAD_START_S, rid=f"{FAIL_MARK}-1"
            )
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=bad)
    t.start()
    good = route_concurrent(pair.prefill, pair.decode, good_prompt, MAX_TOKENS, head_start_s=HEAD_START_S)
    t.join(300)
    assert len(errors) == 1 and isinstance(errors[0], EngineError), errors  # the decode answered it with an error
    assert good.tokens == ref.fresh_tokens
    assert pair.prefill.metric(STREAMED) - before >= 1
    failed = pair.prefill.metric("vllm:hybrid_kv_num_failed_transfers_total")
    RESULTS.setdefault("stream_failure", []).append({"failed_transfers": failed, "error": str(errors[0])[:200]})
    assert failed >= 1
    # the engines keep serving
    again = route_concurrent(pair.prefill, pair.decode, bad_prompt, MAX_TOKENS, head_start_s=HEAD_START_S)
    assert again.tokens == pair.reference(bad_prompt, MAX_TOKENS).fresh_tokens
