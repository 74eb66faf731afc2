"""The demo's transfer against the bare-NIXL floor and memcpy, side by side in one run.

Starts the demo's processes (``hybrid-kv demo``'s defaults: tiny Kimi-Linear, prefill TP 2 -> decode TP 1, pull,
16 requests): every rank allocates its pool from the preset and builds its region table as the demo's ranks do;
the decode rank plans every request once (``PeerLink.transfers``). Then, in interleaved rounds, it moves the same
descriptor ids three ways:

* ``hybrid-kv``: ``Endpoint.post`` per request, then ``Endpoint.poll()`` until every request is done, sleeping
  the demo's poll interval between polls (``demo.worker._wait_done``); the prefill ranks run the demo's
  passive loop (``poll()`` + sleep).
* ``bare NIXL``: a second NIXL agent per process (created, configured and registered as ``transport.Agent``
  does: no progress thread, UCX with ``ucx_error_handling_mode=peer``, restricted to loopback, the same
  registration), the same local and remote tables prepped once (``prep_xfer_dlist``, strided rows), and per
  request and peer one ``make_prepped_xfer`` (the same ids, a notification of a done-notice's length) +
  ``transfer``, then ``check_xfer_state`` on every handle until all are done, handles released. The prefill ranks
  drain ``get_new_notifs()`` with the same sleep between calls.
* ``endpoint raw``: the same bare NIXL calls on the handles the hybrid-kv endpoint prepped (``Endpoint.post_raw``,
  what the demo reports as its NIXL floor).
* ``memcpy``: one contiguous ``np.copyto`` of the same number of bytes in the decode rank (the demo's reference).

Before each round the decode pools are zeroed; after the first and the last round of each NIXL path their digest
must be the same for every path (the same bytes landed), else the bench fails. ``us/desc`` divides by the
descriptors NIXL posted after its merge (telemetry, as the demo prints them).

Run: ``PYTHONPATH=python python benches/nixl_floor.py [--rounds 7] [--requests 16] [--tokens 4000] [--json F]``
(``--profile F``: cProfile of the decode rank's ``hybrid-kv`` rounds, written to F).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import json
import multiprocessing as mp
import os
import queue
import secrets
import statistics
import time
from typing import Any

import numpy as np

from hybrid_kv.demo.run import DemoConfig, make_requests
from hybrid_kv.demo.worker import POLL_SLEEP_S

PATHS = ("hybrid-kv", "endpoint raw", "bare NIXL", "memcpy")
IDLE_POLL_S = 0.002
"""How often a rank progresses its agents between rounds."""
SETTLE_S = 0.3
"""Pause between connecting and the first round (the demo fills its pools then), with every agent progressed."""


def _side(cfg: DemoConfig, role: str) -> Any:
    prefill, decode = cfg.validate()
    return (prefill, decode) if role == "prefill" else (decode, prefill)


def _setup(cfg: DemoConfig, role: str, rank: int) -> tuple[Any, list[np.ndarray], Any, bytes, Any]:
    """The rank's pools (prefill: random bytes), region table, handshake payload and registration, as the demo's
    worker builds them."""
    from hybrid_kv.demo.content import random_bytes
    from hybrid_kv.torch_adapter import region_table_from_tensors

    side, _ = _side(cfg, role)
    geo, preset = side.geometry, side.preset
    kb = cfg.prefill_block_size if role == "prefill" else cfg.decode_block_size
    pools_t, layers, _ = preset.torch_layers(side.tp, rank, side.num_blocks, kernel_block_size=kb)
    pools = [p.numpy().reshape(-1) for p in pools_t]
    for i, pool in enumerate(pools):
        pool[:] = random_bytes(cfg.seed, (7, int(role == "decode"), rank, i), pool.size)
    table = region_table_from_tensors(
        layers,
        logical_block_size=geo.logical_block_size,
        kernel_block_size=geo.kernel_block_size,
        num_logical_blocks=side.num_blocks,
        tp_rank=rank,
        tp_size=side.tp,
        total_num_kv_heads=preset.attention.num_kv_heads,
    )
    payload = table.handshake_payload(preset.engine_info(role, cfg.mode))
    return pools_t, pools, table, payload, table.registration()


def _bare_agent(name: str, registration: Any) -> tuple[Any, Any]:
    """A NIXL agent set up as ``transport.Agent`` sets its own up (no progress thread, UCX, peer error mode,
    loopback only), with ``registration`` registered."""
    from nixl._api import nixl_agent, nixl_agent_config

    from hybrid_kv.transport import netif

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[], capture_telemetry=True))
    with netif.ucx_restricted_to(netif.interface_of(netif.listen_host("tcp://127.0.0.1:0"))):
        agent.create_backend("UCX", {"ucx_error_handling_mode": "peer"})
    reg = agent.register_memory(np.ascontiguousarray(registration, dtype=np.uint64), "DRAM")
    return agent, reg


def rank_main(cfg_kw: dict[str, Any], role: str, rank: int, inbox: Any, outbox: Any, secret: str, prof: str) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ["HYBRID_KV_SECRET"] = secret
    import torch

    torch.set_num_threads(1)
    try:
        cfg = DemoConfig(**cfg_kw)
        if role == "prefill":
            _prefill(cfg, rank, inbox, outbox)
        else:
            _decode(cfg, rank, inbox, outbox, prof)
    except BaseException as exc:
        import traceback

        outbox.put(("error", role, rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _prefill(cfg: DemoConfig, rank: int, inbox: Any, outbox: Any) -> None:
    from hybrid_kv.transport import Endpoint

    pools_t, _pools, table, payload, registration = _setup(cfg, "prefill", rank)
    agent, _reg = _bare_agent(f"bare-prefill-{rank}", registration)
    ep = Endpoint(f"prefill-{rank}", registration, {"whole": table.local_rows()}, metadata_provider=lambda r: payload)
    outbox.put(("ready", "prefill", rank, ep.address, agent.get_agent_metadata()))
    serving, notices = "idle", 0
    while True:
        try:
            cmd = inbox.get(timeout=IDLE_POLL_S) if serving == "idle" else inbox.get_nowait()
        except queue.Empty:
            cmd = None
        if cmd is None and serving == "idle":  # a passive rank keeps both agents progressed (UCX wire-up)
            ep.poll()
            agent.get_new_notifs()
        if cmd is not None:
            if cmd[0] == "stop":
                break
            serving = cmd[1]
            outbox.put(("serving", "prefill", rank, notices))
            continue
        if serving in ("hybrid-kv", "endpoint raw"):  # the demo's passive rank: demo.worker._Worker.wait
            ev = ep.poll()
            if ev.failed or ev.remote_failed:
                raise RuntimeError(f"prefill {rank}: {ev.failed} {ev.remote_failed}")
            time.sleep(POLL_SLEEP_S)
        elif serving == "bare NIXL":
            notices += sum(len(v) for v in agent.get_new_notifs().values())
            time.sleep(POLL_SLEEP_S)
    ep.close()
    del pools_t


def _decode(cfg: DemoConfig, rank: int, inbox: Any, outbox: Any, prof: str) -> None:
    from hybrid_kv._core import handshake_target_ranks
    from hybrid_kv.peer_link import attach_link, prepare_link
    from hybrid_kv.transport import Endpoint
    from hybrid_kv.transport.notifications import done_message

    decode, prefill = _side(cfg, "decode")
    pools_t, pools, table, payload, registration = _setup(cfg, "decode", rank)
    requests = make_requests(cfg, prefill, decode)
    outbox.put(("ready", "decode", rank, None, None))
    _, addresses, bare_mds = inbox.get()
    targets = [int(r) for r in handshake_target_ranks(rank, decode.tp, prefill.tp)]
    ep = Endpoint(f"decode-{rank}", registration, {})
    prepared = prepare_link(
        table, payload, {r: addresses[r] for r in targets}, "pull", sender=f"decode-{rank}", timeout_s=10
    )
    link = attach_link(ep, prepared, "peer", timeout_s=10.0)
    plans = [link.transfers(r.decode_ids, r.prefill_ids) for r in requests]
    nbytes = sum(link.transfer_bytes(t) for p in plans for t in p)
    ids = sum(int(t.local_ids.size) for p in plans for t in p)

    agent, _reg = _bare_agent(f"bare-decode-{rank}", registration)
    local = {k: agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, "DRAM") for k, rows in link.local_tables.items()}
    remote: dict[int, dict[str, Any]] = {}
    for r in targets:
        name = agent.add_remote_agent(bare_mds[r])
        name = name.decode() if isinstance(name, bytes) else name
        agent.make_connection(name)  # as transport.Agent.add_remote does
        remote[r] = {k: agent.prep_xfer_dlist(name, rows, "DRAM") for k, rows in link.remote_tables(r).items()}
    bare_items = []
    for req, p in zip(requests, plans, strict=True):
        per_peer: dict[int, int] = {}
        for t in p:
            per_peer[link.rank_of(t.peer)] = per_peer.get(link.rank_of(t.peer), 0) + 1
        index: dict[int, int] = {}
        for t in p:
            r = link.rank_of(t.peer)
            msg = done_message(req.rid, index.get(r, 0), per_peer[r])  # what hybrid-kv's notice carries
            index[r] = index.get(r, 0) + 1
            bare_items.append((local[t.local_key], t.local_ids, remote[r][t.remote_key], t.remote_ids, msg))
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.full(nbytes, 2, dtype=np.uint8)  # touched: the reference copies into faulted-in memory
    profiler = cProfile.Profile() if prof else None
    counter = [0]

    def run_hybrid() -> int:
        counter[0] += 1
        pending = set()
        handles = []
        for req, p in zip(requests, plans, strict=True):
            rid = f"{req.rid}/{counter[0]}"
            handles.append(ep.post(rid, p, "READ", 60.0))
            pending.add(rid)
        while pending:  # demo.worker._Worker._wait_done
            ev = ep.poll()
            for rid in ev.done:
                pending.discard(rid)
            if ev.failed:
                raise RuntimeError(str(ev.failed[0]))
            if pending:
                time.sleep(POLL_SLEEP_S)
        return sum(h.stats.descriptors for h in handles)

    def run_bare() -> int:
        live = []
        for lh, lids, rh, rids, msg in bare_items:
            h = agent.make_prepped_xfer("READ", lh, lids, rh, rids, notif_msg=msg)
            st = agent.transfer(h)
            if st == "ERR":
                raise RuntimeError("bare transfer ERR")
            live.append(h)
        pending = list(live)
        while pending:
            rest = []
            for h in pending:
                st = agent.check_xfer_state(h)
                if st == "ERR":
                    raise RuntimeError("bare transfer ERR")
                if st != "DONE":
                    rest.append(h)
            pending = rest
        posted = sum(int(agent.get_xfer_telemetry(h).descCount) for h in live)
        for h in live:
            agent.release_xfer_handle(h)
        return posted

    raw_items = []
    for req, p in zip(requests, plans, strict=True):
        counts: dict[Any, int] = {}
        for t in p:
            counts[t.peer] = counts.get(t.peer, 0) + 1
        raw_items += [(t, f"{counts[t.peer]}:{req.rid}".encode()) for t in p]

    def run_raw() -> int:
        return int(ep.post_raw(raw_items, "READ").descriptors)

    def run_memcpy() -> int:
        np.copyto(dst, src)
        return 0

    runners = {"hybrid-kv": run_hybrid, "endpoint raw": run_raw, "bare NIXL": run_bare, "memcpy": run_memcpy}
    outbox.put(("connected", "decode", rank, nbytes, ids, sum(len(p) for p in plans)))
    while True:
        try:
            cmd = inbox.get(timeout=IDLE_POLL_S)
        except queue.Empty:  # progress both agents between rounds (as the demo's ranks poll while waiting)
            ep.poll()
            agent.get_new_notifs()
            continue
        if cmd[0] == "stop":
            break
        path, profile, check = cmd[1], cmd[2], cmd[3]
        for pool in pools:
            pool.fill(0)
        gc.collect()
        gc.disable()
        if profile and profiler is not None and path == "hybrid-kv":
            profiler.enable()
        t0 = time.perf_counter()
        posted = runners[path]()
        secs = time.perf_counter() - t0
        if profiler is not None:
            profiler.disable()
        gc.enable()
        digest = ""
        if check and path != "memcpy":
            digest = hashlib.blake2b(b"".join(p.tobytes() for p in pools)).hexdigest()
        outbox.put(("ran", "decode", rank, path, secs, posted, digest))
    if profiler is not None:
        profiler.dump_stats(prof)
    link.close()
    ep.close()
    del pools_t


class Ranks:
    def __init__(self, cfg: DemoConfig, prof: str) -> None:
        ctx = mp.get_context("spawn")
        prefill, decode = cfg.validate()
        self.outbox: Any = ctx.Queue()
        self.inboxes: dict[tuple[str, int], Any] = {}
        self.procs: list[Any] = []
        secret = secrets.token_hex(32)
        for role, tp in (("prefill", prefill.tp), ("decode", decode.tp)):
            for rank in range(tp):
                q = ctx.Queue()
                p = ctx.Process(
                    target=rank_main,
                    args=(vars(cfg) | {}, role, rank, q, self.outbox, secret, prof if role == "decode" else ""),
                    daemon=True,
                )
                p.start()
                self.inboxes[(role, rank)] = q
                self.procs.append(p)

    def keys(self, role: str) -> list[tuple[str, int]]:
        return [k for k in self.inboxes if k[0] == role]

    def collect(
        self, kind: str, keys: list[tuple[str, int]], timeout: float = 300.0
    ) -> dict[tuple[str, int], tuple[Any, ...]]:
        got: dict[tuple[str, int], tuple[Any, ...]] = {}
        end = time.monotonic() + timeout
        while len(got) < len(keys):
            msg = self.outbox.get(timeout=max(0.1, end - time.monotonic()))
            if msg[0] == "error":
                raise RuntimeError(f"{msg[1]} rank {msg[2]}: {msg[3]}")
            if msg[0] != kind:
                raise RuntimeError(f"expected {kind!r}, got {msg[0]!r}")
            got[(msg[1], msg[2])] = tuple(msg[3:])
        return got

    def send(self, keys: list[tuple[str, int]], *cmd: Any) -> None:
        for k in keys:
            self.inboxes[k].put(cmd)

    def close(self) -> None:
        self.send(list(self.inboxes), "stop")
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--preset", default="tiny-kimi-linear")
    ap.add_argument("--prefill-tp", type=int, default=2)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--profile", default="", help="write a cProfile of the decode rank's hybrid-kv rounds here")
    ap.add_argument(
        "--paths",
        default=",".join(PATHS),
        help="which paths to run, comma-separated (an older tree has no 'endpoint raw'); 'bare NIXL' and 'memcpy' "
        "are always run",
    )
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    cfg = DemoConfig(
        preset=args.preset,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        requests=args.requests,
        tokens=args.tokens,
        verify="off",
    )
    chosen = {p.strip() for p in args.paths.split(",")} | {"bare NIXL", "memcpy"}
    if not chosen <= set(PATHS):
        ap.error(f"--paths: unknown {sorted(chosen - set(PATHS))}; known: {', '.join(PATHS)}")
    paths = [p for p in PATHS if p in chosen]
    ranks = Ranks(cfg, os.path.abspath(args.profile) if args.profile else "")
    try:
        ready = ranks.collect("ready", ranks.keys("prefill") + ranks.keys("decode"))
        addresses = {rank: v[0] for (role, rank), v in ready.items() if role == "prefill"}
        mds = {rank: v[1] for (role, rank), v in ready.items() if role == "prefill"}
        ranks.send(ranks.keys("decode"), "connect", addresses, mds)
        connected = ranks.collect("connected", ranks.keys("decode"))
        time.sleep(SETTLE_S)
        nbytes = sum(v[0] for v in connected.values())
        ids = sum(v[1] for v in connected.values())
        xfers = sum(v[2] for v in connected.values())
        times: dict[str, list[float]] = {p: [] for p in paths}
        posted: dict[str, int] = {}
        digests: dict[tuple[str, int], set[str]] = {k: set() for k in ranks.keys("decode")}
        first: dict[str, float] = {}
        for rnd in range(args.rounds + 1):  # round 0 warms up (UCX connections, caches) and is not counted
            for k in range(len(paths)):
                path = paths[(rnd + k) % len(paths)]
                if path != "memcpy":
                    ranks.send(ranks.keys("prefill"), "serve", path)
                    ranks.collect("serving", ranks.keys("prefill"))
                ranks.send(ranks.keys("decode"), "run", path, rnd > 0, rnd in (0, args.rounds))
                ran = ranks.collect("ran", ranks.keys("decode"))
                ranks.send(ranks.keys("prefill"), "serve", "idle")
                ranks.collect("serving", ranks.keys("prefill"))
                secs = max(v[1] for v in ran.values())
                posted[path] = sum(v[2] for v in ran.values())
                for key, v in ran.items():
                    digests[key] |= {v[3]} if v[3] else set()
                if rnd > 0:
                    times[path].append(secs)
                else:
                    first[path] = secs
        if any(len(d) != 1 for d in digests.values()):
            raise RuntimeError(f"the NIXL paths landed different bytes: {digests}")
        counts = {p: posted[p] for p in paths if p != "memcpy"}
        if len(set(counts.values())) != 1:
            raise RuntimeError(f"the NIXL paths posted different numbers of descriptors: {counts}")
    finally:
        ranks.close()
    med = {p: statistics.median(v) for p, v in times.items()}
    desc = posted["bare NIXL"]
    print(
        f"{cfg.preset}, prefill TP {cfg.prefill_tp} -> decode TP {cfg.decode_tp}, pull, {cfg.requests} requests: "
        f"{nbytes / 2**20:.1f} MiB in {desc} descriptors posted ({ids} ids, {xfers} NIXL transfers, "
        f"{nbytes / max(1, desc) / 1024:.1f} KiB per descriptor); median of {args.rounds} interleaved rounds"
    )
    print("| path | time | GB/s | us/desc | x bare NIXL | x memcpy | first round (cold) |")
    print("|---|---|---|---|---|---|---|")
    for p in paths:
        us = f"{med[p] / desc * 1e6:.2f}" if p != "memcpy" else "-"
        print(
            f"| {p} | {med[p] * 1e3:.2f} ms | {nbytes / med[p] / 1e9:.2f} | {us} | {med[p] / med['bare NIXL']:.2f} "
            f"| {med[p] / med['memcpy']:.1f} | {first[p] * 1e3:.2f} ms |"
        )
    for p in paths:
        if p not in ("bare NIXL", "memcpy"):
            ratios = sorted(h / b for h, b in zip(times[p], times["bare NIXL"], strict=True))
            print(
                f"{p} / bare NIXL, round by round: median {statistics.median(ratios):.2f}x "
                f"[{ratios[0]:.2f}-{ratios[-1]:.2f}]"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "descriptors": desc, "ids": ids, "times": times, "first": first}, f, indent=1)


if __name__ == "__main__":
    main()
