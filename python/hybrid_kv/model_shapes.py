"""The KV-cache shapes of a model's layers (global, before TP): its attention layers (``AttentionShape``) and its
state-space / linear-attention layers (``SsmShape``), and the builders that make them from ``presets.json``'s
parameters, by kind (``ATTENTION_BUILDERS``, ``SSM_BUILDERS``, ``build_shape``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from .layout import Spec

__all__ = ["ATTENTION_BUILDERS", "SSM_BUILDERS", "AttentionShape", "SsmShape", "build_shape"]

_S = TypeVar("_S", "AttentionShape", "SsmShape")


@dataclass(frozen=True)
class AttentionShape:
    """The attention layers of a model (global, before TP)."""

    kind: Literal["mla", "gqa"]
    num_layers: int
    head_size: int
    """MLA: latent elements per token (``kv_lora_rank + qk_rope_head_dim``); GQA: ``head_dim``."""
    num_kv_heads: int = 1
    """GQA: total KV heads; 1 for MLA."""
    num_heads: int = 1
    """Query heads (TP must divide them, as vLLM asserts)."""
    dtype_bytes: int = 2
    kernel_block_size: int = 64
    backend: str = "FLASHMLA"

    def bytes_per_token(self, tp: int) -> int:
        """Attention bytes one rank stores per token and layer."""
        if self.kind == "mla":
            return self.head_size * self.dtype_bytes
        return self.local_kv_heads(tp) * 2 * self.head_size * self.dtype_bytes

    def local_kv_heads(self, tp: int) -> int:
        """KV heads on one rank (replicated when ``tp`` exceeds them)."""
        return 1 if self.kind == "mla" else max(1, self.num_kv_heads // tp)

    def spec(self, tp: int, page_bytes: int | None = None) -> Spec:
        """The per-rank layer spec (``page_size_padded`` is never needed: pages are exact)."""
        if self.kind == "mla":
            return {"type": "mla", "head_size": self.head_size, "dtype_bytes": self.dtype_bytes}
        return {
            "type": "full_attention",
            "num_kv_heads": self.local_kv_heads(tp),
            "head_size": self.head_size,
            "dtype_bytes": self.dtype_bytes,
        }


@dataclass(frozen=True)
class SsmShape:
    """The state-space / linear-attention layers of a model (global, before TP).

    ``conv_proj_dims`` are the global channel counts of the conv sub-projections in page order
    (Mamba2: ``x | B | C``; GDN/KDA: ``Q | K | V``); ``temporal`` is the global recurrent state shape,
    sharded on dim 0.
    """

    kind: Literal["mamba2", "gdn"]
    num_layers: int
    conv_proj_dims: tuple[int, ...]
    conv_rows: int
    temporal: tuple[int, ...]
    shard_counts: tuple[tuple[str, int], ...]
    """Head/group counts that TP must divide, e.g. ``(("linear_num_key_heads", 16), ...)``."""
    conv_dtype_bytes: int = 2
    temporal_dtype_bytes: int = 4
    label: str = "SSM"

    def conv_bytes(self, tp: int) -> int:
        return sum(self.conv_proj_dims) // tp * self.conv_rows * self.conv_dtype_bytes

    def temporal_bytes(self, tp: int) -> int:
        return math.prod(self.temporal) // tp * self.temporal_dtype_bytes

    def state_bytes(self, tp: int) -> int:
        """One rank's raw state: conv sub-projections + temporal share."""
        return self.conv_bytes(tp) + self.temporal_bytes(tp)

    def spec(self, tp: int, page_bytes: int) -> Spec:
        """The per-rank layer spec, padded to the unified page."""
        return {
            "type": "ssm",
            "kind": self.kind,
            "conv_shape": [sum(self.conv_proj_dims) // tp, self.conv_rows],
            "conv_dtype_bytes": self.conv_dtype_bytes,
            "temporal_shape": [self.temporal[0] // tp, *self.temporal[1:]],
            "temporal_dtype_bytes": self.temporal_dtype_bytes,
            "page_size_padded": page_bytes,
        }


def _mla(layers: int, head_size: int, num_heads: int, kernel_block_size: int = 64) -> AttentionShape:
    """MLA attention on FlashMLA (64-token kernel blocks unless the preset says otherwise)."""
    return AttentionShape("mla", layers, head_size, num_heads=num_heads, kernel_block_size=kernel_block_size)


def _gqa(layers: int, head_dim: int, kv_heads: int, heads: int) -> AttentionShape:
    """GQA attention on FlashAttention (16-token kernel blocks)."""
    return AttentionShape(
        "gqa", layers, head_dim, num_kv_heads=kv_heads, num_heads=heads, kernel_block_size=16, backend="FLASH_ATTN"
    )


def _kimi(heads: int, head_dim: int, conv_kernel: int, layers: int) -> SsmShape:
    """Kimi Delta Attention, stored as GDN: conv ``Q | K | V`` of ``heads * head_dim`` channels each."""
    d = heads * head_dim
    return SsmShape(
        "gdn",
        layers,
        (d, d, d),
        conv_kernel - 1,
        (heads, head_dim, head_dim),
        (("linear_attn_config.num_heads", heads),),
        label="KDA",
    )


def _gdn(k_heads: int, k_dim: int, v_heads: int, v_dim: int, conv_kernel: int, layers: int) -> SsmShape:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): conv ``Q | K | V``, recurrent ``(v_heads, v_dim, k_dim)``."""
    return SsmShape(
        "gdn",
        layers,
        (k_heads * k_dim, k_heads * k_dim, v_heads * v_dim),
        conv_kernel - 1,
        (v_heads, v_dim, k_dim),
        (("linear_num_key_heads", k_heads), ("linear_num_value_heads", v_heads)),
        label="GDN",
    )


def _mamba2(heads: int, head_dim: int, state: int, n_groups: int, conv_kernel: int, layers: int) -> SsmShape:
    """Mamba2 (Nemotron-H): conv ``x | B | C``, recurrent ``(heads, head_dim, state)``."""
    gs = n_groups * state
    return SsmShape(
        "mamba2",
        layers,
        (heads * head_dim, gs, gs),
        conv_kernel - 1,
        (heads, head_dim, state),
        (("mamba_num_heads", heads), ("n_groups", n_groups)),
        label="Mamba2",
    )


ATTENTION_BUILDERS: dict[str, Callable[..., AttentionShape]] = {"mla": _mla, "gqa": _gqa}
SSM_BUILDERS: dict[str, Callable[..., SsmShape]] = {"kda": _kimi, "gdn": _gdn, "mamba2": _mamba2}


def build_shape(builders: dict[str, Callable[..., _S]], entry: dict[str, Any]) -> _S:
    """The shape of a ``{"kind": ..., **parameters}`` entry, built by the builder of that kind."""
    params = dict(entry)
    kind = params.pop("kind")
    if kind not in builders:
        raise ValueError(f"presets.json: unknown shape kind {kind!r}; known: {', '.join(builders)}")
    return builders[kind](**params)
