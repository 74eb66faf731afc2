"""Verified transfers between real processes over NIXL: each corruption fails exactly its request.

A decode rank (this process) pulls three requests from a tiny Kimi-Linear prefill process with verification:
it asks the prefill for its digest of the request (the prefill rebuilds the decode's plan from the decode's
payload and digests the blocks it holds for the request), posts the READ once answered, and compares its own
digest of the bytes that landed. The middle request is corrupted; it alone fails, with
``digest mismatch: N bytes in M moves of rank pair (0, 0)``, and the prefill is told. The others complete
and their bytes are exact.

Corruptions: a byte flipped in the decode's destination after the READ landed; the prefill re-writing a
block between its digest and the READ (a stale or reused block); a third process (a NIXL agent holding the
secret) writing into a destination block while the request is in flight; a wrong remote id (the READ reads
another request's blocks). Each is also caught when the prefill's digest follows its confirmation (as the
connector and the demo run it): the READ lands first and its check waits for the digest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl")
pytest.importorskip("zmq")
pytest.importorskip("torch")

from pd_helpers import ZERO, DecodeRank, PrefillProcess, RogueWriter, pump  # noqa: E402

from hybrid_kv.claims import ClaimRound  # noqa: E402
from hybrid_kv.demo.content import Request  # noqa: E402
from hybrid_kv.demo.run import DemoConfig, make_requests  # noqa: E402
from hybrid_kv.verify import mismatch_reason  # noqa: E402


@pytest.fixture
def pair() -> Iterator[tuple[DecodeRank, PrefillProcess, list[Request]]]:
    cfg = DemoConfig(prefill_tp=1, decode_tp=1, requests=4, tokens=100)
    (
        prefill,
        decode,
    ) = cfg.validate()
    reqs = make_requests(cfg, prefill, decode)
    d = DecodeRank("D", decode.num_blocks, seed=3)
    try:
        with PrefillProcess("PA", 11, reqs, prefill.num_blocks) as a:
            d.connect("A", a.address, 5.0)
            yield d, a, reqs
            assert a.stop() == ZERO
    finally:
        d.ep.close()
    assert d.ep.handle_counts() == ZERO


def expected_reason(d: DecodeRank, req: Request, prefill_ids: list[list[int]] | None = None) -> str:
    """The mismatch reason the decode reports for ``req``: every byte and move of its one rank pair."""
    (t,) = d.transfers("A", req if prefill_ids is None else Request(**{**req.__dict__, "prefill_ids": prefill_ids}))
    moves = d.plans["A"].resolve(t.local_key, 0, t.local_ids, t.remote_ids)
    return mismatch_reason(0, 0, int(moves[:, 2].sum()), len(moves))


def flipper(d: DecodeRank, req: Request, offset: int, mask: int) -> Callable[[], None]:
    """Fault injection: flip ``mask`` in byte ``offset`` of ``req``'s first destination block (third tensor)."""
    at = req.decode_ids[0][0] * d.rank.side.geometry.page_bytes + offset

    def flip() -> None:
        d.rank.pools[2][at] ^= mask

    return flip


def run_three(
    d: DecodeRank,
    a: PrefillProcess,
    reqs: list[Request],
    corrupt: Callable[[], None] | None = None,
    prefill_ids: list[list[int]] | None = None,
) -> str:
    """Pull requests 0, 1 and 2 verified, request 1 corrupted; returns request 1's failure message."""
    before = d.rank.snapshot()
    d.pull_verified("A", reqs[0], 5.0)
    assert pump(d.ep, lambda e: e.done or e.failed, 5.0).done == [reqs[0].rid]
    d.pull_verified("A", reqs[1], 5.0, prefill_ids=prefill_ids, before_check=corrupt)
    ev = pump(d.ep, lambda e: e.done or e.failed, 5.0)
    assert not ev.done, ev
    (err,) = ev.failed
    assert err.request_id == reqs[1].rid
    d.pull_verified("A", reqs[2], 5.0)
    assert pump(d.ep, lambda e: e.done or e.failed, 5.0).done == [reqs[2].rid]
    # the prefill was told request 1 failed, and only it
    msg = a.expect("remote_failed", 5.0)
    assert msg[2] == reqs[1].rid and "digest mismatch" in msg[3]
    # the other requests' bytes are exact
    prefill = DemoConfig(prefill_tp=1, decode_tp=1, requests=4, tokens=100).validate()[0]
    want = d.expected(before, [(reqs[0], 11), (reqs[2], 11)], prefill)
    keep = ~d.blocks_mask([reqs[1]])
    for got, w in zip(d.rank.pools, want, strict=True):
        assert np.array_equal(got[keep], w[keep])
    return str(err)


def test_clean_verified_pulls_report_nothing(pair: tuple[DecodeRank, PrefillProcess, list[Request]]) -> None:
    d, a, reqs = pair
    prefill = DemoConfig(prefill_tp=1, decode_tp=1, requests=4, tokens=100).validate()[0]
    before = d.rank.snapshot()
    for r in reqs:
        d.pull_verified("A", r, 5.0)
        ev = pump(d.ep, lambda e: e.done or e.failed, 5.0)
        assert ev.done == [r.rid] and not ev.failed, ev
    want = d.expected(before, [(r, 11) for r in reqs], prefill)
    assert all(np.array_equal(g, w) for g, w in zip(d.rank.pools, want, strict=True))


