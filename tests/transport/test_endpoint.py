"""Endpoint behaviour with two real NIXL agents in one process (fast): checks before posting,
handshake failures, queued requests, passive deadlines and handle accounting."""

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from _peers import BLOCK, BLOCKS, expected_after, pattern, payload_for, pump, registration, tables, tables_from_payload

from hybrid_kv.transport import Endpoint, HandshakeError, RequestState, Transfer, TransferError
from hybrid_kv.transport.channel_server import SideChannelServer

ZERO = {"xfer": 0, "zombie_xfer": 0, "local_dlists": 0, "remote_dlists": 0, "remote_agents": 0, "registrations": 0}


@pytest.fixture
def pair() -> Iterator[tuple[Endpoint, Endpoint, np.ndarray, np.ndarray]]:
    src, dst = pattern(1), pattern(2)

    def provider(rank: int) -> bytes:
        if rank != 0:
            raise KeyError(f"no rank {rank} here")
        return payload_for(src)

    p = Endpoint("P", registration(src.ctypes.data), tables(src.ctypes.data), metadata_provider=provider)
    d = Endpoint("D", registration(dst.ctypes.data), tables(dst.ctypes.data))
    with p, d:
        yield p, d, src, dst
    assert p.handle_counts() == ZERO and d.handle_counts() == ZERO


def ids(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int32)


def test_loopback_read_all_table_forms(pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray]) -> None:
    p, d, src, dst = pair
    d.connect(0, p.address, tables_from_payload, timeout_s=2.0)
    before = dst.copy()
    d.post(
        "r",
        [(0, "whole", "blocks3", ids(0, 5), ids(7, 1)), (0, "halves", "halves", ids(9, 2), ids(3, 12))],
        "READ",
        2.0,
    )
    ev = pump(d, lambda e: e.done or e.failed, 3.0, others=[p])
    assert ev.done == ["r"] and not ev.failed
    want = expected_after(before, src, "whole", [0, 5], [7, 1])
    want = expected_after(want, src, "halves", [9, 2], [3, 12])
    assert np.array_equal(dst, want)
    assert d.handle_counts()["xfer"] == 0


def test_bad_ids_rejected_before_posting(pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray]) -> None:
    p, d, _, _ = pair
    d.connect(0, p.address, tables_from_payload, timeout_s=2.0)
    with pytest.raises(
        TransferError, match=f"local descriptor id {BLOCKS} out of range for table 'whole' of {BLOCKS} descriptors"
    ):
        d.post("r", [(0, "whole", "whole", ids(0, BLOCKS), ids(0, 1))], "READ", 1.0)
    with pytest.raises(TransferError, match=f"remote descriptor id 99 out of range for table 'halves' of {2 * BLOCKS}"):
        d.post("r", [(0, "halves", "halves", ids(0), ids(99))], "READ", 1.0)
    with pytest.raises(TransferError, match="2 local ids but 1 remote ids"):
        d.post("r", [(0, "whole", "whole", ids(0, 1), ids(0))], "READ", 1.0)
    with pytest.raises(TransferError, match="unknown remote table 'nope'"):
        d.post("r3", [(0, "whole", "nope", ids(0), ids(0))], "READ", 1.0)
    with pytest.raises(TransferError, match="unknown local table"):
        d.post("r3", [(0, "nope", "whole", ids(0), ids(0))], "READ", 1.0)
    with pytest.raises(TransferError, match="peer 7 is not connected"):
        d.post("r3", [(7, "whole", "whole", ids(0), ids(0))], "READ", 1.0)
    with pytest.raises(TransferError, match="op must be"):
        d.post("r3", [(0, "whole", "whole", ids(0), ids(0))], "read", 1.0)  # type: ignore[arg-type]
    assert d.handle_counts()["xfer"] == 0
    d.post("r", [(0, "whole", "whole", ids(0), ids(0))], "READ", 1.0)
    with pytest.raises(TransferError, match="already in flight"):
        d.post("r", [(0, "whole", "whole", ids(0), ids(0))], "READ", 1.0)
    pump(d, lambda e: e.done, 2.0, others=[p])
    assert d.handle_counts()["xfer"] == 0


