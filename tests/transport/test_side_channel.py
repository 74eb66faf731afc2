"""The ZeroMQ side channel on its own: replies, remote errors, timeouts that never hang, and authentication
(forged, replayed and unauthenticated frames in both directions)."""

import struct
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from hybrid_kv.transport import auth
from hybrid_kv.transport.side_channel import (
    PROTOCOL,
    ChannelError,
    SideChannelServer,
    fetch_meta,
    fetch_named_meta,
    send_control,
)

KEY = b"k" * 32
OTHER_KEY = b"o" * 32


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:  # type: ignore[type-arg]
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


class Owner:
    """What a server hands its requests to; records every call that reached it."""

    def __init__(self) -> None:
        self.meta_calls: list[int] = []
        self.controls: list[tuple[str, bytes]] = []

    def meta(self, rank: int) -> tuple[bytes, bytes]:
        self.meta_calls.append(rank)
        if rank > 1:
            raise KeyError(f"no rank {rank}")
        return (f"payload-{rank}".encode(), b"nixl-md")

    def on_control(self, sender: str, payload: bytes) -> None:
        self.controls.append((sender, payload))


@pytest.fixture
def served(ctx: zmq.Context) -> Iterator[tuple[SideChannelServer, Owner]]:  # type: ignore[type-arg]
    owner = Owner()
    server = SideChannelServer(ctx, "tcp://127.0.0.1:0", owner.meta, owner.on_control, name="P", key=KEY)
    yield server, owner
    server.close()


def test_meta_and_control_round_trip(
    ctx: zmq.Context,  # type: ignore[type-arg]
    served: tuple[SideChannelServer, Owner],
) -> None:
    server, owner = served
    assert fetch_named_meta(ctx, server.address, 1, "D", 2.0, key=KEY) == ("P", b"payload-1", b"nixl-md")
    assert fetch_meta(ctx, server.address, 1, "D", 2.0, secret=KEY) == (b"payload-1", b"nixl-md")
    assert send_control(ctx, server.address, b"\x00blocks", "D", 2.0, key=KEY) == "P"
    assert owner.controls == [("D", b"\x00blocks")]
    with pytest.raises(ChannelError, match="no rank 5"):
        fetch_named_meta(ctx, server.address, 5, "D", 2.0, key=KEY)


def test_silent_peer_times_out(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    mute = ctx.socket(zmq.ROUTER)  # receives, never answers
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        t0 = time.monotonic()
        with pytest.raises(ChannelError, match="no reply"):
            fetch_named_meta(ctx, f"tcp://127.0.0.1:{port}", 0, "D", 0.3, key=KEY)
        assert time.monotonic() - t0 < 1.5
    finally:
        mute.close(linger=0)


def test_nobody_listening_times_out(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    probe = ctx.socket(zmq.ROUTER)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)  # a port nobody listens on any more
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="no reply"):
        send_control(ctx, f"tcp://127.0.0.1:{port}", b"x", "D", 0.3, key=KEY)
    assert time.monotonic() - t0 < 1.5


def raw_call(ctx: zmq.Context, address: str, frames: list[bytes]) -> list[bytes]:  # type: ignore[type-arg]
    """Send ``frames`` as they are and return the reply."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(2000), "no reply"
        return sock.recv_multipart()
    finally:
        sock.close(linger=0)


def request(kind: bytes, arg: bytes, key: bytes | None, sent_at: float | None = None) -> list[bytes]:
    """A well-formed request, tagged with ``key`` (untagged for ``None``)."""
    when = time.time() if sent_at is None else sent_at
    frames = [PROTOCOL, kind, b"n" * 8 + struct.pack(">d", time.monotonic()), struct.pack(">d", when), b"D", arg]
    return [*frames, auth.tag(key, auth.REQUEST, frames) if key is not None else b""]


def test_protocol_mismatch_is_reported(
    ctx: zmq.Context,  # type: ignore[type-arg]
    served: tuple[SideChannelServer, Owner],
) -> None:
    server, owner = served
    reply = raw_call(ctx, server.address, [b"hkv-sc/1", b"meta", b"id", b"D", b"0"])
    assert reply[0] == PROTOCOL and reply[2] == b"err" and b"incompatible side-channel protocol" in reply[4]
    assert owner.meta_calls == []


@pytest.mark.parametrize("forgery", ["no_mac", "wrong_key", "tampered"])
def test_unauthenticated_requests_never_reach_the_owner(
    ctx: zmq.Context,  # type: ignore[type-arg]
    served: tuple[SideChannelServer, Owner],
    caplog: pytest.LogCaptureFixture,
    forgery: str,
) -> None:
    """Requests without the secret's tag get an error reply; meta and on_control never see them; logged once."""
    server, owner = served
    for kind, arg in [(b"meta", b"0"), (b"ctrl", b"write into me"), (b"ctrl", b"again")]:
        frames = request(kind, arg, None if forgery == "no_mac" else OTHER_KEY if forgery == "wrong_key" else KEY)
        if forgery == "tampered":
            frames[4] = b"P"  # a forged sender under a tag computed for "D"
        reply = raw_call(ctx, server.address, frames)
        assert reply[2] == b"err" and b"request failed authentication" in reply[4]
        assert reply[3] == b""  # the server's name is not told to unauthenticated peers
        assert auth.verify(KEY, auth.REPLY, reply[:-1], reply[-1])  # the refusal itself is authentic
    assert owner.meta_calls == [] and owner.controls == []
    refusals = [r for r in caplog.records if r.name == "hybrid_kv.transport" and "refused a request" in r.getMessage()]
    assert len(refusals) == 1 and "from 127.0.0.1" in refusals[0].getMessage(), caplog.text
    # an unauthenticated client sees why
    with pytest.raises(ChannelError, match="answered with an error: request failed authentication"):
        fetch_named_meta(ctx, server.address, 0, "D", 2.0, key=None)


