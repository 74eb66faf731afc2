"""The multi-process acceptance matrix: a tiny Kimi-Linear (MLA + KDA layers sharing tensors) on torch CPU
tensors, real NIXL transfers between rank processes, every byte checked.

Transfers: the demo harness (``run_demo``) for P TP 1 -> D TP 2, 2 -> 1 and 2 -> 4, in pull and push mode,
plus different kernel block sizes on the two sides, all with ``verify=all`` (every request's end-to-end
digests compared, none differing; ``tests/test_pd_verify.py`` has the corruptions they catch) and once off.
Decode ranks compare every byte of their pools with the logical model (requested blocks: MLA replicated, SSM
state sharded; every other byte unchanged), prefill ranks check that not one of their bytes changed.

Faults, at the planner + transport level (``tests/pd_helpers.py``): a prefill killed mid-transfer, a peer
that never answers the handshake, a peer with incompatible metadata, block ids out of range. Each fails the
affected request only, within its deadline; every endpoint ends with no live handle. Every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl")
pytest.importorskip("zmq")
pytest.importorskip("torch")

from pd_helpers import ZERO, DecodeRank, PrefillProcess, pump  # noqa: E402

from hybrid_kv import HandshakeError, PlanError, handshake_findings, handshake_target_ranks  # noqa: E402
from hybrid_kv.demo.content import Request, Side  # noqa: E402
from hybrid_kv.demo.run import DemoConfig, DemoResult, make_requests, run_demo  # noqa: E402
from hybrid_kv.transport import RequestState, TransferError  # noqa: E402
from hybrid_kv.transport.channel_client import fetch_reply  # noqa: E402

TENSORS = 3  # the tiny Kimi-Linear pools KDA and MLA layers into 3 tensors


def demo(p_tp: int, d_tp: int, mode: str, **kw: Any) -> tuple[DemoResult, Side, Side]:
    cfg = DemoConfig(
        prefill_tp=p_tp, decode_tp=d_tp, mode=mode, requests=3, tokens=150, timeout_s=30.0, start_method="forkserver"
    )
    cfg = dataclasses.replace(cfg, **kw)
    prefill, decode = cfg.validate()
    return run_demo(cfg), prefill, decode


def assert_every_byte_verified(res: DemoResult, prefill: Side, decode: Side, tensors: int = TENSORS) -> None:
    assert res.problems == [] and res.verified, res.problems
    # verify=all (the demo's default): every decode rank compared the digests of every request, all equal
    assert res.digested_requests == (decode.tp * res.requests if res.verify == "all" else 0), res.verify
    assert res.bytes_moved > 0 and res.descriptors > 0
    assert res.bytes_verified == decode.tp * tensors * decode.num_blocks * decode.geometry.page_bytes
    assert res.prefill_bytes_verified == prefill.tp * tensors * prefill.num_blocks * prefill.geometry.page_bytes


# ---------------------------------------------------------------------------------------------- the matrix


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 4)])
def test_kimi_linear_tp_matrix(p_tp: int, d_tp: int, mode: str) -> None:
    res, prefill, decode = demo(p_tp, d_tp, mode)
    assert_every_byte_verified(res, prefill, decode)
    active, tp, remote_tp = ("decode", d_tp, p_tp) if mode == "pull" else ("prefill", p_tp, d_tp)
    assert res.peers == {f"{active}-{r}": handshake_target_ranks(r, tp, remote_tp) for r in range(tp)}


@pytest.mark.parametrize("verify", ["all", "off"])
def test_different_kernel_block_sizes_on_the_two_sides(verify: str) -> None:
    res, prefill, decode = demo(2, 1, "pull", prefill_block_size=8, decode_block_size=32, verify=verify)
    assert (prefill.geometry.kernel_block_size, decode.geometry.kernel_block_size) == (8, 32)
    assert prefill.geometry.logical_block_size != decode.geometry.logical_block_size
    assert_every_byte_verified(res, prefill, decode)


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "p_block", "d_block", "mode"),
    [
        (1, 1, 16, 32, "pull"),
        (2, 1, 16, 32, "pull"),
        (1, 2, 32, 16, "pull"),
        (1, 1, 32, 16, "push"),
        (1, 2, 16, 32, "push"),
    ],
)
def test_heads_major_pages_of_different_kernel_block_sizes(
    p_tp: int, d_tp: int, p_block: int, d_block: int, mode: str
) -> None:
    """A tiny Qwen3-Next (GQA with 2 KV heads in heads-major pages, beside GDN state in the same tensors) with
    different kernel blocks on the two sides, at equal TP (2 heads per rank) and under a head split both ways:
    pages cut per (head, common unit), over real NIXL, every byte verified (before: refused at the handshake,
    ``block_size_ratio``)."""
    res, prefill, decode = demo(
        p_tp, d_tp, mode, preset="tiny-qwen3-next", prefill_block_size=p_block, decode_block_size=d_block
    )
    assert (prefill.geometry.kernel_block_size, decode.geometry.kernel_block_size) == (p_block, d_block)
    assert max(len(prefill.heads(0)), len(decode.heads(0))) == 2
    assert_every_byte_verified(res, prefill, decode, tensors=2)
    # what NIXL posted after merging ids consecutive on both sides is never more than the ids handed to it
    assert res.descriptors <= res.descriptor_ids


@pytest.mark.parametrize(("where", "who"), [("hole", "decode rank 0"), ("prefill", "prefill rank 0")])
def test_verification_covers_untouched_bytes(where: str, who: str) -> None:
    """One flipped byte in a decode block no request names, or in prefill memory, fails the run."""
    res, prefill, decode = demo(1, 1, "push", requests=2, corrupt=True, corrupt_at=where)
    assert not res.verified
    (problem,) = res.problems
    first = make_requests(DemoConfig(**res.config), prefill, decode)[0]
    named = {b for g in first.decode_ids for b in g} if where == "hole" else set()
    block = max(named) + 1 if where == "hole" else first.prefill_ids[0][0]
    assert block not in named
    assert problem.startswith(f"{who}: 1 bytes differ in tensor 0; first at logical block {block},"), problem


@pytest.mark.parametrize(("mode", "p_tp", "d_tp"), [("pull", 2, 1), ("push", 1, 2)])
def test_verify_fails_only_the_request_whose_bytes_changed_after_landing(mode: str, p_tp: int, d_tp: int) -> None:
    """Decode rank 0 flips one byte of the first request's first block after it landed and before its digest
    (pull: the READ is done; push: the writers' notices arrived): that request alone fails with the mismatch
    named, every other request of every decode rank is verified and byte-exact."""
    res, prefill, decode = demo(p_tp, d_tp, mode, requests=3, corrupt=True, corrupt_at="landed")
    assert not res.verified and res.digested_requests == decode.tp * 3
    (mismatch,) = res.digest_mismatches
    assert re.fullmatch(
        r"decode rank 0: request 'req-0' failed: digest mismatch: \d+ bytes in \d+ moves of rank pair \(0, 0\)",
        mismatch,
    ), mismatch
    first = make_requests(DemoConfig(**res.config), prefill, decode)[0]
    block = first.decode_ids[0][0]
    assert res.problems == [mismatch, res.problems[1]], res.problems
    assert res.problems[1].startswith(f"decode rank 0: 1 bytes differ in tensor 0; first at logical block {block},")


def test_handshake_targets_come_from_the_planner() -> None:
    assert handshake_target_ranks(1, 2, 4) == [2, 3]
    assert handshake_target_ranks(3, 4, 2) == [1]
    with pytest.raises(PlanError, match="local TP 3 and remote TP 2"):
        handshake_target_ranks(0, 3, 2)
    with pytest.raises(PlanError, match="tp_rank must be a non-negative"):
        handshake_target_ranks(-1, 2, 2)


# ---------------------------------------------------------------------------------------------- faults


def batch(n: int) -> tuple[Side, Side, list[Request]]:
    cfg = DemoConfig(prefill_tp=1, decode_tp=1, requests=n, tokens=100)
    prefill, decode = cfg.validate()
    return prefill, decode, make_requests(cfg, prefill, decode)


@pytest.fixture
def decode() -> Iterator[DecodeRank]:
    _, side, _ = batch(5)
    d = DecodeRank("D", side.num_blocks, seed=3)
    try:
        yield d
    finally:
        d.ep.close()
    assert d.ep.handle_counts() == ZERO


def assert_memory(d: DecodeRank, want: list[np.ndarray], skip: tuple[Request, ...] = ()) -> None:
    """Decode memory equals ``want`` everywhere except the blocks of ``skip`` (requests whose bytes are unknown)."""
    keep = ~d.blocks_mask(list(skip))
    for i, (got, w) in enumerate(zip(d.rank.pools, want, strict=True)):
        bad = np.flatnonzero((got != w) & keep)
        assert bad.size == 0, f"tensor {i}: {bad.size} bytes differ, first at {bad[0]}"


def stop_clean(p: PrefillProcess) -> None:
    assert p.stop() == ZERO
    assert p.memory_unchanged


def test_prefill_killed_mid_transfer_fails_only_its_request(decode: DecodeRank) -> None:
    d = decode
    prefill, _, reqs = batch(5)
    with (
        PrefillProcess("PA", 11, reqs, prefill.num_blocks) as a,
        PrefillProcess("PB", 12, reqs, prefill.num_blocks) as b,
    ):
        d.connect("A", a.address, 5.0)
        d.connect("B", b.address, 5.0)
        before = d.rank.snapshot()
        d.pull("A", reqs[0], 5.0)  # also wires UCX up before the fault
        d.pull("B", reqs[1], 5.0)
        ev = pump(d.ep, lambda e: len(e.done) + len(e.failed) == 2, 5.0)
        assert sorted(ev.done) == [reqs[0].rid, reqs[1].rid], ev
        a.signal(signal.SIGSTOP)  # alive but never progresses: the READ stays in flight
        deadline = 2.0
        t0 = time.monotonic()
        h = d.pull("A", reqs[2], deadline)
        d.pull("B", reqs[3], deadline)
        ev = pump(d.ep, lambda e: e.done or e.failed, deadline)
        assert ev.done == [reqs[3].rid] and not ev.failed and h.state is RequestState.POSTED, ev
        a.kill()  # dies while its READ is in flight
        ev = pump(d.ep, lambda e: e.failed, deadline + 5.0)
        assert time.monotonic() - t0 < deadline + 5.0  # failed by its death or its deadline, not hung (a loaded
        # machine stalls a process for seconds)
        (err,) = ev.failed
        assert err.request_id == reqs[2].rid and reqs[2].rid in str(err)
        planned = d.transfers("A", reqs[2])
        assert [(t.local_ids.tolist(), t.remote_ids.tolist()) for t in err.failed] == [
            (t.local_ids.tolist(), t.remote_ids.tolist()) for t in planned
        ]
        assert d.ep.handle_counts()["xfer"] == 0 and d.ep.handle_counts()["zombie_xfer"] == 0
        d.pull("B", reqs[4], 5.0)  # the healthy prefill keeps serving
        assert pump(d.ep, lambda e: e.done or e.failed, 5.0).done == [reqs[4].rid]
        landed = [(reqs[0], 11), (reqs[1], 12), (reqs[3], 12), (reqs[4], 12)]
        assert_memory(d, d.expected(before, landed, prefill), skip=(reqs[2],))
        stop_clean(b)


def test_peer_that_never_answers_the_handshake(decode: DecodeRank) -> None:
    d = decode
    prefill, _, reqs = batch(2)
    with (
        PrefillProcess("PA", 11, reqs, prefill.num_blocks) as a,
        PrefillProcess("PB", 12, reqs, prefill.num_blocks) as b,
    ):
        d.connect("A", a.address, 5.0)
        b.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(HandshakeError, match=r"peer 'B' .* no reply (from \S+ )?within 0.5 s"):
            d.connect("B", b.address, 0.5)
        assert time.monotonic() - t0 < 30.0  # its own timeout, not a hang
        # a request waiting on such a handshake fails with it; the others go on
        before = d.rank.snapshot()
        t0 = time.monotonic()
        d.begin_connect("B", b.address, 1.0)
        d.pull("B", reqs[1], 120.0, plan=d.plans["A"])  # same geometry as A: A's plan gives the same ids
        d.pull("A", reqs[0], 120.0)
        ev = pump(d.ep, lambda e: len(e.done) + len(e.failed) == 2, 60.0)
        assert time.monotonic() - t0 < 60.0  # failed with its handshake (1 s), not at its deadline (120 s)
        assert ev.done == [reqs[0].rid]
        (err,) = ev.failed
        assert err.request_id == reqs[1].rid and re.search(r"handshake .* no reply (from \S+ )?within 1 s", str(err))
        assert d.ep.peer_state("B")[0] == "down"
        assert_memory(d, d.expected(before, [(reqs[0], 11)], prefill))
        b.signal(signal.SIGCONT)
        stop_clean(b)
        stop_clean(a)


def test_peer_with_incompatible_metadata(decode: DecodeRank) -> None:
    d = decode
    prefill, _, reqs = batch(2)
    with (
        PrefillProcess("PA", 11, reqs, prefill.num_blocks) as a,
        PrefillProcess("PC", 13, [], prefill.num_blocks, preset="tiny-deepseek-v3") as c,
    ):
        d.connect("A", a.address, 5.0)
        with pytest.raises(HandshakeError) as e:
            d.connect("C", c.address, 5.0)
        msg = str(e.value)
        assert "rejected: incompatible peer" in msg
        assert "region_count: local 3, remote 4" in msg  # an MLA-only model with 4 tensors, not Kimi's 3
        import zmq

        ctx = zmq.Context()
        try:
            payload = fetch_reply(ctx, c.address, 0, "probe", 5.0).payload
        finally:
            ctx.destroy(linger=0)
        findings = handshake_findings(d.rank.payload, payload)
        assert len(findings) >= 2
        for check, local, remote, _ in findings:  # every finding, with both values
            assert f"{check}: local {local}, remote {remote}" in msg
        assert [tuple(f) for f in e.value.findings] == [tuple(f) for f in findings]  # and as data
        # a request waiting on the rejected peer fails; the compatible peer's request completes
        before = d.rank.snapshot()
        d.begin_connect("C", c.address, 5.0)
        d.pull("C", reqs[1], 5.0, plan=d.plans["A"])
        d.pull("A", reqs[0], 5.0)
        ev = pump(d.ep, lambda e: len(e.done) + len(e.failed) == 2, 5.0)
        assert ev.done == [reqs[0].rid]
        (err,) = ev.failed
        assert err.request_id == reqs[1].rid and "region_count: local 3, remote 4" in str(err)
        assert_memory(d, d.expected(before, [(reqs[0], 11)], prefill))
        stop_clean(c)
        stop_clean(a)


def test_block_ids_out_of_range(decode: DecodeRank) -> None:
    d = decode
    prefill, _, reqs = batch(2)
    n_d, n_p = d.rank.side.num_blocks, prefill.num_blocks
    with PrefillProcess("PA", 11, reqs, n_p) as a:
        d.connect("A", a.address, 5.0)
        before = d.rank.snapshot()
        r = reqs[1]
        oob = "block id {} of group {} is out of range: the pool has {} logical blocks"
        cases = [  # (decode ids, prefill ids, the error): the id and the limit are named
            ([*r.decode_ids[:3], [n_d]], r.prefill_ids, "local " + oob.format(n_d, 3, n_d)),
            (r.decode_ids, [[0, n_p + 5], *r.prefill_ids[1:]], "remote " + oob.format(n_p + 5, 0, n_p)),
            ([[-1, 0], *r.decode_ids[1:]], r.prefill_ids, "local block id -1 of group 0 is out of range"),
        ]
        for local, remote, message in cases:
            with pytest.raises(PlanError, match=re.escape(message)):
                d.pull("A", dataclasses.replace(r, decode_ids=local, prefill_ids=remote), 5.0)
        # the transport's own guard: descriptor ids past the prepped tables, refused before posting
        (t,) = d.transfers("A", reqs[0])
        rows = int(d.local["whole"][:, 4].sum())
        with pytest.raises(TransferError, match=str(rows)) as e:
            d.ep.post("bad-descs", [t._replace(local_ids=np.array([rows], dtype=np.int32))], "READ", 5.0)
        assert e.value.request_id == "bad-descs"
        ev = d.ep.poll()
        assert not (ev.done or ev.failed) and d.ep.handle_counts()["xfer"] == 0  # nothing was posted
        d.pull("A", reqs[0], 5.0)
        assert pump(d.ep, lambda e: e.done or e.failed, 5.0).done == [reqs[0].rid]
        assert_memory(d, d.expected(before, [(reqs[0], 11)], prefill))
        stop_clean(a)
