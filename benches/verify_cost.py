"""What ``verify=all`` (``hybrid_kv.verify``) costs on host memory, side by side in one run.

1. Digest throughput: XXH3-64 of a region in Rust (``RegionTable.digest``, one range, and the same bytes cut
   into 64 KiB moves) against one ``np.copyto`` of the same bytes (memcpy), interleaved, medians. The torch
   ``wsum`` path (the device-memory digest, run here on CPU tensors) is shown for reference.
2. A request's READ with and without verification, for real-size model presets at TP 1 (Kimi-Linear and
   DeepSeek-V3, 4K-32K tokens): a prefill process holds the request's KV and answers digest asks (it rebuilds
   the decode's plan with ``MirrorPlan`` and digests its side), this process is the decode. ``plain`` posts
   the READ and polls it done; ``verified`` asks the prefill for its digest, posts once answered and digests
   what landed before completing (what the connector does). Plain and verified alternate, medians of
   ``--repeats``. ``added`` is verified minus plain, also split into the ask's round trip (the prefill's digest
   inside it) and the decode's digest.

Run: ``PYTHONPATH=python python benches/verify_cost.py [--tokens 4096,8192,16384,32768] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import secrets
import statistics
import time
from typing import Any

import numpy as np

from hybrid_kv.claims import ClaimEntry, claim_digests, serve_claims
from hybrid_kv.demo.run import DemoConfig, make_requests
from hybrid_kv.hugepages import zeros
from hybrid_kv.peer_link import link_peer
from hybrid_kv.presets import get_preset
from hybrid_kv.torch_adapter import region_table_from_tensors
from hybrid_kv.transport import Endpoint
from hybrid_kv.verify import Digester, MirrorCache, initiator_digests, wsum_digest


def rank(preset: str, role: str, blocks: int, fill: int) -> tuple[Any, Any, bytes, list[Any]]:
    """A TP-1 rank of ``preset`` with ``blocks`` logical blocks (host pools on huge pages), filled with a
    pattern: ``(table, digester, payload, tensors)``."""
    p = get_preset(preset)
    tensors, layers, geo = p.torch_layers(1, 0, blocks)
    for i, t in enumerate(tensors):
        flat = t.view(-1).numpy()
        flat[: flat.size // 8 * 8].view(np.uint64)[:] = np.arange(flat.size // 8, dtype=np.uint64) * (fill + i + 1)
    table = region_table_from_tensors(
        layers,
        logical_block_size=geo.logical_block_size,
        kernel_block_size=geo.kernel_block_size,
        num_logical_blocks=blocks,
        tp_rank=0,
        tp_size=1,
        total_num_kv_heads=p.attention.num_kv_heads if p.attention.kind == "gqa" else 1,
    )
    return table, Digester(table, tensors), table.handshake_payload(p.engine_info(role, "pull")), tensors


def prefill_main(preset: str, blocks: int, own_ids: list[list[int]], out: Any, stop: Any) -> None:
    table, digester, payload, keep = rank(preset, "prefill", blocks, 3)
    mirrors = MirrorCache(payload)
    reg = table.registration()
    with Endpoint("bench-prefill", reg, {"whole": table.local_rows()}, metadata_provider=lambda r: payload) as ep:
        out.put(ep.address)
        while not stop.is_set():
            ev = ep.poll()
            serve_claims(ep, ev.control, lambda entry: (own_ids, 0.0), mirrors, digester)
            if not ev:
                time.sleep(0.0002)
    del keep


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def throughput(size_mib: int, repeats: int) -> None:
    """Part 1: digest GB/s against memcpy of the same bytes (one region over a huge-page buffer)."""
    import torch

    from hybrid_kv.layout import build_region_table, layer, rank_layout

    p = get_preset("deepseek-v3")
    geo = p.geometry(1)
    blocks = (size_mib << 20) // geo.page_bytes
    n = blocks * geo.page_bytes
    src, dst = zeros(n), zeros(n)
    src.view(np.uint64)[:] = np.arange(n // 8, dtype=np.uint64) * 0x9E3779B97F4A7C15
    base = src.ctypes.data
    spec = p.attention.spec(1)
    entry = layer("mla.0", 0, spec, base=base, nbytes=n)
    table = build_region_table(
        rank_layout(
            [entry],
            logical_block_size=geo.logical_block_size,
            kernel_block_size=geo.kernel_block_size,
            num_logical_blocks=blocks,
        )
    )
    digester = Digester(table, [torch.from_numpy(src)])
    one = np.array([[base, 0, n]], dtype=np.uint64)
    cut = 64 << 10
    many = np.array([[base + o, 0, min(cut, n - o)] for o in range(0, n, cut)], dtype=np.uint64)
    views = digester._byte_views()
    small = one.copy()
    small[0, 2] = n // 16  # the torch path is slow on a CPU: a sixteenth of the bytes, scaled
    t: dict[str, list[float]] = {"memcpy (np.copyto)": [], "xxh3, one range": [], "xxh3, 64 KiB moves": []}
    t["wsum (torch on CPU)"] = []
    torch.set_num_threads(1)
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        t["memcpy (np.copyto)"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        table.digest(one)
        t["xxh3, one range"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        table.digest(many)
        t["xxh3, 64 KiB moves"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        wsum_digest(views, small, 0)
        t["wsum (torch on CPU)"].append((time.perf_counter() - t0) * 16)
    print(f"\nDigest throughput on host memory ({n >> 20} MiB, huge pages, {repeats} repeats, medians, one core):\n")
    print("| what | GB/s | time / memcpy |\n|---|---|---|")
    mc = median(t["memcpy (np.copyto)"])
    for k, v in t.items():
        print(f"| {k} | {n / median(v) / 1e9:.2f} | {median(v) / mc:.2f} |")


def request_cost(preset: str, tokens: int, repeats: int) -> list[str]:
    """Part 2: one request's READ, plain and verified, alternating."""
    from hybrid_kv.demo.run import _blocks_needed

    p = get_preset(preset)
    need = _blocks_needed(p.group_kinds(), p.geometry(1).logical_block_size, [tokens]) + 1  # no spare pool
    cfg = DemoConfig(preset, 1, 1, "pull", requests=1, tokens=tokens, num_blocks=need)
    ps, ds = cfg.validate()
    (req,) = make_requests(cfg, ps, ds)
    blocks = max(ps.num_blocks, ds.num_blocks)
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=prefill_main, args=(preset, blocks, req.prefill_ids, out, stop), daemon=True)
    proc.start()
    try:
        address = out.get(timeout=300)
        table, digester, payload, keep = rank(preset, "decode", blocks, 7)
        with Endpoint("bench-decode", table.registration(), {}) as ep:
            link = link_peer(
                ep, table, payload, {0: address}, "pull", scope="link", sender="bench-decode", timeout_s=60
            )
            plan = link.plan
            ts = link.transfers(req.decode_ids, req.prefill_ids)
            peer = ts[0].peer
            nbytes = sum(int(plan.local_bytes(t.local_key, t.local_ids)) for t in ts)
            n = 0

            def wait(rid: str) -> None:
                while True:
                    ev = ep.poll()
                    if ev.failed:
                        raise ev.failed[0]
                    if rid in ev.done:
                        return

            def plain() -> float:
                nonlocal n
                n += 1
                t0 = time.perf_counter()
                ep.post(f"r{n}", ts, "READ", 120.0)
                wait(f"r{n}")
                return time.perf_counter() - t0

            parts: dict[str, list[float]] = {"ask": [], "digest": []}

            def verified() -> float:
                nonlocal n
                n += 1
                rid = f"r{n}"
                t0 = time.perf_counter()
                entry = ClaimEntry(rid, b"", rid, req.decode_ids, True)
                got = claim_digests(ep, {0: (address, "bench-prefill")}, [entry], "decode", payload, "xxh3", 30.0)
                theirs, _ = got[rid][0]
                t1 = time.perf_counter()
                parts["ask"].append(t1 - t0)

                def check() -> str | None:
                    t2 = time.perf_counter()
                    mine = initiator_digests(digester, plan, ts, link.rank_of, "xxh3")[peer]
                    parts["digest"].append(time.perf_counter() - t2)
                    return None if mine.digest == theirs else "digest mismatch"

                ep.post(rid, ts, "READ", 120.0, check=check)
                wait(rid)
                return time.perf_counter() - t0

            plain()
            verified()  # warm-up (wire-up, mirror built once)
            parts = {"ask": [], "digest": []}
            p_s, v_s = [], []
            for _ in range(repeats):
                p_s.append(plain())
                v_s.append(verified())
            del keep
        pm, vm = median(p_s), median(v_s)
        ask, dig = median(parts["ask"]), median(parts["digest"])
        return [
            preset,
            f"{tokens:,}",
            f"{nbytes / 2**20:.0f} MiB",
            f"{pm * 1e3:.1f}",
            f"{nbytes / pm / 1e9:.2f}",
            f"{vm * 1e3:.1f}",
            f"{(vm - pm) * 1e3:.1f}",
            f"{(vm - pm) / pm * 100:.0f} %",
            f"{ask * 1e3:.1f}",
            f"{dig * 1e3:.1f} ({nbytes / dig / 1e9:.1f} GB/s)",
        ]
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="4096,8192,16384,32768", help="request lengths, comma separated")
    ap.add_argument("--presets", default="kimi-linear-48b-a3b,deepseek-v3")
    ap.add_argument("--size-mib", type=int, default=256, help="bytes digested in part 1")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("HYBRID_KV_SECRET", secrets.token_hex(32))
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    throughput(args.size_mib, args.repeats)
    header = ["preset (TP 1 -> 1)", "tokens", "bytes", "plain ms", "plain GB/s", "verified ms", "added ms"]
    header += ["added / plain", "ask round trip ms", "decode digest ms"]
    print(f"\nOne request's READ, plain and verify=all alternating ({args.repeats} repeats, medians):\n")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for preset in args.presets.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            try:
                print("| " + " | ".join(request_cost(preset, tokens, args.repeats)) + " |", flush=True)
            except (queue.Empty, MemoryError) as exc:
                print(f"| {preset} | {tokens:,} | not measured: {type(exc).__name__} |", flush=True)


if __name__ == "__main__":
    main()