def test_length_mismatch_message(pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray]) -> None:
    p, d, _, _ = pair
    d.connect(0, p.address, tables_from_payload, timeout_s=2.0)
    with pytest.raises(TransferError, match=r"pair 0: local 'whole'\[0\] is 256 B, remote 'halves'\[0\] is 128 B"):
        d.post("r", [(0, "whole", "halves", ids(0), ids(0))], "READ", 1.0)


def test_validate_rejection_is_a_clear_handshake_error(pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray]) -> None:
    p, d, _, _ = pair

    def validate(payload: bytes) -> None:
        raise ValueError("block_len 256 != remote 128 * ratio 1")

    with pytest.raises(HandshakeError, match=r"rejected: block_len 256 != remote 128 \* ratio 1") as e:
        d.connect(0, p.address, tables_from_payload, validate=validate, timeout_s=2.0)
    assert e.value.findings == []  # a plain ValueError carries no findings
    assert d.peer_state(0)[0] == "down"
    with pytest.raises(TransferError, match="peer 0 is down: .*rejected"):
        d.post("r", [(0, "whole", "whole", ids(0), ids(0))], "READ", 1.0)
    assert d.handle_counts()["remote_agents"] == 0


def test_remote_error_and_bad_tables_fail_the_handshake(
    pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray],
) -> None:
    p, d, src, _ = pair
    with pytest.raises(HandshakeError, match="answered with an error: KeyError: 'no rank 3 here'"):
        d.connect(0, p.address, tables_from_payload, rank=3, timeout_s=2.0)
    outside = {"whole": np.array([[src.ctypes.data + 16 * BLOCK, BLOCK, 0, BLOCK, 2]], dtype=np.uint64)}
    with pytest.raises(HandshakeError, match="nixlNotFoundError"):
        d.connect(1, p.address, lambda pl: outside, timeout_s=2.0)
    with pytest.raises(HandshakeError, match="RuntimeError: planner said no"):
        d.connect(2, p.address, _raise_runtime, timeout_s=2.0)
    assert d.handle_counts()["remote_agents"] == 0 and d.handle_counts()["remote_dlists"] == 0


def _raise_runtime(payload: bytes) -> dict[str, np.ndarray]:
    raise RuntimeError("planner said no")


def test_a_fetched_reply_is_connected_from_without_fetching_again() -> None:
    """``connect(..., reply=...)``: validate, tables and the loaded agent all come from the one reply the caller
    fetched (and planned from); the peer is not asked again, so a peer that would now serve something else
    (here: refuse) does not change what is connected."""
    from hybrid_kv.transport.channel_client import fetch_reply

    src, dst = pattern(1), pattern(2)
    served: list[int] = []

    def provider(rank: int) -> bytes:
        served.append(rank)
        if len(served) > 1:
            raise RuntimeError("asked twice")
        return payload_for(src)

    p = Endpoint("P", registration(src.ctypes.data), tables(src.ctypes.data), metadata_provider=provider)
    d = Endpoint("D", registration(dst.ctypes.data), tables(dst.ctypes.data))
    with p, d:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            reply = fetch_reply(ctx, p.address, 0, "D", 2.0)
        finally:
            ctx.destroy(linger=0)
        assert reply.name == "P" and reply.payload == payload_for(src)
        seen: list[bytes] = []
        got = d.connect(0, p.address, tables_from_payload, validate=seen.append, timeout_s=2.0, reply=reply)
        assert got == seen[0] == reply.payload and served == [0]
        before = dst.copy()
        d.post("r", [(0, "whole", "blocks3", ids(4, 6), ids(2, 3))], "READ", 2.0)
        ev = pump(d, lambda e: e.done or e.failed, 3.0, others=[p])
        assert ev.done == ["r"] and not ev.failed
        assert np.array_equal(dst, expected_after(before, src, "whole", [4, 6], [2, 3]))
        with pytest.raises(HandshakeError, match="asked twice"):  # a fresh connect does ask again
            d.connect(1, p.address, tables_from_payload, timeout_s=2.0)
    assert p.handle_counts() == ZERO and d.handle_counts() == ZERO


