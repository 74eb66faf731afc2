"""Staged requests (streaming push): a request checked whole, posted stage by stage as ``release`` allows, seen
done by its peer only once every stage landed, failed whole by any failure; and ``release`` from a second
thread while the owner polls (the endpoint's lock serialises every NIXL call)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
from _peers import BLOCKS, expected_after, pattern, payload_for, pump, registration, tables, tables_from_payload

from hybrid_kv.transport import Endpoint, RequestState, TransferError

Pair = tuple[Endpoint, Endpoint, np.ndarray, np.ndarray]


@pytest.fixture
def push_pair() -> Iterator[Pair]:
    """P writes into D: D serves its payload, P connects to it."""
    src, dst = pattern(3), pattern(4)
    d = Endpoint("D", registration(dst.ctypes.data), tables(dst.ctypes.data), metadata_provider={0: payload_for(dst)})
    p = Endpoint("P", registration(src.ctypes.data), tables(src.ctypes.data))
    with p, d:
        p.connect(0, d.address, tables_from_payload, timeout_s=2.0)
        yield p, d, src, dst
    assert p.handle_counts()["xfer"] == 0 and p.handle_counts()["zombie_xfer"] == 0


def ids(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int32)


def test_stages_are_posted_as_released_and_the_peer_sees_the_whole(push_pair: Pair) -> None:
    p, d, src, dst = push_pair
    before = dst.copy()
    waiting = d.expect("req", 5.0, writers={"P"})
    transfers = [
        (0, "whole", "whole", ids(0, 1), ids(4, 5)),
        (0, "whole", "whole", ids(2), ids(6)),
        (0, "halves", "halves", ids(3), ids(BLOCKS + 7)),
    ]
    h = p.post("req", transfers, "WRITE", 5.0, stages=[0, 2, 1])
    assert h.released == 0 and h.state is RequestState.POSTED
    for _ in range(20):
        p.poll(), d.poll()
    assert np.array_equal(dst, before), "nothing is posted before its stage is released"

    assert p.release("req", 1)  # stage 0: one transfer
    pump(p, lambda e: h._done[0], 3.0, others=[d])
    stage0 = expected_after(before, src, "whole", [4, 5], [0, 1])
    assert np.array_equal(dst, stage0)
    for _ in range(20):
        assert not d.poll().done, "the peer sees the request done only when every stage landed"
    assert waiting.state is RequestState.POSTED

    assert p.release("req", 3)  # stages 1 and 2
    ev = pump(d, lambda e: e.done, 3.0, others=[p])
    assert ev.done == ["req"]
    want = expected_after(stage0, src, "whole", [6], [2])
    want = expected_after(want, src, "halves", [BLOCKS + 7], [3])
    assert np.array_equal(dst, want)
    pump(p, lambda e: h.state is RequestState.DONE, 3.0)  # its done event may have been taken above
    assert h.stats.transfers == 3
    assert not p.release("req", 3), "a finished request is left alone"


def test_a_failing_stage_fails_the_whole_request_and_its_peer(push_pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    p, d, _, dst = push_pair
    before = dst.copy()
    waiting = d.expect("req", 5.0, writers={"P"})
    h = p.post(
        "req",
        [(0, "whole", "whole", ids(b), ids(4 + b)) for b in range(3)],
        "WRITE",
        5.0,
        stages=[0, 1, 2],
    )
    p.release("req", 1)
    pump(p, lambda e: h._done[0], 3.0, others=[d])
    real = p._agent.nixl.transfer
    monkeypatch.setattr(p._agent.nixl, "transfer", lambda xfer: "ERR")
    p.release("req", 2)  # stage 1 fails at posting
    monkeypatch.setattr(p._agent.nixl, "transfer", real)
    ev = pump(p, lambda e: e.failed, 3.0, others=[d])
    assert h.state is RequestState.FAILED and "posting transfer 1" in str(ev.failed[0]) and ev.failed[0].settled
    assert [t.local_ids.tolist() for t in ev.failed[0].failed] == [[1], [2]]
    assert not p.release("req", 3), "a failed request posts nothing more"
    pump(d, lambda e: waiting.state is RequestState.FAILED, 3.0, others=[p])  # its event may be taken above
    assert waiting.error is not None and "posting transfer 1 to peer 0 returned ERR" in str(waiting.error)
    assert waiting.error.settled, "its only writer said it failed: nothing of it can land any more"
    assert np.array_equal(dst[6 * 256 : 7 * 256], before[6 * 256 : 7 * 256]), "stage 2 was never written"


def test_a_writer_tells_its_peer_of_a_failure_only_once_nixl_released_its_transfer(
    push_pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fail-notice tells the decode that nothing of the writer's is in flight (it frees the blocks on it), so a
    writer whose transfer NIXL would not cancel says nothing until NIXL released it; then it reports the request
    ``settled`` and tells the peer."""
    from hybrid_kv.transport.agent import NIXL_ERRORS

    p, d, _, _ = push_pair
    waiting = d.expect("req", 30.0, writers={"P"})
    h = p.post("req", [(0, "whole", "whole", ids(0), ids(4))], "WRITE", 30.0, stages=[0])
    real_release = p._agent.nixl.release_xfer_handle
    monkeypatch.setattr(p._agent.nixl, "transfer", lambda xfer, *a, **k: "PROC")  # "in flight", never done
    monkeypatch.setattr(p._agent.nixl, "check_xfer_state", lambda xfer: "PROC")
    p.release("req", 1)

    def refuse(xfer: object) -> None:
        raise NIXL_ERRORS[0]("still in progress")

    monkeypatch.setattr(p._agent.nixl, "release_xfer_handle", refuse)
    assert p.cancel("req", "the engine aborted it")
    assert h.state is RequestState.FAILED and h.error is not None and not h.error.settled, "it may still land"
    for _ in range(30):
        assert not p.poll().settled
        d.poll()
    assert waiting.state is RequestState.POSTED and p.handle_counts()["zombie_xfer"] == 1, "no fail-notice yet"
    monkeypatch.setattr(p._agent.nixl, "release_xfer_handle", real_release)  # NIXL lets it go
    assert pump(p, lambda e: e.settled, 3.0).settled == ["req"]
    ev = pump(d, lambda e: e.failed, 3.0, others=[p])
    assert "the engine aborted it" in str(ev.failed[0]) and ev.failed[0].settled
    assert waiting.state is RequestState.FAILED


