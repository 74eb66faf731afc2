"""End-to-end NIXL transfer throughput between two processes, against memcpy and raw NIXL in the same run.

A target process (the "prefill") registers a source region and serves its handshake; this process (the
"decode") registers a destination region, connects, and READs requests. Everything is measured twice in
one run: with every buffer a plain torch tensor (4 KiB pages: torch's allocator asks for no huge pages, and
the endpoints are told ``huge_pages="off"``) and with every buffer from ``hybrid_kv.hugepages.zeros``
(transparent huge pages from the first touch, as the presets allocate KV pools). For each block size:

* contiguous: blocks 0..n-1 on both sides (NIXL merges them into few descriptors);
* fragmented: local blocks 0..n-1 <- n distinct remote blocks in random order (paged-KV-like).

Columns: ``raw`` posts the same ids with NIXL directly on the endpoint's prepped handles
(``make_prepped_xfer`` + ``transfer`` + ``check_xfer_state`` until done); ``endpoint`` goes through
``hybrid_kv.transport.Endpoint`` (checks, request bookkeeping, ``poll()``); ``base`` is a memcpy of the same
bytes (``np.copyto``, contiguous) or a numpy block gather (``np.take``, fragmented) between the same kind of
buffers. ``us/desc`` is the endpoint time per descriptor NIXL posted (after its merge).

Run: ``PYTHONPATH=python python benches/transfer_throughput.py [--size-mib 32,256] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import statistics
import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from hybrid_kv.hugepages import zeros  # noqa: E402
from hybrid_kv.transport import Endpoint, PollResult  # noqa: E402

KEEP: list[Any] = []  # torch tensors backing the numpy views handed out by ``pool``


def pool(size: int, fill: bool, huge: bool) -> npt.NDArray[np.uint8]:
    """A byte buffer, faulted in, with a reproducible pattern when ``fill``: from ``hybrid_kv.hugepages.zeros``
    when ``huge``, else a plain torch tensor (4 KiB pages)."""
    import torch

    if huge:
        a = zeros(size)
    else:
        t = torch.empty(size, dtype=torch.uint8)
        KEEP.append(t)
        a = t.numpy()
    if fill:
        a[:] = np.arange(size // 8, dtype=np.uint64).view(np.uint8)
    else:
        a.fill(0)
    return a


def tables_for(base: int, size: int, block_sizes: list[int]) -> dict[str, npt.NDArray[np.uint64]]:
    return {f"b{bs}": np.array([[base, bs, 0, bs, size // bs]], dtype=np.uint64) for bs in block_sizes}


def target_main(size: int, block_sizes: list[int], huge: bool, out: Any, stop: Any) -> None:
    src = pool(size, fill=True, huge=huge)
    payload = struct.pack("<QQ", src.ctypes.data, size)
    reg = np.array([[src.ctypes.data, size, 0]], dtype=np.uint64)
    tables = tables_for(src.ctypes.data, size, block_sizes)
    pages = "advise" if huge else "off"
    with Endpoint("bench-target", reg, tables, metadata_provider=lambda r: payload, huge_pages=pages) as ep:
        out.put(ep.address)
        while not stop.is_set():
            ep.poll()  # the passive side must be progressed (notifications, UCX wire-up)
            time.sleep(0.001)


def median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Initiator:
    """The READing side: one endpoint connected to the target, and the two ways of posting a request."""

    def __init__(self, ep: Endpoint) -> None:
        self.ep, self.n = ep, 0
        self.nixl = ep._agent.nixl
        self.peer = ep._peers[0]

    def raw(self, key: str, local_ids: Any, remote_ids: Any) -> None:
        """Post with NIXL directly on the endpoint's handles and spin until done."""
        h = self.nixl.make_prepped_xfer("READ", self.ep._agent.local[key], local_ids, self.peer.dlists[key], remote_ids)
        state = self.nixl.transfer(h)
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed")
            state = self.nixl.check_xfer_state(h)
        self.nixl.release_xfer_handle(h)

    def endpoint(self, key: str, local_ids: Any, remote_ids: Any) -> None:
        """Post one READ request through the transport (a fresh xfer handle, as in serving) and poll it done."""
        self.n += 1
        rid = f"r{self.n}"
        self.ep.post(rid, [(0, key, key, local_ids, remote_ids)], "READ", deadline_s=60.0)
        end = time.monotonic() + 60.0
        while True:
            ev: PollResult = self.ep.poll()
            if ev.failed:
                raise ev.failed[0]
            if rid in ev.done:
                return
            if time.monotonic() > end:
                raise TimeoutError(rid)

    @staticmethod
    def posted(local_ids: Any, remote_ids: Any) -> int:
        """Descriptors NIXL posts for these ids after its merge of runs consecutive on both sides (the tables
        here are one dense row each)."""
        runs = np.flatnonzero((np.diff(local_ids) != 1) | (np.diff(remote_ids) != 1))
        return int(runs.size) + 1