def test_handshake_timeout_fails_waiting_requests(pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray]) -> None:
    import os

    from hybrid_kv.transport import curve

    _, d, _, _ = pair
    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)  # a CURVE server of the deployment (admitting anyone) that never answers
    mute.setsockopt(zmq.CURVE_SERVER, 1)
    mute.setsockopt(zmq.CURVE_SECRETKEY, curve.derive_keys(os.environ["HYBRID_KV_SECRET"].encode()).server_secret)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        d.begin_connect(0, f"tcp://127.0.0.1:{port}", tables_from_payload, timeout_s=0.4)
        h = d.post("queued", [(0, "whole", "whole", ids(0), ids(0))], "READ", 5.0)
        assert h.state is RequestState.QUEUED
        ev = pump(d, lambda e: e.failed, 2.0)
        assert h.state is RequestState.FAILED and ev.failed[0].request_id == "queued"
        assert re.search(r"no reply (from \S+ )?within 0.4 s", str(ev.failed[0]))
        assert ev.failed[0].failed[0].local_ids.tolist() == [0]
        with pytest.raises(HandshakeError, match="no reply"):
            d.connect(1, f"tcp://127.0.0.1:{port}", tables_from_payload, timeout_s=0.3)
    finally:
        mute.close(linger=0)
        ctx.destroy(linger=0)


def test_request_queued_behind_handshake_runs_after_it(pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray]) -> None:
    p, d, src, dst = pair
    before = dst.copy()
    d.begin_connect(0, p.address, tables_from_payload, timeout_s=2.0)
    d.post("ok", [(0, "whole", "whole", ids(3), ids(4))], "READ", 2.0)
    d.post("bad", [(0, "whole", "whole", ids(3), ids(BLOCKS + 5))], "READ", 2.0)  # checked once tables are known
    ev = pump(d, lambda e: len(e.done) + len(e.failed) == 2, 3.0, others=[p])
    assert ev.done == ["ok"]
    assert f"remote descriptor id {BLOCKS + 5} out of range for table 'whole' of {BLOCKS}" in str(ev.failed[0])
    assert np.array_equal(dst, expected_after(before, src, "whole", [3], [4]))


def test_expect_deadline_and_remote_failure(pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray]) -> None:
    p, d, _, _ = pair
    h = d.expect("never", deadline_s=0.2)
    ev = pump(d, lambda e: e.failed, 2.0)
    assert h.state is RequestState.FAILED and "0 of 1 senders" in str(ev.failed[0])


