"""Small MLA and KDA layer specs (hand-checked test vectors), shared by ``hybrid-kv regions`` and the tests.

The values are data in ``fixtures.json`` beside this module, the one source that ``rust/core/fixtures.rs``
embeds too (``include_str!``): one MLA layer (6 fp16 latents per token) and two KDA layers (GDN, conv
``(8, 3)`` fp16, temporal ``(1, 4, 4)`` fp32) share each HMA tensor; logical block 12 tokens, kernel block 4,
144-byte pages. Every call returns fresh dicts, so callers may change what they get.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from typing import Any

from .layout import Spec

__all__ = ["F2_PAGE", "f2_geometry", "f2_sharers", "kda_spec", "mla_spec"]

_DATA: dict[str, Any] = json.loads(resources.files(__package__).joinpath("fixtures.json").read_text("utf-8"))
"""``fixtures.json`` as loaded (never handed out: callers get copies)."""

F2_PAGE: int = _DATA["f2"]["page_bytes"]
"""Bytes of one logical block of one F.2 tensor (12 tokens of 6 fp16 latents; the padded KDA page)."""


def mla_spec() -> Spec:
    """The test MLA spec: one latent of 6 fp16 elements per token."""
    spec: Spec = copy.deepcopy(_DATA["mla"])
    return spec


def kda_spec(tp: int = 1, page: int = F2_PAGE) -> Spec:
    """The test KDA spec at TP ``tp`` (conv channels and temporal rows sharded), padded to ``page``."""
    spec: Spec = copy.deepcopy(_DATA["kda"])
    conv_dim, conv_rows = spec["conv_shape"]
    spec["conv_shape"] = [conv_dim // tp, conv_rows]
    heads, rows, cols = spec["temporal_shape"]
    spec["temporal_shape"] = [heads, rows // tp, cols]  # one head: its rows are what TP splits
    spec["page_size_padded"] = page
    return spec


def f2_sharers(tp: int = 1, page: int = F2_PAGE) -> list[tuple[str, int, Spec]]:
    """``(name prefix, group, spec)`` of the three layers sharing each F.2 tensor, KDA first as the vLLM test
    registers them; tensor *i* holds ``kda_a.i``, ``mla.i`` and ``kda_b.i``."""
    specs = {"mla": mla_spec(), "kda": kda_spec(tp, page)}
    return [(s["name"], s["group"], copy.deepcopy(specs[s["spec"]])) for s in _DATA["f2"]["sharers"]]


def f2_geometry(num_logical_blocks: int = 4) -> dict[str, int]:
    """F.2 block geometry: logical block 12 tokens, kernel block 4 (ppl 3), ``num_logical_blocks`` blocks."""
    f2 = _DATA["f2"]
    return {
        "logical_block_size": f2["logical_block_size"],
        "kernel_block_size": f2["kernel_block_size"],
        "num_logical_blocks": num_logical_blocks,
    }
