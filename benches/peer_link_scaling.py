"""Handshake time, RSS and NIXL agents per added peer engine: one endpoint per worker vs one per peer.

A decode rank (a tiny Kimi-Linear pool of ``--pool-mib``) links to ``--engines`` prefill engines, each a rank in
its own process, two ways, side by side in one run:

- ``shared``: what the connector does now: one ``Endpoint`` (one NIXL agent, the pool registered once); each
  engine adds a ``peer_link`` (its ``PeerPlan`` local tables as a scope, its rank as a peer);
- ``per-peer``: what it did before: a new ``Endpoint`` per engine (a new agent registering the whole pool again).

For each added engine it prints the link time (fetch, plan, tables, connect) and the decode process's RSS
growth; at the end the agents and registrations held. Usage::

    python benches/peer_link_scaling.py --engines 8 --pool-mib 512
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from typing import Any


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _rank(role: str, num_blocks: int) -> Any:
    from hybrid_kv.presets import get_preset
    from hybrid_kv.torch_adapter import region_table_from_tensors

    p = get_preset("tiny-kimi-linear")
    geo = p.geometry(1)
    tensors, layers, _ = p.torch_layers(1, 0, num_blocks)
    for t in tensors:
        t.view(-1).numpy()[:] = 1  # fault every page in, as a serving engine's pool is
    table = region_table_from_tensors(
        layers,
        logical_block_size=geo.logical_block_size,
        kernel_block_size=geo.kernel_block_size,
        num_logical_blocks=num_blocks,
        tp_rank=0,
        tp_size=1,
        total_num_kv_heads=p.attention.num_kv_heads,
    )
    return tensors, table, table.handshake_payload(p.engine_info(role, "pull"))


def _prefill(name: str, num_blocks: int, out: Any, stop: Any) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from hybrid_kv.transport import Endpoint

    tensors, table, payload = _rank("prefill", num_blocks)
    with Endpoint(name, table.registration(), {"whole": table.local_rows()}, metadata_provider={0: payload}) as ep:
        out.put(ep.address)
        while not stop.is_set():
            ep.poll()
            time.sleep(0.001)
    del tensors


def _blocks_for(pool_mib: int) -> int:
    from hybrid_kv.presets import get_preset

    page = get_preset("tiny-kimi-linear").geometry(1).page_bytes
    return max(64, pool_mib * 2**20 // (3 * page))  # the tiny Kimi-Linear pools into 3 tensors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--pool-mib", type=int, default=512, help="the decode rank's KV pool")
    args = ap.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("HYBRID_KV_SECRET", "peer-link-scaling-bench-secret-0123456789abcdef")
    from hybrid_kv.peer_link import link_peer
    from hybrid_kv.transport import Endpoint

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    out = ctx.Queue()
    procs = [ctx.Process(target=_prefill, args=(f"P{i}", 64, out, stop), daemon=True) for i in range(args.engines)]
    for p in procs:
        p.start()
    addresses = [out.get(timeout=300) for _ in procs]
    tensors, table, payload = _rank("decode", _blocks_for(args.pool_mib))
    pool = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    results: dict[str, list[tuple[float, float]]] = {}
    held: dict[str, dict[str, int]] = {}
    try:
        # shared: one endpoint, one registration; each engine adds a link
        t0, rss0 = time.perf_counter(), _rss_mib()
        d = Endpoint("D", table.registration(), {}, listen=None)
        setup = (time.perf_counter() - t0, _rss_mib() - rss0)
        rows = []
        for i, addr in enumerate(addresses):
            t0, rss0 = time.perf_counter(), _rss_mib()
            link_peer(d, table, payload, {0: addr}, "pull", scope=f"p{i}", sender="D", timeout_s=30.0)
            rows.append((time.perf_counter() - t0, _rss_mib() - rss0))
        results["shared"] = rows
        held["shared"] = {"agents": 1, **d.handle_counts()}
        d.close()
        # per-peer: a new endpoint (agent + registration of the whole pool) per engine, as before
        from hybrid_kv.peer_link import prepare_link

        eps = []
        rows = []
        for i, addr in enumerate(addresses):
            t0, rss0 = time.perf_counter(), _rss_mib()
            prepared = prepare_link(table, payload, {0: addr}, "pull", sender=f"D->{i}", timeout_s=30.0)
            ep = Endpoint(f"D->{i}", table.registration(), prepared.local_tables, listen=None)
            ep.connect(0, addr, lambda pl, pr=prepared: pr.remote_tables(0), timeout_s=30.0, reply=prepared.replies[0])
            eps.append(ep)
            rows.append((time.perf_counter() - t0, _rss_mib() - rss0))
        results["per-peer"] = rows
        held["per-peer"] = {"agents": len(eps), "registrations": sum(e.handle_counts()["registrations"] for e in eps)}
        for ep in eps:
            ep.close()
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    print(f"decode pool {pool:.0f} MiB (tiny Kimi-Linear, 3 tensors), {args.engines} prefill engines (TP 1 each)")
    print(f"shared endpoint set-up (agent + one registration): {setup[0] * 1e3:.1f} ms, +{setup[1]:.1f} MiB RSS")
    print("| engine | shared: link ms | shared: +RSS MiB | per-peer: link ms | per-peer: +RSS MiB |")
    print("|---|---|---|---|---|")
    for i in range(args.engines):
        (st, sr), (pt, pr) = results["shared"][i], results["per-peer"][i]
        print(f"| {i + 1} | {st * 1e3:.1f} | {sr:.1f} | {pt * 1e3:.1f} | {pr:.1f} |")
    for mode in ("shared", "per-peer"):
        ts = [t for t, _ in results[mode]]
        rs = [r for _, r in results[mode]]
        print(f"{mode}: median {statistics.median(ts) * 1e3:.1f} ms and {statistics.median(rs):.1f} MiB per engine")
    print(f"held with {args.engines} engines: shared {held['shared']}; per-peer {held['per-peer']}")


if __name__ == "__main__":
    main()