@pytest.mark.parametrize("how", ["handshake_rejected", "disconnected", "reconnected"])
def test_partial_done_notices_of_a_lost_peer_are_dropped(
    pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Done-notices that will never be completed (their sender went down or was dropped) are forgotten."""
    from hybrid_kv.transport import notifications
    from hybrid_kv.transport.agent import DISCONNECT

    p, d, _, _ = pair
    p.connect(0, d.address, lambda payload: {}, timeout_s=2.0)  # so that P's agent can notify D
    if how != "handshake_rejected":
        d.connect(0, p.address, tables_from_payload, timeout_s=2.0)
    p._agent.nixl.send_notif("D", notifications.done_message("push-1", 0, 2))  # 1 of 2 transfers landed
    pump(d, lambda e: bool(d._inbox.partial()), 2.0, others=[p])
    assert d._inbox.partial() == {("P", "push-1")}

    if how == "handshake_rejected":  # P's agent is loaded, then its tables are refused
        with pytest.raises(HandshakeError, match="planner said no"):
            d.connect(0, p.address, _raise_runtime, timeout_s=2.0)
    elif how == "disconnected":  # NIXL reports P gone: marked down, its agent stays loaded
        monkeypatch.setattr(d._agent.nixl, "transfer", lambda xfer: _raise(DISCONNECT[0]("peer gone")))
        d.post("r", [(0, "whole", "whole", ids(0), ids(0))], "READ", 1.0)
        assert d.peer_state(0)[0] == "down" and d.remote_agent(0) == "P"
    else:  # a new connection under the same key replaces (drops) the old one
        d.begin_connect(0, p.address, tables_from_payload, timeout_s=2.0)
    assert d._inbox.partial() == set()

    # notices that arrive afterwards are handled as before
    for i in range(2):
        p._agent.nixl.send_notif("D", notifications.done_message("push-2", i, 2))
    ev = pump(d, lambda e: e.remote_done, 2.0, others=[p])
    assert [(e.sender, e.request_id) for e in ev.remote_done] == [("P", "push-2")] and not d._inbox.partial()


def test_partial_done_notices_of_an_unconnected_sender_are_given_up(
    pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sender that is not D's peer (it only notifies D) and never completes a request is reported, not kept."""
    import hybrid_kv.transport.inbox as inbox_mod
    from hybrid_kv.transport import notifications

    monkeypatch.setattr(inbox_mod, "PARTIAL_TTL_S", 0.3)
    p, d, _, _ = pair
    p.connect(0, d.address, lambda payload: {}, timeout_s=2.0)  # P can notify D; D never connects to P
    h = d.expect("push-9", deadline_s=30.0)
    p._agent.nixl.send_notif("D", notifications.done_message("push-9", 0, 3))  # 1 of 3 transfers landed
    pump(d, lambda e: bool(d._inbox.partial()), 2.0, others=[p])
    ev = pump(d, lambda e: e.remote_failed, 3.0, others=[p])
    (gone,) = ev.remote_failed
    assert (gone.sender, gone.request_id) == ("P", "push-9") and "1 done-notice(s) from 'P'" in gone.reason
    assert not d._inbox.partial() and h.state is RequestState.FAILED  # the awaiting request fails now


def _raise(exc: BaseException) -> None:
    raise exc


def test_control_messages_reach_poll(pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray]) -> None:
    p, d, _, _ = pair
    d.send_control(p.address, b"register r1 blocks 1,2")
    ev = pump(p, lambda e: e.control, 2.0)
    assert ev.control[0].sender == "D" and ev.control[0].payload == b"register r1 blocks 1,2"
    with pytest.raises(TransferError, match="control message .* failed"):
        d.send_control("tcp://127.0.0.1:1", b"x", timeout_s=0.2)


class SlowFirstAck:
    """A side-channel owner whose first control message holds the server past the sender's first attempt, so
    that attempt is never acknowledged in time (a lost ack, as a starved peer causes)."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.seen: list[bytes] = []

    def meta(self, rank: int) -> tuple[bytes, bytes]:
        raise KeyError(rank)

    def on_control(self, sender: str, payload: bytes) -> None:
        self.seen.append(payload)
        if len(self.seen) == 1:
            time.sleep(self.hold_s)


@pytest.mark.parametrize("attempts", [1, 3])
def test_unacknowledged_control_messages_are_sent_again_within_the_timeout(
    pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray], attempts: int
) -> None:
    _, d, _, _ = pair
    owner = SlowFirstAck(hold_s=0.5)
    server = SideChannelServer("tcp://127.0.0.1:0", owner.meta, owner.on_control, name="Q", key=d._key)
    try:
        if attempts == 1:  # one attempt of the whole 1.0 s would wait out the hold: 0.3 s does not
            with pytest.raises(TransferError, match=r"no acknowledgement within 0.3 s"):
                d.send_control(server.address, b"release r1", timeout_s=0.3, expected_name="Q")
        else:  # attempts of 1/7, 2/7 and 4/7 s: the first two end inside the hold, the third is acknowledged
            d.send_control(server.address, b"release r1", timeout_s=1.0, expected_name="Q", attempts=attempts)
            assert owner.seen[-1] == b"release r1" and len(owner.seen) >= 2  # the receiver saw it again
    finally:
        server.close()
    with pytest.raises(ValueError, match="attempts must be 1 to 5, got 0"):
        d.send_control(server.address, b"x", attempts=0)


def test_close_is_idempotent_and_blocks_further_use() -> None:
    buf = pattern(3)
    ep = Endpoint("solo", registration(buf.ctypes.data), tables(buf.ctypes.data), listen=None)
    ep.close()
    ep.close()
    assert ep.handle_counts() == ZERO
    with pytest.raises(TransferError, match="closed"):
        ep.poll()


def test_expanded_nx3_fallback_moves_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where NIXL lacks the Nx5 form, strided tables are expanded to Nx3 with numpy."""
    import hybrid_kv.transport.agent as agent_mod

    monkeypatch.setattr(agent_mod, "_strided_ok", False)
    src, dst = pattern(11), pattern(12)
    before = dst.copy()
    with (
        Endpoint(
            "P3", registration(src.ctypes.data), tables(src.ctypes.data), metadata_provider=lambda r: payload_for(src)
        ) as p,
        Endpoint("D3", registration(dst.ctypes.data), tables(dst.ctypes.data)) as d,
    ):
        d.connect(0, p.address, tables_from_payload, timeout_s=2.0)
        d.post("r", [(0, "halves", "halves", ids(BLOCKS + 1, 0), ids(3, BLOCKS + 7))], "READ", 2.0)
        assert pump(d, lambda e: e.done or e.failed, 3.0, others=[p]).done == ["r"]
    assert np.array_equal(dst, expected_after(before, src, "halves", [BLOCKS + 1, 0], [3, BLOCKS + 7]))


