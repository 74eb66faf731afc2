"""Helpers shared by the transport tests and pd_helpers: buffers, hand-built tables, and the peer process.

The peer process is started with multiprocessing's spawn context, so everything it runs lives in
this importable module.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import struct
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

BLOCKS = 8
BLOCK = 256
HALF = BLOCK // 2

Buf = npt.NDArray[np.uint8]


def pattern(seed: int) -> Buf:
    """A buffer of BLOCKS x BLOCK random bytes, reproducible from ``seed``."""
    return np.random.default_rng(seed).integers(0, 256, BLOCKS * BLOCK, dtype=np.uint8)


def registration(base: int) -> npt.NDArray[np.uint64]:
    return np.array([[base, BLOCKS * BLOCK, 0]], dtype=np.uint64)


def tables(base: int) -> dict[str, npt.NDArray[np.uint64]]:
    """The three table forms the planner emits, over one region of BLOCKS blocks.

    whole:   one Nx5 row, id b = block b
    halves:  two Nx5 rows with stride != len, id b = first half of block b, BLOCKS + b = second half
    blocks3: Nx3 rows, one per block (id b = block b)
    """
    return {
        "whole": np.array([[base, BLOCK, 0, BLOCK, BLOCKS]], dtype=np.uint64),
        "halves": np.array([[base, HALF, 0, BLOCK, BLOCKS], [base + HALF, HALF, 0, BLOCK, BLOCKS]], dtype=np.uint64),
        "blocks3": np.array([[base + b * BLOCK, BLOCK, 0] for b in range(BLOCKS)], dtype=np.uint64),
    }


def payload_for(buf: Buf) -> bytes:
    """The test's stand-in for the planner's handshake payload: the region's base address."""
    return struct.pack("<Q", buf.ctypes.data)


def tables_from_payload(payload: bytes) -> dict[str, npt.NDArray[np.uint64]]:
    (base,) = struct.unpack("<Q", payload)
    return tables(base)


