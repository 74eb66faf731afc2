"""The typed vocabulary of hybrid-kv's inputs: layer specs, rank layouts, engine facts and model factors.

Every dict the Rust core takes is one of these ``TypedDict``s; the core refuses a key that is not listed here
(``LayoutError``/``ValueError`` naming the layer and the key), so a misspelling can never be ignored. The
scenario format (``docs/scenario.md``, ``schemas/scenario.schema.json``) uses the same words: the same
``MambaKind`` and ``KvLayout`` values, the same spec field names. Specs are per TP rank (a rank's heads and SSM
shapes); the scenario's groups give the whole model's and are divided per rank as docs/byte-layouts.md says.
"""

from __future__ import annotations

import sys
from typing import Literal

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # NotRequired is 3.11's; typing_extensions' TypedDict honours it on 3.10
    from typing_extensions import NotRequired, TypedDict

__all__ = [
    "KV_LAYOUTS",
    "AttentionSpec",
    "ConvLayout",
    "EngineInfo",
    "KvLayout",
    "LayerInput",
    "LayerMemory",
    "LayerSpec",
    "MambaKind",
    "MemType",
    "MlaSpec",
    "ModelFactors",
    "PageLayout",
    "RankLayout",
    "SsmSpec",
    "StatePart",
    "TransferMode",
]

KvLayout = Literal["HND", "NHD", "LBHNC", "LBNHC", "BLHNC", "BLNHC", "HKTV", "LHBNC", "BHLNC"]
"""An engine's KV-cache layout name: FlashInfer's ``HND``/``NHD``, vLLM's stride orders of ``[L, B, H, N, C]``
(layers, blocks, heads, tokens, cell), or ``HKTV``. ``HND``, ``LBHNC`` and ``BLHNC`` have heads-major pages,
``NHD``, ``LBNHC`` and ``BLNHC`` token-major ones; ``HKTV`` heads-major pages whose heads keep K transposed
(``[head_size, tokens]``, then V as ``[tokens, head_size]``: vLLM's CPU attention); ``LHBNC`` and ``BHLNC`` keep a
block's heads apart and are refused for attention."""

KV_LAYOUTS: tuple[KvLayout, ...] = ("HND", "NHD", "LBHNC", "LBNHC", "BLHNC", "BLNHC", "HKTV", "LHBNC", "BHLNC")

PageLayout = Literal["HND", "NHD", "HKTV"]
"""Order of the (head, token) cells in an attention page: heads-major, token-major, or heads-major with each
head's K transposed (docs/byte-layouts.md)."""

MambaKind = Literal["mamba1", "mamba2", "gdn"]
"""Conv sub-projections of an SSM state: Mamba1 ``x``; Mamba2 ``x | B | C``; GDN/KDA ``Q | K | V``."""

ConvLayout = Literal["ds", "sd"]
"""How a conv state is stored: ``ds`` channels x conv rows (vLLM, SGLang's Mamba2), ``sd`` conv rows x channels
(SGLang's Kimi-Linear)."""

StatePart = dict[Literal["conv"], list[int]] | Literal["temporal"]
"""The part of an SSM state one tensor holds: ``{"conv": [0, 1, 2]}`` (those sub-projections' conv state, in
``kind`` order; e.g. ``[1]`` for a tensor of K alone) or ``"temporal"``."""

MemType = Literal["DRAM", "VRAM"]
"""NIXL's memory type: host or device memory."""

TransferMode = Literal["pull", "push"]
"""Who initiates transfers: ``pull`` (decode reads from prefill) or ``push`` (prefill writes into decode)."""


class AttentionSpec(TypedDict):
    """GQA/MHA attention (``type`` ``full_attention`` or ``sliding_window``), per TP rank."""

    type: Literal["full_attention", "sliding_window"]
    num_kv_heads: int
    """KV heads on this rank."""
    head_size: int
    """K elements per head."""
    head_size_v: NotRequired[int | None]
    """V elements per head (default: ``head_size``); 0 for a tensor of K or of V alone (an engine that keeps K and
    V in separate tensors, as SGLang's ``MHATokenToKVPool`` does, describes each as its own layer)."""
    dtype_bytes: int
    """Bytes per element."""
    page_size_padded: NotRequired[int | None]
    """Bytes per logical block when the engine pads pages (vLLM's ``page_size_padded``)."""


class MlaSpec(TypedDict):
    """MLA latents (``type`` ``mla`` or ``sliding_window_mla``): one latent per token, the same on every rank."""

    type: Literal["mla", "sliding_window_mla"]
    head_size: int
    """Latent elements per token (e.g. 512 + 64 for DeepSeek-V3)."""
    dtype_bytes: int
    page_size_padded: NotRequired[int | None]


