"""Real transfers between processes: pull, push, one decode with two prefills, and faults.

Every peer runs in its own spawned process with its own NIXL agent; bytes are checked one for one
(requested blocks equal the source, every other byte unchanged). Every wait is bounded.
"""

import json
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
from _peers import (
    BLOCKS,
    Peer,
    expected_after,
    pattern,
    payload_for,
    pump,
    registration,
    tables,
    tables_from_payload,
)

from hybrid_kv.transport import Endpoint, HandshakeError, RequestState

ZERO = {"xfer": 0, "zombie_xfer": 0, "local_dlists": 0, "remote_dlists": 0, "remote_agents": 0, "registrations": 0}


def ids(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int32)


@pytest.fixture
def decode() -> Iterator[tuple[Endpoint, np.ndarray]]:
    dst = pattern(100)
    with Endpoint(
        "D", registration(dst.ctypes.data), tables(dst.ctypes.data), metadata_provider=lambda r: payload_for(dst)
    ) as ep:
        yield ep, dst
    assert ep.handle_counts() == ZERO


def test_pull_read_from_a_prefill_process(decode: tuple[Endpoint, np.ndarray]) -> None:
    d, dst = decode
    with Peer("P0", seed=1) as p:
        d.connect(0, p.address, tables_from_payload, timeout_s=5.0)
        before = dst.copy()
        transfers = [
            (0, "whole", "whole", ids(0, 1, 2), ids(5, 6, 7)),  # contiguous on both sides: NIXL merges
            (0, "blocks3", "whole", ids(6, 3), ids(0, 4)),  # Nx3 local table against an Nx5 remote one
            (0, "halves", "halves", ids(4, 12), ids(9, 1)),  # stride != len, second-half ids
        ]
        d.post("pull-1", transfers, "READ", deadline_s=5.0)
        ev = pump(d, lambda e: e.done or e.failed, 5.0)
        assert ev.done == ["pull-1"], ev
        want = expected_after(before, p.data, "whole", [0, 1, 2], [5, 6, 7])
        want = expected_after(want, p.data, "whole", [6, 3], [0, 4])
        want = expected_after(want, p.data, "halves", [4, 12], [9, 1])
        assert np.array_equal(dst, want)
        assert p.expect("remote_done")[1:] == ("D", "pull-1")  # the passive side learns it may free the blocks
        assert p.stop() == ZERO


def test_push_write_into_decode(decode: tuple[Endpoint, np.ndarray]) -> None:
    d, dst = decode
    with Peer("P0", seed=2) as p:
        before = dst.copy()
        h = d.expect("push-1", deadline_s=5.0)
        ctrl = {"rid": "push-1", "address": d.address, "key": "whole", "src": [7, 0, 3], "dst": [1, 2, 6]}
        d.send_control(p.address, json.dumps(ctrl).encode(), timeout_s=5.0)
        ev = pump(d, lambda e: e.done or e.failed, 5.0)
        assert ev.done == ["push-1"] and h.state is RequestState.DONE, ev
        assert [(e.sender, e.request_id) for e in ev.remote_done] == [("P0", "push-1")]
        assert np.array_equal(dst, expected_after(before, p.data, "whole", [1, 2, 6], [7, 0, 3]))
        assert p.expect("done")[1] == "push-1"
        assert p.stop() == ZERO


def test_one_decode_two_prefills(decode: tuple[Endpoint, np.ndarray]) -> None:
    d, dst = decode
    with Peer("PA", seed=3) as a, Peer("PB", seed=4) as b:
        d.connect(0, a.address, tables_from_payload, timeout_s=5.0)
        d.connect(1, b.address, tables_from_payload, timeout_s=5.0)
        before = dst.copy()
        # one request reading first halves from rank 0 and second halves from rank 1 (a TP split)
        first, second = ids(2, 3), ids(BLOCKS + 2, BLOCKS + 3)
        d.post("tp", [(0, "halves", "halves", first, first), (1, "halves", "halves", second, second)], "READ", 5.0)
        d.post("only-b", [(1, "whole", "whole", ids(7), ids(0))], "READ", 5.0)
        ev = pump(d, lambda e: len(e.done) == 2 or e.failed, 5.0)
        assert sorted(ev.done) == ["only-b", "tp"] and not ev.failed
        want = expected_after(before, a.data, "halves", [2, 3], [2, 3])
        want = expected_after(want, b.data, "halves", [BLOCKS + 2, BLOCKS + 3], [BLOCKS + 2, BLOCKS + 3])
        want = expected_after(want, b.data, "whole", [7], [0])
        assert np.array_equal(dst, want)
        assert a.expect("remote_done")[2] == "tp"
        assert {b.expect("remote_done")[2], b.expect("remote_done")[2]} == {"tp", "only-b"}