def byte_ranges(key: str, ids: Iterable[int]) -> list[tuple[int, int]]:
    """(offset, length) in the region of each descriptor id of table ``key``."""
    out = []
    for i in ids:
        if key == "halves":
            out.append(((i % BLOCKS) * BLOCK + (i // BLOCKS) * HALF, HALF))
        else:
            out.append((i * BLOCK, BLOCK))
    return out


def expected_after(dst_before: Buf, src: Buf, key: str, dst_ids: Iterable[int], src_ids: Iterable[int]) -> Buf:
    """What the destination must hold after copying ``src_ids`` of ``src`` onto ``dst_ids``."""
    out = dst_before.copy()
    for (d, n), (s, m) in zip(byte_ranges(key, dst_ids), byte_ranges(key, src_ids), strict=True):
        assert n == m
        out[d : d + n] = src[s : s + n]
    return out


def pump(ep: Any, until: Callable[[Any], bool], timeout_s: float, others: Iterable[Any] = ()) -> Any:
    """Poll ``ep`` (and ``others``) until ``until(events)`` holds for the accumulated events.

    Returns the accumulated PollResult; raises AssertionError on timeout.
    """
    from hybrid_kv.transport import PollResult

    acc = PollResult()
    end = time.monotonic() + timeout_s
    while True:
        ev = ep.poll()
        for name in ("done", "failed", "remote_done", "remote_failed", "control", "notifs", "settled"):
            getattr(acc, name).extend(getattr(ev, name))
        for other in others:
            other.poll()
        if until(acc):
            return acc
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s} s; events so far: {acc}")
        time.sleep(0.0005)


# ---------------------------------------------------------------------------- the peer process


def peer_main(name: str, seed: int, out: Any, cmds: Any, lifetime_s: float, answer_handshake: bool = True) -> None:
    """A prefill-like endpoint: serves its metadata, reports passive events, WRITEs on control messages.

    Control payload (JSON): ``{"rid", "address", "key", "src", "dst"}``: WRITE our ``src`` ids of
    table ``key`` onto the sender's ``dst`` ids, connecting to the sender at ``address`` first; the
    endpoint there must be the (authenticated) sender itself, else the request fails.
    Commands on ``cmds``: ``"stop"``, ``"hang"`` (stop polling NIXL but stay alive).
    """
    from hybrid_kv.transport import Endpoint, HandshakeError, TransferError

    buf = pattern(seed)
    provider = (lambda rank: payload_for(buf)) if answer_handshake else _never_answer
    end = time.monotonic() + lifetime_s
    with Endpoint(name, registration(buf.ctypes.data), tables(buf.ctypes.data), metadata_provider=provider) as ep:
        out.put(("ready", ep.address, os.getpid()))
        while time.monotonic() < end:
            try:
                cmd = cmds.get_nowait()
            except queue.Empty:
                cmd = None
            if cmd == "stop":
                break
            if cmd == "hang":
                time.sleep(end - time.monotonic())
                break
            ev = ep.poll()
            for e in ev.remote_done:
                out.put(("remote_done", e.sender, e.request_id))
            for e in ev.remote_failed:
                out.put(("remote_failed", e.sender, e.request_id, e.reason))
            for rid in ev.done:
                out.put(("done", rid))
            for err in ev.failed:
                out.put(("failed", err.request_id, str(err)))
            for msg in ev.control:
                req = json.loads(msg.payload)
                try:
                    if ep.peer_state(msg.sender)[0] != "ready":
                        ep.connect(
                            msg.sender, req["address"], tables_from_payload, timeout_s=3.0, expected_name=msg.sender
                        )
                    src = np.array(req["src"], dtype=np.int32)
                    dst = np.array(req["dst"], dtype=np.int32)
                    ep.post(req["rid"], [(msg.sender, req["key"], req["key"], src, dst)], "WRITE", 3.0)
                except (HandshakeError, TransferError) as exc:
                    out.put(("failed", req["rid"], str(exc)))
            time.sleep(0.0005)
        out.put(("counts", ep.handle_counts()))
    out.put(("closed", ep.handle_counts()))


def _never_answer(rank: int) -> bytes:
    raise RuntimeError("unused")


class Peer:
    """A running peer process and its queues (use as a context manager; always reaped)."""

    def __init__(self, name: str, seed: int, lifetime_s: float = 30.0) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.seed = seed
        self.data = pattern(seed)
        self.out = ctx.Queue()
        self.cmds = ctx.Queue()
        self.proc = ctx.Process(target=peer_main, args=(name, seed, self.out, self.cmds, lifetime_s), daemon=True)
        self.proc.start()
        msg = self.out.get(timeout=30)
        assert msg[0] == "ready", msg
        self.address: str = msg[1]

    def expect(self, kind: str, timeout_s: float = 5.0) -> tuple[Any, ...]:
        """The next message of ``kind`` from the peer (other kinds are skipped)."""
        end = time.monotonic() + timeout_s
        while True:
            msg = self.out.get(timeout=max(0.01, end - time.monotonic()))
            if msg[0] == kind:
                return tuple(msg)

    def stop(self) -> dict[str, int]:
        """Ask the peer to close cleanly; returns its handle counts after close."""
        self.cmds.put("stop")
        counts = self.expect("closed", 10.0)[1]
        self.proc.join(10)
        return dict(counts)

    def signal(self, sig: int) -> None:
        """Send ``sig`` (e.g. SIGSTOP to freeze the peer, SIGCONT to resume it)."""
        assert self.proc.pid is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def connect_immediately(monkeypatch: Any) -> None:
    """Every ZeroMQ DEALER connected from now on (the side channel's clients) sets ``ZMQ_IMMEDIATE``: a fresh
    connection refuses sends (EAGAIN) until it is connected, as one being remade after a failed handshake does."""
    import zmq

    connect = zmq.Socket.connect

    def immediately(sock: zmq.Socket, address: str) -> object:  # type: ignore[type-arg]
        if sock.type == zmq.DEALER:
            sock.setsockopt(zmq.IMMEDIATE, 1)
        return connect(sock, address)

    monkeypatch.setattr(zmq.Socket, "connect", immediately)
