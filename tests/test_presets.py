"""Model presets: geometry per TP size, HMA sharing, layouts with synthetic addresses and with torch tensors."""

from __future__ import annotations

import json

import pytest

from hybrid_kv import LayoutError
from hybrid_kv.layout import build_region_table
from hybrid_kv.presets import PRESETS, get_preset, preset_names

FULL = ["kimi-linear-48b-a3b", "deepseek-v3", "qwen3-next-80b-a3b", "nemotron-h-8b", "qwen3.5-27b"]


def valid_tps(name: str, limit: int = 16) -> list[int]:
    out = []
    for tp in range(1, limit + 1):
        try:
            PRESETS[name].check_tp(tp)
        except LayoutError:
            continue
        out.append(tp)
    return out


def test_every_model_has_a_full_and_a_tiny_preset_with_a_source() -> None:
    for name in FULL:
        p = PRESETS[name]
        assert p.source.startswith("https://huggingface.co/") and p.source.endswith("/config.json")
        assert p.fields
        assert any(t.tiny_of == name for t in PRESETS.values()), name
    assert preset_names()[: len(FULL)] == sorted(FULL)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_geometry_invariants_at_every_valid_tp(name: str) -> None:
    p = PRESETS[name]
    tps = valid_tps(name)
    assert 1 in tps and 2 in tps
    kernel_pages = set()
    for tp in tps:
        g = p.geometry(tp)
        assert g.logical_block_size % g.kernel_block_size == 0
        assert g.page_bytes == g.logical_block_size * g.attn_bytes_per_token
        assert g.page_bytes >= g.state_bytes
        if p.ssm is not None:  # the smallest page that holds the state: one kernel block less would not
            assert (g.logical_block_size - g.kernel_block_size) * g.attn_bytes_per_token < g.state_bytes
        kernel_pages.add(g.kernel_page_bytes)
        table = build_region_table(p.rank_layout(tp, tp - 1, 8))
        assert table.num_regions == p.num_tensors
        assert table.ppl == g.ppl
        assert set(table.block_lens) == {g.kernel_page_bytes}
        assert table.ssm_sizes == (g.conv_bytes, g.temporal_bytes)
        if p.attention.kind == "mla":
            assert all(table.region_is_mla)  # OR-merged over the KDA sharers
    if p.attention.kind == "mla":
        assert len(kernel_pages) == 1  # MLA pages never depend on TP: block_size_ratio stays 1


def test_kimi_linear_matches_the_published_shapes() -> None:
    p = get_preset("Kimi-Linear-48B-A3B")
    assert p.num_tensors == 7 and p.group_kinds() == ["mla", "ssm", "ssm", "ssm"]
    assert p.layer_order().count("A") == 7 and p.layer_order()[3] == "A"  # full_attn_layers are 1-based
    g1, g8 = p.geometry(1), p.geometry(8)
    assert (g1.logical_block_size, g1.ppl, g1.kernel_page_bytes) == (1920, 30, 64 * 576 * 2)
    assert (g8.logical_block_size, g8.ppl, g8.kernel_page_bytes) == (256, 4, 64 * 576 * 2)
    assert (g1.conv_bytes, g1.temporal_bytes) == (3 * 32 * 128 * 3 * 2, 32 * 128 * 128 * 4)
    slots = p.slots()
    assert sum(s.tensor == 6 for s in slots) == 3  # the last KDA group is one layer short (padded)


@pytest.mark.parametrize(
    ("name", "tp", "proj_dims"),
    [  # conv channel splits per sub-projection
        ("nemotron-h-8b", 1, [8192, 1024, 1024]),
        ("nemotron-h-8b", 4, [2048, 256, 256]),
        ("qwen3.5-27b", 1, [2048, 2048, 6144]),
        ("qwen3.5-27b", 8, [256, 256, 768]),
    ],
)
def test_conv_split_matches_reference_vectors(name: str, tp: int, proj_dims: list[int]) -> None:
    info = json.loads(build_region_table(PRESETS[name].rank_layout(tp, 0, 4)).to_json())
    assert info["conv_split"]["proj_dims"] == proj_dims


