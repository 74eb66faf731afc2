"""The ZeroMQ side channel on its own: replies, remote errors, and timeouts that never hang."""

import time

import pytest
import zmq

from hybrid_kv.transport.side_channel import PROTOCOL, ChannelError, SideChannelServer, fetch_meta, send_control


@pytest.fixture
def ctx():  # type: ignore[no-untyped-def]
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_meta_and_control_round_trip(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    got: list[tuple[str, bytes]] = []

    def meta(rank: int) -> tuple[bytes, bytes]:
        if rank > 1:
            raise KeyError(f"no rank {rank}")
        return (f"payload-{rank}".encode(), b"nixl-md")

    server = SideChannelServer(ctx, "tcp://127.0.0.1:0", meta, lambda s, p: got.append((s, p)))
    try:
        assert fetch_meta(ctx, server.address, 1, "D", 2.0) == (b"payload-1", b"nixl-md")
        send_control(ctx, server.address, b"\x00blocks", "D", 2.0)
        assert got == [("D", b"\x00blocks")]
        with pytest.raises(ChannelError, match="no rank 5"):
            fetch_meta(ctx, server.address, 5, "D", 2.0)
    finally:
        server.close()


def test_silent_peer_times_out(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    mute = ctx.socket(zmq.ROUTER)  # receives, never answers
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        t0 = time.monotonic()
        with pytest.raises(ChannelError, match="no reply"):
            fetch_meta(ctx, f"tcp://127.0.0.1:{port}", 0, "D", 0.3)
        assert time.monotonic() - t0 < 1.5
    finally:
        mute.close(linger=0)


def test_nobody_listening_times_out(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    probe = ctx.socket(zmq.ROUTER)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)  # a port nobody listens on any more
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="no reply"):
        send_control(ctx, f"tcp://127.0.0.1:{port}", b"x", "D", 0.3)
    assert time.monotonic() - t0 < 1.5


def test_protocol_mismatch_is_reported(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    server = SideChannelServer(ctx, "tcp://127.0.0.1:0", lambda r: (b"", b""), lambda s, p: None)
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(server.address)
        sock.send_multipart([b"hkv-sc/0", b"meta", b"id", b"D", b"0"])
        assert sock.poll(2000)
        reply = sock.recv_multipart()
        sock.close(linger=0)
        assert reply[0] == PROTOCOL and reply[2] == b"err" and b"incompatible side-channel protocol" in reply[3]
    finally:
        server.close()
