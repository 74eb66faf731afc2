"""``PeerPlan.plan`` block ids that are not what they claim: every error names the group and the value."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hybrid_kv import PlanError
from hybrid_kv._core import PeerPlan
from hybrid_kv.fixtures import F2_PAGE, f2_geometry, f2_sharers
from hybrid_kv.layout import build_region_table, layer, rank_layout

GOOD = [[1], [2], [3]]


def f2_table(bases: tuple[int, int]) -> Any:
    """Reference F.2 (as in test_plan.py): two tensors, each shared by kda_a.i, mla.i, kda_b.i; 4 blocks."""
    layers = [
        layer(f"{name}.{i}", group, spec, base=base, nbytes=4 * F2_PAGE)
        for i, base in enumerate(bases)
        for name, group, spec in f2_sharers()
    ]
    return build_region_table(rank_layout(layers, **f2_geometry(4)))


@pytest.fixture(scope="module")
def peer() -> PeerPlan:
    info = {"engine_id": "prefill", "agent_metadata": [], "kv_layout": "HND", "attn_backend": "FLASHMLA"}
    info |= {"transfer_mode": "pull", "compat_hash": "0" * 64}
    remote = f2_table((0x90000, 0xA0000)).handshake_payload(info)
    return PeerPlan(f2_table((0x1000, 0x10000)), [remote], "pull")


def gen(*ids: int) -> Iterator[int]:
    yield from ids


@pytest.mark.parametrize(
    ("group1", "error", "needle"),
    [
        ([2**70], PlanError, f"local block id {2**70} of group 1 is out of range: block ids are below 2**63"),
        ([2**63], PlanError, f"local block id {2**63} of group 1 is out of range"),
        ([0, 2**64 + 1], PlanError, f"local block id {2**64 + 1} of group 1 is out of range"),
        (np.array([2**64 - 1], dtype=np.uint64), PlanError, f"local block id {2**64 - 1} of group 1 is out of range"),
        ([-(2**70)], PlanError, f"local block id {-(2**70)} of group 1 is out of range"),
        ([2.0], TypeError, "local block id 2.0 (float) of group 1 is not an integer"),
        ([0, 2.5], TypeError, "local block id 2.5 (float) of group 1 is not an integer"),
        (np.array([2.0]), TypeError, "local block id 2.0 (float64) of group 1 is not an integer"),
        (["2"], TypeError, "local block id '2' (str) of group 1 is not an integer"),
        ([True], TypeError, "local block id True (bool) of group 1 is not an integer"),
        ([0, False], TypeError, "local block id False (bool) of group 1 is not an integer"),
        (np.array([True]), TypeError, "local block id True (bool) of group 1 is not an integer"),
        ({2}, TypeError, "local ids: group 1 must be a sequence of block ids, got set {2}"),
        (frozenset({2}), TypeError, "local ids: group 1 must be a sequence of block ids, got frozenset"),
        (gen(2), TypeError, "local ids: group 1 must be a sequence of block ids, got generator"),
        (iter([2]), TypeError, "local ids: group 1 must be a sequence of block ids, got list_iterator"),
        ({2: 0}, TypeError, "local ids: group 1 must be a sequence of block ids, got dict {2: 0}"),
        ("2", TypeError, "local ids: group 1 must be a sequence of block ids, got str '2'"),
        (b"\x02", TypeError, "local ids: group 1 must be a sequence of block ids, got bytes"),
        (2, TypeError, "local ids: group 1 must be a sequence of block ids, got int 2"),
        (True, TypeError, "local ids: group 1 must be a sequence of block ids, got bool True"),
    ],
)
def test_bad_ids_name_the_group_and_the_value(peer: PeerPlan, group1: Any, error: type, needle: str) -> None:
    with pytest.raises(error) as e:
        peer.plan([[1], group1, [3]], GOOD)
    assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("ids", "needle"),
    [
        ((g for g in GOOD), "remote ids must be a sequence of groups, got generator"),
        ({(1,), (2,), (3,)}, "remote ids must be a sequence of groups, got set"),
        (None, "remote ids must be a sequence of groups, got NoneType None"),
        ("abc", "remote ids must be a sequence of groups, got str 'abc'"),
    ],
)
def test_bad_id_containers_are_type_errors(peer: PeerPlan, ids: Any, needle: str) -> None:
    with pytest.raises(TypeError) as e:
        peer.plan(GOOD, ids)
    assert needle in str(e.value), str(e.value)


def test_long_values_are_shortened_in_the_message(peer: PeerPlan) -> None:
    with pytest.raises(TypeError) as e:
        peer.plan([[1], set(range(100_000)), [3]], GOOD)
    assert len(str(e.value)) < 200 and "got set of 100000 items" in str(e.value)


def test_every_accepted_form_still_plans_alike(peer: PeerPlan) -> None:
    ref = peer.plan(GOOD, GOOD).transfers[0].local_ids.tolist()
    forms: list[Any] = [
        ([1], (2,), np.array([3])),
        [[1], range(2, 3), np.array([3], dtype=np.uint8)],
        ((1,), [np.int64(2)], [3]),
        np.array([[1], [2], [3]]),
    ]
    for ids in forms:
        assert peer.plan(ids, GOOD).transfers[0].local_ids.tolist() == ref, ids