class SsmSpec(TypedDict):
    """An SSM / linear-attention state (``type`` ``ssm``): one whole state per logical block, per TP rank; or, with
    ``part``, the part of it one tensor holds (an engine keeping conv and temporal state apart, as SGLang's
    ``MambaPool``, describes each tensor as its own layer; the shapes stay the whole state's)."""

    type: Literal["ssm"]
    kind: MambaKind
    conv_shape: list[int]
    """``[conv_dim_local, conv_rows]`` (channels, rows: whatever ``conv_layout`` stores them as)."""
    conv_dtype_bytes: int
    temporal_shape: list[int]
    """Temporal state shape on this rank; dim 0 is split across TP."""
    temporal_dtype_bytes: int
    page_size_padded: NotRequired[int | None]
    """Bytes per state page after padding (default: the raw state size, or the part's)."""
    conv_layout: NotRequired[ConvLayout]
    """How the conv state is stored (default ``ds``); every state layer of a rank says the same."""
    part: NotRequired[StatePart]
    """The part of the state this layer's tensor holds (default: the whole state in one page)."""


LayerSpec = AttentionSpec | MlaSpec | SsmSpec
"""One layer's KV-cache spec, tagged by ``type``."""


class LayerMemory(TypedDict):
    """Where one layer's KV cache lives (plain integers; never dereferenced)."""

    base: int
    """Base address (``tensor.data_ptr()``); layers sharing it share a region."""
    bytes: int
    """Bytes addressable from ``base``."""
    block_stride: NotRequired[int]
    """Bytes between blocks of dim 0 (0: dense, the page size)."""
    device: NotRequired[int]
    mem_type: NotRequired[MemType]
    num_blocks: NotRequired[int | None]
    """Kernel blocks of this attention layer when they differ from the rank's count; for an SSM layer, the state
    slots its tensor holds (a state pool of its own size, as SGLang's ``MambaPool``; its group's ids are checked
    against it; at most 2**31 - 1 kernel blocks' worth)."""
    page_layout: NotRequired[PageLayout]
    """The page cell order its tensor's strides show (``torch_adapter.page_layout``)."""


class LayerInput(TypedDict):
    """One layer: name, KV-cache group, spec and memory."""

    name: str
    group: int
    spec: LayerSpec
    memory: LayerMemory


class RankLayout(TypedDict):
    """Everything one rank hands to ``RegionTable.from_json`` / ``hybrid_kv.build_region_table``."""

    tp_rank: int
    tp_size: int
    logical_block_size: int
    """Tokens per logical (scheduler) block."""
    kernel_block_size: int
    """Tokens per kernel block (the attention kernel's page)."""
    num_logical_blocks: int
    total_num_kv_heads: NotRequired[int]
    """KV heads of the whole model across TP (1 for MLA; default 1)."""
    kv_layout: NotRequired[KvLayout]
    """The page order where no tensor shows it; every layer's ``page_layout`` must agree (default heads-major)."""
    layers: list[LayerInput]


class EngineInfo(TypedDict):
    """The engine facts ``RegionTable.handshake_payload`` adds to the table (unknown keys are refused)."""

    engine_id: str
    """The whole engine instance (every rank of it gives the same id)."""
    attn_backend: str
    """Attention backend name(s), informational."""
    transfer_mode: TransferMode
    compat_hash: str
    """``hybrid_kv.compat_hash(ModelFactors)``: 64 lowercase hex digits; peers with different hashes are refused."""
    agent_metadata: NotRequired[list[int]]
    """Opaque bytes; NIXL's own metadata travels beside the payload, so normally ``[]``."""
    kv_layout: NotRequired[KvLayout]
    """The engine's layout name; its page order must be the table's (default: the table's page order)."""
    prefix_caching: NotRequired[bool]
    """Whether this engine serves prefix-cache hits (default false)."""


class ModelFactors(TypedDict):
    """The model facts both engines must share, hashed by ``hybrid_kv.compat_hash`` (two engines whose hashes
    differ refuse each other at the handshake). TP sizes, block sizes and layouts are not factors: the handshake
    validates those field by field. Every key but ``connector`` is required; unknown keys are refused."""

    model: str
    """Model name or path, as both engines load it."""
    dtype: str
    """Model dtype (``"bfloat16"``, ...)."""
    cache_dtype: str
    """KV-cache dtype (``"auto"``, ``"fp8_e4m3"``, ...)."""
    total_num_kv_heads: int
    """KV heads of the whole model across TP (1 for MLA)."""
    head_size: int
    """Attention head size (the latent size for MLA)."""
    num_hidden_layers: int
    """Hidden layers of the model."""
    attn_backend: str
    """Attention backend name(s) both engines run (hashed: different kernels may lay pages out differently)."""
    hma: bool
    """Whether the hybrid memory allocator pools the groups' layers into shared tensors."""
    speculative: list[str]
    """Speculative-decoding factors as ``"key=value"`` strings; ``[]`` without."""
    transfer_mode: TransferMode
    connector: NotRequired[str]
    """Wire version of an integration's own messages (e.g. ``"hybrid-kv-vllm/2"``); absent or ``""`` without."""
