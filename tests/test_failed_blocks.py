"""``PeerPlan.failed_blocks``: a failed transfer's local descriptor ids back to logical block ids per group, in
Rust, checked against the flat table (``local_descs``) and the regions' block geometry in NumPy."""

from __future__ import annotations

import json

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_kv import PeerPlan, PlanError, RegionTable
from hybrid_kv.layout import build_region_table
from hybrid_kv.presets import get_preset


def rank(preset: str, tp: int, r: int, blocks: int, engine: str) -> tuple[RegionTable, bytes]:
    p = get_preset(preset)
    table = build_region_table(p.rank_layout(tp=tp, rank=r, num_blocks=blocks))
    return table, table.handshake_payload(p.engine_info(engine, "pull"))


def peer(preset: str, coalesce: bool) -> tuple[RegionTable, PeerPlan, list[str]]:
    decode, _ = rank(preset, 1, 0, 32, "decode")
    payloads = [rank(preset, 2, r, 32, "prefill")[1] for r in (0, 1)]
    kinds = get_preset(preset).group_kinds()
    return decode, PeerPlan(decode, payloads, "pull", coalesce=coalesce), kinds


def brute_force(
    table: RegionTable, plan: PeerPlan, kinds: list[str], key: str, ids: npt.NDArray[np.int32]
) -> list[set[int]]:
    """Every (region, logical block) whose bytes a descriptor overlaps, by comparing every block's byte range."""
    flat = plan.local_descs(key)[ids.astype(np.int64)]
    lo, hi = flat[:, 0], flat[:, 0] + flat[:, 1]
    info = json.loads(table.to_json())
    ppl = info["geometry"]["ppl"]
    out: list[set[int]] = [set() for _ in kinds]
    for i, r in enumerate(info["regions"]):
        page = r["block_stride"] * ppl
        starts = r["base"] + page * np.arange(r["num_blocks"] // ppl, dtype=np.uint64)
        hit = (lo[:, None] < starts[None, :] + page) & (starts[None, :] < hi[:, None])
        blocks = set(np.nonzero(hit.any(axis=0))[0].tolist())
        for g, kind in enumerate(kinds):
            attention = kind != "ssm" and r["group"] in (None, g)
            if attention or (kind == "ssm" and i in info["ssm_regions"]):
                out[g] |= blocks
    return out


@pytest.mark.parametrize("preset", ["tiny-kimi-linear"])
@pytest.mark.parametrize("coalesce", [True, False])
def test_every_descriptor_maps_like_the_flat_table(preset: str, coalesce: bool) -> None:
    table, plan, kinds = peer(preset, coalesce)
    for key in plan.table_keys:
        n = plan.table_descriptors(key)
        for i in range(n):
            ids = np.array([i], dtype=np.int32)
            got = [set(a.tolist()) for a in plan.failed_blocks(key, ids)]
            assert got == brute_force(table, plan, kinds, key, ids), (key, i)


@settings(max_examples=30, deadline=None)
@given(picks=st.lists(st.integers(0, 2**31 - 1), max_size=40), coalesce=st.booleans())
def test_any_id_set_maps_like_the_flat_table(picks: list[int], coalesce: bool) -> None:
    table, plan, kinds = peer("tiny-kimi-linear", coalesce)
    key = plan.table_keys[0]
    ids = np.array([p % plan.table_descriptors(key) for p in picks], dtype=np.int32)
    got = plan.failed_blocks(key, ids)
    assert all(a.dtype == np.uint64 and np.all(np.diff(a.astype(np.int64)) > 0) for a in got)
    assert [set(a.tolist()) for a in got] == brute_force(table, plan, kinds, key, ids)


def test_a_failed_request_names_its_blocks_and_bad_ids_raise() -> None:
    _, plan, kinds = peer("tiny-kimi-linear", True)
    local = [[1, 2, 3, 4] if k != "ssm" else [10 + g] for g, k in enumerate(kinds)]
    remote = [list(range(5, 13)) if k != "ssm" else [20 + g] for g, k in enumerate(kinds)]  # half-size blocks
    seen: list[set[int]] = [set() for _ in kinds]
    for t in plan.plan(local, remote).transfers:
        for g, blocks in enumerate(plan.failed_blocks(t.local_table, t.local_ids)):
            seen[g] |= set(blocks.tolist()) & set(local[g])
    assert seen == [set(g) for g in local]
    n = plan.table_descriptors("whole")
    with pytest.raises(PlanError, match=f"local descriptor id {n} is out of range for table whole of {n} descriptors"):
        plan.failed_blocks("whole", np.array([0, n], dtype=np.int32))
    with pytest.raises(PlanError, match="no local table"):
        plan.failed_blocks("split:7", np.array([0], dtype=np.int32))
