"""vLLM's KV-cache specs and tensors, translated into a hybrid-kv rank layout — in this one place.

``layer_spec`` maps each vLLM spec type to a hybrid-kv layer spec (FullAttention, SlidingWindow, MLA,
SlidingWindowMLA, Mamba1/Mamba2/GDN/KDA state); anything else is refused by name. ``rank_table`` turns the
``kv_caches`` dict vLLM hands to ``register_kv_caches`` (the views ``allocate_kv_cache`` made from a
``KVCacheConfig``) into a ``RegionTable``; ``compat_factors`` derives the handshake's compatibility hash
factors from a ``VllmConfig``; ``engine_facts`` reads the KV layout and attention backends vLLM applied.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..._core import LayoutError, RegionTable
from ...layout import build_region_table, layer, rank_layout
from ...torch_adapter import tensor_memory

__all__ = [
    "CONNECTOR_WIRE_VERSION",
    "CONV_LAYOUT_ENV",
    "K_TRANSPOSED_ISAS",
    "RankGeometry",
    "UNCUT_PAGE_BACKENDS",
    "UNKNOWN_BACKEND",
    "attention_backends",
    "check_conv_layout",
    "compat_factors",
    "engine_facts",
    "layer_spec",
    "logical_block_tokens",
    "page_facts",
    "prefer_ds_conv_layout",
    "rank_table",
    "transfer_group_kinds",
]

log = logging.getLogger("hybrid_kv.integrations.vllm")

_MAMBA_KINDS = {"MAMBA1": "mamba1", "MAMBA2": "mamba2", "GDN_ATTN": "gdn"}


def _dtype_bytes(dtype: Any) -> int:
    import torch

    return int(torch.empty((), dtype=dtype).element_size())


def unwrap(spec: Any, layer_name: str) -> Any:
    """The layer's own spec (``UniformTypeKVCacheSpecs`` holds one per layer)."""
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, Mapping):
        return inner[layer_name]
    return spec


def layer_spec(spec: Any) -> dict[str, Any]:
    """The hybrid-kv layer spec of one vLLM KV-cache spec (per TP rank, as vLLM's are).

    Raises:
        LayoutError: spec types hybrid-kv does not transfer (cross attention, chunked local attention, circular
            buffers, quantized-scale layouts, replicated (``tp_replicated``) or speculative SSM state...).
    """
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    name = type(spec).__name__
    padded = getattr(spec, "page_size_padded", None)
    if isinstance(spec, MambaSpec):
        kind = _MAMBA_KINDS.get(getattr(spec.mamba_type, "name", ""))
        if kind is None:
            raise LayoutError(f"{name} with mamba_type {spec.mamba_type} is not supported by hybrid-kv")
        if spec.tp_replicated or spec.num_speculative_blocks:
            raise LayoutError(f"{name}: replicated or speculative SSM state is not supported by hybrid-kv")
        if len(spec.shapes) != 2:
            raise LayoutError(f"{name}: expected (conv, temporal) state shapes, got {spec.shapes}")
        return {
            "type": "ssm",
            "kind": kind,
            "conv_shape": [int(d) for d in spec.shapes[0]],
            "conv_dtype_bytes": _dtype_bytes(spec.dtypes[0]),
            "temporal_shape": [int(d) for d in spec.shapes[1]],
            "temporal_dtype_bytes": _dtype_bytes(spec.dtypes[1]),
            "page_size_padded": int(spec.page_size_bytes),
        }
    if isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
        if getattr(spec, "alignment", None) or getattr(spec, "num_head_slots", None):
            raise LayoutError(f"{name}: padded/packed MLA pages are not supported by hybrid-kv")
        return {
            "type": "sliding_window_mla" if isinstance(spec, SlidingWindowMLASpec) else "mla",
            "head_size": int(spec.head_size),
            "dtype_bytes": _dtype_bytes(spec.dtype),
            "page_size_padded": padded,
        }
    if type(spec) in (FullAttentionSpec, SlidingWindowSpec):
        assert isinstance(spec, AttentionSpec)
        return {
            "type": "sliding_window" if isinstance(spec, SlidingWindowSpec) else "full_attention",
            "num_kv_heads": int(spec.num_kv_heads),
            "head_size": int(spec.head_size),
            "head_size_v": int(spec.head_size_v),
            "dtype_bytes": _dtype_bytes(spec.dtype),
            "page_size_padded": padded,
        }
    raise LayoutError(f"KV-cache spec {name} is not supported by hybrid-kv (not transferred)")


CONV_LAYOUT_ENV = "VLLM_SSM_CONV_STATE_LAYOUT"