def test_a_byte_flipped_in_the_destination_after_the_read(
    pair: tuple[DecodeRank, PrefillProcess, list[Request]],
) -> None:
    d, a, reqs = pair
    err = run_three(d, a, reqs, flipper(d, reqs[1], 17, 0x01))
    assert err.endswith(expected_reason(d, reqs[1])), err


def test_the_prefill_rewriting_a_block_between_its_digest_and_the_read(
    pair: tuple[DecodeRank, PrefillProcess, list[Request]],
) -> None:
    d, a, reqs = pair
    a.cmds.put(("rewrite", reqs[1].rid))
    err = run_three(d, a, reqs)
    assert err.endswith(expected_reason(d, reqs[1])), err


def test_a_third_process_writing_into_a_destination_block_in_flight(
    pair: tuple[DecodeRank, PrefillProcess, list[Request]],
) -> None:
    d, a, reqs = pair
    page = d.rank.side.geometry.page_bytes
    block = reqs[1].decode_ids[0][-1]
    target = int(d.rank.table.base_addrs[1]) + block * page + 64
    with RogueWriter(d.ep.address, target, 32) as rogue:
        rogue.wait_ready(d.ep)
        # the READ of request 1 has landed but the request is still in flight: the third process writes now
        err = run_three(d, a, reqs, lambda: rogue.write(d.ep))
    assert err.endswith(expected_reason(d, reqs[1])), err


def test_a_wrong_remote_id(pair: tuple[DecodeRank, PrefillProcess, list[Request]]) -> None:
    d, a, reqs = pair
    wrong = [list(g) for g in reqs[1].prefill_ids]
    wrong[0][0] = reqs[3].prefill_ids[0][0]  # one block of another request
    err = run_three(d, a, reqs, prefill_ids=wrong)
    assert err.endswith(expected_reason(d, reqs[1], wrong)), err


# ---------------------------------------------------------------------------------------------- the digest follows


def pump_claims(d: DecodeRank, claims: ClaimRound, until: Callable[[Any], bool], timeout_s: float = 10.0) -> Any:
    """``pump`` feeding each poll's control messages to ``claims`` (the prefill's digest answers)."""
    fed = [0]

    def fed_until(ev: Any) -> bool:
        claims.feed(ev.control[fed[0] :])
        fed[0] = len(ev.control)
        return until(ev)

    return pump(d.ep, fed_until, timeout_s)


def test_the_read_runs_while_the_prefill_digest_is_on_its_way(
    pair: tuple[DecodeRank, PrefillProcess, list[Request]],
) -> None:
    """The claim is confirmed before the prefill digests (its digest answer is held here): the READ lands and
    the check answers NOT_YET, poll after poll, until the digest comes; then the request completes byte-exact."""
    d, a, reqs = pair
    before = d.rank.snapshot()
    a.cmds.put(("hold", reqs[0].rid))
    handle, claims, verdicts = d.pull_overlapped("A", reqs[0], 20.0)
    assert a.expect("holding", 10.0)[1] == reqs[0].rid
    assert claims.digests[reqs[0].rid] == {}  # confirmed, digest still owed
    pump_claims(d, claims, lambda e: verdicts.count("not yet") >= 3)  # the bytes landed; the check waits
    assert handle.checking and not handle.finished
    a.cmds.put(("release", reqs[0].rid))
    ev = pump_claims(d, claims, lambda e: e.done or e.failed)
    assert ev.done == [reqs[0].rid] and not ev.failed, ev
    assert verdicts[-1] == "None" and set(verdicts[:-1]) == {"not yet"}
    prefill = DemoConfig(prefill_tp=1, decode_tp=1, requests=4, tokens=100).validate()[0]
    want = d.expected(before, [(reqs[0], 11)], prefill)
    for got, w in zip(d.rank.pools, want, strict=True):
        assert np.array_equal(got, w)


def test_a_flipped_byte_is_caught_when_the_digest_comes_after_the_read(
    pair: tuple[DecodeRank, PrefillProcess, list[Request]],
) -> None:
    d, a, reqs = pair
    a.cmds.put(("hold", reqs[1].rid))
    _, claims, verdicts = d.pull_overlapped("A", reqs[1], 20.0, before_check=flipper(d, reqs[1], 5, 0x40))
    pump_claims(d, claims, lambda e: "not yet" in verdicts)
    a.cmds.put(("release", reqs[1].rid))
    ev = pump_claims(d, claims, lambda e: e.done or e.failed)
    (err,) = ev.failed
    assert str(err).endswith(expected_reason(d, reqs[1])), err
    msg = a.expect("remote_failed", 5.0)
    assert msg[2] == reqs[1].rid and "digest mismatch" in msg[3]


def test_a_digest_that_never_comes_fails_the_request_at_its_deadline(
    pair: tuple[DecodeRank, PrefillProcess, list[Request]],
) -> None:
    d, a, reqs = pair
    a.cmds.put(("hold", reqs[2].rid))
    _, claims, verdicts = d.pull_overlapped("A", reqs[2], 1.5)
    ev = pump_claims(d, claims, lambda e: e.done or e.failed)
    (err,) = ev.failed
    assert "deadline exceeded waiting for its check" in str(err), err
    assert verdicts and set(verdicts) == {"not yet"}
    a.cmds.put(("release", reqs[2].rid))
