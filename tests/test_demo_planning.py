"""The demo's active rank validates every peer payload before planning from it (issue #11 item 5)."""

from __future__ import annotations

import pytest

import hybrid_kv
from hybrid_kv import HandshakeError, PeerPlan
from hybrid_kv.demo.planning import validated_planner
from hybrid_kv.presets import get_preset

KIMI = get_preset("tiny-kimi-linear")


def rank(tp: int, r: int, blocks: int, engine: str, **info: object) -> tuple[hybrid_kv.RegionTable, bytes]:
    table = hybrid_kv.build_region_table(KIMI.rank_layout(tp=tp, rank=r, num_blocks=blocks))
    facts = {**KIMI.engine_info(engine, "pull"), **info}
    return table, table.handshake_payload(facts)


def test_compatible_peers_are_planned_from_the_validated_bytes() -> None:
    decode, mine = rank(1, 0, 64, "decode")
    payloads = {r: rank(2, r, 128, "prefill")[1] for r in (0, 1)}
    planner = validated_planner(decode, mine, payloads, "pull")
    assert planner.plan_.remote_ranks == [0, 1]


def test_an_incompatible_peer_is_refused_before_anything_is_planned() -> None:
    decode, mine = rank(1, 0, 64, "decode")
    payloads = {0: rank(2, 0, 128, "prefill")[1], 1: rank(2, 1, 128, "prefill", compat_hash="a" * 64)[1]}
    # The planner alone would accept it: a model mismatch is the handshake's to catch, not the geometry's.
    assert PeerPlan(decode, [payloads[0], payloads[1]], "pull").remote_ranks == [0, 1]
    with pytest.raises(HandshakeError, match="(?s)^peer rank 1: .*compat_hash") as info:
        validated_planner(decode, mine, payloads, "pull")
    assert [f[0] for f in info.value.findings] == ["compat_hash"]
