"""SSM states split over several tensors (``part``, ``conv_layout``) with their own slot counts
(``memory.num_blocks``), through the Python inputs: tables, plans, handshake payloads and the errors that name the
field, the value and the limit. The byte-exact proofs are the Rust byte model (``rust/core/state_split_tests.rs``)
and the real-NIXL SGLang pools (``tests/test_sglang_pools.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from hybrid_kv import LayoutError, PlanError, RegionTable
from hybrid_kv._core import PeerPlan
from hybrid_kv.layout import build_region_table, layer, rank_layout

PAGES, SLOTS, ROWS = 6, 9, 3


def state_layout(
    tp: int, conv_layout: str = "sd", slots: int = SLOTS, *, split: bool = True, rank: int = 0
) -> dict[str, Any]:
    """One attention layer (a page pool) and one GDN state layer: a Q|K|V conv tensor and a temporal tensor, each
    of ``slots`` slots (or one whole-state tensor when not ``split``)."""
    conv = 32 // tp * ROWS * 2
    temporal = 4 // tp * 4 * 4 * 4
    spec = {
        "type": "ssm",
        "kind": "gdn",
        "conv_shape": [32 // tp, ROWS],
        "conv_dtype_bytes": 2,
        "temporal_shape": [4 // tp, 4, 4],
        "temporal_dtype_bytes": 4,
        "conv_layout": conv_layout,
    }
    attn = {"type": "full_attention", "num_kv_heads": 2 // tp, "head_size": 8, "dtype_bytes": 2}
    page = 2 // tp * 4 * 16 * 2
    layers = [layer("model.layers.0.attn", 0, attn, base=0x10000, nbytes=PAGES * page)]
    if split:
        layers += [
            layer("model.layers.1.conv", 1, {**spec, "part": {"conv": [0, 1, 2]}}, base=0x20000, nbytes=slots * conv),
            layer("model.layers.1.temporal", 1, {**spec, "part": "temporal"}, base=0x30000, nbytes=slots * temporal),
        ]
        for entry in layers[1:]:
            entry["memory"]["num_blocks"] = slots
    else:
        layers.append(layer("model.layers.1.state", 1, spec, base=0x20000, nbytes=PAGES * (conv + temporal)))
    return rank_layout(
        layers,
        logical_block_size=4,
        kernel_block_size=4,
        num_logical_blocks=PAGES,
        tp_rank=rank,
        tp_size=tp,
        total_num_kv_heads=2,
    )


def payload(table: RegionTable, engine: str) -> bytes:
    info = {"engine_id": engine, "attn_backend": "x", "transfer_mode": "pull", "compat_hash": "0" * 64}
    return table.handshake_payload(info)


def test_split_state_tables_and_plans_take_each_groups_own_count() -> None:
    local = build_region_table(state_layout(1))
    remotes = [build_region_table(state_layout(2, rank=r)) for r in range(2)]
    peer = PeerPlan(local, [payload(t, "prefill") for t in remotes], "pull")
    plan = peer.plan([[1, 4], [SLOTS - 1]], [[0, 5], [7]])
    moves = [plan.moves(i) for i in range(len(plan.transfers))]
    moved = sum(int(m[:, 2].sum()) for m in moves)
    # attention: 2 pages of 2 heads x 4 tokens x 16 bytes; state: the whole TP-1 state (conv + temporal)
    assert moved == 2 * 2 * 4 * 16 * 2 + 32 * ROWS * 2 + 4 * 4 * 4 * 4
    with pytest.raises(
        PlanError, match=f"block id {SLOTS} of group 1 is out of range: the pool has {SLOTS} state slots"
    ):
        peer.plan([[1], [SLOTS]], [[0], [1]])
    with pytest.raises(
        PlanError, match=f"block id {PAGES} of group 0 is out of range: the pool has {PAGES} logical blocks"
    ):
        peer.plan([[PAGES], [1]], [[0], [1]])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda lay: lay["layers"][1]["spec"].update(part={"conv": [2, 1]}), "distinct ascending sub-projections"),
        (lambda lay: lay["layers"][1]["spec"].update(part={"conv": [0, 1]}), "split states are not whole"),
        (lambda lay: lay["layers"][2]["spec"].update(conv_layout="ds"), "differs from"),
        (lambda lay: lay["layers"][1]["spec"].update(part="all"), "unknown variant"),
        (lambda lay: lay["layers"][1]["memory"].update(num_blocks=2**40), "memory.num_blocks"),
        (lambda lay: lay["layers"][1]["spec"].update(conv_shape=[32, 100]), "over the limit of 64"),
    ],
)
def test_bad_state_parts_are_layout_errors_naming_the_field(change: Any, message: str) -> None:
    bad = state_layout(1)
    change(bad)
    with pytest.raises(LayoutError, match=message) as err:
        build_region_table(bad)
    assert isinstance(err.value, ValueError)


def test_a_state_pool_over_the_limit_names_value_and_limit() -> None:
    bad = state_layout(1)
    bad["layers"][1]["memory"]["num_blocks"] = 2**31
    with pytest.raises(LayoutError, match=r"2147483648 states .* exceed the limit of 2147483647 kernel blocks"):
        build_region_table(bad)


def test_split_and_fused_peers_refuse_each_other_and_fused_payloads_are_unchanged() -> None:
    split, fused = build_region_table(state_layout(1)), build_region_table(state_layout(2, "ds", split=False))
    with pytest.raises(PlanError, match="regions .* differs between the sides"):
        PeerPlan(split, [payload(build_region_table(state_layout(1, split=False, conv_layout="sd")), "p")], "pull")
    body = payload(fused, "p")
    for key in (b"state_part", b"states", b"conv_rows", b"conv_layout"):
        assert key not in body
    assert b"state_part" in payload(split, "p")
