"""The side channel served from its own process: it answers while the worker's main thread holds
the GIL, forwards control messages to ``poll()``, and goes away with its endpoint."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import time
from typing import Any

import numpy as np
import pytest
import zmq
from _peers import expected_after, pattern, payload_for, pump, registration, tables, tables_from_payload

from hybrid_kv.errors import ChannelError
from hybrid_kv.transport import Endpoint, HandshakeError
from hybrid_kv.transport.channel_client import fetch_reply

CATASTROPHIC = re.compile(r"(a+)+$")  # backtracks exponentially; sre holds the GIL throughout


def test_process_side_channel_serves_reads_and_forwards_controls() -> None:
    src, dst = pattern(21), pattern(22)
    p = Endpoint(
        "P",
        registration(src.ctypes.data),
        tables(src.ctypes.data),
        metadata_provider={0: payload_for(src)},
        side_channel="process",
    )
    child = p._server.pid  # type: ignore[union-attr]
    with p, Endpoint("D", registration(dst.ctypes.data), tables(dst.ctypes.data)) as d:
        assert child != os.getpid()
        before = dst.copy()
        d.connect(0, p.address, tables_from_payload, timeout_s=10.0)
        d.post("r", [(0, "whole", "blocks3", np.array([2, 5], np.int32), np.array([1, 6], np.int32))], "READ", 5.0)
        assert pump(d, lambda e: e.done or e.failed, 5.0, others=[p]).done == ["r"]
        assert np.array_equal(dst, expected_after(before, src, "whole", [2, 5], [1, 6]))
        with pytest.raises(HandshakeError, match=r"serves TP rank\(s\) \[0\], not 3"):
            d.connect(1, p.address, tables_from_payload, rank=3, timeout_s=10.0)
        p.poll()
        assert not p.controls_waiting()
        for i in range(3):
            d.send_control(p.address, f"release r{i}".encode(), timeout_s=10.0, expected_name="P")
        # seen without a poll (what lets an owner progress between its steps only when a peer waits), bounded
        end = time.monotonic() + 5.0
        while not p.controls_waiting() and time.monotonic() < end:
            time.sleep(0.01)
        assert p.controls_waiting()
        ev = pump(p, lambda e: len(e.control) == 3, 5.0)
        assert [(c.sender, c.payload) for c in ev.control] == [("D", f"release r{i}".encode()) for i in range(3)]
        assert not p.controls_waiting()
    _gone(child)
    with pytest.raises(ValueError, match="serves fixed replies: pass metadata_provider as a dict"):
        Endpoint("Q", registration(src.ctypes.data), {}, metadata_provider=lambda r: b"", side_channel="process")


def _gone(pid: int, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"side-channel process {pid} outlived its endpoint")


def _busy() -> None:
    while True:
        pass


def _gil_holding_worker(mode: str, hold_s: float, out: Any, holding: Any) -> None:
    """A worker whose main thread keeps the GIL for ``hold_s`` at a time (native code that never releases it,
    as a spin extension or a long C call does), bound to one core, serving its side channel as ``mode``. Right
    before each hold it writes a byte to ``holding`` (a pipe: a synchronous write, no helper thread), so the
    test can ask while a hold has just begun."""
    buf = pattern(31)
    ep = Endpoint("W", registration(buf.ctypes.data), {}, metadata_provider={0: payload_for(buf)}, side_channel=mode)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    n = 16
    while True:  # the pattern length whose match holds the GIL for about hold_s
        t0 = time.perf_counter()
        CATASTROPHIC.match("a" * n + "b")
        if time.perf_counter() - t0 >= hold_s / 4:
            break
        n += 1
    n += 2
    out.put(ep.address)
    while True:
        holding.send_bytes(b"h")
        CATASTROPHIC.match("a" * n + "b")


@pytest.mark.slow
def test_side_channel_answers_while_the_worker_holds_the_gil() -> None:
    """With the worker's main thread holding the GIL for seconds at a time (and busy processes on every core),
    the side channel in its own process answers every request asked right after a hold began within the
    deadline. (A side-channel thread in the same worker mostly cannot; how often depends on where the hold
    boundaries fall, so that comparison is measured in benches/side_channel_starvation.py, not asserted.)"""
    ctx = mp.get_context("spawn")
    busy = [ctx.Process(target=_busy, daemon=True) for _ in range(len(os.sched_getaffinity(0)))]
    for b in busy:
        b.start()
    zctx: Any = zmq.Context()
    try:
        latencies: dict[str, list[float]] = {}
        for mode in ("process",):
            q = ctx.Queue()
            holding, holds = ctx.Pipe(duplex=False)
            w = ctx.Process(target=_gil_holding_worker, args=(mode, 8.0, q, holds), daemon=True)
            w.start()
            try:
                address = q.get(timeout=120)
                lat = []
                for _ in range(4):
                    while holding.poll(0):  # only a hold that has just begun (at least 8 s, 2 s when loaded)
                        holding.recv_bytes()
                    assert holding.poll(120), "the worker never started a hold"
                    holding.recv_bytes()
                    t0 = time.monotonic()
                    try:
                        reply = fetch_reply(zctx, address, 0, "client", 3.0)
                        assert reply.name == "W" and len(reply.payload) == 8
                        lat.append(time.monotonic() - t0)
                    except ChannelError as exc:
                        assert "no reply" in str(exc) or "within" in str(exc), exc
                        lat.append(float("inf"))
                    time.sleep(0.5)
                latencies[mode] = lat
            finally:
                w.kill()
                w.join(10)
        assert all(t < 3.0 for t in latencies["process"]), latencies
    finally:
        zctx.destroy(linger=0)
        for b in busy:
            b.kill()
            b.join(5)