def test_large_expansions_are_logged_once_with_the_advice(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without the Nx5 form a table of a million descriptors is expanded; the log says so, once, and why."""
    import hybrid_kv.transport.agent as agent_mod

    buf = np.zeros(1 << 20, dtype=np.uint8)
    big = {"big": np.array([[buf.ctypes.data, 1, 0, 1, 1 << 20]], dtype=np.uint64)}
    reg = np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64)
    with Endpoint("S0", reg, big, listen=None) as ep:
        assert ep.strided_rows_supported  # nixl >= 1.5 here: nothing expanded, nothing logged
    assert "expanded" not in caplog.text
    monkeypatch.setattr(agent_mod, "_strided_ok", False)
    monkeypatch.setattr(agent_mod, "_warned_expansion", False)
    for name in ("S1", "S2"):
        with Endpoint(name, reg, big, listen=None) as ep:
            assert not ep.strided_rows_supported
    warnings = [r for r in caplog.records if r.name == "hybrid_kv.transport" and "expanded" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    msg = warnings[0].getMessage()
    assert "'big' was expanded from 1 rows to 1048576 descriptors (24 MiB)" in msg and "coalesce=False" in msg


def test_transport_errors_join_the_package_hierarchy() -> None:
    import hybrid_kv.errors
    from hybrid_kv.transport import HandshakeError as TransportHandshakeError
    from hybrid_kv.transport import TransferError as TransportTransferError

    assert TransportTransferError is hybrid_kv.errors.TransferError
    assert issubclass(TransportTransferError, hybrid_kv.HybridKvError)
    assert TransportHandshakeError is hybrid_kv.HandshakeError


def test_nixl_telemetry_counts_merged_descriptors_and_bytes(
    pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray],
) -> None:
    p, d, src, dst = pair
    d.connect(0, p.address, tables_from_payload, timeout_s=2.0)
    # 4 ids consecutive on both sides of the dense "whole" row (NIXL merges them into one descriptor), and 2
    # scattered ones (two descriptors): 3 descriptors, 6 blocks.
    h = d.post(
        "t",
        [(0, "whole", "whole", ids(0, 1, 2, 3), ids(4, 5, 6, 7)), (0, "whole", "whole", ids(5, 7), ids(2, 0))],
        "READ",
        2.0,
    )
    ev = pump(d, lambda e: e.done or e.failed, 3.0, others=[p])
    assert ev.done == ["t"] and h.state is RequestState.DONE
    assert (h.stats.transfers, h.stats.descriptors, h.stats.bytes) == (2, 3, 6 * BLOCK)
    assert h.stats.post_s >= 0 and h.stats.transfer_s >= 0


def _read_one_half_block(p: Endpoint, d: Endpoint, src: np.ndarray, dst: np.ndarray, peer: str) -> None:
    """READ the first half of the peer's block 5 into the second half of our block 2, through local table ``only``
    (the "halves" form) of ``peer``'s scope, and check the bytes."""
    before = dst.copy()
    d.post("r", [(peer, "only", "halves", ids(BLOCKS + 2), ids(5))], "READ", 2.0)
    assert pump(d, lambda e: e.done or e.failed, 3.0, others=[p]).done == ["r"]
    assert np.array_equal(dst, expected_after(before, src, "halves", [BLOCKS + 2], [5]))


def test_peers_post_from_their_own_scope_of_local_tables(
    pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray],
) -> None:
    """Local tables added after creation (one scope per peer engine) are prepped against the one registration;
    a peer connected with ``local_scope`` posts from that scope only, and removing it releases its dlists."""
    p, d, src, dst = pair
    base = d.handle_counts()
    d.add_local_tables("eng", {"only": tables(dst.ctypes.data)["halves"]})
    with pytest.raises(ValueError, match="unknown local table scope 'nope'"):
        d.begin_connect(5, p.address, tables_from_payload, local_scope="nope")
    d.connect("eng/0", p.address, tables_from_payload, timeout_s=2.0, local_scope="eng")
    assert d.handle_counts()["local_dlists"] == base["local_dlists"] + 1 and d.handle_counts()["registrations"] == 1
    with pytest.raises(
        TransferError, match=r"unknown local table 'whole' in scope 'eng' \(peer 'eng/0'\); known: \['only'\]"
    ):
        d.post("r", [("eng/0", "whole", "whole", ids(0), ids(0))], "READ", 1.0)
    _read_one_half_block(p, d, src, dst, "eng/0")
    d.disconnect("eng/0")
    d.remove_local_tables("eng")
    assert d.handle_counts() == base and d.local_scopes() == []


