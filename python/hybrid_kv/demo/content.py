"""What the demo's KV caches hold, defined once for the whole (logical, pre-TP) model.

Every request has a *logical* KV cache: for each HMA tensor (region) and attention group, one cell per
(token, head) — one latent per token for MLA — and for each SSM group one full state (conv
sub-projections + temporal state). Each rank's bytes are that logical content cut the way docs/byte-layouts.md
says: attention pages heads-major (the rank's heads), token-major inside a head; MLA pages token-major and
identical on every rank; SSM pages ``[conv 0 | conv 1 | conv 2 | temporal | padding]`` holding the rank's
channel and row shares. Prefill ranks write their shares into their pools; decode ranks compute from the
same definition what their pools must hold after the transfer, and compare every byte — including every
byte no request names, which must be unchanged.

Pure numpy; no NIXL, no planner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..model_preset import Geometry, Preset

__all__ = [
    "U8",
    "Content",
    "Request",
    "Side",
    "expect_decode",
    "fill_prefill",
    "first_mismatch",
    "kernel_ids",
    "random_bytes",
    "region_mismatch",
]

U8 = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class Side:
    """One engine: its preset geometry at its TP size and its pool size."""

    preset: Preset
    geometry: Geometry
    num_blocks: int

    @property
    def tp(self) -> int:
        return self.geometry.tp_size

    def heads(self, rank: int) -> list[int]:
        """Global attention heads rank ``rank`` holds (one latent "head" for MLA)."""
        a = self.preset.attention
        if a.kind == "mla":
            return [0]
        h, tp = a.num_kv_heads, self.tp
        if tp <= h:
            return list(range(rank * h // tp, (rank + 1) * h // tp))
        return [rank * h // tp]

    def attention_tokens(self, num_logical: int) -> int:
        """Tokens an allocation of ``num_logical`` logical blocks covers."""
        return num_logical * self.geometry.logical_block_size

    def logical_blocks_for(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.geometry.logical_block_size))


@dataclass(frozen=True)
class Request:
    """One request of the batch: its length and its logical block ids per group on both sides.

    ``content_tokens`` is how many tokens of logical content to define: the larger of the two sides'
    attention allocations, so both sides cut their pages from the same content.
    """

    index: int
    rid: str
    tokens: int
    prefill_ids: list[list[int]]
    decode_ids: list[list[int]]
    content_tokens: int


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng([seed, *key])


def random_bytes(seed: int, key: tuple[int, ...], n: int) -> U8:
    """``n`` reproducible random bytes."""
    return _rng(seed, *key).integers(0, 256, n, dtype=np.uint8)


class Content:
    """The logical KV content of one request (deterministic from ``seed`` and the request index)."""

    def __init__(self, preset: Preset, seed: int, request: int, tokens: int) -> None:
        self.preset = preset
        self.seed = seed
        self.request = request
        self.tokens = tokens
        self._att: dict[tuple[int, int], U8] = {}
        self._ssm: dict[tuple[int, int], tuple[list[U8], U8]] = {}

    def attention(self, region: int, group: int) -> U8:
        """``(tokens, heads, cell_bytes)``: every token's cell of every (global) head."""
        key = (region, group)
        if key not in self._att:
            a = self.preset.attention
            heads = 1 if a.kind == "mla" else a.num_kv_heads
            cell = a.head_size * a.dtype_bytes * (1 if a.kind == "mla" else 2)
            data = random_bytes(self.seed, (1, self.request, region, group), self.tokens * heads * cell)
            self._att[key] = data.reshape(self.tokens, heads, cell)
        return self._att[key]

    def ssm(self, region: int, group: int) -> tuple[list[U8], U8]:
        """Global state: one ``(channels, row_bytes)`` array per conv sub-projection, and ``(S, rest_bytes)``."""
        key = (region, group)
        if key not in self._ssm:
            s = self.preset.ssm
            assert s is not None
            row = s.conv_rows * s.conv_dtype_bytes
            conv = [
                random_bytes(self.seed, (2, self.request, region, group, p), c * row).reshape(c, row)
                for p, c in enumerate(s.conv_proj_dims)
            ]
            rest = math.prod(s.temporal[1:]) * s.temporal_dtype_bytes
            temporal = random_bytes(self.seed, (3, self.request, region, group), s.temporal[0] * rest)
            self._ssm[key] = (conv, temporal.reshape(s.temporal[0], rest))
        return self._ssm[key]

    def state_share(self, side: Side, rank: int, region: int, group: int) -> U8:
        """Rank ``rank``'s SSM state bytes: its slice of every conv sub-projection, then its temporal rows."""
        conv, temporal = self.ssm(region, group)
        tp = side.tp
        parts = [c[rank * len(c) // tp : (rank + 1) * len(c) // tp].reshape(-1) for c in conv]
        s = len(temporal)
        parts.append(temporal[rank * s // tp : (rank + 1) * s // tp].reshape(-1))
        return np.concatenate(parts)


def kernel_ids(logical: list[int], ppl: int) -> list[int]:
    """Kernel block ids of logical ids, in order."""
    return [b * ppl + k for b in logical for k in range(ppl)]


def fill_prefill(pools: list[U8], side: Side, rank: int, request: Request, content: Content, seed: int) -> None:
    """Write a request's KV shares into a prefill rank's pools (``pools[i]`` is tensor *i*, flat bytes).

    Attention pages are filled for every token of every allocated block (tokens past the prompt too, as a
    real cache holds whatever was there); SSM pages hold the state then padding bytes that are garbage.
    """
    geo = side.geometry
    kinds = side.preset.group_kinds()
    heads = side.heads(rank)
    kb, kpage = geo.kernel_block_size, geo.kernel_page_bytes
    for region, pool in enumerate(pools):
        for g, kind in enumerate(kinds):
            ids = request.prefill_ids[g]
            if kind == "ssm":
                state = content.state_share(side, rank, region, g)
                for b in ids:
                    page = pool[b * geo.page_bytes : (b + 1) * geo.page_bytes]
                    page[: state.size] = state
                    page[state.size :] = random_bytes(seed, (9, rank, region, b), page.size - state.size)
                continue
            cells = content.attention(region, g)
            for j, k in enumerate(kernel_ids(ids, geo.ppl)):
                tok = cells[j * kb : (j + 1) * kb, heads]  # (kb, local heads, cell)
                pool[k * kpage : (k + 1) * kpage] = tok.transpose(1, 0, 2).reshape(-1)


def expect_decode(
    pools_before: list[U8],
    decode: Side,
    prefill: Side,
    rank: int,
    requests: list[Request],
    contents: list[Content],
) -> list[U8]:
    """What a decode rank's pools must hold after every request landed, starting from ``pools_before``.

    Attention: decode kernel page *j* of a request holds tokens ``[j*kb, (j+1)*kb)``; a token is transferred
    when both sides allocated it (the shorter allocation bounds the transfer), its cells are the rank's heads
    of the logical content, anything else in the page is unchanged. SSM: the state prefix of the page is the
    rank's share; the padding is unchanged. Every byte of every block no request names is unchanged.
    """
    geo = decode.geometry
    kinds = decode.preset.group_kinds()
    heads = decode.heads(rank)
    kb, kpage = geo.kernel_block_size, geo.kernel_page_bytes
    out = [p.copy() for p in pools_before]
    for req, content in zip(requests, contents, strict=True):
        for region, pool in enumerate(out):
            for g, kind in enumerate(kinds):
                ids = req.decode_ids[g]
                if kind == "ssm":
                    state = content.state_share(decode, rank, region, g)
                    for b in ids:
                        pool[b * geo.page_bytes : b * geo.page_bytes + state.size] = state
                    continue
                moved = min(prefill.attention_tokens(len(req.prefill_ids[g])), decode.attention_tokens(len(ids)))
                cells = content.attention(region, g)
                for j, k in enumerate(kernel_ids(ids, geo.ppl)):
                    n = min(kb, moved - j * kb)
                    if n <= 0:
                        break
                    page = pool[k * kpage : (k + 1) * kpage].reshape(len(heads), kb, -1)
                    page[:, :n, :] = cells[j * kb : j * kb + n, heads].transpose(1, 0, 2)
    return out


def first_mismatch(actual: list[U8], expected: list[U8], side: Side) -> str | None:
    """A one-line description of the first differing byte (region, block, offset), or ``None``."""
    for region, (a, e) in enumerate(zip(actual, expected, strict=True)):
        problem = region_mismatch(a, e, side, region)
        if problem is not None:
            return problem
    return None


def region_mismatch(actual: U8, expected: U8, side: Side, region: int) -> str | None:
    """:func:`first_mismatch` for one tensor (``region``, its index in the pool list)."""
    page = side.geometry.page_bytes
    diff = np.flatnonzero(actual != expected)
    if not diff.size:
        return None
    off = int(diff[0])
    return (
        f"{diff.size} bytes differ in tensor {region}; first at logical block {off // page}, "
        f"byte {off % page} of the page (got {int(actual[off])}, expected {int(expected[off])})"
    )
