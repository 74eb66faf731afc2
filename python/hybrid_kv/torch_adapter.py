"""Torch adapter: reduce KV-cache tensors to plain integers (pointer, bytes, block stride, device).

Lifetime rule that Rust cannot enforce: the tensors must outlive every region table, plan and NIXL
registration built from them. Torch is imported lazily; the rest of hybrid_kv works without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._core import LayoutError, RegionTable
from .layout import Spec, build_region_table, layer, rank_layout

if TYPE_CHECKING:
    import torch


def tensor_memory(tensor: torch.Tensor, name: str) -> dict[str, Any]:
    """``base``, ``nbytes``, ``block_stride``, ``device`` and ``mem_type`` of a KV-cache view.

    Dim 0 indexes blocks. A 1-D tensor is a dense byte pool (stride = page). Each block (``tensor[0]``)
    must be contiguous, since a descriptor is one contiguous byte range.
    """
    if tensor.dim() == 0:
        raise LayoutError(f"layer {name}: a 0-d tensor has no block dimension")
    if tensor.dim() > 1 and tensor.shape[0] > 0 and not tensor[0].is_contiguous():
        raise LayoutError(
            f"layer {name}: blocks must be contiguous, but tensor[0] of shape {tuple(tensor[0].shape)} "
            f"has strides {tensor[0].stride()}"
        )
    elem = tensor.element_size()
    if tensor.dim() == 1 and tensor.stride(0) != 1:
        raise LayoutError(f"layer {name}: a 1-D pool must be dense, got stride {tensor.stride(0)}")
    nbytes = (
        (tensor.shape[0] - 1) * tensor.stride(0) * elem + tensor[0].numel() * elem
        if tensor.dim() > 1 and tensor.shape[0] > 0
        else tensor.numel() * elem
    )
    is_cuda = tensor.device.type == "cuda"
    return {
        "base": tensor.data_ptr(),
        "nbytes": nbytes,
        "block_stride": tensor.stride(0) * elem if tensor.dim() > 1 else 0,
        "device": (tensor.device.index or 0) if is_cuda else 0,
        "mem_type": "VRAM" if is_cuda else "DRAM",
    }


def region_table_from_tensors(
    layers: list[tuple[str, int, Spec, torch.Tensor]],
    *,
    logical_block_size: int,
    kernel_block_size: int,
    num_logical_blocks: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    total_num_kv_heads: int = 1,
) -> RegionTable:
    """Build a region table from ``(layer name, group, spec, tensor)`` tuples.

    Layers of different groups that share one tensor (HMA) must pass views with the same ``data_ptr()``.
    """
    entries = [layer(name, group, spec, **tensor_memory(t, name)) for name, group, spec, t in layers]
    return build_region_table(
        rank_layout(
            entries,
            logical_block_size=logical_block_size,
            kernel_block_size=kernel_block_size,
            num_logical_blocks=num_logical_blocks,
            tp_rank=tp_rank,
            tp_size=tp_size,
            total_num_kv_heads=total_num_kv_heads,
        )
    )
