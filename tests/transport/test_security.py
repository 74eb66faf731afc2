"""Untrusted peers can neither crash a rank nor touch memory they were not granted.

Each test reproduces an attack with real endpoints, real NIXL agents and (where a process must die or
act on its own) real peer processes, then checks that it is refused and that nothing else changed.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
from _peers import Peer, expected_after, pattern, payload_for, pump, registration, tables, tables_from_payload
from _wire import peak_rss_growth

from hybrid_kv.transport import Endpoint, HandshakeError, TransferError
from hybrid_kv.transport import endpoint as endpoint_mod
from hybrid_kv.transport.auth import SECRET_ENV
from hybrid_kv.transport.netif import UCX_DEVICES_ENV, interface_of

ZERO = {"xfer": 0, "zombie_xfer": 0, "local_dlists": 0, "remote_dlists": 0, "remote_agents": 0, "registrations": 0}


def ids(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int32)


def endpoint(name: str, buf: np.ndarray, **kw: object) -> Endpoint:
    """An endpoint over ``buf`` serving ``payload_for(buf)``."""
    return Endpoint(
        name,
        registration(buf.ctypes.data),
        tables(buf.ctypes.data),
        metadata_provider=lambda rank: payload_for(buf),
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def pair() -> Iterator[tuple[Endpoint, Endpoint, np.ndarray, np.ndarray]]:
    """Prefill ``P`` and decode ``D`` in this process, both with the session's secret."""
    src, dst = pattern(1), pattern(2)
    with endpoint("P", src) as p, endpoint("D", dst) as d:
        yield p, d, src, dst
    assert p.handle_counts() == ZERO and d.handle_counts() == ZERO


def refusals(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "hybrid_kv.transport" and text in r.getMessage()]


# ---------------------------------------------------------------------------- 1. authentication


