"""Plain-integer rank layouts: the one input the Rust core takes to build a region table.

A layout is a dict that mirrors ``RankLayout`` in ``rust/core/layout.rs``; these helpers build it without
torch. Specs are dicts tagged by ``type``: ``full_attention``, ``sliding_window``, ``mla``,
``sliding_window_mla`` or ``ssm``; ``hybrid_kv.inputs`` types every field, and the core refuses any other key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ._core import RegionTable
from .inputs import RankLayout

__all__ = ["Spec", "build_region_table", "layer", "rank_layout"]

Spec = dict[str, Any]


def layer(
    name: str,
    group: int,
    spec: Spec,
    *,
    base: int,
    nbytes: int,
    block_stride: int = 0,
    device: int = 0,
    mem_type: str = "DRAM",
    num_blocks: int | None = None,
    page_layout: str | None = None,
) -> dict[str, Any]:
    """One layer of a layout: name, KV-cache group, spec and memory (``block_stride`` 0 means dense).

    ``page_layout`` (``"HND"`` or ``"NHD"``) is the order of (head, token) cells its tensor's strides show
    (``torch_adapter.page_layout``); leave it out where no tensor says.
    """
    memory: dict[str, Any] = {
        "base": base,
        "bytes": nbytes,
        "block_stride": block_stride,
        "device": device,
        "mem_type": mem_type,
        "num_blocks": num_blocks,
    }
    if page_layout is not None:
        memory["page_layout"] = page_layout
    return {"name": name, "group": group, "spec": spec, "memory": memory}


def rank_layout(
    layers: list[dict[str, Any]],
    *,
    logical_block_size: int,
    kernel_block_size: int,
    num_logical_blocks: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    total_num_kv_heads: int = 1,
    kv_layout: str | None = None,
) -> dict[str, Any]:
    """A rank layout: its layers plus block geometry and TP position.

    ``kv_layout`` declares the attention pages' cell order by the engine's layout name (``"HND"``, ``"NHD"``,
    vLLM's ``"LBHNC"``...) where no tensor shows it; heads-major when nothing says.
    """
    out: dict[str, Any] = {
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "logical_block_size": logical_block_size,
        "kernel_block_size": kernel_block_size,
        "num_logical_blocks": num_logical_blocks,
        "total_num_kv_heads": total_num_kv_heads,
        "layers": layers,
    }
    if kv_layout is not None:
        out["kv_layout"] = kv_layout
    return out


def build_region_table(layout: RankLayout | Mapping[str, Any]) -> RegionTable:
    """Build the region table of one rank (``hybrid_kv.inputs.RankLayout``); raises ``LayoutError`` (also a
    ``ValueError``) naming the bad value, or the layer and the key of an unknown or misspelled one."""
    return RegionTable.from_json(json.dumps(layout))
