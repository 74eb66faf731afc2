"""What a process without the deployment's secret can do to a side channel.

Each test reproduces an attack from below ZeroMQ's API (hand-rolled ZMTP, a recording TCP relay, bytes captured
and replayed) against real endpoints and real NIXL agents, and checks that it gets nowhere: no memory grows, no
NIXL metadata crosses the wire in the clear, no captured message is accepted twice or elsewhere.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq
from _peers import pattern, payload_for, registration, tables, tables_from_payload
from _wire import HostileServer, Relay, flood_server, peak_rss_growth, replay

from hybrid_kv.errors import ChannelError
from hybrid_kv.transport import Endpoint, HandshakeError
from hybrid_kv.transport.channel_client import fetch_reply

FLOOD = 512 << 20
"""Bytes an attacker floats in one unfinished message (the victim must not buffer them)."""

BOUND = 64 << 20
"""How far the victim's peak RSS may rise meanwhile."""

SECRET_PAYLOAD = bytes(np.random.default_rng(77).integers(0, 256, 96, dtype=np.uint8))
"""A distinctive handshake payload, to be looked for on the wire."""


def endpoint(name: str, buf: np.ndarray, **kw: object) -> Endpoint:
    return Endpoint(
        name,
        registration(buf.ctypes.data),
        tables(buf.ctypes.data),
        metadata_provider=lambda rank: payload_for(buf),
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:  # type: ignore[type-arg]
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def windows(data: bytes, width: int = 24, step: int = 8) -> list[bytes]:
    """Overlapping slices of ``data``: one of them is on the wire if any stretch of ``data`` is."""
    return [data[i : i + width] for i in range(0, max(1, len(data) - width), step)]


def leaked(secret: bytes, wire: bytes) -> bool:
    return any(w in wire for w in windows(secret))


# ---------------------------------------------------------------------------- unbounded buffering


def test_an_unfinished_message_without_the_secret_is_not_buffered_by_a_server() -> None:
    """512 MiB of one never-finished multipart message: the server drops the connection before any frame."""
    buf, dbuf = pattern(1), pattern(2)
    with endpoint("P", buf) as p, endpoint("D", dbuf) as d:
        growth = peak_rss_growth()
        flood = flood_server(p.address, FLOOD)
        assert growth() < BOUND, f"peak RSS rose by {growth() / 2**20:.0f} MiB while {flood.sent >> 20} MiB floated"
        assert flood.refused and flood.sent < FLOOD, f"the server took all {flood.sent >> 20} MiB"
        d.send_control(p.address, b"after the flood")  # the server still serves secret holders
        assert [(m.sender, m.payload) for m in p.poll().control] == [("D", b"after the flood")]


def test_an_unfinished_reply_from_a_server_without_the_secret_is_not_buffered_by_a_client(
    ctx: zmq.Context,  # type: ignore[type-arg]
) -> None:
    """A hostile server answers a fetching client with an endless multipart reply: the client never buffers it
    and fails at once, naming the failed authentication."""
    hostile = HostileServer(FLOOD)
    try:
        growth = peak_rss_growth()
        t0 = time.monotonic()
        with pytest.raises(ChannelError) as refused:
            fetch_reply(ctx, hostile.address, 0, "D", 20.0)
        took = time.monotonic() - t0
        assert growth() < BOUND, f"peak RSS rose by {growth() / 2**20:.0f} MiB"
        assert f"peer at {hostile.address} failed authentication" in str(refused.value)
        # at once: a client that waited would take its whole 20 s; a loaded machine stalls a process for seconds
        assert took < 10.0, f"the client waited {took:.1f} s for a server that failed its handshake"
    finally:
        hostile.close()
    assert hostile.floods and all(f.refused for f in hostile.floods)


# ---------------------------------------------------------------------------- relays and captures


def test_a_relay_sees_no_nixl_metadata_and_no_payload() -> None:
    """The decode dials a relay that forwards to the real prefill: the handshake works through it (a relay is a
    router), but neither the payload nor the NIXL metadata nor a control message crosses it in the clear."""
    buf, dbuf = pattern(3), pattern(4)
    with endpoint("P", buf) as p, endpoint("D", dbuf) as d:
        p._provider = lambda rank: SECRET_PAYLOAD
        relay = Relay(p.address)
        try:
            got = d.connect(0, relay.address, lambda payload: tables_from_payload(payload_for(buf)), timeout_s=5.0)
            d.send_control(relay.address, SECRET_PAYLOAD[::-1], expected_name="P")
        finally:
            relay.close()
        assert got == SECRET_PAYLOAD and d.peer_state(0)[0] == "ready"
        wire = bytes(relay.downstream) + bytes(relay.upstream)
        assert len(relay.downstream) > 0
        assert not leaked(p._agent.metadata, wire), "the prefill's NIXL metadata crossed the relay in the clear"
        assert not leaked(SECRET_PAYLOAD, wire) and not leaked(SECRET_PAYLOAD[::-1], wire)
        assert [m.payload for m in p.poll().control] == [SECRET_PAYLOAD[::-1]]


def test_a_captured_request_is_accepted_nowhere_again() -> None:
    """Bytes captured from a control call and from a metadata call, replayed into new connections to the same
    server, to another server of the deployment and to a restarted server on the same port: no control message
    reaches any of them, and no NIXL metadata comes back."""
    buf, dbuf, buf2 = pattern(5), pattern(6), pattern(7)
    with endpoint("D", dbuf) as d, endpoint("P2", buf2) as p2:
        p = endpoint("P", buf)
        port = p.address.rsplit(":", 1)[1]
        control, meta = Relay(p.address), Relay(p.address)
        try:
            d.send_control(control.address, b"release r1", expected_name="P")
            d.connect(0, meta.address, lambda payload: tables_from_payload(payload_for(buf)), timeout_s=5.0)
        finally:
            control.close()
            meta.close()
        assert [m.payload for m in p.poll().control] == [b"release r1"]
        d.close()
        answers = [replay(p.address, bytes(control.upstream)), replay(p2.address, bytes(control.upstream))]
        answers += [replay(p.address, bytes(meta.upstream)), replay(p2.address, bytes(meta.upstream))]
        assert not p.poll().control and not p2.poll().control
        p.close()
        with endpoint("P", buf, listen=f"tcp://127.0.0.1:{port}") as restarted:
            answers += [replay(restarted.address, bytes(control.upstream))]
            answers += [replay(restarted.address, bytes(meta.upstream))]
            assert not restarted.poll().control
            for md in (p._agent.metadata, p2._agent.metadata, restarted._agent.metadata):
                assert not any(leaked(md, a) for a in answers), "a replayed metadata request was answered"


def test_one_control_message_teed_to_two_servers_reaches_one() -> None:
    """An on-path attacker copies everything the decode sends to P to a second server P2 as well: P acts on the
    control message, P2 never sees it."""
    buf, buf2, dbuf = pattern(8), pattern(9), pattern(10)
    with endpoint("P", buf) as p, endpoint("P2", buf2) as p2, endpoint("D", dbuf) as d:
        tee = Relay(p.address, tee=p2.address)
        try:
            d.send_control(tee.address, b"push r7 blocks 1,2", expected_name="P")
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                assert not p2.poll().control, "the teed control message was accepted by a second server"
                time.sleep(0.01)
        finally:
            tee.close()
        assert [(m.sender, m.payload) for m in p.poll().control] == [("D", b"push r7 blocks 1,2")]


# ---------------------------------------------------------------------------- waiting is no replay


def test_a_request_that_waited_is_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's clock reads 60 s later than the client's when the request is handled (it waited in a queue,
    or the clocks differ): the request is answered, not refused as a replay."""
    buf, dbuf = pattern(11), pattern(12)
    real = time.time
    monkeypatch.setattr(
        time, "time", lambda: real() + (60.0 if threading.current_thread().name == "hkv-side-channel" else 0.0)
    )
    with endpoint("P", buf) as p, endpoint("D", dbuf) as d:
        assert d.connect(0, p.address, tables_from_payload, timeout_s=5.0) == payload_for(buf)
        d.send_control(p.address, b"late", expected_name="P")
        assert [m.payload for m in p.poll().control] == [b"late"]


def test_a_client_without_the_secret_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process without the secret gets no reply at all (no error reply tagged over its nonce): its handshake
    fails, and it is told so without waiting for its timeout."""
    buf = pattern(13)
    with endpoint("P", buf) as p:
        loot = pattern(14)
        with Endpoint("T", registration(loot.ctypes.data), tables(loot.ctypes.data), listen=None, insecure=True) as t:
            t0 = time.monotonic()
            with pytest.raises(HandshakeError, match=f"peer at {p.address} failed authentication"):
                t.connect(0, p.address, tables_from_payload, timeout_s=120.0)
            assert time.monotonic() - t0 < 60.0  # told at once why, not left to the 120 s timeout
            assert t.handle_counts()["remote_agents"] == 0
        assert not p.poll().control
