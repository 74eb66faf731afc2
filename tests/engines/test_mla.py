"""MLA (DeepSeek-V2-shaped, latent 512 + rope 64 for vLLM's CPU MLA kernel) in real engines: hybrid-kv pull
against vLLM's own NixlConnector on the same model and prompts.

Why the reference on the CPU is NixlConnector's decode and not the single engine: after a transfer the decode
engine computes only the last prompt token, a 1-token query over the transferred latents, which vLLM's MLA batch
split (``reorder_batch_threshold`` 1) runs on its absorbed decode path (``mla_decode_kvcache_cpu``). A single CPU
engine never computes a prompt token that way: vLLM's CPU platform turns prefix caching off for MLA
(``platforms/cpu.py``), so it computes every prompt on the expanded prefill path (SDPA). On vLLM's CPU MLA backend
the two paths do not agree, with no connector involved: one engine, float32, token 2 of a greedy run (decode path)
against the same token recomputed as the last token of a prompt (prefill path) differed in 2 of 3 prompts with
logprob deltas up to 1.1 (every CPU run records this check as ``cpu_mla_paths`` in its results). Both connectors'
decodes differed from the single engine identically (deltas 0.9-1.7), so the bytes were right and the reference
was not. What a transfer must reproduce is the decode path over the prefill's latents, which is exactly what
vLLM's NixlConnector gives: hybrid-kv's greedy tokens and logprobs must equal NixlConnector's, bit for bit. The
NixlConnector pair is therefore always started here (it is this test's reference, not an optional control).

On CUDA (``scripts/gpu-e2e.sh``) prefix caching works: the single engine's second run of a prompt one token past a
block boundary computes its last token on the decode path over cached latents, as a decode engine does, so the
decode must also equal that ``cached`` single-engine reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import RESULTS, RUNNING
from engine import DEVICE, logprobs, tokens
from pd import PdPair, compare_tokens, delivered_under_load, max_delta, pair_fixture_body, prompt
from proxy import route

MODEL = "mla"
BLOCK = 64  # a multiple of every MLA block size vLLM picks (16 on the CPU, 64 for FlashMLA)
LENGTHS = [BLOCK + 1, 2 * BLOCK + 1, 4 * BLOCK + 1]
MAX_TOKENS = 12
LOGPROB_TOL = 1e-4  # the same kernels over the same latent bytes: bit-identical in practice
LOAD_PROMPTS = [prompt(400 + i, BLOCK + 1 + 23 * i) for i in range(6)]
ENGINE_ARGS = ["--max-num-seqs", "1"]
"""One request per step in both engines. vLLM's CPU MLA kernels are not batch invariant: routed concurrently,
0 of 6 decodes of either connector gave the tokens of the same prompt's unloaded decode, with no error. One
sequence per step makes each request's bytes and tokens independent of what else is in flight, so concurrent
requests under load have a right answer; the requests still arrive, handshake, queue and transfer
concurrently."""


def _run(connector: str, models_root: Path, logs_root: Path, load_refs: list[list[int]] | None) -> dict[str, Any]:
    """Start ``connector``'s pair, route every prompt through it, record the single-engine references and the
    CPU path check, route ``LOAD_PROMPTS`` under load, stop it; returns the rows. Without ``load_refs`` (the
    NixlConnector pair, the reference) the pair's own unloaded decodes of ``LOAD_PROMPTS`` are the reference,
    and are returned as ``load_refs``."""
    out: dict[str, Any] = {}
    for pair in pair_fixture_body(MODEL, connector, models_root, logs_root, RUNNING, extra_args=ENGINE_ARGS):
        out["rows"] = compare_tokens(pair, RESULTS, LENGTHS, MAX_TOKENS)
        out["hits"] = pair.decode.metric("vllm:external_prefix_cache_hits_total")
        if connector == "hybrid-kv-pull" and DEVICE == "cpu":
            out["paths"] = _paths(pair)
        if load_refs is None:
            load_refs = [route(pair.prefill, pair.decode, p, MAX_TOKENS).tokens for p in LOAD_PROMPTS]
            out["load_refs"] = load_refs
        out["load"] = delivered_under_load(pair, LOAD_PROMPTS, MAX_TOKENS, load_refs)
    return out


def _paths(pair: PdPair) -> list[dict[str, Any]]:
    """On the prefill engine (no connector involved): token 2 of a greedy run, computed on MLA's decode path,
    against the same position computed as the last prompt token on its prefill path."""
    rows = []
    for i, n in enumerate(LENGTHS):
        p = prompt(10 + i, n)
        a = pair.prefill.complete(p, 2)
        b = pair.prefill.complete(p + tokens(a)[:1], 1)
        rows.append(
            {
                "prompt_len": n,
                "decode_path_token": tokens(a)[1],
                "prefill_path_token": tokens(b)[0],
                "logprob_delta": abs(logprobs(a)[1] - logprobs(b)[0]),
            }
        )
    RESULTS.setdefault("cpu_mla_paths", []).extend(rows)
    return rows


@pytest.fixture(scope="module")
def runs(models_root: Path, logs_root: Path) -> Iterator[dict[str, dict[str, Any]]]:
    """NixlConnector's pair (the reference), then hybrid-kv's (one pair at a time on the machine)."""
    control = _run("nixl", models_root, logs_root, None)
    yield {"nixl": control, "hybrid-kv-pull": _run("hybrid-kv-pull", models_root, logs_root, control["load_refs"])}


def test_tokens_equal_nixl_connector(runs: dict[str, dict[str, Any]]) -> None:
    """hybrid-kv's decode gives NixlConnector's greedy tokens and logprobs on every prompt; both decodes read the
    prompt from their prefill (external prefix-cache hits)."""
    ours, control = runs["hybrid-kv-pull"], runs["nixl"]
    assert ours["hits"] >= sum(LENGTHS) - len(LENGTHS) and control["hits"] >= sum(LENGTHS) - len(LENGTHS)
    for (n, out, _), (_, ref, _) in zip(ours["rows"], control["rows"], strict=True):
        assert out.tokens == ref.tokens, f"prompt of {n}: hybrid-kv {out.tokens} != NixlConnector {ref.tokens}"
        assert max_delta(out.logprobs, ref.logprobs) <= LOGPROB_TOL


def test_delivers_everything_under_load(runs: dict[str, dict[str, Any]]) -> None:
    """Every request delivered while busy processes saturate every core, by both connectors, each with the
    tokens of NixlConnector's decode of the same prompt on an unloaded machine."""
    for connector in ("nixl", "hybrid-kv-pull"):
        delivered, errors = runs[connector]["load"]
        assert delivered == len(LOAD_PROMPTS), f"{connector}: {delivered} of {len(LOAD_PROMPTS)}: {errors}"


@pytest.mark.skipif(DEVICE == "cpu", reason="no prefix cache for MLA on vLLM's CPU platform (see the module doc)")
def test_tokens_equal_single_engine_over_cached_latents(runs: dict[str, dict[str, Any]]) -> None:
    for n, out, ref in runs["hybrid-kv-pull"]["rows"]:
        assert out.tokens == ref.cached_tokens, f"prompt of {n}: decode {out.tokens} != single {ref.cached_tokens}"
        assert max_delta(out.logprobs, ref.cached_logprobs) <= LOGPROB_TOL
