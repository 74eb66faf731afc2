"""Heterogeneous TP in real engines: a GQA prefill at TP 1 and its decode at TP 2 (two worker processes, each
holding one of the model's two KV heads), hybrid-kv pull. Each decode rank reads its head's half of every page
from the one prefill rank.

No engine computes exactly what this decode does: its KV comes from a TP 1 engine while it computes the new tokens
at TP 2, whose row-parallel layers sum their halves in another order, so logprobs move by bfloat16 rounding.
Measured: against the TP 1 single engine over the same cached context, and against the TP 2 decode engine serving
the prompt itself (under a cache salt), tokens equal and logprob deltas 0.04-0.09. So greedy tokens must equal
the single engine's and logprobs agree within ``LOGPROB_TOL``; with the wrong head's bytes, or none, the context
would not be the prompt's, and at these weight scales the context decides the greedy tokens
(``test_weights_make_kv_matter`` in ``test_gqa.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import RESULTS, RUNNING
from pd import PdPair, compare_tokens, max_delta, pair_fixture_body

MODEL = "gqa"
BLOCK = 128
LENGTHS = [BLOCK + 1, 2 * BLOCK + 1]
MAX_TOKENS = 12
LOGPROB_TOL = 0.25  # bfloat16 TP 2 vs TP 1 reductions (measured up to 0.09)


@pytest.fixture(scope="module")
def pair(models_root: Path, logs_root: Path) -> Iterator[PdPair]:
    yield from pair_fixture_body(MODEL, "hybrid-kv-pull", models_root, logs_root, RUNNING, decode_tp=2)


def test_decode_tp2_tokens_equal_single_engine(pair: PdPair) -> None:
    for n, out, ref in compare_tokens(pair, RESULTS, LENGTHS, MAX_TOKENS):
        assert out.tokens == ref.cached_tokens, f"prompt of {n}: decode {out.tokens} != single {ref.cached_tokens}"
        assert max_delta(out.logprobs, ref.cached_logprobs) <= LOGPROB_TOL