def _warm_up(d: Endpoint, peers: list[int]) -> None:
    """One small READ per peer so that UCX wire-up is done before the fault is injected."""
    for k in peers:
        d.post(f"warm-{k}", [(k, "whole", "whole", ids(0), ids(0))], "READ", 5.0)
    ev = pump(d, lambda e: len(e.done) + len(e.failed) == len(peers), 5.0)
    assert not ev.failed, ev


def test_killed_peer_fails_only_its_requests(decode: tuple[Endpoint, np.ndarray]) -> None:
    d, dst = decode
    with Peer("PA", seed=5) as a, Peer("PB", seed=6) as b:
        d.connect(0, a.address, tables_from_payload, timeout_s=5.0)
        d.connect(1, b.address, tables_from_payload, timeout_s=5.0)
        _warm_up(d, [0, 1])
        a.kill()
        before = dst.copy()
        t0 = time.monotonic()
        d.post("to-dead", [(0, "whole", "whole", ids(4, 5), ids(1, 2))], "READ", deadline_s=120.0)
        d.post("to-live", [(1, "whole", "whole", ids(6), ids(3))], "READ", deadline_s=120.0)
        ev = pump(d, lambda e: len(e.done) + len(e.failed) == 2, 60.0)
        assert time.monotonic() - t0 < 60.0  # the dead peer failed it, not its 120 s deadline
        assert ev.done == ["to-live"]
        (err,) = ev.failed
        assert err.request_id == "to-dead" and err.failed[0].local_ids.tolist() == [4, 5]
        assert err.failed[0].remote_ids.tolist() == [1, 2]
        assert np.array_equal(dst, expected_after(before, b.data, "whole", [6], [3]))  # nothing else touched
        assert d.handle_counts()["xfer"] == 0 and d.handle_counts()["zombie_xfer"] == 0
        # the live peer keeps working after the failure
        d.post("again", [(1, "whole", "whole", ids(0), ids(0))], "READ", deadline_s=3.0)
        assert pump(d, lambda e: e.done or e.failed, 5.0).done == ["again"]


def test_hung_then_killed_peer_mid_transfer(decode: tuple[Endpoint, np.ndarray]) -> None:
    d, dst = decode
    with Peer("PA", seed=7) as a, Peer("PB", seed=8) as b:
        d.connect(0, a.address, tables_from_payload, timeout_s=5.0)
        d.connect(1, b.address, tables_from_payload, timeout_s=5.0)
        _warm_up(d, [0, 1])
        a.signal(signal.SIGSTOP)  # alive but never progresses: its READ stays in flight
        h = d.post("stuck", [(0, "whole", "whole", ids(2), ids(2))], "READ", deadline_s=120.0)
        d.post("fine", [(1, "whole", "whole", ids(3), ids(3))], "READ", deadline_s=120.0)
        ev = pump(d, lambda e: e.done, 30.0)
        assert ev.done == ["fine"] and h.state is RequestState.POSTED
        a.kill()  # dies while the READ is in flight
        ev = pump(d, lambda e: e.failed, 30.0)
        assert ev.failed[0].request_id == "stuck"
        assert d.handle_counts()["xfer"] == 0


def test_deadline_on_hung_peer_notifies_it(decode: tuple[Endpoint, np.ndarray]) -> None:
    d, _ = decode
    with Peer("PA", seed=9) as a:
        d.connect(0, a.address, tables_from_payload, timeout_s=5.0)
        _warm_up(d, [0])
        a.signal(signal.SIGSTOP)
        d.post("slow", [(0, "whole", "whole", ids(1), ids(1))], "READ", deadline_s=0.5)
        ev = pump(d, lambda e: e.failed, 2.0)
        assert "deadline exceeded with 0 of 1 transfers done" in str(ev.failed[0])
        a.signal(signal.SIGCONT)
        msg = a.expect("remote_failed", 5.0)
        assert msg[1:3] == ("D", "slow") and "deadline exceeded" in msg[3]
        assert a.stop() == ZERO


def test_stopped_peer_never_answers_handshake(decode: tuple[Endpoint, np.ndarray]) -> None:
    d, _ = decode
    with Peer("PA", seed=10) as a:
        a.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(HandshakeError, match="no reply"):
            d.connect(0, a.address, tables_from_payload, timeout_s=0.5)
        assert time.monotonic() - t0 < 30.0  # its own timeout, not a hang
        a.signal(signal.SIGCONT)
