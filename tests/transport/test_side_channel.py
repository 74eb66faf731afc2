"""The ZeroMQ side channel on its own: replies, remote errors, timeouts that never hang, CURVE authentication in
both directions, requests bound to the endpoint they are meant for, and secrets resolved strictly."""

import secrets
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from _peers import connect_immediately

from hybrid_kv.errors import ChannelError
from hybrid_kv.transport import auth, curve
from hybrid_kv.transport.channel_client import fetch_named_meta, fetch_reply, send_control
from hybrid_kv.transport.channel_server import SideChannelServer
from hybrid_kv.transport.side_channel import PROTOCOL, REQUEST_ID_BYTES

KEY = secrets.token_bytes(32)
OTHER_KEY = secrets.token_bytes(32)


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
def served() -> Iterator[tuple[SideChannelServer, Owner]]:
    owner = Owner()
    server = SideChannelServer("tcp://127.0.0.1:0", owner.meta, owner.on_control, name="P", key=KEY)
    yield server, owner
    server.close()


def test_meta_and_control_round_trip(
    ctx: zmq.Context,  # type: ignore[type-arg]
    served: tuple[SideChannelServer, Owner],
) -> None:
    server, owner = served
    assert fetch_named_meta(ctx, server.address, 1, "D", 2.0, key=KEY) == ("P", b"payload-1", b"nixl-md")
    assert fetch_reply(ctx, server.address, 1, "D", 2.0, secret=KEY, to="P") == ("P", b"payload-1", b"nixl-md")
    assert send_control(ctx, server.address, b"\x00blocks", "D", 2.0, key=KEY) == "P"
    assert owner.controls == [("D", b"\x00blocks")]
    with pytest.raises(ChannelError, match="no rank 5"):
        fetch_named_meta(ctx, server.address, 5, "D", 2.0, key=KEY)


