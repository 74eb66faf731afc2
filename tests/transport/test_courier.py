"""The courier: control messages per destination, none waiting behind another destination, each with a deadline.

Before it, a worker's control messages went out on 4 lanes chosen by ``crc32(address) % 4``: one undeliverable
message held its lane for its whole timeout, so a healthy peer sharing the lane got its message 8.0 s late instead
of 0.01 s, and any API client could pick the lane by naming an address. Also: a dead side-channel child went
unnoticed, and ``post(deadline_s=nan)`` never failed.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest
from _peers import connect_immediately, pattern, payload_for, pump, registration, tables, tables_from_payload

from hybrid_kv.transport import Endpoint
from hybrid_kv.transport.courier import WINDOW, Delivery


def _outcomes(ep: Endpoint, n: int, timeout_s: float) -> list[tuple[Delivery, float]]:
    """The next ``n`` outcomes of ``ep``'s courier, each with the time it was taken (bounded wait)."""
    out: list[tuple[Delivery, float]] = []
    end = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < end:
        out += [(d, time.monotonic()) for d in ep.courier.take()]
        time.sleep(0.002)
    assert len(out) >= n, f"{len(out)} of {n} outcomes within {timeout_s} s: {out}"
    return out


@pytest.fixture
def silent() -> Iterator[str]:
    """An address that accepts TCP connections and never speaks ZeroMQ (a hung peer)."""
    with socket.create_server(("127.0.0.1", 0), backlog=128) as s:
        yield f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def refusing() -> Iterator[str]:
    """An address nobody listens on, held by this test so no one else can take it (a dead peer)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def pair() -> Iterator[tuple[Endpoint, Endpoint]]:
    src, dst = pattern(31), pattern(32)
    served = {0: payload_for(src)}
    with (
        Endpoint("P", registration(src.ctypes.data), tables(src.ctypes.data), metadata_provider=served) as p,
        Endpoint("D", registration(dst.ctypes.data), tables(dst.ctypes.data)) as d,
    ):
        yield p, d


def test_a_dead_destination_delays_no_other(pair: tuple[Endpoint, Endpoint], silent: str) -> None:
    """A full window and a queue of messages to a peer that never answers, then one to a healthy peer: it is
    delivered while the dead peer's are still waiting out their time (they held a shared lane for it before)."""
    p, d = pair
    for i in range(WINDOW + 8):
        d.courier.send(silent, b"stuck %d" % i, "Z", timeout_s=30.0, attempts=3, tag=("dead", i))
    t0 = time.monotonic()
    d.courier.send(p.address, b"hello", "P", timeout_s=30.0, attempts=3, tag="live")
    [(outcome, t)] = _outcomes(d, 1, 30.0)
    assert outcome.tag == "live" and outcome.delivered
    assert d.courier.pending() == WINDOW + 8, "the dead peer's messages were still waiting"
    print(f"healthy destination delivered after {1e3 * (t - t0):.1f} ms beside a dead one")
    assert [c.payload for c in pump(p, lambda e: bool(e.control), 10.0).control] == [b"hello"]


def test_messages_keep_their_order_per_destination(pair: tuple[Endpoint, Endpoint]) -> None:
    p, d = pair
    for i in range(3 * WINDOW):
        d.courier.send(p.address, b"%d" % i, "P", timeout_s=30.0, tag=i)
    outcomes = _outcomes(d, 3 * WINDOW, 60.0)
    assert all(o.delivered for o, _ in outcomes)
    got: list[bytes] = []
    end = time.monotonic() + 30.0
    while len(got) < 3 * WINDOW and time.monotonic() < end:
        got += [c.payload for c in p.poll().control]
    assert got == [b"%d" % i for i in range(3 * WINDOW)]