def test_a_process_without_the_secret_can_neither_read_nor_control(
    pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It reaches the port but gets neither the metadata (so no READ/WRITE) nor a control message through."""
    p, _, _, _ = pair
    served: list[int] = []
    provider = p._provider
    p._provider = lambda rank: served.append(rank) or provider(rank)  # type: ignore[assignment,misc,func-returns-value]
    monkeypatch.delenv(SECRET_ENV)
    loot = pattern(3)
    with Endpoint("D", registration(loot.ctypes.data), tables(loot.ctypes.data), listen=None) as thief:
        with pytest.raises(HandshakeError, match=f"peer at {p.address} failed authentication"):
            thief.connect(0, p.address, tables_from_payload, timeout_s=2.0)
        with pytest.raises(TransferError, match=f"peer at {p.address} failed authentication"):
            thief.send_control(p.address, b"register r1 blocks 0,1")  # claims to be "D"
        assert thief.handle_counts()["remote_agents"] == 0
        # The server thread logs the refusal asynchronously, once per kind: wait for it, bounded. A client that
        # gives up first may end its handshake with a hang-up (EPIPE, which libzmq reports without the mismatch,
        # and which is no refusal to log): the thief then tries again, as a real one would.
        text = "refused a connection: it does not speak CURVE"
        end = time.monotonic() + 30.0
        while not refusals(caplog, text) and time.monotonic() < end:
            deadline = time.monotonic() + 1.0
            while not refusals(caplog, text) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not refusals(caplog, text):
                with pytest.raises(TransferError, match="failed authentication"):
                    thief.send_control(p.address, b"register r1 blocks 0,1")
    assert served == []
    assert not any(p.poll().control for _ in range(20))
    assert len(refusals(caplog, text)) == 1, caplog.text  # once, however many connections it refused


def test_a_server_without_the_secret_cannot_pose_as_a_peer(
    pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray],
) -> None:
    _, d, _, _ = pair
    fake_buf = pattern(4)
    with endpoint("P", fake_buf, secret=secrets.token_hex(32)) as fake:  # another deployment's secret
        with pytest.raises(HandshakeError, match=f"peer at {fake.address} failed authentication"):
            d.connect(0, fake.address, tables_from_payload, timeout_s=2.0)
        with pytest.raises(TransferError, match=f"peer at {fake.address} failed authentication"):
            d.send_control(fake.address, b"x")
        assert not fake.poll().control
    assert d.peer_state(0)[0] == "down" and d.handle_counts()["remote_agents"] == 0


def test_a_side_channel_needs_a_secret_or_an_explicit_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = pattern(5), pattern(6)
    monkeypatch.delenv(SECRET_ENV)
    no_secret = r"^endpoint 'P' has a side channel but no secret: pass secret=\.\.\. or set HYBRID_KV_SECRET"
    generate = r"generate one with: python -c \"import secrets; print\(secrets.token_hex\(32\)\)\""
    with pytest.raises(ValueError, match=no_secret + rf" \({generate}; or insecure=True to run it unauthenticated\)$"):
        endpoint("P", src)
    with pytest.raises(ValueError, match="the secret argument is 5 bytes; at least 32 are required"):
        endpoint("P", src, secret="short")
    with pytest.raises(ValueError, match="the secret argument has only 1 distinct byte values"):
        endpoint("P", src, secret=bytes(32))
    with endpoint("P", src, insecure=True) as p, endpoint("D", dst, insecure=True) as d:  # both opted out
        before = dst.copy()
        d.connect(0, p.address, tables_from_payload, timeout_s=2.0)
        d.post("r", [(0, "whole", "whole", ids(2), ids(5))], "READ", 2.0)
        assert pump(d, lambda e: e.done or e.failed, 3.0, others=[p]).done == ["r"]
        assert np.array_equal(dst, expected_after(before, src, "whole", [2], [5]))


# ---------------------------------------------------------------------------- 2. side-channel name = NIXL agent


def test_a_peer_serving_another_agents_metadata_is_refused(
    pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray],
) -> None:
    """R (holding the secret) serves P's NIXL metadata: D refuses it and P's agent stays loaded and usable."""
    p, d, src, dst = pair
    d.connect(0, p.address, tables_from_payload, timeout_s=2.0)
    rbuf = pattern(7)
    with endpoint("R", rbuf) as rogue, endpoint("P", rbuf) as liar:
        for copy in (rogue, liar):  # exact replicas of what P serves: its payload and its NIXL agent
            copy._agent.metadata, copy._provider = p._agent.metadata, p._provider
        with pytest.raises(HandshakeError, match="it answered as 'R' but its NIXL agent is 'P'"):
            d.connect(1, rogue.address, tables_from_payload, timeout_s=2.0)
        with pytest.raises(HandshakeError, match=r"agent 'P' is already connected as peer 0 \(ready\)"):
            d.connect(2, liar.address, tables_from_payload, timeout_s=2.0)
        d.begin_connect(1, rogue.address, tables_from_payload, timeout_s=2.0)  # replacing key 1 drops nothing of P
        pump(d, lambda e: d.peer_state(1)[0] != "connecting", 3.0)
    assert d.peer_state(0) == ("ready", "") and d.remote_agent(0) == "P" and d.peer_of("P") == 0
    assert d.handle_counts()["remote_agents"] == 1
    before = dst.copy()
    d.post("still-works", [(0, "whole", "whole", ids(1), ids(6))], "READ", 2.0)
    assert pump(d, lambda e: e.done or e.failed, 3.0, others=[p]).done == ["still-works"]
    assert np.array_equal(dst, expected_after(before, src, "whole", [1], [6]))


def test_expected_name_and_payload_bind_a_connection(pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray]) -> None:
    p, d, src, _ = pair
    with pytest.raises(HandshakeError, match="answered with an error: request meant for 'Q', this endpoint is 'P'"):
        d.connect(0, p.address, tables_from_payload, timeout_s=2.0, expected_name="Q")
    with pytest.raises(HandshakeError, match="served a 8-byte payload that differs from the expected 3 bytes"):
        d.connect(0, p.address, tables_from_payload, timeout_s=2.0, expected_payload=b"abc")
    assert d.handle_counts()["remote_agents"] == 0
    got = d.connect(
        0, p.address, tables_from_payload, timeout_s=2.0, expected_payload=payload_for(src), expected_name="P"
    )
    assert got == payload_for(src) and d.peer_state(0)[0] == "ready"


def test_a_control_message_cannot_redirect_writes_into_another_decode() -> None:
    """A secret holder claiming to be D asks prefill to WRITE "D's" request into D2: refused, D2 untouched."""
    d_buf, d2_buf = pattern(100), pattern(101)
    with endpoint("D", d_buf) as d, endpoint("D2", d2_buf) as d2, Peer("P0", seed=8) as p:
        d2_before, d_before = d2_buf.copy(), d_buf.copy()
        with Endpoint("D", registration(d_buf.ctypes.data), tables(d_buf.ctypes.data), listen=None) as forger:
            evil = {"rid": "push-evil", "address": d2.address, "key": "whole", "src": [0, 1], "dst": [2, 3]}
            forger.send_control(p.address, json.dumps(evil).encode())
        msg = p.expect("failed", 5.0)
        assert msg[1] == "push-evil" and "request meant for 'D', this endpoint is 'D2'" in msg[2], msg
        end = time.monotonic() + 0.3
        while time.monotonic() < end:  # D2 is progressed, as a live decode would be: nothing arrives
            assert not d2.poll()
        assert np.array_equal(d2_buf, d2_before)
        # the real D's request still works over the same prefill
        h = d.expect("push-ok", deadline_s=5.0)
        ok = {"rid": "push-ok", "address": d.address, "key": "whole", "src": [7], "dst": [4]}
        d.send_control(p.address, json.dumps(ok).encode(), expected_name="P0")
        assert pump(d, lambda e: e.done or e.failed, 5.0).done == ["push-ok"] and h.error is None
        assert np.array_equal(d_buf, expected_after(d_before, p.data, "whole", [4], [7]))
        assert p.stop() == ZERO


# ---------------------------------------------------------------------------- 3. resource limits


_OVERSIZE_SENDER = """
import os, sys, zmq
from hybrid_kv.transport import curve
from hybrid_kv.transport.side_channel import PROTOCOL, REQUEST_ID_BYTES
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
curve.make_client(sock, curve.derive_keys(os.environ["HYBRID_KV_SECRET"].encode()))
sock.connect(sys.argv[1])
sock.send_multipart([PROTOCOL, b"ctrl", os.urandom(REQUEST_ID_BYTES), b"", b"D", b"x" * (512 << 20)])
print("answered" if sock.poll(3000) else "not answered", flush=True)
"""


@pytest.mark.slow
def test_an_oversize_control_frame_is_dropped_before_it_is_buffered(
    pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray],
) -> None:
    """512 MiB in one control frame from a secret holder (another process: CURVE encrypts on the sender's side):
    never answered, never queued, and the receiver never buffers it."""
    p, d, _, _ = pair
    growth = peak_rss_growth()
    sender = subprocess.run(
        [sys.executable, "-c", _OVERSIZE_SENDER, p.address], capture_output=True, text=True, timeout=60
    )
    assert sender.stdout.strip() == "not answered", sender.stdout + sender.stderr
    d.send_control(p.address, b"small")  # the server is alive and past the oversize frame
    assert [m.payload for m in p.poll().control] == [b"small"]
    assert growth() < 64 << 20, f"peak RSS rose by {growth() / 2**20:.0f} MiB"


def test_control_queue_overflow_is_refused_and_logged(
    pair: tuple[Endpoint, Endpoint, np.ndarray, np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    p, d, _, _ = pair
    monkeypatch.setattr(endpoint_mod, "MAX_QUEUED_CONTROLS", 3)
    for i in range(3):
        d.send_control(p.address, b"c%d" % i)
    for i in (3, 4):
        with pytest.raises(TransferError, match=r"control queue of 'P' is full: 3 messages not yet polled \(limit 3\)"):
            d.send_control(p.address, b"c%d" % i)
    assert len(refusals(caplog, "control queue full")) == 1, caplog.text
    assert [m.payload for m in p.poll().control] == [b"c0", b"c1", b"c2"]
    d.send_control(p.address, b"c5")  # drained: accepted again
    assert [(m.sender, m.payload) for m in p.poll().control] == [("D", b"c5")]


# ---------------------------------------------------------------------------- 4. a restarted peer


@pytest.mark.slow
def test_a_restarted_peer_replaces_its_dead_agent_under_a_new_key() -> None:
    dst = pattern(100)
    with endpoint("D", dst) as d:
        with Peer("PA", seed=5) as old:
            d.connect(0, old.address, tables_from_payload, timeout_s=5.0)
            d.post("warm", [(0, "whole", "whole", ids(0), ids(0))], "READ", 5.0)
            assert pump(d, lambda e: e.done or e.failed, 5.0).done == ["warm"]
            old.kill()
            d.post("to-dead", [(0, "whole", "whole", ids(1), ids(1))], "READ", 3.0)
            assert pump(d, lambda e: e.failed, 5.0).failed[0].request_id == "to-dead"
            assert d.peer_state(0)[0] == "down" and d.remote_agent(0) == "PA"  # dead, its agent still loaded
        with Peer("PA", seed=6) as new:  # same name, new process, new memory
            d.connect(1, new.address, tables_from_payload, timeout_s=5.0)
            assert d.remote_agent(0) is None and d.peer_of("PA") == 1 and d.handle_counts()["remote_agents"] == 1
            before = dst.copy()
            d.post("from-new", [(1, "whole", "whole", ids(2, 3), ids(4, 5))], "READ", 5.0)
            assert pump(d, lambda e: e.done or e.failed, 5.0).done == ["from-new"]
            assert np.array_equal(dst, expected_after(before, new.data, "whole", [2, 3], [4, 5]))
            with pytest.raises(HandshakeError, match=r"agent 'PA' is already connected as peer 1 \(ready\)"):
                d.connect(2, new.address, tables_from_payload, timeout_s=5.0)
            assert d.peer_state(1) == ("ready", "")
            assert new.stop() == ZERO
    assert d.handle_counts() == ZERO


# ---------------------------------------------------------------------------- 5. where UCX listens


def _listening() -> set[tuple[str, int]]:
    """``(ip, port)`` of every TCP socket of this process in LISTEN state (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for family, path in ((socket.AF_INET, "/proc/net/tcp"), (socket.AF_INET6, "/proc/net/tcp6")):
        try:
            with open(path) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        for row in rows:
            if row[3] != "0A" or row[9] not in inodes:  # 0A = LISTEN
                continue
            addr, port = row[1].split(":")
            raw = bytes.fromhex(addr)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
            found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def _other_ipv4() -> str | None:
    """An IPv4 address of a non-loopback interface of this machine, if any."""
    import fcntl

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        ip = socket.inet_ntoa(raw[20:24])
        if not ip.startswith("127."):
            return ip
    return None


@pytest.mark.skipif(UCX_DEVICES_ENV in os.environ, reason="UCX_NET_DEVICES is set by the caller")
def test_ucx_listens_only_where_the_side_channel_does() -> None:
    buf = pattern(9)
    hosts = ["127.0.0.1", None] + ([ip] if (ip := _other_ipv4()) is not None else [])
    for host in hosts:
        before = _listening()
        listen = None if host is None else f"tcp://{host}:0"
        with endpoint("P", buf, listen=listen) as ep:
            opened = _listening() - before
            want = host or "127.0.0.1"
            assert len(opened) >= 1 + (listen is not None), opened  # UCX's own listener (+ the side channel)
            assert {ip for ip, _ in opened} == {want}, f"listen={listen}: listening on {sorted(opened)}"
            if listen is not None:
                assert (want, int(ep.address.rsplit(":", 1)[1])) in opened
        assert UCX_DEVICES_ENV not in os.environ
    assert interface_of("127.0.0.1") == interface_of("127.0.0.2") and interface_of("0.0.0.0") is None
    with pytest.raises(ValueError, match="no network interface of this machine has the address 192.0.2.254"):
        endpoint("P", buf, listen="tcp://192.0.2.254:0")
    with pytest.raises(ValueError, match="host 'localhost' is not an IPv4 address"):
        endpoint("P", buf, listen="tcp://localhost:0")
