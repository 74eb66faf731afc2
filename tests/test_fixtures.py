"""``hybrid_kv.fixtures`` reads the one data file that ``rust/core/fixtures.rs`` embeds, and gives the
hand-checked F.2 vectors the Rust and Python tests were written against."""

from __future__ import annotations

import json
import re
from pathlib import Path

import hybrid_kv
from hybrid_kv import fixtures
from hybrid_kv.fixtures import F2_PAGE, f2_geometry, f2_sharers, kda_spec, mla_spec

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(hybrid_kv.__file__).with_name("fixtures.json")


def test_rust_embeds_the_file_python_loads() -> None:
    src = (ROOT / "rust" / "core" / "fixtures.rs").read_text()
    embedded = re.findall(r'include_str!\("([^"]+)"\)', src)
    assert embedded == ["../../python/hybrid_kv/fixtures.json"], embedded
    assert (ROOT / "rust" / "core" / embedded[0]).resolve() == (ROOT / "python/hybrid_kv/fixtures.json").resolve()
    assert json.loads(DATA.read_text()) == fixtures._DATA


def test_fixtures_are_the_hand_checked_f2_vectors() -> None:
    assert F2_PAGE == 144
    assert mla_spec() == {"type": "mla", "head_size": 6, "dtype_bytes": 2}
    assert kda_spec() == {
        "type": "ssm",
        "kind": "gdn",
        "conv_shape": [8, 3],
        "conv_dtype_bytes": 2,
        "temporal_shape": [1, 4, 4],
        "temporal_dtype_bytes": 4,
        "page_size_padded": 144,
    }
    # TP shares: conv channels and the one head's temporal rows split; the page is the caller's.
    tp2 = kda_spec(2, 96)
    assert (tp2["conv_shape"], tp2["temporal_shape"], tp2["page_size_padded"]) == ([4, 3], [1, 2, 4], 96)
    assert [(n, g, s["type"]) for n, g, s in f2_sharers()] == [
        ("kda_a", 1, "ssm"),
        ("mla", 0, "mla"),
        ("kda_b", 2, "ssm"),
    ]
    assert f2_geometry(7) == {"logical_block_size": 12, "kernel_block_size": 4, "num_logical_blocks": 7}
    # The page is one logical block of MLA latents.
    assert F2_PAGE == f2_geometry()["logical_block_size"] * mla_spec()["head_size"] * mla_spec()["dtype_bytes"]


def test_every_call_returns_fresh_dicts() -> None:
    a = mla_spec()
    a["head_size"] = 99
    k = kda_spec()
    k["conv_shape"][0] = 99
    sharers = f2_sharers()
    sharers[0][2]["temporal_shape"][1] = 99
    assert mla_spec()["head_size"] == 6 and kda_spec()["conv_shape"] == [8, 3]
    assert sharers[2][2]["temporal_shape"] == [1, 4, 4]
    assert f2_sharers()[0][2]["temporal_shape"] == [1, 4, 4]