def test_a_read_only_table_given_to_several_scopes_is_prepped_once(
    pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray],
) -> None:
    """The same read-only array in two scopes (as ``PeerPlan.local_rows`` returns a rank's shared base table) is
    checked and prepped once and released with the last scope; a writable array is prepped per scope."""
    p, d, src, dst = pair
    base = d.handle_counts()["local_dlists"]
    shared = tables(dst.ctypes.data)["halves"]
    shared.setflags(write=False)
    d.add_local_tables("a", {"only": shared})
    d.add_local_tables("b", {"only": shared, "mine": tables(dst.ctypes.data)["whole"]})
    assert d.handle_counts()["local_dlists"] == base + 2
    d.remove_local_tables("a")
    assert d.handle_counts()["local_dlists"] == base + 2
    d.connect("b/0", p.address, tables_from_payload, timeout_s=2.0, local_scope="b")
    _read_one_half_block(p, d, src, dst, "b/0")
    d.disconnect("b/0")
    d.remove_local_tables("b")
    assert d.handle_counts()["local_dlists"] == base
    writable = tables(dst.ctypes.data)["whole"]
    d.add_local_tables("c", {"w": writable})
    d.add_local_tables("e", {"w": writable})
    assert d.handle_counts()["local_dlists"] == base + 2
    d.remove_local_tables("c")
    d.remove_local_tables("e")
    assert d.handle_counts()["local_dlists"] == base


def test_post_raw_moves_the_bytes_with_bare_nixl_calls_on_the_endpoints_handles(
    pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray],
) -> None:
    """The NIXL floor the demo measures: the transfer posted without checks or bookkeeping still moves exactly its
    bytes, NIXL merges the consecutive ids as for ``post``, and the peer gets a notice it does not take for a
    hybrid-kv one."""
    p, d, src, dst = pair
    d.connect(0, p.address, tables_from_payload, timeout_s=2.0)
    before = dst.copy()
    t = Transfer(0, "whole", "whole", ids(0, 1, 2, 3, 5), ids(4, 5, 6, 7, 2))
    got: list[Any] = []
    poster = threading.Thread(target=lambda: got.append(d.post_raw([(t, b"1:raw-0")], "READ", 5.0)))
    poster.start()  # the passive side is progressed here meanwhile, as its own process would
    notifs = pump(p, lambda e: bool(e.notifs), 5.0).notifs
    poster.join(5.0)
    (res,) = got
    assert (res.descriptors, res.bytes) == (2, 5 * BLOCK) and res.seconds > 0
    assert np.array_equal(dst, expected_after(before, src, "whole", [0, 1, 2, 3, 5], [4, 5, 6, 7, 2]))
    assert notifs == [("D", b"hkv:raw:0:1:raw-0")]
    assert d.handle_counts()["xfer"] == 0 and d.handle_counts()["zombie_xfer"] == 0
    with pytest.raises(TransferError, match="peer 1 is not ready"):
        d.post_raw([(t._replace(peer=1), b"x")], "READ")
