"""Prefill and decode with different block sizes in real engines (``--block-size`` per engine), hybrid-kv.

One pair per case (module-scoped, parametrized), greedy tokens equal to the single engine's and logprobs within
``LOGPROB_TOL``, with each model's reference as in its own module (``test_gqa.py``: the cached context;
``test_hybrid.py``: the same chunked split):

- GQA, prefill blocks of 128 tokens to decode blocks of 64 (pull), and 64 to 128 (push);
- the Qwen3-Next-shaped hybrid, prefill blocks of 384 tokens to decode blocks of 768 (pull). vLLM raises a hybrid
  model's attention block until a page holds an SSM state (``_align_hybrid_block_size``: the smallest multiple of
  the given size whose page is at least the state), so both sizes are given and large enough to be kept.

The prompt lengths are one past a multiple of the smaller block and cross the larger one mid-page, so the decode
reads pages whose boundaries are not the prefill's.

On the CPU, vLLM's attention stores each head's K transposed over the block's tokens (``HKTV`` pages,
``K_TRANSPOSED_ISAS`` in ``hybrid_kv/integrations/vllm/layout.py``; ``test_cpu_attn_layout.py`` checks the layout
against the kernel): each engine registers ``HKTV`` pages and the pages are cut into ``head_size`` K runs and one V
run per head and common unit. (Cut as plain heads-major pages, the GQA 128-to-64 pair answered every prompt with
other tokens, logprobs off by up to 2.)
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import RESULTS, RUNNING
from engine import DEVICE, Engine
from pd import PdPair, compare_tokens, max_delta, pair_fixture_body
from test_hybrid import CHUNK, ENGINE_ARGS, PREFILL_ARGS

MAX_TOKENS = 12
LOGPROB_TOL = 1e-4  # the same bytes in the context: as in test_gqa.py and test_hybrid.py


@dataclass(frozen=True)
class Case:
    model: str
    connector: str
    prefill_block: int
    decode_block: int
    lengths: tuple[int, ...]
    reference: str  # "cached" (the single engine over the cached context) or "fresh" (the same chunked split)
    engine_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()


CASES = {
    "gqa-128-to-64": Case("gqa", "hybrid-kv-pull", 128, 64, (129, 193, 257), "cached"),
    "gqa-64-to-128": Case("gqa", "hybrid-kv-push", 64, 128, (129, 193, 257), "cached"),
    "qwen3_next-384-to-768": Case(
        "qwen3_next",
        "hybrid-kv-pull",
        384,
        768,
        (CHUNK + 1, 3 * CHUNK + 1, 6 * CHUNK + 1),
        "fresh",
        tuple(ENGINE_ARGS),
        tuple(PREFILL_ARGS),
    ),
}

REGISTERED = re.compile(
    r"hybrid-kv worker \S+: \d+ regions, \d+ blocks of (\d+) tokens \((\d+)-token kernel blocks\), (\S+) pages"
)


@dataclass
class BlockPair:
    case: Case
    pair: PdPair


@pytest.fixture(scope="module", params=list(CASES))
def bp(request: pytest.FixtureRequest, models_root: Path, logs_root: Path) -> Iterator[BlockPair]:
    case = CASES[request.param]
    for pair in pair_fixture_body(
        case.model,
        case.connector,
        models_root,
        logs_root,
        RUNNING,
        extra_args=list(case.engine_args),
        prefill_args=[*case.prefill_args, "--block-size", str(case.prefill_block)],
        decode_args=["--block-size", str(case.decode_block)],
    ):
        yield BlockPair(case, pair)


def _registered(e: Engine) -> tuple[int, int, str]:
    """(block, kernel block) in tokens and the page layout, as the engine's hybrid-kv worker registered its table."""
    m = REGISTERED.search(e.log_path.read_text(errors="replace"))
    assert m, e.tail(40)
    return int(m.group(1)), int(m.group(2)), m.group(3)


def test_engines_page_with_their_own_block_sizes(bp: BlockPair) -> None:
    """Each engine kept its ``--block-size`` (vLLM may raise a hybrid model's); kernel blocks and page layouts
    recorded (``HKTV`` on the CPU)."""
    prefill, decode = _registered(bp.pair.prefill), _registered(bp.pair.decode)
    RESULTS.setdefault("block_sizes", []).append(
        {"model": bp.case.model, "connector": bp.case.connector, "prefill": prefill, "decode": decode}
    )
    assert prefill[0] == bp.case.prefill_block
    assert decode[0] == bp.case.decode_block
    if DEVICE == "cpu":
        assert prefill[2] == decode[2] == "HKTV"


def test_tokens_equal_single_engine(bp: BlockPair) -> None:
    for n, out, ref in compare_tokens(bp.pair, RESULTS, list(bp.case.lengths), MAX_TOKENS):
        want, want_lp = (
            (ref.cached_tokens, ref.cached_logprobs)
            if bp.case.reference == "cached"
            else (ref.fresh_tokens, ref.fresh_logprobs)
        )
        assert out.tokens == want, f"prompt of {n}: decode {out.tokens} != single {want}"
        assert max_delta(out.logprobs, want_lp) <= LOGPROB_TOL