def test_a_request_zeromq_cannot_queue_yet_is_sent_once_it_can(
    ctx: zmq.Context,  # type: ignore[type-arg]
    served: tuple[SideChannelServer, Owner],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection with no pipe yet (ZeroMQ remaking it after a failed handshake) refuses a non-blocking send
    with EAGAIN; the client raised "Resource temporarily unavailable" (seen in a CI-like run). It now waits for
    the pipe: here ``ZMQ_IMMEDIATE`` on every client makes each fresh connection refuse sends until connected."""
    server, owner = served
    connect_immediately(monkeypatch)
    assert send_control(ctx, server.address, b"late pipe", "D", 5.0, key=KEY) == "P"
    assert fetch_named_meta(ctx, server.address, 1, "D", 5.0, key=KEY) == ("P", b"payload-1", b"nixl-md")
    assert owner.controls == [("D", b"late pipe")]


def mute_server(ctx: zmq.Context) -> tuple[zmq.Socket, int]:  # type: ignore[type-arg]
    """A CURVE server holding the deployment's key (no ZAP handler: it admits anyone) that never answers."""
    mute = ctx.socket(zmq.ROUTER)
    mute.setsockopt(zmq.CURVE_SERVER, 1)
    mute.setsockopt(zmq.CURVE_SECRETKEY, curve.derive_keys(KEY).server_secret)
    return mute, mute.bind_to_random_port("tcp://127.0.0.1")


def test_silent_peer_times_out(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    mute, port = mute_server(ctx)
    try:
        t0 = time.monotonic()
        with pytest.raises(ChannelError, match="no reply"):
            fetch_named_meta(ctx, f"tcp://127.0.0.1:{port}", 0, "D", 0.3, key=KEY)
        assert time.monotonic() - t0 < 30.0  # its own timeout, not a hang
    finally:
        mute.close(linger=0)


def test_nobody_listening_times_out(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    with socket.socket() as held:  # bound, never listening, and held: no other process can take the port
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(ChannelError, match="no reply"):
            send_control(ctx, f"tcp://127.0.0.1:{port}", b"x", "D", 0.3, key=KEY)
        assert time.monotonic() - t0 < 30.0  # its own timeout, not a hang


def client_socket(ctx: zmq.Context, address: str, key: bytes = KEY) -> zmq.Socket:  # type: ignore[type-arg]
    """A DEALER holding the deployment's CURVE client key, connected to ``address``."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    curve.make_client(sock, curve.derive_keys(key))
    sock.connect(address)
    return sock


def raw_call(ctx: zmq.Context, address: str, frames: list[bytes]) -> list[bytes]:  # type: ignore[type-arg]
    """Send ``frames`` as they are (as a secret holder) and return the reply."""
    sock = client_socket(ctx, address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(2000), "no reply"
        return sock.recv_multipart()
    finally:
        sock.close(linger=0)


def request(kind: bytes, arg: bytes, sender: bytes = b"D") -> list[bytes]:
    """A well-formed request with a fresh id, meant for whichever endpoint serves the address."""
    return [PROTOCOL, kind, secrets.token_bytes(REQUEST_ID_BYTES), b"", sender, arg]


def refusals(caplog: pytest.LogCaptureFixture, wait_s: float = 30.0) -> list[str]:
    """The server's refusal log lines, once there is one (the server thread logs asynchronously: bounded wait)."""

    def found() -> list[str]:
        return [
            r.getMessage() for r in caplog.records if r.name == "hybrid_kv.transport" and "refused" in r.getMessage()
        ]

    end = time.monotonic() + wait_s
    while not found() and time.monotonic() < end:
        time.sleep(0.05)
    return found()


def test_protocol_mismatch_is_reported(
    ctx: zmq.Context,  # type: ignore[type-arg]
    served: tuple[SideChannelServer, Owner],
) -> None:
    server, owner = served
    reply = raw_call(ctx, server.address, [b"hkv-sc/2", b"meta", b"id", b"D", b"0"])
    assert reply[0] == PROTOCOL and reply[2] == b"err" and b"incompatible side-channel protocol" in reply[4]
    assert owner.meta_calls == []


@pytest.mark.parametrize("client", ["no_secret", "wrong_secret"])
def test_clients_without_the_secret_never_get_past_the_handshake(
    ctx: zmq.Context,  # type: ignore[type-arg]
    served: tuple[SideChannelServer, Owner],
    caplog: pytest.LogCaptureFixture,
    client: str,
) -> None:
    """They get no reply at all (so nothing tagged or named), meta and on_control never see them, they are told at
    once why, and the server logs the refusal once."""
    server, owner = served
    key = None if client == "no_secret" else OTHER_KEY
    for _ in range(3):  # told why, not left to their 60 s timeouts
        with pytest.raises(ChannelError, match=f"peer at {server.address} failed authentication"):
            send_control(ctx, server.address, b"write into me", "D", 60.0, key=key)
        with pytest.raises(ChannelError, match=f"peer at {server.address} failed authentication"):
            fetch_named_meta(ctx, server.address, 0, "D", 60.0, key=key)
    assert owner.meta_calls == [] and owner.controls == []
    logged = refusals(caplog)
    assert len(logged) == 1 and "refused a connection" in logged[0], caplog.text
    assert ("does not speak CURVE" if client == "no_secret" else "its HYBRID_KV_SECRET differs") in logged[0]


def test_a_client_key_outside_the_deployment_is_refused_by_the_zap_handler(
    ctx: zmq.Context,  # type: ignore[type-arg]
    served: tuple[SideChannelServer, Owner],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client pinning the right server key (e.g. it learnt the public key) but holding another client key
    completes the key exchange and is refused by the ZAP handler, which logs its address."""
    server, owner = served
    sock = ctx.socket(zmq.DEALER)
    own = zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, curve.derive_keys(KEY).server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, own[0])
    sock.setsockopt(zmq.CURVE_SECRETKEY, own[1])
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        sock.connect(server.address)
        sock.send_multipart(request(b"ctrl", b"let me in"))
        assert monitor.poll(30000), "the handshake of a foreign client key did not fail"
        assert not sock.poll(300)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
    assert owner.controls == []
    logged = refusals(caplog)
    assert len(logged) == 1 and "refused a connection from 127.0.0.1" in logged[0], caplog.text
    assert "its CURVE client key is not the deployment's (check HYBRID_KV_SECRET)" in logged[0]


def test_client_rejects_a_server_without_the_secret(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    """A server with another secret, or none, cannot answer a client: the handshake fails, at once."""
    owner = Owner()
    for key in (OTHER_KEY, None):
        forged = SideChannelServer("tcp://127.0.0.1:0", owner.meta, owner.on_control, name="P", key=key)
        try:
            t0 = time.monotonic()
            with pytest.raises(ChannelError, match=f"peer at {forged.address} failed authentication"):
                fetch_named_meta(ctx, forged.address, 0, "D", 120.0, key=KEY)
            with pytest.raises(ChannelError, match="failed authentication"):
                send_control(ctx, forged.address, b"x", "D", 120.0, key=KEY)
            assert time.monotonic() - t0 < 60.0  # told at once why, not left to the 120 s timeouts
        finally:
            forged.close()
    assert owner.meta_calls == [] and owner.controls == []


def test_client_refuses_a_reply_to_another_request(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    """A reply echoing another request id (e.g. one replayed by a misbehaving server) is refused."""
    mute, port = mute_server(ctx)
    old = [PROTOCOL, b"x" * REQUEST_ID_BYTES, b"ok", b"P", b"stale-payload", b"md"]
    try:

        def answer_with_old_reply() -> None:
            if mute.poll(2000):
                ident = mute.recv_multipart()[0]
                mute.send_multipart([ident, *old])

        t = threading.Thread(target=answer_with_old_reply)
        t.start()
        with pytest.raises(ChannelError, match="another request's id"):
            fetch_named_meta(ctx, f"tcp://127.0.0.1:{port}", 0, "D", 2.0, key=KEY)
        t.join()
    finally:
        mute.close(linger=0)


def test_a_request_meant_for_another_endpoint_is_refused(
    ctx: zmq.Context,  # type: ignore[type-arg]
    served: tuple[SideChannelServer, Owner],
) -> None:
    """``to`` names the endpoint meant: any other refuses the request before its owner sees it (a control message
    delivered to the wrong server is never acted on); the client refuses a reply from another name too."""
    server, owner = served
    with pytest.raises(ChannelError, match="request meant for 'Q', this endpoint is 'P'"):
        send_control(ctx, server.address, b"release r1", "D", 2.0, key=KEY, to="Q")
    with pytest.raises(ChannelError, match="request meant for 'Q', this endpoint is 'P'"):
        fetch_named_meta(ctx, server.address, 0, "D", 2.0, key=KEY, to="Q")
    assert owner.meta_calls == [] and owner.controls == []
    assert send_control(ctx, server.address, b"release r1", "D", 2.0, key=KEY, to="P") == "P"
    assert owner.controls == [("D", b"release r1")]


@pytest.mark.slow
def test_one_sender_cannot_lock_out_the_others(
    ctx: zmq.Context,  # type: ignore[type-arg]
    served: tuple[SideChannelServer, Owner],
) -> None:
    """65,546 requests from one secret holder (more than hkv-sc/2 remembered nonces in its window,
    after which it refused every peer's requests) leave every other sender served, and the flooder too."""
    server, owner = served
    flood = 65_546
    sock = client_socket(ctx, server.address)
    try:
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        answered = 0
        batch = 512
        for start in range(0, flood, batch):
            n = min(batch, flood - start)
            for _ in range(n):
                sock.send_multipart(request(b"meta", b"0", sender=b"flooder"))
            for _ in range(n):
                answered += sock.recv_multipart()[2] == b"ok"
        assert answered == flood
    finally:
        sock.close(linger=0)
    assert fetch_named_meta(ctx, server.address, 1, "D", 2.0, key=KEY).payload == b"payload-1"
    assert send_control(ctx, server.address, b"still served", "D", 2.0, key=KEY) == "P"
    assert owner.controls == [("D", b"still served")] and len(owner.meta_calls) == flood + 1


def test_limits_are_checked_before_sending(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    from hybrid_kv.transport.side_channel import MAX_CONTROL_BYTES, MAX_NAME_BYTES

    with pytest.raises(ChannelError, match=f"control payload of {MAX_CONTROL_BYTES + 1} bytes exceeds the limit"):
        send_control(ctx, "tcp://127.0.0.1:1", b"x" * (MAX_CONTROL_BYTES + 1), "D", 0.2, key=KEY)
    with pytest.raises(ChannelError, match=f"endpoint name of {MAX_NAME_BYTES + 1} bytes exceeds the limit"):
        send_control(ctx, "tcp://127.0.0.1:1", b"x", "D" * (MAX_NAME_BYTES + 1), 0.2, key=KEY)
    with pytest.raises(ChannelError, match=f"destination name of {MAX_NAME_BYTES + 1} bytes exceeds the limit"):
        send_control(ctx, "tcp://127.0.0.1:1", b"x", "D", 0.2, key=KEY, to="P" * (MAX_NAME_BYTES + 1))


@pytest.mark.parametrize(
    ("secret", "why"),
    [
        (bytes(16), "is 16 bytes; at least 32 are required"),
        ("x" * 31, "is 31 bytes; at least 32 are required"),
        (bytes(32), "has only 1 distinct byte values"),
        ("k" * 64, "has only 1 distinct byte values"),
        ("0123456" * 5, "has only 7 distinct byte values"),
        ("abcdefgh" * 4, "repeats its first 8 bytes"),
        ("0123456789abcdef" * 2 + "0", "repeats its first 16 bytes"),
    ],
)
def test_degenerate_secrets_are_refused(secret: bytes | str, why: str) -> None:
    with pytest.raises(ValueError, match=f"^endpoint 'P': the secret argument {why}.*generate one with: python -c"):
        auth.resolve_secret(secret, insecure=False, required=True, what="endpoint 'P'")


def test_secrets_are_resolved_strictly(ctx: zmq.Context, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[type-arg]
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="no secret: pass secret=... or set HYBRID_KV_SECRET"):
        auth.resolve_secret(None, insecure=False, required=True, what="endpoint 'P'")
    assert auth.resolve_secret(None, insecure=False, required=False, what="x") is None
    with pytest.raises(ValueError, match="not both"):
        auth.resolve_secret(KEY, insecure=True, required=True, what="x")
    for _ in range(100):  # what the docs say to run is always accepted
        good = secrets.token_hex(32)
        assert auth.resolve_secret(good, insecure=False, required=True, what="x") == good.encode()
    assert auth.resolve_secret(KEY, insecure=False, required=True, what="x") == KEY
    monkeypatch.setenv(auth.SECRET_ENV, "e" * 40)
    with pytest.raises(ValueError, match="the HYBRID_KV_SECRET has only 1 distinct byte values"):
        auth.resolve_secret(None, insecure=False, required=True, what="x")
    monkeypatch.setenv(auth.SECRET_ENV, good)
    assert auth.resolve_secret(None, insecure=False, required=True, what="x") == good.encode()
    assert auth.resolve_secret(None, insecure=True, required=True, what="x") is None
    monkeypatch.delenv(auth.SECRET_ENV)
    with pytest.raises(ChannelError, match="no secret"):
        fetch_reply(ctx, "tcp://127.0.0.1:1", 0, "D", 0.1)


def test_keys_are_derived_per_deployment_and_need_curve(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same secret gives the same keys everywhere; another secret, other keys; server and client keys differ;
    without CURVE in libzmq a keyed side channel refuses to start, saying why."""
    a, b = curve.derive_keys(KEY), curve.derive_keys(bytes(KEY))
    assert a == b and a != curve.derive_keys(OTHER_KEY)
    assert a.server_secret != a.client_secret and zmq.curve_public(a.server_secret) == a.server_public
    curve.derive_keys.cache_clear()
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    try:
        with pytest.raises(ChannelError, match="needs ZeroMQ CURVE, but libzmq .* was built without it"):
            SideChannelServer("tcp://127.0.0.1:0", Owner().meta, Owner().on_control, name="P", key=KEY)
    finally:
        curve.derive_keys.cache_clear()
