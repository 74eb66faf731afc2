"""Handshake from Python: wire bytes, digests, validation errors with every finding, hostile payloads."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_kv import HandshakeError, HybridKvError, PeerPlan, PlanError, RegionTable
from hybrid_kv._core import (
    compat_hash,
    decode_meta,
    encode_meta,
    handshake_findings,
    meta_fingerprint,
    validate_handshake,
)
from hybrid_kv.fixtures import f2_sharers
from hybrid_kv.layout import build_region_table, layer, rank_layout


def hybrid_json(tp: int, rank: int, logical: int, n: int, engine: str, **info: Any) -> dict[str, Any]:
    """Metadata (as a dict) of the F.2 hybrid MLA layout at TP ``tp``, kernel block 4."""
    page = logical * 12
    layers = []
    for i, base in enumerate([0x1000 + rank * 0x100000, 0x80000 + rank * 0x100000]):
        for name, group, spec in f2_sharers(tp, page):
            layers.append(layer(f"{name}.{i}", group, spec, base=base, nbytes=n * page))
    table = build_region_table(
        rank_layout(
            layers, logical_block_size=logical, kernel_block_size=4, num_logical_blocks=n, tp_rank=rank, tp_size=tp
        )
    )
    engine_info = {
        "engine_id": engine,
        "agent_metadata": list(b"nixl-blob"),
        "kv_layout": "HND",
        "attn_backend": "FLASH_ATTN",
        "transfer_mode": "pull",
        "compat_hash": "c0ffee" * 8 + "0" * 16,
        **info,
    }
    return decode_meta(table.handshake_payload(engine_info))


def enc(meta: dict[str, Any]) -> bytes:
    return encode_meta(meta)


def f6_pair() -> tuple[dict[str, Any], dict[str, Any]]:
    """Reference F.6: local TP 1 (block 12, ppl 3), remote TP 2 (block 8, ppl 2)."""
    return hybrid_json(1, 0, 12, 8, "local-engine"), hybrid_json(2, 0, 8, 12, "remote-engine")


def test_round_trip_and_fingerprints_across_tp() -> None:
    local, remote = f6_pair()
    assert decode_meta(enc(local)) == local
    assert remote["ssm_sizes"] == [24, 32]
    validate_handshake(enc(local), enc(remote))
    assert handshake_findings(enc(local), enc(remote)) == []
    assert meta_fingerprint(enc(local)) == meta_fingerprint(enc(remote))


def test_f6_remote_block_lens_24_rejected_with_both_values() -> None:
    local, remote = f6_pair()
    for r in remote["regions"]:
        r["block_len"] = 24
    with pytest.raises(HandshakeError) as info:
        validate_handshake(enc(local), enc(remote))
    msg = str(info.value)
    assert "hybrid_mla_block_len: local [48, 48], remote [24, 24]" in msg
    assert isinstance(info.value, HybridKvError)
    findings = info.value.findings
    # The reference's remote also keeps its 24 + 32-byte state in 24 x 2-byte pages (hybrid-kv checks that).
    assert [f[0] for f in findings] == ["remote.ssm_state_size", "hybrid_mla_block_len"]
    assert findings[1][1:3] == ("[48, 48]", "[24, 24]")
    assert meta_fingerprint(enc(local)) != meta_fingerprint(enc(remote))
    assert len(HandshakeError("raised elsewhere").findings) == 0  # every instance has the attribute


def test_every_mismatch_is_one_line() -> None:
    local, remote = f6_pair()
    remote["engine_id"] = "local-engine"
    remote["attn_backend"] = "TRITON_MLA"
    remote["transfer_mode"] = "push"
    remote["ssm_sizes"] = [24, 30]
    local["prefix_caching"] = True
    with pytest.raises(HandshakeError) as info:
        validate_handshake(enc(local), enc(remote), expected_engine_id="remote-engine", expected_tp_size=4)
    lines = str(info.value).splitlines()
    checks = [line.split(":")[0].strip() for line in lines[1:]]
    assert checks == [
        "engine_id",
        "engine_id",
        "transfer_mode",
        "tp_size",
        "prefix_caching_hetero_ppl",
        "ssm_temporal_bytes",
        "attn_backend",
    ]
    assert "7 handshake check(s) failed" in lines[0]
    assert "tp_size: local expected 4, remote 2" in lines[4]


def test_wrong_version_names_both_versions() -> None:
    local, _ = f6_pair()
    local["version"] = 2
    with pytest.raises(HandshakeError, match="version mismatch: local 1, remote 2"):
        decode_meta(enc(local))


def test_inconsistent_metadata_is_rejected_at_decode() -> None:
    local, _ = f6_pair()
    local["tp_rank"] = 4
    with pytest.raises(HandshakeError, match="tp_rank: value 4/1"):
        decode_meta(enc(local))


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xdf\xff\xff\xff\xff",
        b"\x81\xa1a\xdd\xff\xff\xff\xff",
        b"\x81\xa1a\xc6\xff\xff\xff\xff",
        b"\x91" * 64,
        b"\x91\x01",
        b"\x80",
    ],
)
def test_absurd_payloads(payload: bytes) -> None:
    with pytest.raises(HandshakeError):
        decode_meta(payload)


def test_oversized_payload() -> None:
    with pytest.raises(HandshakeError, match="exceeds the limit"):
        decode_meta(b"\x90" * ((8 << 20) + 1))


def test_every_truncation_fails() -> None:
    data = enc(f6_pair()[0])
    for n in range(len(data)):
        with pytest.raises(HandshakeError):
            decode_meta(data[:n])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_are_an_error(data: bytes) -> None:
    with pytest.raises(HandshakeError):
        decode_meta(data)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), min_size=1, max_size=6))
def test_mutated_payloads_never_crash(edits: list[tuple[int, int]]) -> None:
    data = bytearray(enc(f6_pair()[1]))
    for at, value in edits:
        data[at % len(data)] = value
    try:
        decode_meta(bytes(data))
    except HandshakeError:
        pass


def test_compat_hash_over_model_factors() -> None:
    factors = {
        "model": "moonshotai/Kimi-Linear-48B-A3B-Instruct",
        "dtype": "bfloat16",
        "cache_dtype": "auto",
        "total_num_kv_heads": 1,
        "head_size": 576,
        "num_hidden_layers": 27,
        "attn_backend": "FLASHMLA",
        "hma": True,
        "speculative": [],
        "transfer_mode": "pull",
    }
    h = compat_hash(json.dumps(factors))
    assert len(h) == 64 and h == compat_hash(json.dumps(factors))
    assert compat_hash(json.dumps({**factors, "dtype": "float16"})) != h
    assert compat_hash(factors) == h  # a dict needs no JSON round trip
    # a local argument: a ValueError naming every missing key at once, a TypeError naming a mistyped one
    with pytest.raises(ValueError, match=r'^factors: missing keys \["model", "dtype", "cache_dtype"'):
        compat_hash("{}")
    with pytest.raises(ValueError, match=r'^factors: unknown keys \["dtyp"\]'):
        compat_hash({**factors, "dtyp": "x"})
    with pytest.raises(TypeError, match=r'^factors\["hma"\]: invalid type'):
        compat_hash({**factors, "hma": "yes"})


def kimi_rank(tp: int, rank: int, blocks: int, engine: str, **info: Any) -> tuple[RegionTable, bytes]:
    from hybrid_kv.presets import get_preset

    kimi = get_preset("tiny-kimi-linear")
    table = build_region_table(kimi.rank_layout(tp=tp, rank=rank, num_blocks=blocks))
    return table, table.handshake_payload({**kimi.engine_info(engine, "pull"), **info})


def test_handshake_payload_is_the_wire_metadata_of_the_table() -> None:
    table, payload = kimi_rank(2, 1, 64, "prefill")
    meta = decode_meta(payload)
    assert (meta["engine_id"], meta["tp_rank"], meta["tp_size"]) == ("prefill", 1, 2)
    assert [r["base"] for r in meta["regions"]] == table.base_addrs
    assert encode_meta(meta) == payload  # the dict is the whole payload: it encodes back byte for byte


def test_handshake_payload_errors_name_the_field() -> None:
    table, _ = kimi_rank(1, 0, 64, "decode")
    info = {"engine_id": "d", "agent_metadata": [], "kv_layout": "HND", "attn_backend": "x", "compat_hash": "0" * 64}
    with pytest.raises(PlanError, match='mode must be "pull" or "push", got "sideways"'):
        table.handshake_payload({**info, "transfer_mode": "sideways"})
    # a local argument mistake is a ValueError (TypeError for a wrong type) naming the parameter and the key
    with pytest.raises(ValueError, match='^engine_info: missing key "transfer_mode"'):
        table.handshake_payload(info)
    info["transfer_mode"] = "pull"
    with pytest.raises(ValueError, match='^engine_info: unknown key "kv_layut"'):
        table.handshake_payload({**info, "kv_layut": "HND"})
    with pytest.raises(TypeError, match=r'^engine_info\["engine_id"\]: invalid type: integer `7`'):
        table.handshake_payload({**info, "engine_id": 7})
    with pytest.raises(ValueError, match=r'^engine_info\["kv_layout"\]: unknown KV-cache layout "XYZ"'):
        table.handshake_payload({**info, "kv_layout": "XYZ"})
    with pytest.raises(ValueError, match=r'^engine_info\["compat_hash"\]: "abc" is not a compatibility hash'):
        table.handshake_payload({**info, "compat_hash": "abc"})
    # without kv_layout the payload names the table's page order (heads-major unless the tensors say otherwise)
    assert (
        decode_meta(table.handshake_payload({k: v for k, v in info.items() if k != "kv_layout"}))["kv_layout"] == "HND"
    )
    with pytest.raises(HandshakeError, match="bad metadata: missing field `engine_id`"):
        encode_meta({"version": 1})


def test_peer_plan_validates_the_payloads_it_plans_from() -> None:
    decode, mine = kimi_rank(1, 0, 64, "decode")
    payloads = [kimi_rank(2, r, 128, "prefill")[1] for r in (0, 1)]
    peer = PeerPlan(decode, payloads, "pull", own_payload=mine, expected_engine_id="prefill", expected_tp_size=2)
    assert peer.remote_ranks == [0, 1]
    with pytest.raises(HandshakeError, match="(?s)^peer rank 0: .*engine_id") as info:
        PeerPlan(decode, payloads, "pull", own_payload=mine, expected_engine_id="another")
    assert [f[0] for f in info.value.findings] == ["engine_id"]
    with pytest.raises(HandshakeError, match="^own payload: malformed handshake payload"):
        PeerPlan(decode, payloads, "pull", own_payload=b"\x90")
    with pytest.raises(PlanError, match="expected_\\* arguments need own_payload"):
        PeerPlan(decode, payloads, "pull", expected_tp_size=2)
