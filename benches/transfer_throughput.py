"""End-to-end NIXL transfer throughput between two processes vs numpy copies of the same bytes.

A target process (the "prefill") registers a source region and serves its handshake; this process
(the "decode") registers a destination region, connects, and READs requests through
``hybrid_kv.transport.Endpoint`` (make_prepped_xfer + transfer + polling to completion, so the per
request cost is included). Layouts, for each block size:

* contiguous: blocks 0..n-1 on both sides (NIXL merges them into few descriptors);
* fragmented: local blocks 0..n-1 <- n distinct remote blocks in random order (paged-KV-like).

Baselines measured in the same run on buffers of the same size: ``np.copyto`` (one memcpy) and, for
fragmented, a numpy block gather (``np.take`` of the same block order). Ratios are NIXL / baseline.

Run: ``PYTHONPATH=python python benches/transfer_throughput.py [--size-mib 256] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import secrets
import statistics
import struct
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from hybrid_kv.transport import Endpoint, PollResult  # noqa: E402


def region(size: int) -> npt.NDArray[np.uint8]:
    """A region whose 8-byte words hold their own index (cheap to generate and to verify)."""
    return np.arange(size // 8, dtype=np.uint64).view(np.uint8)


def tables_for(base: int, size: int, block_sizes: list[int]) -> dict[str, npt.NDArray[np.uint64]]:
    return {f"b{bs}": np.array([[base, bs, 0, bs, size // bs]], dtype=np.uint64) for bs in block_sizes}


def target_main(size: int, block_sizes: list[int], out: Any, stop: Any) -> None:
    src = region(size)
    payload = struct.pack("<QQ", src.ctypes.data, size)
    reg = np.array([[src.ctypes.data, size, 0]], dtype=np.uint64)
    with Endpoint(
        "bench-target", reg, tables_for(src.ctypes.data, size, block_sizes), metadata_provider=lambda r: payload
    ) as ep:
        out.put(ep.address)
        while not stop.is_set():
            ep.poll()  # the passive side must be progressed (notifications, UCX wire-up)
            time.sleep(0.001)


def wait(ep: Endpoint, rid: str, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while True:
        ev: PollResult = ep.poll()
        if ev.failed:
            raise ev.failed[0]
        if rid in ev.done:
            return
        if time.monotonic() > end:
            raise TimeoutError(rid)


_counter = 0


def run_request(ep: Endpoint, transfers: list[tuple[Any, ...]]) -> None:
    """Post one READ request (a fresh xfer handle, as in serving) and poll it to completion."""
    global _counter
    _counter += 1
    rid = f"r{_counter}"
    ep.post(rid, transfers, "READ", deadline_s=60.0)
    wait(ep, rid)


def median_s(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=256, help="bytes moved per request (and region size)")
    ap.add_argument("--blocks-kib", default="4,64,1024", help="block sizes in KiB, comma separated")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    size = args.size_mib << 20
    # Both processes share one side-channel secret (the target inherits it); HYBRID_KV_SECRET wins if set.
    os.environ.setdefault("HYBRID_KV_SECRET", secrets.token_hex(32))
    block_sizes = [int(k) << 10 for k in args.blocks_kib.split(",")]

    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    target = ctx.Process(target=target_main, args=(size, block_sizes, out, stop), daemon=True)
    target.start()
    try:
        address = out.get(timeout=60)
        dst = np.zeros(size, dtype=np.uint8)
        reg = np.array([[dst.ctypes.data, size, 0]], dtype=np.uint64)
        with Endpoint("bench-init", reg, tables_for(dst.ctypes.data, size, block_sizes), listen=None) as ep:

            def remote_tables(payload: bytes) -> dict[str, npt.NDArray[np.uint64]]:
                base, remote_size = struct.unpack("<QQ", payload)
                return tables_for(base, remote_size, block_sizes)

            ep.connect(0, address, remote_tables, timeout_s=30.0)
            src_local = region(size)  # same bytes as the target's region, for the baselines
            base_dst = np.empty_like(src_local)
            memcpy_s = median_s(lambda: np.copyto(base_dst, src_local), args.repeats)
            print(f"payload {args.size_mib} MiB per request, {args.repeats} repeats, medians; GB/s = 1e9 B/s")
            print(f"numpy memcpy (np.copyto): {size / memcpy_s / 1e9:6.2f} GB/s")
            cols = [("block", 8), ("layout", 10), ("descs", 7), ("NIXL GB/s", 10), ("base GB/s", 10)]
            cols += [("NIXL/base", 9), ("NIXL/memcpy", 11)]
            print(" ".join(f"{name:>{width}}" for name, width in cols))
            rng = np.random.default_rng(0)
            for bs in block_sizes:
                n = size // bs
                local_ids = np.arange(n, dtype=np.int32)
                layouts = {"contiguous": local_ids, "fragmented": rng.permutation(n).astype(np.int32)}
                for layout, remote_ids in layouts.items():
                    request = [(0, f"b{bs}", f"b{bs}", local_ids, remote_ids)]
                    dst[:] = 0
                    run_request(ep, request)  # warm-up and verification
                    expect = region(size).reshape(n, bs)[remote_ids]
                    assert np.array_equal(dst.reshape(n, bs), expect), f"data mismatch for {layout} {bs} B blocks"
                    nixl_s = median_s(functools.partial(run_request, ep, request), args.repeats)
                    if layout == "contiguous":
                        base_s = memcpy_s
                    else:
                        gather = functools.partial(
                            np.take, src_local.reshape(n, bs), remote_ids, axis=0, out=base_dst.reshape(n, bs)
                        )
                        base_s = median_s(gather, args.repeats)
                    print(
                        f"{bs >> 10:>6}Ki {layout:>10} {n:>7} {size / nixl_s / 1e9:>10.2f} {size / base_s / 1e9:>10.2f}"
                        f" {base_s / nixl_s:>9.2f} {memcpy_s / nixl_s:>11.2f}"
                    )
            counts = ep.handle_counts()
            assert counts["xfer"] == 0 and counts["zombie_xfer"] == 0, counts
    finally:
        stop.set()
        target.join(10)
        if target.is_alive():
            target.kill()


if __name__ == "__main__":
    main()