def test_replayed_and_stale_requests_are_refused(
    ctx: zmq.Context,  # type: ignore[type-arg]
    served: tuple[SideChannelServer, Owner],
) -> None:
    server, owner = served
    frames = request(b"ctrl", b"once", KEY)
    assert raw_call(ctx, server.address, frames)[2] == b"ok"
    replay = raw_call(ctx, server.address, frames)  # captured and sent again, byte for byte
    assert replay[2] == b"err" and b"replayed request" in replay[4]
    stale = raw_call(ctx, server.address, request(b"ctrl", b"old", KEY, sent_at=time.time() - 120))
    assert stale[2] == b"err" and b"request timestamp is -120" in stale[4] and b"window" in stale[4]
    assert owner.controls == [("D", b"once")]


def test_client_rejects_a_server_without_the_secret(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    """A server with another secret, or none, cannot answer a client: it fails authentication."""
    owner = Owner()
    for key in (OTHER_KEY, None):
        forged = SideChannelServer(ctx, "tcp://127.0.0.1:0", owner.meta, owner.on_control, name="P", key=key)
        try:
            with pytest.raises(ChannelError, match=f"peer at {forged.address} failed authentication"):
                fetch_named_meta(ctx, forged.address, 0, "D", 2.0, key=KEY)
            with pytest.raises(ChannelError, match="failed authentication"):
                send_control(ctx, forged.address, b"x", "D", 2.0, key=KEY)
        finally:
            forged.close()


def test_client_ignores_a_replayed_reply(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    """A correctly tagged reply to another call (another nonce) is not taken as this call's answer."""
    fake = ctx.socket(zmq.ROUTER)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    old = [PROTOCOL, b"x" * auth.NONCE_BYTES, b"ok", b"P", b"stale-payload", b"md"]
    old.append(auth.tag(KEY, auth.REPLY, old))
    try:

        def answer_with_old_reply() -> None:
            if fake.poll(2000):
                ident = fake.recv_multipart()[0]
                fake.send_multipart([ident, *old])

        t = threading.Thread(target=answer_with_old_reply)
        t.start()
        with pytest.raises(ChannelError, match="no reply"):
            fetch_named_meta(ctx, f"tcp://127.0.0.1:{port}", 0, "D", 0.5, key=KEY)
        t.join()
    finally:
        fake.close(linger=0)


def test_limits_are_checked_before_sending(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    from hybrid_kv.transport.side_channel import MAX_CONTROL_BYTES, MAX_NAME_BYTES

    with pytest.raises(ChannelError, match=f"control payload of {MAX_CONTROL_BYTES + 1} bytes exceeds the limit"):
        send_control(ctx, "tcp://127.0.0.1:1", b"x" * (MAX_CONTROL_BYTES + 1), "D", 0.2, key=KEY)
    with pytest.raises(ChannelError, match=f"endpoint name of {MAX_NAME_BYTES + 1} bytes exceeds the limit"):
        send_control(ctx, "tcp://127.0.0.1:1", b"x", "D" * (MAX_NAME_BYTES + 1), 0.2, key=KEY)


def test_secrets_are_resolved_strictly(ctx: zmq.Context, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[type-arg]
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="no secret: pass secret=... or set HYBRID_KV_SECRET"):
        auth.resolve_secret(None, insecure=False, required=True, what="endpoint 'P'")
    assert auth.resolve_secret(None, insecure=False, required=False, what="x") is None
    with pytest.raises(ValueError, match="the secret argument is 5 bytes; at least 16 are required"):
        auth.resolve_secret("short", insecure=False, required=True, what="x")
    with pytest.raises(ValueError, match="not both"):
        auth.resolve_secret(KEY, insecure=True, required=True, what="x")
    monkeypatch.setenv(auth.SECRET_ENV, "e" * 20)
    assert auth.resolve_secret(None, insecure=False, required=True, what="x") == b"e" * 20
    assert auth.resolve_secret(None, insecure=True, required=True, what="x") is None
    monkeypatch.delenv(auth.SECRET_ENV)
    with pytest.raises(ChannelError, match="no secret"):
        fetch_meta(ctx, "tcp://127.0.0.1:1", 0, "D", 0.1)
