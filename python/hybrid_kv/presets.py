"""Model presets: KV-cache shapes of public hybrid models, by name (``get_preset``, ``preset_names``); what a
preset computes is in ``model_preset``, its layer shapes in ``model_shapes``.

The numbers are data in ``presets.json`` beside this module: per preset, the configuration fields used and the
shape parameters taken from them. Where they were read: each preset's ``source`` is the model's canonical
``config.json``; the values were taken from copies of those configs found through a search of public pages and
code (Kimi-Linear: the ``Firworks/Kimi-Linear-48B-A3B-Instruct-nvfp4`` mirror of the same config; DeepSeek-V3 and
Nemotron-H-8B: config dicts quoted verbatim in public test suites, the Nemotron one with its
``hybrid_override_pattern``; Qwen3-Next: the Qwen3-Coder-Next / Qwen3-Next configs with identical linear-attention
fields and vLLM's ``Qwen3NextConfig`` defaults; Qwen3.5-27B: its ``text_config`` quoted in public tests). vLLM's
``derive_mamba_conv_split`` vectors for Nemotron-H-8B and Qwen3.5-27B agree with them and are checked in
``tests/test_presets.py``.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from ._core import LayoutError
from .model_preset import Preset
from .model_shapes import ATTENTION_BUILDERS, SSM_BUILDERS, build_shape

__all__ = ["PRESETS", "get_preset", "preset_names"]

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
        attention=build_shape(ATTENTION_BUILDERS, entry["attention"]),
        ssm=None if ssm is None else build_shape(SSM_BUILDERS, ssm),
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