def test_a_message_whose_deadline_passed_in_its_queue_is_never_sent(
    pair: tuple[Endpoint, Endpoint], silent: str
) -> None:
    _, d = pair
    for i in range(WINDOW):  # the window of a peer that never answers is full
        d.courier.send(silent, b"first", "Z", timeout_s=30.0, tag=("first", i))
    d.courier.send(silent, b"late", "Z", timeout_s=30.0, deadline=time.monotonic() + 0.2, tag="late")
    [(outcome, _)] = _outcomes(d, 1, 30.0)
    assert outcome.tag == "late" and not outcome.delivered
    assert "deadline passed while it was queued" in outcome.reason


def test_a_refused_connection_fails_at_once(pair: tuple[Endpoint, Endpoint], refusing: str) -> None:
    """A dead peer (nothing listens) is known within milliseconds, not after the whole timeout."""
    _, d = pair
    t0 = time.monotonic()
    d.courier.send(refusing, b"x", "Z", timeout_s=60.0, attempts=3, tag="x")
    [(outcome, t)] = _outcomes(d, 1, 60.0)
    assert not outcome.delivered and "connection refused (3 attempts)" in outcome.reason
    assert t - t0 < 30.0, f"took {t - t0:.1f} s of its 60 s"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0])
def test_non_finite_or_non_positive_deadlines_are_refused(pair: tuple[Endpoint, Endpoint], bad: float) -> None:
    """``post(deadline_s=nan)`` was never failed (a request against a stopped peer was still POSTED 15 s later)."""
    p, d = pair
    d.connect(0, p.address, tables_from_payload, timeout_s=10.0)
    t = (0, "whole", "blocks3", np.array([1], np.int32), np.array([1], np.int32))
    with pytest.raises(ValueError, match="deadline_s must be finite, positive"):
        d.post("r", [t], "READ", bad)
    with pytest.raises(ValueError, match="deadline_s must be finite, positive"):
        p.expect("r", bad)
    with pytest.raises(ValueError, match="timeout_s must be finite, positive"):
        d.send_control(p.address, b"x", bad)
    with pytest.raises(ValueError, match="timeout_s must be finite, positive"):
        d.courier.send(p.address, b"x", "P", timeout_s=bad)
    with pytest.raises(ValueError, match="timeout_s must be finite, positive"):
        d.connect(1, p.address, tables_from_payload, timeout_s=bad)


def test_a_killed_side_channel_process_is_restarted_on_its_address() -> None:
    """SIGKILL of the side-channel child (an OOM kill): ``poll()`` notices, logs and restarts it on the same
    address; peers handshake and send control messages as before (every one timed out before)."""
    src, dst = pattern(41), pattern(42)
    p = Endpoint(
        "P",
        registration(src.ctypes.data),
        tables(src.ctypes.data),
        metadata_provider={0: payload_for(src)},
        side_channel="process",
    )
    with p, Endpoint("D", registration(dst.ctypes.data), tables(dst.ctypes.data)) as d:
        server = p._server
        old = server.pid  # type: ignore[union-attr]
        os.kill(old, signal.SIGKILL)
        restarted = 0
        end = time.monotonic() + 60.0
        while restarted == 0 and time.monotonic() < end:
            restarted += p.poll().side_channel_restarted
            time.sleep(0.01)
        assert restarted == 1 and server.pid != old  # type: ignore[union-attr]
        d.connect(0, p.address, tables_from_payload, timeout_s=10.0)
        d.send_control(p.address, b"after the restart", timeout_s=10.0, expected_name="P")
        assert [c.payload for c in pump(p, lambda e: bool(e.control), 10.0).control] == [b"after the restart"]


def test_a_message_zeromq_cannot_queue_yet_is_sent_once_it_can(
    pair: tuple[Endpoint, Endpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection with no pipe yet refuses a non-blocking send with EAGAIN (ZeroMQ remaking a connection); the
    courier reported the message lost at once. Now it is sent once the pipe is there (``ZMQ_IMMEDIATE`` on every
    client makes each fresh connection refuse sends until connected)."""
    connect_immediately(monkeypatch)
    p, d = pair
    d.courier.send(p.address, b"late pipe", "P", timeout_s=30.0, tag="late")
    ((outcome, _),) = _outcomes(d, 1, 30.0)
    assert outcome.delivered, outcome
