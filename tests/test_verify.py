"""Transfer digests (``hybrid_kv.verify``, ``RegionTable.digest``, ``MirrorPlan``) without NIXL: two ranks'
pools in this process, a transfer simulated by copying each planned move, and both sides' digests compared.

The passive rank's moves come from its mirror of the initiator's plan (rebuilt from the two payloads), so
equal digests show both sides cut the same byte stream, for pull and push, equal and different TP sizes and
kernel block sizes. One byte changed anywhere in the moved ranges changes the digest; bytes outside them do
not. The torch ``wsum`` path runs on CPU tensors here (the same code gathers on the GPU) and is checked
against a direct computation.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hybrid_kv import HandshakeError, MirrorPlan, PeerPlan, RegionTable  # noqa: E402
from hybrid_kv.demo.content import random_bytes  # noqa: E402
from hybrid_kv.presets import get_preset  # noqa: E402
from hybrid_kv.torch_adapter import region_table_from_tensors  # noqa: E402
from hybrid_kv.verify import (  # noqa: E402
    WSUM_PRIME,
    Digester,
    MirrorCache,
    VerifyPolicy,
    algorithm,
    mismatch_reason,
    wsum_digest,
)


class Rank:
    """One rank's pools (torch CPU tensors filled with seeded garbage), table and payload."""

    def __init__(self, preset: str, role: str, mode: str, tp: int, rank: int, blocks: int, kb: int | None = None):
        p = get_preset(preset)
        self.tensors, layers, geo = p.torch_layers(tp, rank, blocks, kernel_block_size=kb)
        for i, t in enumerate(self.tensors):
            t.view(-1).numpy()[:] = random_bytes(5, (tp, rank, i, int(role == "decode")), t.numel())
        self.table: RegionTable = region_table_from_tensors(
            layers,
            logical_block_size=geo.logical_block_size,
            kernel_block_size=geo.kernel_block_size,
            num_logical_blocks=blocks,
            tp_rank=rank,
            tp_size=tp,
            total_num_kv_heads=p.attention.num_kv_heads if p.attention.kind == "gqa" else 1,
        )
        self.payload = self.table.handshake_payload(p.engine_info(role, mode))
        self.digester = Digester(self.table, self.tensors)
        self.geo = geo


def copy_moves(moves: Any, src_col: int, dst_col: int) -> None:
    for m in np.asarray(moves):
        ctypes.memmove(int(m[dst_col]), int(m[src_col]), int(m[2]))


CASES = [  # preset, mode, prefill TP, decode TP, prefill kernel block, decode kernel block
    ("tiny-kimi-linear", "pull", 1, 1, None, None),
    ("tiny-kimi-linear", "pull", 2, 1, None, None),
    ("tiny-kimi-linear", "push", 1, 2, None, None),
    ("tiny-kimi-linear", "pull", 2, 1, 8, 32),
    ("tiny-qwen3-next", "push", 2, 2, None, None),
    ("tiny-deepseek-v3", "pull", 1, 2, None, None),
]


