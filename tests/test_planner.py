"""Byte and descriptor counts come from the Rust core: ``RankTransfer.bytes`` / ``num_descriptors``,
``PeerPlan.table_descriptors`` / ``remote_table_descriptors`` / ``local_bytes`` and ``PreparedLink`` (a link's
plan) on top of them, checked against the byte moves the plan resolves to and against the tables expanded row by row."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hybrid_kv
from hybrid_kv import HandshakeError, PeerPlan, PlanError
from hybrid_kv.peer_link import PreparedLink
from hybrid_kv.presets import get_preset

KIMI = get_preset("tiny-kimi-linear")


def payload(tp: int, r: int, blocks: int, engine: str) -> tuple[hybrid_kv.RegionTable, bytes]:
    table = hybrid_kv.build_region_table(KIMI.rank_layout(tp=tp, rank=r, num_blocks=blocks))
    return table, table.handshake_payload(KIMI.engine_info(engine, "pull"))


def request(logical: int, tokens: int) -> list[list[int]]:
    out, nxt = [], 0
    for kind in KIMI.group_kinds():
        n = 1 if kind == "ssm" else -(-tokens // logical)
        out.append(list(range(nxt, nxt + n)))
        nxt += n
    return out


@pytest.mark.parametrize("coalesce", [True, False])
def test_transfer_bytes_and_descriptors_match_the_moves(coalesce: bool) -> None:
    decode, _ = payload(1, 0, 64, "decode")
    remotes = [payload(2, r, 128, "prefill")[1] for r in (0, 1)]
    peer = PeerPlan(decode, remotes, "pull", coalesce=coalesce)
    plan = peer.plan(
        request(KIMI.geometry(1).logical_block_size, 900), request(KIMI.geometry(2).logical_block_size, 900)
    )
    assert len(plan) == 2
    for i, t in enumerate(plan.transfers):
        moves = plan.moves(i)
        assert t.num_descriptors == t.local_ids.size == moves.shape[0] > 0
        assert t.bytes == int(moves[:, 2].sum()) > 0
        flat = peer.local_descs(t.local_table)  # the table expanded in Rust, indexed by id
        assert t.bytes == int(flat[t.local_ids, 1].sum()) == peer.local_bytes(t.local_table, t.local_ids)


def test_table_descriptors_are_the_expanded_lengths() -> None:
    decode, _ = payload(1, 0, 64, "decode")
    remotes = [payload(2, r, 128, "prefill")[1] for r in (0, 1)]
    peer = PeerPlan(decode, remotes, "pull")
    assert peer.table_keys == ["whole", "split:0", "split:1"]
    for key in peer.table_keys:
        rows = peer.local_rows(key)
        assert peer.table_descriptors(key) == peer.local_descs(key).shape[0] == int(rows[:, 4].sum())
    for r in (0, 1):
        assert peer.remote_table_descriptors(r) == peer.remote_descs(r).shape[0] == int(peer.remote_rows(r)[:, 4].sum())
    with pytest.raises(PlanError, match='no local table "split:7"'):
        peer.table_descriptors("split:7")
    with pytest.raises(PlanError, match="no remote rank 5"):
        peer.remote_table_descriptors(5)


def test_local_bytes_names_the_id_and_the_table_size() -> None:
    decode, _ = payload(1, 0, 64, "decode")
    peer = PeerPlan(decode, [payload(1, 0, 64, "prefill")[1]], "pull")
    n = peer.table_descriptors("whole")
    with pytest.raises(PlanError, match=f"local descriptor id {n} is out of range for table whole of {n} descriptors"):
        peer.local_bytes("whole", np.array([0, n], dtype=np.int32))
    with pytest.raises(PlanError, match="id -1 is out of range"):
        peer.local_bytes("whole", np.array([-1], dtype=np.int32))
    one = int(peer.local_descs("whole")[3, 1])
    assert peer.local_bytes("whole", np.array([3, 3, 3], dtype=np.int32)[::2]) == 2 * one  # strided view


def link_plan(decode: Any, payloads: dict[int, bytes], mine: bytes) -> PreparedLink:
    """A prepared link (not connected) planned from ``payloads`` as ``prepare_link`` plans from fetched replies."""
    plan = PeerPlan(decode, [payloads[r] for r in sorted(payloads)], "pull", own_payload=mine)
    return PreparedLink("prefill", sorted(payloads), {r: f"tcp://127.0.0.1:{9 + r}" for r in payloads}, {}, plan)


def test_a_link_plans_and_counts_from_its_peer_plan() -> None:
    decode, mine = payload(1, 0, 64, "decode")
    payloads = {r: payload(2, r, 128, "prefill")[1] for r in (0, 1)}
    link = link_plan(decode, payloads, mine)
    shapes = link.table_shapes()
    assert list(shapes) == link.plan.table_keys
    for key, shape in shapes.items():
        assert shape == {"rows": link.local_tables[key].shape[0], "descriptors": link.plan.table_descriptors(key)}
    assert [link.remote_descriptors(r) for r in (0, 1)] == [link.plan.remote_descs(r).shape[0] for r in (0, 1)]
    ids = request(KIMI.geometry(1).logical_block_size, 900), request(KIMI.geometry(2).logical_block_size, 900)
    transfers = link.transfers(*ids)
    expected = [t.bytes for t in link.plan.plan(*ids).transfers]
    assert [link.transfer_bytes(t) for t in transfers] == expected and all(expected)
    # unattached, a link's peers are its target ranks; a key that is not one is refused
    assert [link.rank_of(t.peer) for t in transfers] == [t.remote_rank for t in link.plan.plan(*ids).transfers]
    with pytest.raises(ValueError, match="not a target rank"):
        link.rank_of(2)


def test_a_link_plan_refuses_an_incompatible_peer_before_planning() -> None:
    decode, mine = payload(1, 0, 64, "decode")
    good = payload(2, 0, 128, "prefill")[1]
    table = hybrid_kv.build_region_table(KIMI.rank_layout(tp=2, rank=1, num_blocks=128))
    bad = table.handshake_payload({**KIMI.engine_info("prefill", "pull"), "compat_hash": "a" * 64})
    # The planner alone would accept it: a model mismatch is the handshake's to catch, not the geometry's.
    assert PeerPlan(decode, [good, bad], "pull").remote_ranks == [0, 1]
    with pytest.raises(HandshakeError, match="(?s)^peer rank 1: .*compat_hash") as info:
        link_plan(decode, {0: good, 1: bad}, mine)
    assert [f[0] for f in info.value.findings] == ["compat_hash"]
