"""A model preset: a model's KV-cache shapes (``model_shapes``) turned into per-rank geometry and layouts for any TP
size, and into the engine facts and scenario entries the planner takes.

From a preset and a TP size, :meth:`Preset.geometry` computes what vLLM's hybrid allocator would (the unified page,
the logical and kernel block sizes), and :meth:`Preset.rank_layout` / :meth:`Preset.torch_layers` give one rank's
layout in :mod:`hybrid_kv.layout` form, with synthetic addresses or with real torch tensors. The presets themselves
are in ``presets``.

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

Known difference: the vLLM test comment gives KimiLinear logical blocks of 5760
(TP 1) and 768 (TP 8); the published config with the formula above gives 1920 and 256 (the same
90:12 ratio of kernel blocks, divided by 3). We follow the formula, as ``rust/core/fixtures.rs`` does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ._core import LayoutError
from .layout import Spec, layer, rank_layout
from .model_shapes import AttentionShape, SsmShape

if TYPE_CHECKING:
    import torch

__all__ = ["SYNTHETIC_BASE", "Geometry", "LayerSlot", "Preset"]

SYNTHETIC_BASE = 0x7F00_0000_0000
"""Where a preset's synthetic layouts put rank 0's first tensor (rank ``r``'s start ``r << 40`` above it)."""
_TENSOR_GAP = 1 << 20  # bytes left between synthetic tensors


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
