"""Torch adapter: reduce KV-cache tensors to plain integers (pointer, bytes, block stride, device) and the facts
their strides show (the order of (head, token) cells in an attention page).

Lifetime rule that Rust cannot enforce: the tensors must outlive every region table, plan and NIXL
registration built from them. Torch is imported lazily; the rest of hybrid_kv works without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._core import LayoutError, RegionTable
from .layout import Spec, build_region_table, layer, rank_layout

if TYPE_CHECKING:
    import torch

__all__ = ["page_layout", "region_table_from_tensors", "tensor_memory"]

_ATTENTION = ("full_attention", "sliding_window")


def _dense(block: torch.Tensor) -> bool:
    """Whether ``block``'s elements fill one contiguous range in some axis order (a permuted contiguous view)."""
    dims = sorted((s, n) for s, n in zip(block.stride(), block.shape, strict=True) if n > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def page_layout(
    tensor: torch.Tensor, name: str, spec: Spec | None, tokens: int | None, dims: str | None = None
) -> str | None:
    """The order of (head, token) cells in the attention pages of ``tensor``, as its strides show it.

    ``"HND"`` (heads-major) or ``"NHD"`` (token-major); ``None`` where the tensor does not say: not a GQA/MHA
    attention layer, one head or one token per page, a flat byte pool, or (without ``dims``) a shape where the heads
    and the tokens axis cannot be told apart. ``dims`` names the view's axes by letter (vLLM's ``"BHNC"``: blocks,
    heads, tokens, cell) so that the strides alone decide.

    Raises:
        LayoutError: ``dims`` does not match the tensor's shape, or a page keeps K and V apart (a ``[2, ...]``
            axis outside the heads and tokens: a head's K and V are then two ranges, not the page model of
            docs/byte-layouts.md).
    """
    if spec is None or spec.get("type") not in _ATTENTION or tokens is None:
        return None
    heads = int(spec["num_kv_heads"])
    if dims is not None:
        if len(dims) != tensor.dim() or "H" not in dims or "N" not in dims:
            raise LayoutError(
                f"layer {name}: axes {dims!r} do not name the {tensor.dim()} dims of shape {tuple(tensor.shape)}"
            )
        h, n = dims.index("H"), dims.index("N")
        if (tensor.shape[h], tensor.shape[n]) != (heads, tokens):
            raise LayoutError(
                f"layer {name}: axes {dims!r} of shape {tuple(tensor.shape)} give {tensor.shape[h]} heads and "
                f"{tensor.shape[n]} tokens, but the spec says {heads} heads and the kernel block {tokens} tokens"
            )
    else:
        if heads == tokens or tensor.dim() < 3:
            return None
        on = [d for d in range(1, tensor.dim()) if tensor.shape[d] > 1]
        hd = [d for d in on if tensor.shape[d] == heads]
        nd = [d for d in on if tensor.shape[d] == tokens]
        if len(hd) != 1 or len(nd) != 1:
            return None
        h, n = hd[0], nd[0]
    if heads == 1 or tokens == 1:
        return None
    inner = min(tensor.stride(h), tensor.stride(n))
    kv = [d for d in range(1, tensor.dim()) if d not in (h, n) and tensor.shape[d] == 2 and tensor.stride(d) > inner]
    if kv:
        raise LayoutError(
            f"layer {name}: its pages keep K and V apart (axis {kv[0]} of shape {tuple(tensor.shape)}, strides "
            f"{tensor.stride()}); hybrid-kv's attention page holds each token's K then V per head "
            "(docs/byte-layouts.md): describe K and V as two layers (one tensor each)"
        )
    return "HND" if tensor.stride(h) > tensor.stride(n) else "NHD"


def tensor_memory(
    tensor: torch.Tensor,
    name: str,
    spec: Spec | None = None,
    tokens: int | None = None,
    dims: str | None = None,
) -> dict[str, Any]:
    """``base``, ``nbytes``, ``block_stride``, ``device``, ``mem_type`` and ``page_layout`` of a KV-cache view.

    Dim 0 indexes blocks. A 1-D tensor is a dense byte pool (stride = page). Each block (``tensor[0]``)
    must fill one contiguous byte range (in any axis order), since a descriptor is one contiguous byte range.
    With the layer's ``spec`` and the kernel block's ``tokens``, an attention page's cell order is read off the
    strides (``page_layout``; see there for ``dims``).

    Raises:
        LayoutError: a 0-d tensor, a block that is not one contiguous range, or what ``page_layout`` refuses.
    """
    if tensor.dim() == 0:
        raise LayoutError(f"layer {name}: a 0-d tensor has no block dimension")
    if tensor.dim() > 1 and tensor.shape[0] > 0 and not _dense(tensor[0]):
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
    memory = {
        "base": tensor.data_ptr(),
        "nbytes": nbytes,
        "block_stride": tensor.stride(0) * elem if tensor.dim() > 1 else 0,
        "device": (tensor.device.index or 0) if is_cuda else 0,
        "mem_type": "VRAM" if is_cuda else "DRAM",
    }
    order = page_layout(tensor, name, spec, tokens, dims)
    if order is not None:
        memory["page_layout"] = order
    return memory


def region_table_from_tensors(
    layers: list[tuple[str, int, Spec, torch.Tensor]],
    *,
    logical_block_size: int,
    kernel_block_size: int,
    num_logical_blocks: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    total_num_kv_heads: int = 1,
    kv_layout: str | None = None,
    state_slots: bool = False,
) -> RegionTable:
    """Build a region table from ``(layer name, group, spec, tensor)`` tuples.

    Layers of different groups that share one tensor (HMA) must pass views with the same ``data_ptr()``. The
    attention pages' cell order is read off the tensors where their shape shows it (``page_layout``);
    ``kv_layout`` (``"HND"``, ``"NHD"`` or vLLM's names) declares it where they do not, and a declaration the
    tensors contradict is a ``LayoutError``.

    ``state_slots``: SSM state tensors are pools of their own, indexed by state slot (dim 0: SGLang's
    ``MambaPool``), not by the rank's logical blocks; each declares its dim 0 as its slot count.
    """
    entries = [
        layer(
            name,
            group,
            spec,
            **tensor_memory(t, name, spec, kernel_block_size),
            num_blocks=int(t.shape[0]) if state_slots and spec.get("type") == "ssm" and t.dim() > 1 else None,
        )
        for name, group, spec, t in layers
    ]
    return build_region_table(
        rank_layout(
            entries,
            logical_block_size=logical_block_size,
            kernel_block_size=kernel_block_size,
            num_logical_blocks=num_logical_blocks,
            tp_rank=tp_rank,
            tp_size=tp_size,
            total_num_kv_heads=total_num_kv_heads,
            kv_layout=kv_layout,
        )
    )
