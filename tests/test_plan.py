"""PeerPlan / Plan / RankTransfer bindings: hand-checked ids, numpy contracts, error mapping, moves."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_kv import HybridKvError, LayoutError, PlanError, RegionTable
from hybrid_kv._core import PeerPlan, Plan, RankTransfer
from hybrid_kv.fixtures import F2_PAGE, f2_geometry, f2_sharers
from hybrid_kv.layout import build_region_table, layer, rank_layout


def f2_layout(bases: tuple[int, int], num_blocks: int = 4) -> dict[str, Any]:
    """Reference F.2: two tensors, each shared by kda_a.i, mla.i, kda_b.i; logical 12, kernel 4."""
    layers = []
    for i, base in enumerate(bases):
        for name, group, spec in f2_sharers():
            layers.append(layer(f"{name}.{i}", group, spec, base=base, nbytes=num_blocks * F2_PAGE))
    return rank_layout(layers, **f2_geometry(num_blocks))


def payload_of(table: RegionTable, mode: str = "pull") -> bytes:
    """The handshake payload of ``table``."""
    return table.handshake_payload(
        {
            "engine_id": "prefill",
            "agent_metadata": [],
            "kv_layout": "HND",
            "attn_backend": "FLASHMLA",
            "transfer_mode": mode,
            "compat_hash": "0" * 64,
        }
    )


T0, T1 = 0x1000, 0x10000


def f2_peer(coalesce: bool) -> PeerPlan:
    local = build_region_table(f2_layout((T0, T1)))
    remote = build_region_table(f2_layout((0x90000, 0xA0000)))
    return PeerPlan(local, [payload_of(remote)], "pull", coalesce=coalesce)


@pytest.fixture
def peer() -> PeerPlan:
    """The reference peer plan: no chunk rows, one descriptor id per kernel unit."""
    return f2_peer(coalesce=False)


def test_f2_request_ids_are_int32_and_match_the_reference(peer: PeerPlan) -> None:
    plan = peer.plan([[1], [2], [3]], [[1], [2], [3]])
    assert isinstance(plan, Plan) and len(plan) == 1
    t = plan.transfers[0]
    assert isinstance(t, RankTransfer)
    assert (t.remote_rank, t.local_table) == (0, "whole")
    want = [3, 4, 5, 15, 16, 17] + [v for s in range(8) for v in (24 + 4 * s + 2, 24 + 4 * s + 3)]
    for ids in (t.local_ids, t.remote_ids):
        assert ids.dtype == np.int32 and ids.flags.c_contiguous and ids.ndim == 1
        assert ids.tolist() == want
    assert plan.notify_ranks == [0]


def test_block_ids_may_be_tuples_or_numpy_arrays(peer: PeerPlan) -> None:
    ref = peer.plan([[1], [2], [3]], [[1], [2], [3]]).transfers[0]
    alt = peer.plan((np.array([1]), (2,), np.array([3], dtype=np.int32)), [[1], [2], [3]]).transfers[0]
    assert alt.local_ids.tolist() == ref.local_ids.tolist()
    assert alt.remote_ids.tolist() == ref.remote_ids.tolist()
    with pytest.raises(PlanError, match="local block id -2 of group 1 is out of range"):
        peer.plan([[1], np.array([-2]), [3]], [[1], [2], [3]])
    with pytest.raises(TypeError):
        peer.plan([[1], [2.5], [3]], [[1], [2], [3]])


def test_list_items_of_any_int_kind_read_alike(peer: PeerPlan) -> None:
    # Exact ints take the binding's direct path, anything else the generic one from that item on.
    rest = [[3], []]  # F2's groups share tensors: no id in two groups
    ref = peer.plan([[0, 1, 2], *rest], [[0, 1, 2], *rest]).transfers[0]
    for mixed in ([0, np.int64(1), 2], [np.int32(0), 1, 2], [0, 1, np.uint8(2)]):
        alt = peer.plan([mixed, *rest], [[0, 1, 2], *rest]).transfers[0]
        assert alt.local_ids.tolist() == ref.local_ids.tolist(), mixed
    for bad, shown in (([0, np.int64(1), -1], -1), ([0, -5, np.int64(1)], -5)):
        with pytest.raises(PlanError, match=f"local block id {shown} of group 0 is out of range"):
            peer.plan([bad, *rest], [[0, 1, 2], *rest])
    with pytest.raises(PlanError, match=f"local block id {2**70} of group 0 is out of range"):
        peer.plan([[0, 2**70, 1], *rest], [[0, 1, 2], *rest])
    with pytest.raises(TypeError, match="local block id True \\(bool\\) of group 0 is not an integer"):
        peer.plan([[0, True, 2], *rest], [[0, 1, 2], *rest])  # bools are refused (tests/test_plan_ids_bad_input.py)


def test_tables_are_uint64_nx3_and_nx5(peer: PeerPlan) -> None:
    assert peer.table_keys == ["whole"]
    descs = peer.local_descs("whole")
    assert descs.dtype == np.uint64 and descs.shape == (56, 3)
    assert descs[1].tolist() == [T0 + 48, 48, 0]
    rows = peer.local_rows("whole")
    assert rows.shape == (10, 5) and int(rows[:, 4].sum()) == 56
    assert peer.remote_descs(0).shape == (56, 3)
    assert peer.remote_rows(0).shape[1] == 5
    assert (peer.mode, peer.tp_ratio, peer.remote_ranks, peer.attn_ranks) == ("pull", 1, [0], [0])
    with pytest.raises(PlanError, match="no remote rank 3"):
        peer.remote_descs(3)
    with pytest.raises(PlanError, match="table key"):
        peer.local_descs("nope")


def test_plans_of_one_rank_return_its_shared_base_table_as_one_read_only_array() -> None:
    """The coalesced base table (chunk and whole-state rows) depends on the local rank alone: every plan of the
    rank returns the same read-only array (copied out once; the transport preps it once); a plan of another
    table object returns equal rows in its own array, and tables only one plan holds are fresh and writable."""
    local = build_region_table(f2_layout((T0, T1)))
    remote = payload_of(build_region_table(f2_layout((0x90000, 0xA0000))))
    a, b = (PeerPlan(local, [remote], "pull") for _ in range(2))
    rows = a.local_rows("whole")
    assert rows is b.local_rows("whole") and rows is a.local_rows("whole")
    assert not rows.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        rows[0, 0] = 0
    other = PeerPlan(build_region_table(f2_layout((T0, T1))), [remote], "pull").local_rows("whole")
    assert other is not rows and np.array_equal(other, rows)
    assert np.array_equal(rows, local.local_rows(coalesce=True))
    fresh = PeerPlan(local, [remote], "pull", coalesce=False).local_rows("whole")
    assert fresh.flags.writeable and fresh is not PeerPlan(local, [remote], "pull", coalesce=False).local_rows("whole")


def test_coalesced_plans_move_the_reference_bytes_in_fewer_ids(peer: PeerPlan) -> None:
    coalesced = f2_peer(coalesce=True)
    assert coalesced.coalesced and not peer.coalesced
    ref_rows, rows = peer.local_rows("whole"), coalesced.local_rows("whole")
    assert np.array_equal(rows[: len(ref_rows)], ref_rows), "chunk rows are appended, existing ids stay valid"
    assert rows.shape[0] > ref_rows.shape[0] and bool((rows[:, 1] <= rows[:, 3]).all())
    ref, plan = peer.plan([[1], [2], [3]], [[0], [1], [2]]), coalesced.plan([[1], [2], [3]], [[0], [1], [2]])
    t, r = plan.transfers[0], ref.transfers[0]
    # MLA runs of 3 units keep their plain ids (odd runs: NIXL merges them as it merges the reference's); equal
    # TP makes each of the 2 x 2 KDA states one whole-state id instead of four pieces.
    assert t.local_ids[:6].tolist() == r.local_ids[:6].tolist() and len(r.local_ids) == 6 + 16
    state_ids = len(coalesced.local_descs("whole")) - 2 * 4  # the last rows: one per SSM region, 4 states each
    assert len(t.local_ids) == 6 + 4 and bool((t.local_ids[6:] >= state_ids).all())

    def merged(moves: npt.NDArray[np.uint64]) -> list[list[int]]:
        out: list[list[int]] = []
        for la, ra, n in sorted(moves.tolist()):
            if out and out[-1][0] + out[-1][2] == la and out[-1][1] + out[-1][2] == ra:
                out[-1][2] += n
            else:
                out.append([la, ra, n])
        return out

    assert merged(plan.moves(0)) == merged(ref.moves(0))
    assert int(plan.moves(0)[:, 2].sum()) == int(ref.moves(0)[:, 2].sum())


def test_moves_resolve_to_equal_length_byte_ranges(peer: PeerPlan) -> None:
    plan = peer.plan([[1], [2], [3]], [[0], [1], [2]])
    moves = plan.moves(0)
    assert moves.dtype == np.uint64 and moves.shape == (22, 3)
    assert moves[0].tolist() == [T0 + 3 * 48, 0x90000 + 0, 48]
    assert int(moves[:, 2].sum()) == 6 * 48 + 2 * 2 * (12 + 12 + 24 + 64)
    with pytest.raises(PlanError, match="out of range"):
        plan.moves(1)


def test_plan_errors_name_the_value_and_the_limit(peer: PeerPlan) -> None:
    with pytest.raises(PlanError, match="block id 4 of group 1 is out of range: the pool has 4 logical blocks"):
        peer.plan([[1], [4], [3]], [[1], [2], [3]])
    with pytest.raises(
        PlanError, match="unpairable SSM state slots in group 1: decode lists 3 states, prefill lists 1"
    ):
        peer.plan([[1], [0, 2, 3], []], [[1], [2], [3]])
    with pytest.raises(PlanError, match="local block id 1 is listed in groups 0 and 1, which share KV-cache tensors"):
        peer.plan([[1], [1], [3]], [[1], [2], [3]])
    with pytest.raises(PlanError, match="2 groups, but the model has 3"):
        peer.plan([[1], [2]], [[1], [2], [3]])
    assert issubclass(PlanError, HybridKvError)


def test_peer_plan_construction_errors() -> None:
    local = build_region_table(f2_layout((T0, T1)))
    remote = build_region_table(f2_layout((0x90000, 0xA0000)))
    with pytest.raises(PlanError, match='mode must be "pull" or "push"'):
        PeerPlan(local, [payload_of(remote)], "sideways")
    with pytest.raises(PlanError, match="transfer mode differs"):
        PeerPlan(local, [payload_of(remote, "push")], "pull")
    with pytest.raises(PlanError, match="bad remote metadata"):
        PeerPlan(local, [{}], "pull")
    other = f2_layout((0x90000, 0xA0000))
    other["kernel_block_size"] = 5
    with pytest.raises(LayoutError):
        build_region_table(other)


@settings(max_examples=25, deadline=None)
@given(
    ids=st.permutations(list(range(8))).map(lambda p: p[:5]),
    remote=st.permutations(list(range(8))).map(lambda p: p[:5]),
)
@pytest.mark.parametrize("coalesce", [False, True])
def test_moves_stay_inside_the_request_blocks(ids: list[int], remote: list[int], coalesce: bool) -> None:
    local = build_region_table(f2_layout((T0, T1), 8))
    remote_meta = payload_of(build_region_table(f2_layout((0x90000, 0xA0000), 8)))
    peer = PeerPlan(local, [remote_meta], "pull", coalesce=coalesce)
    local_ids = [ids[:2], [ids[2]], [ids[3]]]
    plan = peer.plan(local_ids, [remote[:2], [remote[2]], [remote[3]]])
    blocks = set(ids[:4])
    seen: set[int] = set()
    for i in range(len(plan)):
        for la, _, n in plan.moves(i).tolist():
            base = T1 if la >= T1 else T0
            span = set(range(la, la + n))
            if coalesce:  # a chunk may span adjacent request blocks; every byte stays in one of them
                assert {(a - base) // F2_PAGE for a in span} <= blocks
                assert not span & seen
                seen |= span
                continue
            block = (la - base) // F2_PAGE
            assert block in blocks and (la + n - 1 - base) // F2_PAGE == block
            assert not span & seen
            seen |= span
