"""Plain-integer rank layouts: the one input the Rust core takes to build a region table.

A layout is a dict that mirrors ``RankLayout`` in ``rust/core/layout.rs``; these helpers build it without
torch. Specs are dicts tagged by ``type``: ``full_attention``, ``sliding_window``, ``mla``,
``sliding_window_mla`` or ``ssm`` (see ``rust/core/spec.rs`` for their fields).
"""

from __future__ import annotations

import json
from typing import Any

from ._core import RegionTable

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
) -> dict[str, Any]:
    """One layer of a layout: name, KV-cache group, spec and memory (``block_stride`` 0 means dense)."""
    return {
        "name": name,
        "group": group,
        "spec": spec,
        "memory": {
            "base": base,
            "bytes": nbytes,
            "block_stride": block_stride,
            "device": device,
            "mem_type": mem_type,
            "num_blocks": num_blocks,
        },
    }


def rank_layout(
    layers: list[dict[str, Any]],
    *,
    logical_block_size: int,
    kernel_block_size: int,
    num_logical_blocks: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    total_num_kv_heads: int = 1,
) -> dict[str, Any]:
    """A rank layout: its layers plus block geometry and TP position."""
    return {
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "logical_block_size": logical_block_size,
        "kernel_block_size": kernel_block_size,
        "num_logical_blocks": num_logical_blocks,
        "total_num_kv_heads": total_num_kv_heads,
        "layers": layers,
    }


def build_region_table(layout: dict[str, Any]) -> RegionTable:
    """Build the region table of one rank (raises ``LayoutError`` naming the bad value)."""
    return RegionTable.from_json(json.dumps(layout))
