"""Model presets: KV-cache shapes of public hybrid models, turned into per-rank layouts for any TP size.

Each preset records where its numbers come from (the model's public ``config.json``) and which fields were
used. From a preset and a TP size, :meth:`Preset.geometry` computes what vLLM's hybrid allocator would
(the unified page, the logical and kernel block sizes), and :meth:`Preset.rank_layout` /
:meth:`Preset.torch_layers` give one rank's layout in :mod:`hybrid_kv.layout` form, with synthetic
addresses or with real torch tensors.

How a layout follows from a model:

* **HMA pooling.** Layers of one kind are cut into KV-cache groups of ``group_size`` layers (the smallest
  per-kind layer count, or the largest when they are within 25% of each other, as vLLM does); the pool
  has ``group_size`` tensors and tensor *i* is shared by layer *i* of every group. Attention groups come
  first, then SSM groups. A model with one kind of layer (DeepSeek-V3) gets one tensor per layer.
* **Unified page.** Every group must have the same page. The SSM state is TP-sharded, so its size is
  ``(conv + temporal) / tp``; the attention block size is raised, in multiples of the attention kernel
  block, until the attention page covers the state: ``logical = kernel * ceil(state / (kernel *
  attn_bytes_per_token))``. The SSM page is padded up to that page. Hence the logical block size (and
  ``ppl = logical / kernel``) depends on TP while the kernel page does not (MLA) or shrinks with the
  rank's heads (GQA).
* **Kernel blocks.** FlashMLA pages are 64 tokens; FlashAttention takes multiples of 16, so GQA presets
  default to 16. ``--kernel-block-size`` overrides either.
* **TP shares.** MLA latents are replicated. GQA ranks hold ``max(1, K / tp)`` KV heads. The SSM conv
  sub-projections and the temporal state's dim 0 are split evenly (docs/byte-layouts.md).
* **dtypes.** Attention and conv states in bf16; temporal (recurrent) states in fp32, as
  ``mamba_ssm_dtype: float32`` in the Qwen3.5 configs.

The numbers are data in ``presets.json`` beside this module: per preset, the configuration fields used and the
shape parameters taken from them. Where they were read: each preset's ``source`` is the model's canonical
``config.json``; the values were taken from copies of those configs found through a search of public pages and
code (Kimi-Linear: the ``Firworks/Kimi-Linear-48B-A3B-Instruct-nvfp4`` mirror of the same config; DeepSeek-V3 and
Nemotron-H-8B: config dicts quoted verbatim in public test suites, the Nemotron one with its
``hybrid_override_pattern``; Qwen3-Next: the Qwen3-Coder-Next / Qwen3-Next configs with identical linear-attention
fields and vLLM's ``Qwen3NextConfig`` defaults; Qwen3.5-27B: its ``text_config`` quoted in public tests). vLLM's
``derive_mamba_conv_split`` vectors for Nemotron-H-8B and Qwen3.5-27B agree with them and are checked in
``tests/test_presets.py``.

Known difference: the vLLM test comment gives KimiLinear logical blocks of 5760
(TP 1) and 768 (TP 8); the published config with the formula above gives 1920 and 256 (the same
90:12 ratio of kernel blocks, divided by 3). We follow the formula, as ``rust/core/fixtures.rs`` does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ._core import LayoutError
from .layout import Spec, layer, rank_layout

if TYPE_CHECKING:
    import torch

__all__ = [
    "PRESETS",
    "AttentionShape",
    "Geometry",
    "Preset",
    "SsmShape",
    "get_preset",
    "preset_names",
]

_S = TypeVar("_S", "AttentionShape", "SsmShape")

SYNTHETIC_BASE = 0x7F00_0000_0000
_TENSOR_GAP = 1 << 20  # bytes left between synthetic tensors


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


@dataclass(frozen=True)
class Geometry:
    """Block geometry of one rank for a TP size (what the scenario format and a layout need)."""

    tp_size: int
    logical_block_size: int
    kernel_block_size: int
    page_bytes: int
    """Bytes of one logical block of one tensor (the unified page)."""
    attn_bytes_per_token: int
    conv_bytes: int = 0
    temporal_bytes: int = 0

    @property
    def ppl(self) -> int:
        """Kernel blocks per logical block."""
        return self.logical_block_size // self.kernel_block_size

    @property
    def kernel_page_bytes(self) -> int:
        """Bytes of one kernel block (the attention transfer unit, a region's ``block_len``)."""
        return self.page_bytes // self.ppl

    @property
    def state_bytes(self) -> int:
        return self.conv_bytes + self.temporal_bytes

    @property
    def padding_bytes(self) -> int:
        """SSM page padding (0 without SSM)."""
        return self.page_bytes - self.state_bytes if self.state_bytes else 0

    def to_dict(self) -> dict[str, int]:
        return {
            "tp_size": self.tp_size,
            "logical_block_size": self.logical_block_size,
            "kernel_block_size": self.kernel_block_size,
            "ppl": self.ppl,
            "page_bytes": self.page_bytes,
            "kernel_page_bytes": self.kernel_page_bytes,
            "attn_bytes_per_token": self.attn_bytes_per_token,
            "conv_bytes": self.conv_bytes,
            "temporal_bytes": self.temporal_bytes,
            "padding_bytes": self.padding_bytes,
        }


@dataclass(frozen=True)
class LayerSlot:
    """One layer of the pool: its name, KV-cache group, kind and the tensor it lives in."""

    name: str
    group: int
    kind: Literal["attention", "ssm"]
    tensor: int


@dataclass(frozen=True)
class Preset:
    """A model's KV-cache shapes and where they come from."""

    name: str
    title: str
    source: str
    """URL of the public configuration the numbers come from."""
    fields: dict[str, Any]
    """The configuration fields used, with their values."""
    attention: AttentionShape
    ssm: SsmShape | None = None
    layer_kinds: str = ""
    """Layer order, one letter per layer: ``A`` attention, ``S`` SSM (names follow it)."""
    tiny_of: str | None = None
    """For tiny presets: the full-size preset whose shapes this one scales down."""
    notes: str = ""

    # ------------------------------------------------------------------ shape facts

    @property
    def description(self) -> str:
        a = self.attention
        att = "MLA" if a.kind == "mla" else f"GQA ({a.num_kv_heads} KV heads)"
        if self.ssm is None:
            return f"{att}, {a.num_layers} layers"
        return f"{self.ssm.label} + {att}, {self.ssm.num_layers} + {a.num_layers} layers in shared HMA tensors"

    def layer_order(self) -> str:
        """One letter per layer (``A``/``S``), in model order."""
        if self.layer_kinds:
            return self.layer_kinds
        return "A" * self.attention.num_layers

    def check_tp(self, tp: int, side: str = "") -> None:
        """Raise ``LayoutError`` when this model cannot run at TP ``tp`` (names the count that TP must divide)."""
        who = f"{side} " if side else ""
        if tp < 1:
            raise LayoutError(f"{who}TP size must be positive, got {tp}")
        a = self.attention
        problems = []
        if a.num_heads % tp:
            problems.append(f"num_attention_heads={a.num_heads}")
        if a.kind == "gqa" and a.num_kv_heads % tp and tp % a.num_kv_heads:
            problems.append(f"num_key_value_heads={a.num_kv_heads} (nor is it a multiple of it)")
        if self.ssm is not None:
            problems += [f"{name}={n}" for name, n in self.ssm.shard_counts if n % tp]
            problems += [f"conv channels {d}" for d in self.ssm.conv_proj_dims if d % tp]
        if problems:
            unique = list(dict.fromkeys(problems))
            raise LayoutError(f"{self.name}: {who}TP size {tp} does not divide {', '.join(unique)}")

    def group_size(self) -> int:
        """Layers per KV-cache group (= tensors in the HMA pool)."""
        counts = [self.attention.num_layers] + ([self.ssm.num_layers] if self.ssm else [])
        lo, hi = min(counts), max(counts)
        return hi if hi < lo * 1.25 else lo

    def slots(self) -> list[LayerSlot]:
        """Every layer with its group and tensor, attention groups first (vLLM names)."""
        size = self.group_size()
        order = self.layer_order()
        out: list[LayerSlot] = []
        group = 0
        for letter, kind in (("A", "attention"), ("S", "ssm")):
            idx = [i for i, c in enumerate(order) if c == letter]
            for start in range(0, len(idx), size):
                for j, layer_idx in enumerate(idx[start : start + size]):
                    suffix = "self_attn" if kind == "attention" else "linear_attn"
                    out.append(LayerSlot(f"model.layers.{layer_idx}.{suffix}", group, kind, j))  # type: ignore[arg-type]
                group += 1
        return out

    @property
    def num_tensors(self) -> int:
        return self.group_size()

    def group_kinds(self) -> list[str]:
        """Kind of every KV-cache group in group order: ``mla``, ``attention`` or ``ssm``."""
        kinds: dict[int, str] = {}
        for s in self.slots():
            kinds[s.group] = (
                ("mla" if self.attention.kind == "mla" else "attention") if s.kind == "attention" else "ssm"
            )
        return [kinds[g] for g in sorted(kinds)]

    # ------------------------------------------------------------------ geometry

    def geometry(
        self, tp: int, *, kernel_block_size: int | None = None, logical_block_size: int | None = None
    ) -> Geometry:
        """Block geometry of a rank at TP ``tp`` (see the module docstring for the formula).

        ``kernel_block_size`` overrides the backend's kernel block; ``logical_block_size`` fixes the logical
        block instead of deriving it (it must be a multiple of the kernel block and, with SSM layers, give a
        page that holds the state).
        """
        self.check_tp(tp)
        a = self.attention
        kernel = a.kernel_block_size if kernel_block_size is None else kernel_block_size
        if kernel < 1:
            raise LayoutError(f"kernel block size must be positive, got {kernel}")
        per_token = a.bytes_per_token(tp)
        conv = self.ssm.conv_bytes(tp) if self.ssm else 0
        temporal = self.ssm.temporal_bytes(tp) if self.ssm else 0
        if logical_block_size is None:
            units = max(1, -(-(conv + temporal) // (kernel * per_token)))
            logical = kernel * units
        else:
            logical = logical_block_size
            if logical < 1 or logical % kernel:
                raise LayoutError(
                    f"logical block size {logical} is not a positive multiple of the kernel block size {kernel}"
                )
            if logical * per_token < conv + temporal:
                need = kernel * -(-(conv + temporal) // (kernel * per_token))
                raise LayoutError(
                    f"{self.name} at TP {tp}: logical block size {logical} gives a {logical * per_token}-byte page, "
                    f"smaller than the {conv + temporal}-byte SSM state (needs at least {need})"
                )
        return Geometry(tp, logical, kernel, logical * per_token, per_token, conv, temporal)

    # ------------------------------------------------------------------ layouts

    def layer_specs(self, geometry: Geometry) -> Iterator[tuple[LayerSlot, Spec]]:
        """Every layer slot with its per-rank spec."""
        for s in self.slots():
            if s.kind == "attention":
                yield s, self.attention.spec(geometry.tp_size)
            else:
                assert self.ssm is not None
                yield s, self.ssm.spec(geometry.tp_size, geometry.page_bytes)

    def rank_layout(
        self,
        tp: int,
        rank: int,
        num_blocks: int,
        *,
        base: int | None = None,
        kernel_block_size: int | None = None,
        logical_block_size: int | None = None,
        mem_type: str = "VRAM",
        device: int | None = None,
    ) -> dict[str, Any]:
        """One rank's layout with synthetic addresses (never dereferenced): ``num_blocks`` logical blocks.

        Tensors are laid out from ``base`` (default: a per-rank address) with a 1 MiB gap between them.
        """
        if not 0 <= rank < tp:
            raise LayoutError(f"TP rank {rank} is out of range for TP size {tp}")
        if num_blocks < 1:
            raise LayoutError(f"number of blocks must be positive, got {num_blocks}")
        geo = self.geometry(tp, kernel_block_size=kernel_block_size, logical_block_size=logical_block_size)
        size = num_blocks * geo.page_bytes
        step = size + _TENSOR_GAP
        start = SYNTHETIC_BASE + (rank << 40) if base is None else base
        dev = rank if device is None else device
        entries = [
            layer(s.name, s.group, spec, base=start + s.tensor * step, nbytes=size, device=dev, mem_type=mem_type)
            for s, spec in self.layer_specs(geo)
        ]
        return self._layout(entries, geo, tp, rank, num_blocks)

    def torch_layers(
        self,
        tp: int,
        rank: int,
        num_blocks: int,
        *,
        kernel_block_size: int | None = None,
        logical_block_size: int | None = None,
        device: str = "cpu",
    ) -> tuple[list[torch.Tensor], list[tuple[str, int, Spec, torch.Tensor]], Geometry]:
        """Allocate one rank's HMA pool as torch uint8 tensors and return ``(pools, layers, geometry)``.

        ``pools[i]`` is tensor *i*, shape ``(num_blocks, page_bytes)``; ``layers`` holds ``(name, group, spec,
        view)`` for :func:`hybrid_kv.torch_adapter.region_table_from_tensors`: attention layers see the pool
        kernel-granular (``(num_blocks * ppl, kernel_page)``), SSM layers one state per row. Every view of a
        tensor shares its ``data_ptr()``. The pools must outlive every table and registration built from them.
        """
        import torch

        from .hugepages import zeros

        geo = self.geometry(tp, kernel_block_size=kernel_block_size, logical_block_size=logical_block_size)
        shape = (num_blocks, geo.page_bytes)

        def allocate() -> torch.Tensor:
            if device != "cpu":
                return torch.zeros(shape, dtype=torch.uint8, device=device)
            # Host pools on huge pages: NIXL moves them about twice as fast as 4 KiB pages (hybrid_kv.hugepages).
            return torch.from_numpy(zeros(num_blocks * geo.page_bytes).reshape(shape))

        pools = [allocate() for _ in range(self.num_tensors)]
        layers: list[tuple[str, int, Spec, torch.Tensor]] = []
        for s, spec in self.layer_specs(geo):
            pool = pools[s.tensor]
            view = pool.view(num_blocks * geo.ppl, geo.kernel_page_bytes) if s.kind == "attention" else pool
            layers.append((s.name, s.group, spec, view))
        return pools, layers, geo

    def layout_from_tensors(
        self, layers: list[tuple[str, int, Spec, torch.Tensor]], geometry: Geometry, rank: int, num_blocks: int
    ) -> dict[str, Any]:
        """The layout dict of torch layers from :meth:`torch_layers` (for JSON consumers such as the planner)."""
        from .torch_adapter import tensor_memory

        entries = [layer(name, group, spec, **tensor_memory(t, name)) for name, group, spec, t in layers]
        return self._layout(entries, geometry, geometry.tp_size, rank, num_blocks)

    def _layout(
        self, entries: list[dict[str, Any]], geo: Geometry, tp: int, rank: int, num_blocks: int
    ) -> dict[str, Any]:
        return rank_layout(
            entries,
            logical_block_size=geo.logical_block_size,
            kernel_block_size=geo.kernel_block_size,
            num_logical_blocks=num_blocks,
            tp_rank=rank,
            tp_size=tp,
            total_num_kv_heads=self.attention.num_kv_heads if self.attention.kind == "gqa" else 1,
        )

    def compat_factors(self, mode: str) -> dict[str, Any]:
        """The model factors of the handshake's compatibility hash ."""
        a = self.attention
        return {
            "model": self.name,
            "dtype": "bfloat16",
            "cache_dtype": "auto",
            "total_num_kv_heads": a.num_kv_heads if a.kind == "gqa" else 1,
            "head_size": a.head_size,
            "num_hidden_layers": len(self.layer_order()),
            "attn_backend": a.backend,
            "hma": self.ssm is not None,
            "speculative": [],
            "transfer_mode": mode,
        }

    def engine_info(self, engine_id: str, mode: str) -> dict[str, Any]:
        """Engine facts for ``RegionTable.handshake_payload`` (NIXL's own metadata travels beside the payload)."""
        from ._core import compat_hash

        return {
            "engine_id": engine_id,
            "agent_metadata": [],
            "kv_layout": "HND",
            "attn_backend": self.attention.backend,
            "transfer_mode": mode,
            "compat_hash": compat_hash(json.dumps(self.compat_factors(mode))),
        }

    # ------------------------------------------------------------------ scenario format

    def scenario_model(self) -> dict[str, Any]:
        """The scenario format's ``model``: global group specs and the layers sharing each tensor."""
        a = self.attention
        groups: list[dict[str, Any]] = []
        for kind in self.group_kinds():
            if kind == "mla":
                groups.append({"kind": "mla", "head_size": a.head_size, "dtype_bytes": a.dtype_bytes})
            elif kind == "attention":
                groups.append(
                    {
                        "kind": "attention",
                        "num_kv_heads": a.num_kv_heads,
                        "head_size": a.head_size,
                        "dtype_bytes": a.dtype_bytes,
                    }
                )
            else:
                ssm = self.ssm
                assert ssm is not None
                groups.append(
                    {
                        "kind": "ssm",
                        "mamba": ssm.kind,
                        "conv_dim": sum(ssm.conv_proj_dims),
                        "conv_rows": ssm.conv_rows,
                        "conv_dtype_bytes": ssm.conv_dtype_bytes,
                        "temporal_shape": list(ssm.temporal),
                        "temporal_dtype_bytes": ssm.temporal_dtype_bytes,
                    }
                )
        tensors: list[dict[str, Any]] = [{"layers": []} for _ in range(self.num_tensors)]
        for s in self.slots():
            tensors[s.tensor]["layers"].append({"name": s.name, "group": s.group})
        return {"groups": groups, "tensors": tensors}

    def scenario_engine(
        self,
        tp: int,
        num_blocks: int,
        *,
        kernel_block_size: int | None = None,
        logical_block_size: int | None = None,
    ) -> dict[str, int]:
        """The scenario format's ``prefill`` / ``decode`` engine at TP ``tp``."""
        geo = self.geometry(tp, kernel_block_size=kernel_block_size, logical_block_size=logical_block_size)
        return {
            "tp_size": tp,
            "logical_block_size": geo.logical_block_size,
            "kernel_block_size": geo.kernel_block_size,
            "num_blocks": num_blocks,
        }

    def scenario(
        self,
        prefill_tp: int,
        decode_tp: int,
        *,
        mode: str = "pull",
        num_blocks: int = 64,
        prefill_kernel_block_size: int | None = None,
        decode_kernel_block_size: int | None = None,
        requests: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """A whole scenario (``schemas/scenario.schema.json``) for this model on the given deployment."""
        return {
            "name": f"{self.name}: prefill TP {prefill_tp} -> decode TP {decode_tp}, {mode}",
            "model": self.scenario_model(),
            "prefill": self.scenario_engine(prefill_tp, num_blocks, kernel_block_size=prefill_kernel_block_size),
            "decode": self.scenario_engine(decode_tp, num_blocks, kernel_block_size=decode_kernel_block_size),
            "mode": mode,
            "requests": requests or [],
        }

    # ------------------------------------------------------------------ reporting

    def summary(self, tp: int, **geometry_kw: int | None) -> dict[str, Any]:
        """Facts about this preset at TP ``tp`` (JSON-friendly)."""
        geo = self.geometry(tp, **geometry_kw)
        return {
            "name": self.name,
            "title": self.title,
            "description": self.description,
            "source": self.source,
            "fields": self.fields,
            "tiny_of": self.tiny_of,
            "groups": self.group_kinds(),
            "tensors": self.num_tensors,
            "layers": len(self.slots()),
            "attention_backend": self.attention.backend,
            "geometry": geo.to_dict(),
        }


# ---------------------------------------------------------------------------------------------- the presets
# The shapes are data in ``presets.json`` (shipped beside this module); the functions below turn one entry into a
# Preset: its attention and SSM shapes through the builders named by their ``kind``, its layer order from ``layers``.


def _pattern(num_layers: int, attention_layers: list[int]) -> str:
    """Layer kinds from the (0-based) attention layer indices."""
    att = set(attention_layers)
    return "".join("A" if i in att else "S" for i in range(num_layers))


def _every(interval: int, num_layers: int) -> str:
    """``interval - 1`` SSM layers then one attention layer, repeated (Qwen's ``full_attention_interval``)."""
    return "".join("A" if (i + 1) % interval == 0 else "S" for i in range(num_layers))


def _nemotron(pattern: str) -> str:
    """Nemotron-H ``hybrid_override_pattern``: ``M`` Mamba2, ``*`` attention, ``-`` MLP (no KV cache)."""
    return "".join({"M": "S", "*": "A"}[c] for c in pattern if c != "-")


def _layer_kinds(layers: dict[str, Any] | None) -> str:
    """A preset's layer order (one ``A``/``S`` per layer) from its ``layers`` entry; none means all attention."""
    if layers is None:
        return ""
    if "full_attn_layers" in layers:  # 1-based, as Kimi's linear_attn_config lists them
        return _pattern(layers["num_layers"], [i - 1 for i in layers["full_attn_layers"]])
    if "full_attention_interval" in layers:
        return _every(layers["full_attention_interval"], layers["num_layers"])
    if "hybrid_override_pattern" in layers:
        return _nemotron(layers["hybrid_override_pattern"])
    raise ValueError(f"presets.json: unknown layer order {sorted(layers)}")


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


_ATTENTION_BUILDERS: dict[str, Callable[..., AttentionShape]] = {"mla": _mla, "gqa": _gqa}
_SSM_BUILDERS: dict[str, Callable[..., SsmShape]] = {"kda": _kimi, "gdn": _gdn, "mamba2": _mamba2}


def _shape(builders: dict[str, Callable[..., _S]], entry: dict[str, Any]) -> _S:
    """The shape of a ``{"kind": ..., **parameters}`` entry, built by the builder of that kind."""
    params = dict(entry)
    kind = params.pop("kind")
    if kind not in builders:
        raise ValueError(f"presets.json: unknown shape kind {kind!r}; known: {', '.join(builders)}")
    return builders[kind](**params)


def _check_layer_counts(p: Preset) -> None:
    """The layer order holds exactly the attention and SSM layer counts of the shapes."""
    order = p.layer_order()
    for letter, what, want in (
        ("A", "attention", p.attention.num_layers),
        ("S", "SSM", p.ssm.num_layers if p.ssm else 0),
    ):
        if order.count(letter) != want:
            raise ValueError(f"presets.json: {p.name} orders {order.count(letter)} {what} layers, its shape has {want}")


def _preset(entry: dict[str, Any]) -> Preset:
    """One ``presets.json`` entry as a :class:`Preset`."""
    ssm = entry.get("ssm")
    preset = Preset(
        name=entry["name"],
        title=entry["title"],
        source=entry["source"],
        fields=entry["fields"],
        attention=_shape(_ATTENTION_BUILDERS, entry["attention"]),
        ssm=None if ssm is None else _shape(_SSM_BUILDERS, ssm),
        layer_kinds=_layer_kinds(entry.get("layers")),
        tiny_of=entry.get("tiny_of"),
        notes=entry.get("notes", ""),
    )
    _check_layer_counts(preset)
    return preset


def _load() -> dict[str, Preset]:
    """Every preset of ``presets.json``, by name, in file order."""
    data = json.loads(resources.files(__package__).joinpath("presets.json").read_text("utf-8"))
    return {p.name: p for p in map(_preset, data["presets"])}


PRESETS: dict[str, Preset] = _load()


def preset_names() -> list[str]:
    """Every preset name, full-size first."""
    return sorted(PRESETS, key=lambda n: (PRESETS[n].tiny_of is not None, n))


def get_preset(name: str) -> Preset:
    """The preset called ``name`` (case-insensitive); ``LayoutError`` listing the known names otherwise."""
    preset = PRESETS.get(name.lower())
    if preset is None:
        raise LayoutError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    return preset
