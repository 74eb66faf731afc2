"""Side-channel answer latency while the serving worker spins: where to serve the side channel.

A vLLM CPU worker that waits for work spins in Python (``shm_broadcast``: read a flag, ``os.sched_yield()``,
again) on its main thread, which vLLM binds to the first core of its OpenMP set; its OpenMP threads are bound
one per core; busy processes load every core. A side-channel thread started by that main thread inherits
its one-core binding and needs the GIL the spinning thread holds. This script reproduces that worker
(``_worker``: the spinning main thread plus native busy threads, one bound per OpenMP core, written in C and
compiled on the fly, so they hold cores without the GIL like OpenMP's), starts the same background load for
every candidate, and measures from a client process how long ``fetch_reply`` takes for each way of serving:

- ``thread``: the status quo, a ``SideChannelServer`` thread in the worker (inherits the main thread's core);
- ``thread-reserved``: the thread moved to a core the worker's OpenMP threads do not use (vLLM's
  ``VLLM_CPU_NUM_OF_RESERVED_CPU``; what vLLM's NixlConnector does with its threads on CPU);
- ``thread-nice``: the thread on the inherited core at nice -10 (needs ``CAP_SYS_NICE``);
- ``process``: the server in its own process (no GIL shared with the worker) serving a static reply,
  allowed on every core;
- ``process-nice``: the same at nice -10.

Candidates run in rotation (``--rounds``), each for ``--seconds`` per round, under the same load, so their
numbers compare side by side. ``--hold S`` makes the main thread keep the GIL for S seconds at a time (native
code that does not release it, as a spin extension or a long C call does) instead of yielding. Usage::

    python benches/side_channel_starvation.py --seconds 8 --rounds 2 --busy 4
    python benches/side_channel_starvation.py --seconds 8 --rounds 1 --busy 4 --hold 0.5
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import re
import subprocess
import tempfile
import time
from typing import Any

SECRET = "side-channel-starvation-bench-secret-0123456789"
_CATASTROPHIC = re.compile(r"(a+)+$")  # backtracks exponentially; sre keeps the GIL throughout
CANDIDATES = ("thread", "thread-reserved", "thread-nice", "process", "process-nice")

_SPINNER_C = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
static void *spin(void *arg) { volatile unsigned long x = 0; for (;;) x++; return arg; }
int start_spinner(int cpu) {
    pthread_t t; pthread_attr_t at; pthread_attr_init(&at);
    if (cpu >= 0) { cpu_set_t s; CPU_ZERO(&s); CPU_SET(cpu, &s); pthread_attr_setaffinity_np(&at, sizeof s, &s); }
    return pthread_create(&t, &at, spin, 0);
}
"""


def _spinner_lib() -> Any:
    d = tempfile.mkdtemp(prefix="hkv-spin-")
    src, lib = os.path.join(d, "spin.c"), os.path.join(d, "spin.so")
    with open(src, "w") as f:
        f.write(_SPINNER_C)
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-pthread", src, "-o", lib], check=True)
    return ctypes.CDLL(lib)


def _busy() -> None:
    while True:
        pass