def test_deepseek_v3_is_one_region_per_layer() -> None:
    p = get_preset("deepseek-v3")
    table = build_region_table(p.rank_layout(1, 0, 100))
    assert table.num_regions == 61 and table.ppl == 1
    assert table.num_fa_descs() == 61 * 100  # 61 regions x blocks descriptors
    assert p.geometry(1).kernel_page_bytes == 73728


def test_gqa_heads_shrink_with_tp_and_replicate_past_the_kv_heads() -> None:
    p = get_preset("qwen3-next-80b-a3b")  # 2 KV heads
    assert [p.geometry(tp).attn_bytes_per_token for tp in (1, 2, 4)] == [2048, 1024, 1024]
    layout = p.rank_layout(4, 3, 2)
    att = [entry for entry in layout["layers"] if entry["spec"]["type"] == "full_attention"]
    assert {entry["spec"]["num_kv_heads"] for entry in att} == {1}
    assert layout["total_num_kv_heads"] == 2


def test_torch_layers_share_one_tensor_per_hma_slot() -> None:
    from hybrid_kv.torch_adapter import region_table_from_tensors

    p = get_preset("tiny-kimi-linear")
    pools, layers, geo = p.torch_layers(2, 1, 8)
    assert len(pools) == 3 and len(layers) == 12
    assert {t.data_ptr() for _, _, _, t in layers} == {pool.data_ptr() for pool in pools}
    table = region_table_from_tensors(
        layers,
        logical_block_size=geo.logical_block_size,
        kernel_block_size=geo.kernel_block_size,
        num_logical_blocks=8,
        tp_rank=1,
        tp_size=2,
    )
    synthetic = build_region_table(p.rank_layout(2, 1, 8))
    assert table.block_lens == synthetic.block_lens and table.ppl == synthetic.ppl
    assert set(table.base_addrs) == {pool.data_ptr() for pool in pools}
    layout = p.layout_from_tensors(layers, geo, 1, 8)
    assert build_region_table(layout).to_json() == table.to_json()


def test_overrides_and_bad_values_are_clear_errors() -> None:
    p = get_preset("tiny-kimi-linear")
    assert p.geometry(1, kernel_block_size=32).logical_block_size == 64
    assert p.geometry(1, logical_block_size=128).ppl == 8
    with pytest.raises(LayoutError, match="smaller than the 5248-byte SSM state"):
        p.geometry(1, logical_block_size=32)
    with pytest.raises(LayoutError, match="not a positive multiple"):
        p.geometry(1, logical_block_size=40)
    with pytest.raises(LayoutError, match="TP size 3 does not divide num_attention_heads=4"):
        p.geometry(3)
    with pytest.raises(LayoutError, match="unknown preset 'llama'; known presets: deepseek-v3"):
        get_preset("llama")
    with pytest.raises(LayoutError, match="out of range"):
        p.rank_layout(2, 2, 4)


@pytest.mark.parametrize(
    ("name", "ptp", "dtp", "mode"),
    [("kimi-linear-48b-a3b", 8, 1, "pull"), ("nemotron-h-8b", 1, 4, "push"), ("tiny-qwen3.5", 2, 1, "pull")],
)
def test_preset_scenarios_build_and_plan(name: str, ptp: int, dtp: int, mode: str) -> None:
    from hybrid_kv._core import plan_scenario

    p = PRESETS[name]
    kinds = p.group_kinds()
    pg, dg = p.geometry(ptp), p.geometry(dtp)

    def ids(logical: int) -> list[list[int]]:
        out, nxt = [], 0
        for kind in kinds:
            n = 1 if kind == "ssm" else -(-5000 // logical)
            out.append(list(range(nxt, nxt + n)))
            nxt += n
        return out

    request = {"id": "r0", "prefill": ids(pg.logical_block_size), "decode": ids(dg.logical_block_size)}
    scenario = p.scenario(ptp, dtp, mode=mode, num_blocks=128, requests=[request])
    report = plan_scenario(json.dumps(scenario), moves=False)
    assert report["tp"] == [ptp, dtp] and report["mode"] == mode
    ranks = report["requests"][0]["ranks"]
    assert len(ranks) == (dtp if mode == "pull" else ptp)
    assert all(rank["transfers"] for rank in ranks)
