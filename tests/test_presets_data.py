"""``presets.json``, the data behind ``hybrid_kv.presets``: values written twice in it agree, and a malformed
entry is refused by name when the module builds its presets."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

import hybrid_kv
from hybrid_kv import presets

DATA: dict[str, Any] = json.loads(Path(hybrid_kv.__file__).with_name("presets.json").read_text())


def test_every_preset_of_the_data_file_is_loaded_in_order() -> None:
    assert [e["name"] for e in DATA["presets"]] == list(presets.PRESETS)


def test_layer_orders_written_twice_agree_with_the_config_fields() -> None:
    """Kimi's attention layers and Nemotron's pattern are both a config field and the layer order's source."""
    checked = 0
    for entry in DATA["presets"]:
        fields, layers = entry["fields"], entry.get("layers", {})
        if "linear_attn_config.full_attn_layers" in fields:
            assert layers["full_attn_layers"] == fields["linear_attn_config.full_attn_layers"], entry["name"]
            assert layers["num_layers"] == fields["num_hidden_layers"], entry["name"]
            checked += 1
        if "hybrid_override_pattern" in fields:
            assert layers["hybrid_override_pattern"] == fields["hybrid_override_pattern"], entry["name"]
            checked += 1
        for key in ("num_hidden_layers", "text_config.num_hidden_layers"):
            if key in fields and "full_attention_interval" in layers:
                assert layers["num_layers"] == fields[key], entry["name"]
                checked += 1
    assert checked == 4


def _entry(name: str) -> dict[str, Any]:
    return copy.deepcopy(next(e for e in DATA["presets"] if e["name"] == name))


def test_an_entry_whose_layer_order_misses_its_shapes_is_refused() -> None:
    entry = _entry("qwen3-next-80b-a3b")
    entry["layers"]["num_layers"] = 44
    with pytest.raises(ValueError, match="qwen3-next-80b-a3b orders 11 attention layers, its shape has 12"):
        presets._preset(entry)


def test_unknown_kinds_are_refused_by_name() -> None:
    entry = _entry("nemotron-h-8b")
    entry["ssm"]["kind"] = "mamba3"
    with pytest.raises(ValueError, match="unknown shape kind 'mamba3'; known: kda, gdn, mamba2"):
        presets._preset(entry)
    entry = _entry("tiny-qwen3.5")
    entry["layers"] = {"every": 4}
    with pytest.raises(ValueError, match=r"unknown layer order \['every'\]"):
        presets._preset(entry)


def test_an_unchanged_entry_builds_the_loaded_preset() -> None:
    for entry in DATA["presets"]:
        assert presets._preset(copy.deepcopy(entry)) == presets.PRESETS[entry["name"]]