def measure(size: int, block_sizes: list[int], huge: bool, repeats: int) -> list[list[str]]:
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    target = ctx.Process(target=target_main, args=(size, block_sizes, huge, out, stop), daemon=True)
    target.start()
    rows: list[list[str]] = []
    try:
        address = out.get(timeout=120)
        dst = pool(size, fill=False, huge=huge)
        # The baselines copy between buffers of the same kind.
        src_local, base_dst = pool(size, fill=True, huge=huge), pool(size, fill=False, huge=huge)
        reg = np.array([[dst.ctypes.data, size, 0]], dtype=np.uint64)
        tables = tables_for(dst.ctypes.data, size, block_sizes)
        with Endpoint("bench-init", reg, tables, listen=None, huge_pages="advise" if huge else "off") as ep:

            def remote_tables(payload: bytes) -> dict[str, npt.NDArray[np.uint64]]:
                base, remote_size = struct.unpack("<QQ", payload)
                return tables_for(base, remote_size, block_sizes)

            ep.connect(0, address, remote_tables, timeout_s=30.0)
            it = Initiator(ep)
            memcpy_s = median_s(lambda: np.copyto(base_dst, src_local), repeats)
            rng = np.random.default_rng(0)
            for bs in block_sizes:
                n = size // bs
                local_ids = np.arange(n, dtype=np.int32)
                fragmented = rng.permutation(n).astype(np.int32)
                for layout, remote_ids in (("contiguous", local_ids), ("fragmented", fragmented)):
                    key = f"b{bs}"
                    dst.fill(0)
                    it.endpoint(key, local_ids, remote_ids)  # warm-up and verification
                    expect = src_local.reshape(n, bs)[remote_ids]
                    assert np.array_equal(dst.reshape(n, bs), expect), f"data mismatch for {layout} {bs} B blocks"
                    raw_s = median_s(lambda k=key, li=local_ids, r=remote_ids: it.raw(k, li, r), repeats)
                    ep_s = median_s(lambda k=key, li=local_ids, r=remote_ids: it.endpoint(k, li, r), repeats)
                    if layout == "contiguous":
                        base_s = memcpy_s
                    else:
                        src2, out2 = src_local.reshape(n, bs), base_dst.reshape(n, bs)
                        base_s = median_s(lambda s=src2, o=out2, r=remote_ids: np.take(s, r, axis=0, out=o), repeats)
                    descs = it.posted(local_ids, remote_ids)
                    rows.append(
                        [
                            "huge" if huge else "4 KiB",
                            f"{size >> 20} MiB",
                            f"{bs >> 10} KiB",
                            layout,
                            f"{descs:,}",
                            f"{size / raw_s / 1e9:.2f}",
                            f"{size / ep_s / 1e9:.2f}",
                            f"{size / base_s / 1e9:.2f}",
                            f"{base_s / raw_s:.2f}",
                            f"{base_s / ep_s:.2f}",
                            f"{ep_s / descs * 1e6:.2f}",
                        ]
                    )
                    print(" | ".join(rows[-1]), flush=True)
            counts = ep.handle_counts()
            assert counts["xfer"] == 0 and counts["zombie_xfer"] == 0, counts
    finally:
        stop.set()
        target.join(10)
        if target.is_alive():
            target.kill()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", default="32,256", help="bytes moved per request (and region size), comma separated")
    ap.add_argument("--blocks-kib", default="4,64,1024", help="block sizes in KiB, comma separated")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    # Both processes share one side-channel secret (the target inherits it); HYBRID_KV_SECRET wins if set.
    os.environ.setdefault("HYBRID_KV_SECRET", secrets.token_hex(32))
    block_sizes = [int(k) << 10 for k in args.blocks_kib.split(",")]
    header = ["pages", "request", "block", "layout", "descs posted", "raw GB/s", "endpoint GB/s", "base GB/s"]
    header += ["raw/base", "endpoint/base", "us/desc (endpoint)"]
    print(f"{args.repeats} repeats, medians; GB/s = 1e9 B/s; base = memcpy (contiguous) or np.take (fragmented)")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for size_mib in (int(s) for s in args.size_mib.split(",")):
        for huge in (False, True):
            for row in measure(size_mib << 20, block_sizes, huge, args.repeats):
                del row  # printed as measured


if __name__ == "__main__":
    main()