def _worker(candidate: str, hold_s: float, out: Any) -> None:
    """The spinning vLLM-like worker, serving its side channel as ``candidate`` says."""
    from hybrid_kv.transport.auth import resolve_secret
    from hybrid_kv.transport.channel_process import SideChannelProcess
    from hybrid_kv.transport.channel_server import SideChannelServer

    cores = sorted(os.sched_getaffinity(0))
    reserved = candidate == "thread-reserved" and len(cores) > 1
    omp_cores = cores[:-1] if reserved else cores
    lib = _spinner_lib()
    os.sched_setaffinity(0, {omp_cores[0]})  # vLLM binds the main thread as OpenMP thread 0
    for cpu in omp_cores[1:]:
        lib.start_spinner(cpu)  # the other OpenMP threads, one per core (thread 0 is the spinning main thread)
    child = None
    payload, md = os.urandom(600), os.urandom(3000)
    key = resolve_secret(SECRET, insecure=False, required=True, what="bench")
    if candidate.startswith("process"):  # what Endpoint(side_channel="process") runs
        child = SideChannelProcess("tcp://127.0.0.1:0", {0: payload}, md, name="W", key=key, max_queued=1024)
        address = child.address
        if candidate == "process-nice":
            for tid in os.listdir(f"/proc/{child.pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), -10)
    else:
        srv = SideChannelServer("tcp://127.0.0.1:0", lambda rank: (payload, md), lambda s, p: None, name="W", key=key)
        address = srv.address
        tid = srv._thread.native_id
        assert tid is not None
        if reserved:
            os.sched_setaffinity(tid, {cores[-1]})
        if candidate == "thread-nice":
            os.setpriority(os.PRIO_PROCESS, tid, -10)
    out.put(address)
    if hold_s > 0:  # native code that keeps the GIL for about hold_s at a time (a spin extension, a long C call)
        n = 16
        while True:
            t0 = time.perf_counter()
            _CATASTROPHIC.match("a" * n + "b")
            if time.perf_counter() - t0 >= hold_s:
                break
            n += 1
        while True:
            _CATASTROPHIC.match("a" * n + "b")
    flag = [0]
    while True:  # shm_broadcast's idle loop: look at the flag, yield, again (the GIL is retaken each time)
        if flag[0]:
            break
        os.sched_yield()
    if child is not None:
        child.close()


def _measure(address: str, seconds: float, timeout_s: float) -> list[float]:
    import zmq

    from hybrid_kv.errors import ChannelError
    from hybrid_kv.transport.channel_client import fetch_reply

    ctx: Any = zmq.Context()
    lat: list[float] = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                fetch_reply(ctx, address, 0, "bench-client", timeout_s, secret=SECRET)
                lat.append(time.perf_counter() - t0)
            except ChannelError:
                lat.append(float("inf"))
            time.sleep(0.05)
    finally:
        ctx.destroy(linger=0)
    return lat


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="measuring time per candidate and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--busy", type=int, default=2 * len(os.sched_getaffinity(0)), help="background busy processes")
    ap.add_argument("--timeout", type=float, default=10.0, help="one fetch's deadline (a miss counts as inf)")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument(
        "--hold",
        type=float,
        default=0.0,
        help="the worker's main thread holds the GIL this long at a time (native code) instead of yielding",
    )
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    busy = [ctx.Process(target=_busy, daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    results: dict[str, list[float]] = {c: [] for c in args.candidates.split(",")}
    try:
        for _ in range(args.rounds):
            for cand in results:
                q = ctx.Queue()
                w = ctx.Process(target=_worker, args=(cand, args.hold, q), daemon=True)
                w.start()
                try:
                    address = q.get(timeout=120)
                    time.sleep(1.0)  # let the spinners settle
                    results[cand] += _measure(address, args.seconds, args.timeout)
                finally:
                    w.kill()
                    w.join(10)
    finally:
        for p in busy:
            p.kill()
            p.join(5)
    spin = f"main thread holding the GIL {args.hold:g} s at a time" if args.hold else "main thread spinning"
    print(
        f"side-channel fetch latency, {spin}, {args.busy} busy processes, {len(os.sched_getaffinity(0))} cores, "
        f"{args.rounds} x {args.seconds:g} s per candidate (ms; inf = no reply within {args.timeout:g} s)"
    )
    print(f"| {'candidate':<16} | {'n':>4} | {'p50':>8} | {'p90':>8} | {'p99':>8} | {'max':>8} | {'misses':>6} |")
    print(f"|{'-' * 18}|{'-' * 6}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 8}|")
    for cand, lat in results.items():
        ms = [v * 1e3 for v in lat]
        miss = sum(v == float("inf") for v in lat)
        print(
            f"| {cand:<16} | {len(ms):>4} | {_pct(ms, 0.5):>8.1f} | {_pct(ms, 0.9):>8.1f} | {_pct(ms, 0.99):>8.1f} "
            f"| {max(ms):>8.1f} | {miss:>6} |"
        )


if __name__ == "__main__":
    main()
