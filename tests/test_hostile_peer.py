"""A hostile or broken peer through the Python API: every attack is refused with a
``HybridKvError`` subclass naming the value and the limit; none aborts the process or raises ``PanicException``
(a ``BaseException`` that ``except Exception`` lets through)."""

from __future__ import annotations

from typing import Any

import pytest

from hybrid_kv import (
    HandshakeError,
    HybridKvError,
    PlanError,
    RegionTable,
    decode_meta,
    validate_handshake,
)
from hybrid_kv._core import PeerPlan, encode_meta, handshake_findings, handshake_target_ranks
from hybrid_kv.fixtures import F2_PAGE, f2_geometry, f2_sharers
from hybrid_kv.layout import build_region_table, layer, rank_layout

REMOTE_BASES = (0x90000, 0xA0000)


def f2_table(bases: tuple[int, int], num_blocks: int = 4) -> RegionTable:
    """Reference F.2: two tensors, each shared by kda_a.i, mla.i, kda_b.i; logical 12, kernel 4."""
    layers = []
    for i, base in enumerate(bases):
        for name, group, spec in f2_sharers():
            layers.append(layer(f"{name}.{i}", group, spec, base=base, nbytes=num_blocks * F2_PAGE))
    return build_region_table(rank_layout(layers, **f2_geometry(num_blocks)))


def meta(table: RegionTable, engine: str) -> dict[str, Any]:
    info = {
        "engine_id": engine,
        "agent_metadata": [],
        "kv_layout": "HND",
        "attn_backend": "FLASHMLA",
        "transfer_mode": "pull",
        "compat_hash": "0" * 64,
    }
    return decode_meta(table.handshake_payload(info))


@pytest.fixture
def local() -> RegionTable:
    return f2_table((0x1000, 0x10000))


@pytest.fixture
def honest() -> dict[str, Any]:
    return meta(f2_table(REMOTE_BASES), "prefill")


def plan_from(local: RegionTable, remote: dict[str, Any]) -> PeerPlan:
    """Plan from a peer's metadata exactly as it claims it, as a dict (never validated)."""
    return PeerPlan(local, [remote], "pull")


def test_the_honest_peer_plans_from_its_payload_bytes(local: RegionTable, honest: dict[str, Any]) -> None:
    payload = encode_meta(honest)
    mine = encode_meta(meta(local, "decode"))
    validate_handshake(mine, payload)
    peer = PeerPlan(local, [payload], "pull")
    assert peer.plan([[1], [2], [3]], [[1], [2], [3]]).transfers
    with pytest.raises(TypeError, match="payload bytes or a metadata dict, got int"):
        PeerPlan(local, [7], "pull")  # type: ignore[list-item]


def test_a_tp_size_of_u32_max_is_refused_by_name(local: RegionTable, honest: dict[str, Any]) -> None:
    # Before: handshake_target_ranks allocated 4 x tp_size bytes (abort at 2^32 - 1, 1 GiB at 2^28).
    with pytest.raises(PlanError, match="remote TP size is 4294967295, over the limit of 1024"):
        handshake_target_ranks(0, 1, 2**32 - 1)
    with pytest.raises(PlanError, match="over the limit of 1024"):
        handshake_target_ranks(0, 1, 2**28)
    bad = dict(honest, tp_size=2**32 - 1)
    with pytest.raises(HandshakeError, match="tp_size: value 4294967295 .must be at most 1024"):
        PeerPlan(local, [encode_meta(bad)], "pull")
    with pytest.raises(PlanError, match="remote rank 0 metadata is malformed: .*tp_size"):
        plan_from(local, bad)
    mine = encode_meta(meta(local, "decode"))
    with pytest.raises(HandshakeError, match="tp_size"):
        handshake_findings(mine, encode_meta(bad))


@pytest.mark.parametrize(
    ("lie", "named"),
    [
        ({"ppl": 0}, "ppl"),  # before: pyo3_runtime.PanicException
        ({"kernel_block_size": 0}, "ppl"),
        ({"regions": "near-2^64"}, "overflows the 64-bit address space"),  # before: wrapped addresses
        ({"num_blocks": 2**33, "num_logical_blocks": 2**33 // 3}, "num_blocks"),
    ],
)
def test_unvalidated_metadata_is_checked_by_peer_plan(
    local: RegionTable, honest: dict[str, Any], lie: dict[str, Any], named: str
) -> None:
    bad = dict(honest, **lie)
    if lie.get("regions") == "near-2^64":
        bad["regions"] = [dict(honest["regions"][0], base=2**64 - 64), honest["regions"][1]]
    try:
        plan_from(local, bad)
    except Exception as exc:  # must be catchable as an Exception, and one of ours
        assert isinstance(exc, PlanError), repr(exc)
        assert named in str(exc)
    else:
        pytest.fail("PeerPlan accepted inconsistent metadata")


def test_a_remote_claiming_a_billion_blocks_is_refused_before_allocating(
    local: RegionTable, honest: dict[str, Any]
) -> None:
    blocks = 3 * 2**28  # consistent with ppl 3 and under the int32 id limit: only the size is a lie
    regions = [dict(r, num_blocks=blocks, base=(i + 1) << 50) for i, r in enumerate(honest["regions"])]
    bad = dict(honest, num_blocks=blocks, num_logical_blocks=blocks // 3, regions=regions)
    with pytest.raises(PlanError, match="kernel units advertised by remote rank 0 .* over the limit of"):
        plan_from(local, bad)


def test_an_ssm_state_larger_than_its_page_is_refused_at_the_handshake(
    local: RegionTable, honest: dict[str, Any]
) -> None:
    page = honest["regions"][0]["block_len"] * honest["ppl"]
    conv = honest["ssm_sizes"][0]
    bad = dict(honest, ssm_sizes=[conv, page])  # conv + temporal > page: a push would write past every page
    mine = encode_meta(meta(local, "decode"))
    with pytest.raises(HandshakeError, match="must fit its logical page") as info:
        validate_handshake(mine, encode_meta(bad))
    assert "remote.ssm_state_size" in [f[0] for f in info.value.findings]
    with pytest.raises(PlanError):
        plan_from(local, bad)


@pytest.mark.parametrize("shift", [0, 64])
def test_overlapping_region_bases_are_refused_with_every_finding(
    local: RegionTable, honest: dict[str, Any], shift: int
) -> None:
    regions = [dict(r) for r in honest["regions"]]
    regions[1]["base"] = regions[0]["base"] + shift
    bad = dict(honest, regions=regions, compat_hash="other-model")
    mine = encode_meta(meta(local, "decode"))
    with pytest.raises(HandshakeError, match="region_overlap: value regions.0. .0x90000, ") as info:
        validate_handshake(mine, encode_meta(bad))
    assert [f[0] for f in info.value.findings] == ["remote.region_overlap", "compat_hash"]
    assert [f[0] for f in handshake_findings(mine, encode_meta(bad))] == [
        "remote.region_overlap",
        "compat_hash",
    ]
    with pytest.raises(PlanError, match="region_overlap"):
        plan_from(local, bad)


def test_duplicate_block_ids_are_refused_naming_the_id(local: RegionTable, honest: dict[str, Any]) -> None:
    peer = plan_from(local, honest)
    with pytest.raises(PlanError, match="local block id 2 is listed twice in group 0"):
        peer.plan([[2, 1, 2], [2], [3]], [[1, 2, 3], [2], [3]])
    with pytest.raises(PlanError, match="remote block id 3 is listed twice in group 2"):
        peer.plan([[1], [2], [3]], [[1], [2], [3, 3]])
    assert issubclass(PlanError, HybridKvError)
