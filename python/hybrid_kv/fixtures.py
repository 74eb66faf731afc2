"""Small MLA and KDA layer specs (hand-checked test vectors), shared by ``hybrid-kv regions`` and the tests.

The Python twin of ``rust/core/fixtures.rs``: one MLA layer (6 fp16 latents per token) and two KDA layers
(GDN, conv ``(8, 3)`` fp16, temporal ``(1, 4, 4)`` fp32) share each HMA tensor; logical block 12 tokens,
kernel block 4, 144-byte pages. Every call returns fresh dicts, so callers may change what they get.
"""

from __future__ import annotations

from .layout import Spec

F2_PAGE = 144
"""Bytes of one logical block of one F.2 tensor (12 tokens of 6 fp16 latents; the padded KDA page)."""


def mla_spec() -> Spec:
    """The test MLA spec: one latent of 6 fp16 elements per token."""
    return {"type": "mla", "head_size": 6, "dtype_bytes": 2}


def kda_spec(tp: int = 1, page: int = F2_PAGE) -> Spec:
    """The test KDA spec at TP ``tp`` (conv channels and temporal rows sharded), padded to ``page``."""
    return {
        "type": "ssm",
        "kind": "gdn",
        "conv_shape": [8 // tp, 3],
        "conv_dtype_bytes": 2,
        "temporal_shape": [1, 4 // tp, 4],
        "temporal_dtype_bytes": 4,
        "page_size_padded": page,
    }


def f2_sharers(tp: int = 1, page: int = F2_PAGE) -> list[tuple[str, int, Spec]]:
    """``(name prefix, group, spec)`` of the three layers sharing each F.2 tensor, KDA first as the vLLM test
    registers them; tensor *i* holds ``kda_a.i``, ``mla.i`` and ``kda_b.i``."""
    return [("kda_a", 1, kda_spec(tp, page)), ("mla", 0, mla_spec()), ("kda_b", 2, kda_spec(tp, page))]


def f2_geometry(num_logical_blocks: int = 4) -> dict[str, int]:
    """F.2 block geometry: logical block 12 tokens, kernel block 4 (ppl 3), ``num_logical_blocks`` blocks."""
    return {"logical_block_size": 12, "kernel_block_size": 4, "num_logical_blocks": num_logical_blocks}