@pytest.mark.parametrize(("preset", "mode", "p_tp", "d_tp", "p_kb", "d_kb"), CASES)
@pytest.mark.parametrize("coalesce", [True, False])
@pytest.mark.parametrize("algo", ["xxh3", "wsum"])
def test_both_sides_digest_the_same_bytes(
    preset: str, mode: str, p_tp: int, d_tp: int, p_kb: int | None, d_kb: int | None, coalesce: bool, algo: str
) -> None:
    from hybrid_kv import handshake_target_ranks
    from hybrid_kv.demo.run import DemoConfig, make_requests

    cfg = DemoConfig(preset, p_tp, d_tp, mode, 2, 150, prefill_block_size=p_kb, decode_block_size=d_kb)
    ps, ds = cfg.validate()
    req = make_requests(cfg, ps, ds)[1]
    prefill = [Rank(preset, "prefill", mode, p_tp, r, ps.num_blocks, p_kb) for r in range(p_tp)]
    decode = [Rank(preset, "decode", mode, d_tp, r, ds.num_blocks, d_kb) for r in range(d_tp)]
    initiators, passives = (decode, prefill) if mode == "pull" else (prefill, decode)
    i_ids, o_ids = (req.decode_ids, req.prefill_ids) if mode == "pull" else (req.prefill_ids, req.decode_ids)
    pairs = 0
    for init in initiators:
        r, tp = initiators.index(init), len(initiators)
        targets = handshake_target_ranks(r, tp, len(passives))
        plan_ = PeerPlan(init.table, [passives[t].payload for t in targets], mode, coalesce=coalesce)
        plan = plan_.plan(i_ids, o_ids)
        for t in targets:
            idx = [i for i, x in enumerate(plan.transfers) if x.remote_rank == t]
            if not idx:
                continue
            moves = np.concatenate([plan.moves(i) for i in idx])
            mirror = MirrorPlan(passives[t].payload, init.payload, coalesce=coalesce)
            assert (mirror.rank, mirror.initiator_rank) == (t, r)
            mirrored = mirror.moves(i_ids, o_ids)
            np.testing.assert_array_equal(mirrored, moves)
            # simulate the transfer: pull reads the passive (remote) side into the local one, push writes out
            if mode == "pull":
                copy_moves(moves, 1, 0)
            else:
                copy_moves(moves, 0, 1)
            mine = init.digester.digest(moves, "local", algo)
            theirs = passives[t].digester.digest(mirrored, "remote", algo)
            assert mine == theirs and mine.bytes == int(moves[:, 2].sum()) and mine.moves == len(moves)
            # one byte changed in a moved range changes the digest; outside the moves nothing does
            m = moves[len(moves) // 2]
            addr = int(m[0]) + int(m[2]) // 2
            old = ctypes.c_uint8.from_address(addr).value
            ctypes.c_uint8.from_address(addr).value = old ^ 0x01
            assert init.digester.digest(moves, "local", algo).digest != theirs.digest
            ctypes.c_uint8.from_address(addr).value = old
            pairs += 1
    assert pairs >= 1


def test_the_digest_does_not_depend_on_how_moves_are_cut() -> None:
    r = Rank("tiny-kimi-linear", "decode", "pull", 1, 0, 16)
    base = r.tensors[0].data_ptr()
    whole = np.array([[base + 100, 0, 5000]], dtype=np.uint64)
    cut = np.array([[base + 100, 0, 1], [base + 101, 0, 0], [base + 101, 0, 4999]], dtype=np.uint64)
    for algo in ("xxh3", "wsum"):
        a, b = r.digester.digest(whole, "local", algo), r.digester.digest(cut, "local", algo)
        assert a.digest == b.digest and a.bytes == b.bytes == 5000 and (a.moves, b.moves) == (1, 3)
        swapped = cut[[2, 0, 1]].copy()
        assert r.digester.digest(swapped, "local", algo).digest != a.digest  # order counts


def test_wsum_is_the_position_weighted_sums() -> None:
    r = Rank("tiny-kimi-linear", "decode", "pull", 1, 0, 16)
    flat = r.tensors[1].view(-1)
    base = flat.data_ptr()
    moves = np.array([[base + 7, 0, 300], [base + 5000, 0, 77], [base, 0, 9]], dtype=np.uint64)
    stream = np.concatenate([flat[int(m[0]) - base : int(m[0]) - base + int(m[2])].numpy() for m in moves])
    w = np.arange(stream.size, dtype=np.int64) % WSUM_PRIME + 1
    b = stream.astype(np.int64)
    want = ((int((b * w).sum()) % WSUM_PRIME) << 32) | (int((b * (w * w % WSUM_PRIME)).sum()) % WSUM_PRIME)
    assert r.digester.digest(moves, "local", "wsum").digest == want


def test_wsum_chunks_long_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    import hybrid_kv.verify as v

    r = Rank("tiny-kimi-linear", "decode", "pull", 1, 0, 16)
    base = r.tensors[0].data_ptr()
    moves = np.array([[base, 0, 4000], [base + 6000, 0, 999]], dtype=np.uint64)
    want = r.digester.digest(moves, "local", "wsum")
    views = r.digester._byte_views()
    monkeypatch.setattr(v, "_CHUNK", 64)  # many chunks, ranges cut across them
    assert wsum_digest(views, moves, 0) == want.digest


def test_digest_reads_only_the_tables_memory() -> None:
    r = Rank("tiny-kimi-linear", "decode", "pull", 1, 0, 16)
    base = r.table.base_addrs[0]
    inside = np.array([[base, 0, 64]], dtype=np.uint64)
    assert r.table.digest(inside) == r.table.digest(inside[:, [1, 0, 2]].copy(), "remote")
    end = base + int(r.table.registration()[0, 1])
    for bad in ([end - 8, 0, 16], [base - 1, 0, 1], [2**64 - 4, 0, 8]):
        with pytest.raises(ValueError, match="is not inside a region of this table"):
            r.table.digest(np.array([bad], dtype=np.uint64))
    with pytest.raises(ValueError, match="side must be 'local' or 'remote'"):
        r.table.digest(inside, "both")
    with pytest.raises(ValueError, match="got 2 columns"):
        r.table.digest(inside[:, :2].copy())
    with pytest.raises(ValueError, match="not inside the digested memory"):
        r.digester.digest(np.array([[1, 0, 8]], dtype=np.uint64), "local", "wsum")
    with pytest.raises(ValueError, match="unknown digest algorithm"):
        r.digester.digest(inside, "local", "md5")
    with pytest.raises(ValueError, match="needs the tensors"):
        Digester(r.table).digest(inside, "local", "wsum")


def test_a_device_table_is_not_read_from_the_host() -> None:
    p = get_preset("tiny-kimi-linear")
    from hybrid_kv import build_region_table

    table = build_region_table(p.rank_layout(1, 0, 8, mem_type="VRAM"))
    assert table.mem_type == "VRAM"
    base = table.base_addrs[0]
    with pytest.raises(ValueError, match="host .DRAM. memory; this table's regions are VRAM"):
        table.digest(np.array([[base, 0, 8]], dtype=np.uint64))


def test_mirror_refuses_an_incompatible_or_unrelated_initiator() -> None:
    a = Rank("tiny-kimi-linear", "prefill", "pull", 2, 1, 16)
    d = Rank("tiny-kimi-linear", "decode", "pull", 4, 0, 16)  # decode rank 0 of 4 reads prefill rank 0 only
    with pytest.raises(HandshakeError, match="tp_peer"):
        MirrorPlan(a.payload, d.payload)
    other = Rank("tiny-deepseek-v3", "decode", "pull", 1, 0, 16)
    with pytest.raises(HandshakeError) as e:
        MirrorPlan(a.payload, other.payload)
    assert e.value.findings
    with pytest.raises(HandshakeError):
        MirrorPlan(a.payload, b"\x00garbage")
    cache = MirrorCache(a.payload, size=1)
    d1 = Rank("tiny-kimi-linear", "decode", "pull", 1, 0, 16)
    m = cache.get(d1.payload, True)
    assert cache.get(d1.payload, True) is m and cache.get(d1.payload, False) is not m


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_mirror_of_a_gqa_decode_wider_than_the_kv_heads(mode: str) -> None:
    """Qwen3-Next (2 KV heads), prefill TP 2 and decode TP 4: the passive rank validated the initiator with itself
    as the posting side, so a decode wider than the KV heads read as a swapped pair ("prefill TP 4 > decode TP 2")
    and every verified request of such a deployment failed. Checked as the initiator checks, its moves are the
    initiator's plan's."""
    import hybrid_kv

    p = get_preset("qwen3-next-80b-a3b")
    blocks = 8

    def payload(tp: int, rank: int, role: str) -> tuple[RegionTable, bytes]:
        table = hybrid_kv.build_region_table(p.rank_layout(tp=tp, rank=rank, num_blocks=blocks))
        return table, table.handshake_payload(p.engine_info(role, mode))

    decode, d_payload = payload(4, 0, "decode")
    prefill, p_payload = payload(2, 0, "prefill")
    groups = {x["group"] for x in p.rank_layout(tp=2, rank=0, num_blocks=blocks)["layers"]}
    ids = [[1, 2], *[[3 + g] for g in range(len(groups) - 1)]]  # attention, then one state per SSM group
    if mode == "pull":  # decode rank 0 of 4 reads prefill rank 0 of 2
        plan, mirror = PeerPlan(decode, [p_payload], mode).plan(ids, ids), MirrorPlan(p_payload, d_payload)
    else:  # prefill rank 0 of 2 writes decode ranks 0 and 1 of 4
        d1 = payload(4, 1, "decode")[1]
        plan, mirror = PeerPlan(prefill, [d_payload, d1], mode).plan(ids, ids), MirrorPlan(d_payload, p_payload)
    moves = np.concatenate([plan.moves(i) for i, t in enumerate(plan.transfers) if t.remote_rank == 0])
    np.testing.assert_array_equal(mirror.moves(ids, ids), moves)


def test_verify_policy() -> None:
    assert str(VerifyPolicy.parse("off")) == "off" and not VerifyPolicy.parse("OFF").enabled
    assert [VerifyPolicy.parse("all").selects(i) for i in range(3)] == [True] * 3
    s = VerifyPolicy.parse("sampled:3")
    assert str(s) == "sampled:3" and [s.selects(i) for i in range(7)] == [True, False, False] * 2 + [True]
    for bad in ("sampled:0", "sampled:1048577", "sampled:", "sampled:-1", "some", "sampled:1e3", "sampled:999999999"):
        with pytest.raises(ValueError, match=r"'off', 'all' or 'sampled:N' with 1 <= N <= 1048576") as e:
            VerifyPolicy.parse(bad)
        assert repr(bad) in str(e.value)
    assert algorithm("DRAM", "DRAM") == "xxh3" and algorithm("DRAM", "VRAM") == "wsum"


def test_claim_messages_are_typed_and_bounded() -> None:
    """The one verified-transfer exchange: claims with digests and their answers (``hybrid_kv.claims``)."""
    import msgspec

    from hybrid_kv.claims import (
        Claim,
        ClaimAnswers,
        ClaimEntry,
        ClaimResult,
        decode_claim_message,
        encode,
    )
    from hybrid_kv.errors import ClaimError

    claim = Claim([ClaimEntry("r-1", b"", "d-1", [[1, 2], [3]], True)], "decode", "h", 1, b"p")
    assert decode_claim_message(encode(claim)) == claim
    ans = ClaimAnswers([ClaimResult("d-1", True, "", 0.0, f"{2**64 - 1:016x}", 10, 2)], "ab" * 8)
    assert decode_claim_message(encode(ans)) == ans
    raw = msgspec.msgpack.encode
    entry = {"req": "r", "grant": b"", "d_req": "d", "ids": [], "digest": True}
    good = {"hkv": "claim", "entries": [entry], "engine": "e", "host": "h", "port": 1}
    bad = [
        b"\x00",
        raw({**good, "algo": "md5"}),
        raw({**good, "port": 0}),
        raw({**good, "entries": [{**entry, "ids": [[-1]]}]}),
        raw({**good, "entries": []}),
        raw({"hkv": "claim_answers", "results": [{"d_req": "r", "ok": True, "digest": "1" * 17}]}),
        raw({"hkv": "claim_answers", "results": [{"d_req": "r", "ok": True, "digest": "A" * 16}]}),
        raw({"hkv": "claim_answers", "results": [{"d_req": "r", "ok": True, "extra": 1}]}),
        raw({"hkv": "other"}),
        b"\x91" * 100 + b"\xc0",
    ]
    for payload in bad:
        with pytest.raises(ClaimError, match="not a claim message"):
            decode_claim_message(payload)
    assert mismatch_reason(1, 0, 4096, 3) == "digest mismatch: 4096 bytes in 3 moves of rank pair (1, 0)"


def test_a_claim_is_confirmed_at_once_and_its_digest_follows() -> None:
    """``answer_claim`` confirms every held entry now, says a digest follows only where one was asked and can be
    taken, and owes exactly those digests (``take_digests``, after the answers went); it never takes a digest."""
    from hybrid_kv.claims import Claim, ClaimEntry, ClaimResult, answer_claim

    entries = [
        ClaimEntry("r-1", b"", "d-1", [[1]], True),
        ClaimEntry("r-2", b"", "d-2", [], False),
        ClaimEntry("r-3", b"", "d-3", [[2]], True),
        ClaimEntry("r-4", b"", "d-4", [[3]], True),
    ]
    claim = Claim(entries, "decode", "h", 1, b"payload")
    held: dict[str, Any] = {"r-1": ([[7]], 5.0), "r-2": ([[8]], 6.0), "r-3": "no lease of 'r-3'"}

    def lookup(entry: ClaimEntry) -> Any:
        return held.get(entry.req)

    results, early, due = answer_claim(claim, lookup, True)
    assert results == [
        ClaimResult("d-1", True, expires_at=5.0, follows=True),
        ClaimResult("d-2", True, expires_at=6.0),
        ClaimResult("d-3", False, "no lease of 'r-3'"),
    ]
    assert early == {"r-4"}  # not leased here yet: kept by the caller
    assert [(d.entry.req, d.own_ids, d.expires_at) for d in due] == [("r-1", [[7]], 5.0)]
    results, _, due = answer_claim(claim, lookup, False)
    assert results[0] == ClaimResult("d-1", True, "this rank takes no digests", 5.0) and due == []
    results, _, due = answer_claim(claim, lookup, True, only="r-2")
    assert results == [ClaimResult("d-2", True, expires_at=6.0)] and due == []


def test_the_xxh3_digest_is_segments_of_the_stream() -> None:
    """``RegionTable.digest`` against an independent XXH3-64 (the ``xxhash`` package): 256 KiB segments of the moves'
    concatenated bytes, then the stream's length and the segment digests, little-endian."""
    import struct

    xxhash = pytest.importorskip("xxhash")
    r = Rank("tiny-kimi-linear", "prefill", "pull", 1, 0, 2048)
    (a, na), (b, nb) = [(int(t.data_ptr()), t.numel() * t.element_size()) for t in r.tensors[:2]]
    assert na > 3_000_000 and nb > 1_000_000
    moves = np.array([[a + 100, 0, 700_000], [b, 0, nb // 2], [a + 900_000, 0, 1_300_001]], np.uint64)
    stream = b"".join(ctypes.string_at(int(m[0]), int(m[2])) for m in moves)
    segs = [xxhash.xxh3_64_intdigest(stream[i : i + (1 << 18)]) for i in range(0, len(stream), 1 << 18)]
    want = xxhash.xxh3_64_intdigest(struct.pack(f"<{1 + len(segs)}Q", len(stream), *segs))
    assert r.table.digest(moves, "local") == want