def test_stages_must_name_one_stage_per_transfer(push_pair: Pair) -> None:
    p, d, _, _ = push_pair
    with pytest.raises(TransferError, match="2 stages for 1 transfers"):
        p.post("r", [(0, "whole", "whole", ids(0), ids(0))], "WRITE", 1.0, stages=[0, 1])
    with pytest.raises(TransferError, match="one non-negative stage"):
        p.post("r", [(0, "whole", "whole", ids(0), ids(0))], "WRITE", 1.0, stages=[-1])
    assert not p.release("unknown", 1)
    h = p.post("whole", [(0, "whole", "whole", ids(0), ids(0))], "WRITE", 1.0)
    assert h.released is None and not p.release("whole", 1), "a request posted whole has no stages"
    pump(p, lambda e: e.done, 2.0, others=[d])


def test_release_from_a_poster_thread_while_the_owner_polls(push_pair: Pair) -> None:
    """Many staged requests released by a second thread while the main thread polls: every byte lands once."""
    p, d, src, dst = push_pair
    before = dst.copy()
    n, stages = 24, 4
    handles = []
    for i in range(n):
        blk = i % BLOCKS
        # every stage writes the same source block to the same destination: a stage posted twice or lost shows
        transfers = [(0, "whole", "whole", ids(blk), ids((blk + 3) % BLOCKS)) for _ in range(stages)]
        d.expect(f"r{i}", 10.0, writers={"P"})
        handles.append(p.post(f"r{i}", transfers, "WRITE", 10.0, stages=list(range(stages))))
    errors: list[BaseException] = []

    def poster() -> None:
        try:
            for k in range(1, stages + 1):
                for i in range(n):
                    p.release(f"r{i}", k)
        except BaseException as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=poster)
    t.start()
    done: set[str] = set()
    got = pump(d, lambda e: len(e.done) + len(e.failed) >= n, 10.0, others=[p])
    t.join(5.0)
    assert not errors and not got.failed, (errors, got.failed)
    done.update(got.done)
    assert done == {f"r{i}" for i in range(n)}
    pump(p, lambda e: all(h.state is RequestState.DONE for h in handles), 5.0)
    assert all(h.stats.transfers == stages for h in handles), "every stage posted exactly once"
    want = before.copy()
    for blk in range(BLOCKS):
        want = expected_after(want, src, "whole", [(blk + 3) % BLOCKS], [blk])
    assert np.array_equal(dst, want)