def prefer_ds_conv_layout() -> None:
    """Ask vLLM for the DS conv-state layout (``(channels, conv rows)`` per state) unless it is already chosen.

    hybrid-kv's byte layout (docs/byte-layouts.md) has a channel range of a conv sub-projection contiguous, which
    only DS gives. Setting the variable when this module is imported reaches the engine processes that import the
    connector before they create their caches, which is enough where nothing chose a layout earlier. It is not
    enough on vLLM's CPU platform with AVX512-BF16: its config check sets SD in the API server process, before any
    connector module is imported, for every connector not named ``NixlConnector`` (``platforms/cpu.py``), and the
    engine processes inherit it. So operators set ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` for models with SSM state
    (README), and ``check_conv_layout`` refuses an SD engine at start-up with an error naming the variable.
    """
    os.environ.setdefault(CONV_LAYOUT_ENV, "DS")


def check_conv_layout(kv_cache_config: Any) -> None:
    """Refuse SSM groups stored in the SD conv-state layout (hybrid-kv plans DS bytes).

    Raises:
        LayoutError: the engine has SSM groups and its conv states are SD.
    """
    from vllm.v1.kv_cache_interface import MambaSpec

    if not any(isinstance(g.kv_cache_spec, MambaSpec) for g in kv_cache_config.transfer_groups):
        return
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    layout = get_conv_state_layout()
    if layout != "DS":
        raise LayoutError(
            f"this engine stores SSM conv states in the {layout} layout; hybrid-kv transfers the DS layout "
            f"(docs/byte-layouts.md): start the engine with {CONV_LAYOUT_ENV}=DS (vLLM's NixlConnector needs it too)"
        )


def transfer_group_kinds(kv_cache_config: Any) -> list[str]:
    """``attention`` / ``mla`` / ``ssm`` per transfer group, in transfer-group order."""
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec

    kinds = []
    for g in kv_cache_config.transfer_groups:
        spec = g.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)
        if isinstance(inner, Mapping):
            spec = next(iter(inner.values()))
        if isinstance(spec, MambaSpec):
            kinds.append("ssm")
        elif isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
            kinds.append("mla")
        else:
            kinds.append("attention")
    return kinds


def logical_block_tokens(groups: list[Any]) -> int:
    """Tokens per logical block of the region table: the attention groups' block size.

    An SSM group's block is one whole state per request whatever its token count (vLLM sets it to
    ``max_model_len`` without prefix caching, or to the attention block size with it), so it does not enter the
    region table's geometry. vLLM may give attention groups a block size of its own choosing (e.g. 640 tokens so
    that an attention page is at least a mamba page), but every attention group shares it.

    Raises:
        LayoutError: attention groups with different block sizes.
    """
    from vllm.v1.kv_cache_interface import MambaSpec

    attention: set[int] = set()
    ssm: set[int] = set()
    for g in groups:
        spec = unwrap(g.kv_cache_spec, g.layer_names[0])
        (ssm if isinstance(spec, MambaSpec) else attention).add(int(spec.block_size))
    if len(attention) > 1:
        raise LayoutError(f"attention groups have different block sizes {sorted(attention)}; hybrid-kv needs one")
    if attention:
        return attention.pop()
    return max(ssm)  # SSM layers only: the block size does not size any page


@dataclass(frozen=True)
class RankGeometry:
    """Block geometry of one worker, as ``rank_table`` found it."""

    logical_block_size: int
    kernel_block_size: int
    num_logical_blocks: int
    mem_type: str


