"""Qwen3-Next-shaped hybrid (Gated DeltaNet linear attention + full attention) in real engines: hybrid-kv pull and
push, and vLLM's NixlConnector.

vLLM gives this model transfer groups with different block sizes (a 640-token attention block, so that an
attention page is at least a mamba page, and a 1024-token mamba block: one whole state per request), which
hybrid-kv plans (the attention block is the region table's block; SSM blocks are whole states).

Which single-engine output a transfer must reproduce: with SSM state, the prefill engine computes all but the
last prompt token (both connectors back off one token) and the decode engine computes the last one from the
transferred state and KV. A fresh single engine computes the whole prompt in one chunked GDN pass, which rounds
differently from "N-1 tokens, then 1 more from the state", and can flip a greedy token (the control's
divergence seen before). The prefill engine here runs with ``--max-num-batched-tokens CHUNK``: a prompt of
``k*CHUNK + 1`` tokens served without ``kv_transfer_params`` is then computed as chunks of CHUNK tokens and a
last chunk of 1 token from the state, exactly the disaggregated computation. That is the reference asserted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import RESULTS, RUNNING
from pd import PdPair, compare_tokens, connectors, delivered_under_load, max_delta, pair_fixture_body, prompt

MODEL = "qwen3_next"
CHUNK = 128
LENGTHS = [CHUNK + 1, 2 * CHUNK + 1, 3 * CHUNK + 1]
MAX_TOKENS = 12
LOGPROB_TOL = 1e-4
LOAD_REQUESTS = 6
ENGINE_ARGS = ["--no-enable-prefix-caching"]
PREFILL_ARGS = ["--max-num-batched-tokens", str(CHUNK), "--enable-chunked-prefill"]


@pytest.fixture(scope="module", params=connectors("hybrid-kv-pull", "hybrid-kv-push", "nixl"))
def pair(request: pytest.FixtureRequest, models_root: Path, logs_root: Path) -> Iterator[PdPair]:
    yield from pair_fixture_body(
        MODEL,
        request.param,
        models_root,
        logs_root,
        RUNNING,
        extra_args=ENGINE_ARGS,
        prefill_args=PREFILL_ARGS,
    )


def test_hybrid_engine_starts_with_mixed_block_sizes(pair: PdPair) -> None:
    """Both engines started; hybrid-kv's workers registered a table whose attention block is vLLM's choice."""
    if pair.connector.startswith("hybrid-kv"):
        log = pair.decode.log_path.read_text(errors="replace")
        assert "hybrid-kv worker" in log and "regions" in log


def test_tokens_equal_single_engine_computing_the_same_split(pair: PdPair) -> None:
    rows = compare_tokens(pair, RESULTS, LENGTHS, MAX_TOKENS)
    for n, out, ref in rows:
        assert out.tokens == ref.fresh_tokens, f"prompt of {n}: decode {out.tokens} != single {ref.fresh_tokens}"
        assert max_delta(out.logprobs, ref.fresh_logprobs) <= LOGPROB_TOL


def test_delivers_everything_under_load(pair: PdPair) -> None:
    """Every request delivered (and right) while busy processes saturate every core. The prefills go one at a
    time, so each prompt is chunked as in its single-engine reference; the decodes run concurrently."""
    prompts = [prompt(300 + i, CHUNK * (1 + i % 3) + 1) for i in range(LOAD_REQUESTS)]
    refs = [pair.reference(p, MAX_TOKENS).fresh_tokens for p in prompts]
    delivered, errors = delivered_under_load(pair, prompts, MAX_TOKENS, refs, serial_prefill=True)
    assert delivered == len(prompts), errors