def rank_table(
    kv_caches: Mapping[str, Any],
    kv_cache_config: Any,
    *,
    tp_rank: int,
    tp_size: int,
    total_num_kv_heads: int,
    kv_layout: str | None = None,
) -> tuple[RegionTable, RankGeometry]:
    """The region table of one worker from the tensors vLLM registers (layers of transfer groups only).

    Every layer view keeps blocks on dim 0: attention views are kernel-block granular (a manager block is
    ``ppl`` kernel blocks), SSM views one state per block. The kernel block size is read off the attention
    views (``shape[0] / num_blocks`` kernel blocks per block). ``kv_layout`` (``page_facts``) is checked
    against the page order the views' strides show.
    """
    groups = list(kv_cache_config.transfer_groups)
    if not groups:
        raise LayoutError("the KV-cache config has no transfer groups")
    check_conv_layout(kv_cache_config)
    num_blocks = int(kv_cache_config.num_blocks)
    logical_block_size = logical_block_tokens(groups)
    entries = []
    ppl_seen: set[int] = set()
    mem_types: set[str] = set()
    for gi, g in enumerate(groups):
        if getattr(g, "host_resident", False):
            raise LayoutError("host-resident (HiSparse) groups are not supported by hybrid-kv")
        for name in g.layer_names:
            view = kv_caches.get(name)
            if view is None:
                continue  # a layer sharing another layer's cache (not registered)
            spec = layer_spec(unwrap(g.kv_cache_spec, name))
            if isinstance(view, (list, tuple)):
                raise LayoutError(f"layer {name}: per-state tensor lists are not supported; expected one view")
            # vLLM's views are [B, H, N, C] whatever the layout; their strides say the page's cell order
            mem = tensor_memory(view, name, spec, int(view.shape[2]) if view.dim() == 4 else None, "BHNC")
            # a padded page (SSM state shorter than the unified page) ends the view before its last page does;
            # the page's padding is part of the allocation, so the region spans whole pages
            storage = view.untyped_storage()
            avail = storage.data_ptr() + storage.nbytes() - mem["base"]
            mem["nbytes"] = max(mem["nbytes"], min(avail, int(view.shape[0]) * mem["block_stride"]))
            if spec["type"] != "ssm":
                blocks = int(view.shape[0])
                if blocks % num_blocks:
                    raise LayoutError(f"layer {name}: {blocks} kernel blocks is not a multiple of {num_blocks}")
                ppl_seen.add(blocks // num_blocks)
            mem_types.add(mem["mem_type"])
            entries.append(layer(name, gi, spec, **mem))
    if not entries:
        raise LayoutError("no registered KV-cache tensor belongs to a transfer group")
    if len(ppl_seen) > 1:
        raise LayoutError(f"attention groups split blocks differently ({sorted(ppl_seen)} kernel blocks per block)")
    if len(mem_types) > 1:
        raise LayoutError(f"mixed memory types {sorted(mem_types)} are not supported by hybrid-kv")
    ppl = ppl_seen.pop() if ppl_seen else 1
    if logical_block_size % ppl:
        raise LayoutError(f"block size {logical_block_size} is not divisible into {ppl} kernel blocks")
    table = build_region_table(
        rank_layout(
            entries,
            logical_block_size=logical_block_size,
            kernel_block_size=logical_block_size // ppl,
            num_logical_blocks=num_blocks,
            tp_rank=tp_rank,
            tp_size=tp_size,
            total_num_kv_heads=total_num_kv_heads,
            kv_layout=kv_layout,
        )
    )
    geo = RankGeometry(logical_block_size, logical_block_size // ppl, num_blocks, mem_types.pop())
    log.debug(
        "rank %d/%d: %d regions, block %d tokens = %d kernel blocks, %d blocks",
        tp_rank,
        tp_size,
        table.num_regions,
        logical_block_size,
        ppl,
        num_blocks,
    )
    return table, geo


CONNECTOR_WIRE_VERSION = 3
"""Version of what this connector's halves exchange beyond the handshake payload (``kv_transfer_params`` tickets,
control messages, side-channel requests): hashed into ``compat_hash`` (the ``connector`` factor), so engines
speaking different versions refuse each other at the handshake. Bump it with any change to them (2: the
concurrent push's ``stream_reg`` control message; 3: a verified claim's digest follows its confirmation,
``ClaimResult.follows``)."""


UNKNOWN_BACKEND = "unknown"
"""``attn_backend`` where vLLM knows none: no registered layer in its forward context and no platform to pick a
default (vLLM's CUDA wheel driven without a model, as ``tests/integrations`` does)."""


def attention_backends(vllm_config: Any, layer_names: list[str] | None = None) -> str:
    """The attention backends of ``layer_names`` (every attention layer when None), as vLLM's NixlConnector
    reads them (``get_current_attn_backends``): their names, sorted and comma-joined; ``UNKNOWN_BACKEND`` when
    vLLM cannot name one."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    try:
        backends = get_current_attn_backends(vllm_config, layer_names)
    except ValueError as exc:  # no layers registered and no platform default (vLLM: "Invalid attention backend")
        log.warning("hybrid-kv: vLLM names no attention backend for the registered layers: %s", exc)
        return UNKNOWN_BACKEND
    return ",".join(sorted({b.get_name() for b in backends}))


def engine_facts(vllm_config: Any, layer_names: list[str]) -> tuple[str, str]:
    """``(kv_layout, attn_backend)`` of this engine for the handshake: the KV-cache layout vLLM resolved and
    allocated the caches with (``cache_config.get_resolved_kv_cache_layout()``, e.g. ``LBHNC``), and the attention
    backends of the registered layers (``attention_backends``)."""
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout().name
    return str(layout), attention_backends(vllm_config, layer_names)


UNCUT_PAGE_BACKENDS = frozenset({"CPU_ATTN"})
"""Attention backends whose kernel pages are not ``[heads, tokens, cell]`` inside: vLLM's CPU attention
(``cpu_attn.py``) views its ``[blocks, heads, tokens, 2 * head_size]`` cache as each head's K rows then V rows, and
its kernel (``cpu_attn_reshape_and_cache``) lays K out per ISA (``layer.isa``). With the kernels of
``K_TRANSPOSED_ISAS`` the pages are ``HKTV`` (``page_facts``) and are cut into token units like any other;
with any other ISA (``amx``, ``neon``...: a layout not probed) a page is only ever transferred whole, so peers must
use the same kernel block and ISA: both are hashed into ``compat_hash`` (``compat_factors``), and such engines of
different kernel blocks refuse each other at the handshake instead of cutting pages into units of the wrong
bytes."""

K_TRANSPOSED_ISAS = frozenset({"vec", "vec16"})
"""vLLM CPU attention kernels whose pages are ``HKTV``: K element ``e`` of token ``t`` of a head at ``e * block +
t``, its V at ``block * head_size + t * head_size + e`` (``tests/engines/test_cpu_attn_layout.py`` writes keys and
values through vLLM's own ``cpu_attn_reshape_and_cache`` with each of them and checks every element's place)."""


def cpu_attention_isas(vllm_config: Any, layer_names: list[str]) -> set[str]:
    """The ISAs vLLM's CPU attention builders gave the registered attention layers (``layer.isa``, set before the
    connector registers the caches); empty where no layer has one."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
    return {str(isa) for layer in layers.values() if (isa := getattr(layer, "isa", None)) is not None}


def page_facts(
    vllm_config: Any, layer_names: list[str], kv_layout: str, attn_backend: str
) -> tuple[str, set[str] | None]:
    """``(layout, whole_pages_isas)`` of this engine's attention pages: the layout name they are planned and
    advertised with, ``HKTV`` where vLLM's CPU attention runs every registered attention layer with a kernel of
    ``K_TRANSPOSED_ISAS``, else ``kv_layout`` (what vLLM resolved, ``engine_facts``); and the ISAs of CPU attention
    pages only transferred whole (``None`` for pages cut as their layout says; ``{"unknown"}`` where no layer
    names its ISA)."""
    if not UNCUT_PAGE_BACKENDS & set(attn_backend.split(",")):
        return kv_layout, None
    isas = cpu_attention_isas(vllm_config, layer_names)
    if isas and isas <= K_TRANSPOSED_ISAS:
        return "HKTV", None
    return kv_layout, isas or {"unknown"}


def compat_factors(
    vllm_config: Any,
    mode: str,
    attn_backend: str | None = None,
    kernel_block_size: int | None = None,
    whole_pages_isas: set[str] | None = None,
) -> dict[str, Any]:
    """The model factors both engines must share (hashed into the handshake's ``compat_hash``).

    ``attn_backend``: the registered layers' backends (``engine_facts``; every attention layer's when None),
    hashed with vLLM's version. The connector's wire version is the ``connector`` factor. TP size, block sizes
    and layouts are not hashed: the handshake validates them, except for pages only transferred whole
    (``UNCUT_PAGE_BACKENDS`` with ISAs outside ``K_TRANSPOSED_ISAS``: ``whole_pages_isas``, given with
    ``kernel_block_size``), whose kernel block and ISAs are in the ``attn_backend`` factor.
    """
    from vllm import __version__ as vllm_version

    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    spec = vllm_config.speculative_config
    speculative = [] if spec is None else [f"method={spec.method}", f"model={getattr(spec, 'model', None)}"]
    backend = attn_backend or attention_backends(vllm_config)
    whole = kernel_block_size is not None and whole_pages_isas is not None
    return {
        "model": str(mc.model),
        "dtype": str(mc.dtype),
        "cache_dtype": str(cc.cache_dtype),
        "total_num_kv_heads": int(mc.get_total_num_kv_heads()),
        "head_size": int(mc.get_head_size()),
        "num_hidden_layers": int(mc.get_total_num_hidden_layers()),
        "attn_backend": f"{backend}@vllm-{vllm_version}"
        + (f" whole {kernel_block_size}-token pages ({','.join(sorted(whole_pages_isas or ()))})" if whole else ""),
        "hma": not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "speculative": speculative,
        "transfer_mode": mode,
        "connector": f"hybrid-kv-vllm/{CONNECTOR_WIRE_VERSION}",
    }
