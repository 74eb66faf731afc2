"""One kit rank: a prefill or decode rank's pools on the kit's device, its NIXL endpoint, its link to the peer
engine, and the commands the kit's steps drive it with.

A rank allocates its HMA pools from a preset (``Preset.torch_layers`` on the device), fills every byte with its
pattern (``pattern``), builds its region table and handshake payload, and opens an ``Endpoint`` with the pools'
memory type (``VRAM`` on a GPU) and a side channel on loopback. The posting rank (decode in pull, prefill in
push) links to the peer ranks through ``peer_link`` and plans every request with the Rust planner; the passive
rank answers digest asks (pull) or awaits the peer's WRITEs (push), as the demo's ranks and the connector do.
Verified transfers use ``hybrid_kv.verify`` (``wsum`` on the device for device memory, ``xxh3`` for host memory).

``serve`` runs a rank as its own process (spawned by ``Ranks``): commands come on a pipe as ``(command,
kwargs)`` and are answered ``("ok", command, result)`` or ``("error", command, reason)``; between commands the
rank keeps progressing its endpoint, and a passive decode reports each awaited request as an event
``("event", "landed", {...})`` with the monotonic time it completed.
"""

from __future__ import annotations

import ctypes
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .device import Device, copy_seconds
from .pattern import Overlay, check, fill, views_of

__all__ = ["Rank", "RankSpec", "serve"]

POLL_SLEEP_S = 0.0002
U64 = npt.NDArray[np.uint64]


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to set itself up (picklable)."""

    name: str  # the NIXL agent name, unique in the kit run
    role: str  # "prefill" | "decode"
    rank: int
    tp: int
    remote_tp: int
    mode: str  # "pull" | "push"
    preset: str
    num_blocks: int
    seed: int  # the pattern seed of this rank's pools
    device: str
    chunk: int
    deadline_s: float = 60.0
    ucx_error_mode: str = "peer"  # the endpoint's ucx_error_handling_mode (the connector's is "peer")

    @property
    def active(self) -> bool:
        """Whether this rank posts the transfers (decode pulls, prefill pushes)."""
        return (self.role == "decode") == (self.mode == "pull")


@dataclass
class Rank:
    """A rank's state in its process (see the module doc)."""

    spec: RankSpec
    requests: dict[str, Any] = field(default_factory=dict)  # request name -> demo Request (both sides' ids)
    transfers: dict[str, list[Any]] = field(default_factory=dict)  # request name -> its planned transfers
    peers: dict[int, tuple[str, str]] = field(default_factory=dict)  # peer rank -> (address, endpoint name)
    digest_s: float = 0.0  # time this rank spent computing digests
    ask_s: float = 0.0  # pull, posting rank: time from the first digest ask to the last answer
    digested: int = 0
    landed: list[dict[str, Any]] = field(default_factory=list)  # passive push: awaited requests that ended
    awaited: dict[str, Any] = field(default_factory=dict)  # passive push: posted id -> handle

    # ------------------------------------------------------------------ set-up

    def setup(self) -> dict[str, Any]:
        """Pools on the device filled with this rank's pattern, region table, payload and endpoint."""
        from ..presets import get_preset
        from ..torch_adapter import region_table_from_tensors
        from ..transport import Endpoint
        from ..verify import Digester, MirrorCache

        spec = self.spec
        self.device = Device(spec.device, spec.chunk)
        self.device.activate(threads=1)
        t0 = time.perf_counter()
        self.preset = get_preset(spec.preset)
        self.pools, layers, self.geometry = self.preset.torch_layers(
            spec.tp, spec.rank, spec.num_blocks, device=spec.device
        )
        self.views = views_of(self.pools)
        fill(self.views, spec.seed, spec.chunk)
        self.device.sync()
        self.table = region_table_from_tensors(
            layers,
            logical_block_size=self.geometry.logical_block_size,
            kernel_block_size=self.geometry.kernel_block_size,
            num_logical_blocks=spec.num_blocks,
            tp_rank=spec.rank,
            tp_size=spec.tp,
            total_num_kv_heads=self.preset.attention.num_kv_heads,
        )
        self.payload = self.table.handshake_payload(self.preset.engine_info(spec.role, spec.mode))
        self.digester = Digester(self.table, self.pools)
        self.mirrors = MirrorCache(self.payload)
        alloc_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        tables = {} if spec.active else {"whole": self.table.local_rows()}
        self.ep = Endpoint(
            spec.name,
            self.table.registration(),
            tables,
            mem_type=self.table.mem_type,
            metadata_provider={spec.rank: self.payload},
            ucx_error_handling_mode=spec.ucx_error_mode,
        )
        self.link: Any = None
        return {
            "address": self.ep.address,
            "payload": self.payload,
            "name": spec.name,
            "mem_type": self.table.mem_type,
            "pool_bytes": sum(v.nbytes for v in self.views),
            "regions": self.table.num_regions,
            "alloc_fill_s": alloc_s,
            "endpoint_s": time.perf_counter() - t0,
        }

    def connect(self, peers: dict[int, tuple[str, str]]) -> dict[str, Any]:
        """Link to the peer ranks (``{rank: (address, endpoint name)}``): fetch, validate, plan, connect."""
        from ..peer_link import attach_link, prepare_link

        self.peers = dict(peers)
        t0 = time.perf_counter()
        prepared = prepare_link(
            self.table,
            self.payload,
            {r: a for r, (a, _) in peers.items()},
            self.spec.mode,
            sender=self.spec.name,
            timeout_s=30.0,
            names={r: n for r, (_, n) in peers.items()},
        )
        plan_s = time.perf_counter() - t0
        self.peer_payloads = {r: reply.payload for r, reply in prepared.replies.items()}
        self.link = attach_link(self.ep, prepared, "peer", timeout_s=30.0)
        return {"plan_setup_s": plan_s, "connect_s": self.link.connect_s, "tables": self.link.table_shapes()}

    def take_requests(self, requests: list[Any]) -> None:
        """The batch: every request with both sides' logical block ids per group."""
        self.requests.update({r.rid: r for r in requests})

    def ids(self, r: Any) -> tuple[list[list[int]], list[list[int]]]:
        """``(local, remote)`` block ids of request ``r`` for this rank."""
        return (r.decode_ids, r.prefill_ids) if self.spec.role == "decode" else (r.prefill_ids, r.decode_ids)

    # ------------------------------------------------------------------ the posting rank

    def plan(self, names: list[str]) -> dict[str, Any]:
        """Plan each request (Rust planner); returns its bytes, ids, the peer ranks each request moves bytes
        with, and every byte move per peer rank (``(local, remote, len)`` rows, for the peers' byte checks)."""
        link = self.link
        moves: dict[int, list[U64]] = {}
        targets: dict[str, list[int]] = {}
        nbytes = ids = 0
        t0 = time.perf_counter()
        for rid in names:
            local, remote = self.ids(self.requests[rid])
            self.transfers[rid] = link.transfers(local, remote)
        plan_s = time.perf_counter() - t0
        for rid in names:
            ts = self.transfers[rid]
            targets[rid] = sorted({link.rank_of(t.peer) for t in ts})
            for t in ts:
                peer = link.rank_of(t.peer)
                moves.setdefault(peer, []).append(link.plan.resolve(t.local_key, peer, t.local_ids, t.remote_ids))
                nbytes += link.transfer_bytes(t)
                ids += int(t.local_ids.size)
        return {
            "plan_s": plan_s,
            "bytes": nbytes,
            "ids": ids,
            "targets": targets,
            "moves": {p: np.concatenate(m) for p, m in moves.items()},
        }

    def run(self, names: list[str], tag: str, verify: bool) -> dict[str, Any]:
        """Post every request of ``names`` at once (posted ids ``name@tag``) and wait until all ended; with
        ``verify``, end-to-end digests as the connector takes them. Returns the wall time and NIXL's telemetry."""
        from ..transport import Op, RequestState
        from ..verify import algorithm, initiator_digests, payload_mem_type

        spec = self.spec
        op: Op = "READ" if spec.mode == "pull" else "WRITE"
        algo = algorithm(self.table.mem_type, *(payload_mem_type(p) for p in self.peer_payloads.values()))
        self.digest_s, self.digested, self.ask_s = 0.0, 0, 0.0
        t0 = time.perf_counter()
        rounds = self._claim(names, tag, algo) if verify and spec.mode == "pull" else {}
        handles = []
        for rid in names:
            ts = self.transfers[rid]
            if not ts:
                continue  # nothing of this request is this rank's to move (an MLA page another rank sends)
            digests, check_fn = None, None
            if verify and spec.mode == "push":
                d0 = time.perf_counter()
                mine = initiator_digests(self.digester, self.link.plan, ts, self.link.rank_of, algo)
                digests = {k: d.digest for k, d in mine.items()}
                self.digest_s += time.perf_counter() - d0
                self.digested += 1
            elif verify:
                check_fn = self._pull_check(ts, rounds[rid].theirs(rid), algo)
            handles.append(self.ep.post(f"{rid}@{tag}", ts, op, spec.deadline_s, digests=digests, check=check_fn))
        claims = list({id(r): r for r in rounds.values()}.values())
        while any(not h.finished for h in handles):
            controls = self.ep.poll().control
            for r in claims:  # the prefill digests that follow their claims' confirmations
                controls = r.feed(controls)
            time.sleep(POLL_SLEEP_S)
        wall = time.perf_counter() - t0
        failed = [f"{h.request_id}: {h.error}" for h in handles if h.state is not RequestState.DONE]
        return {
            "seconds": wall,
            "descriptors": sum(h.stats.descriptors for h in handles),
            "bytes": sum(h.stats.bytes for h in handles),
            "nixl_transfers": sum(h.stats.transfers for h in handles),
            "digest_s": self.digest_s,
            "digested": self.digested,
            "ask_s": self.ask_s,
            "algorithm": algo if verify else None,
            "failed": failed,
        }

    def _claim(self, names: list[str], tag: str, algo: str) -> dict[str, Any]:
        """Pull: claim every request from the prefill ranks it reads from, asking their digests, and wait for the
        confirmations (as the connector does: the digests follow while the READs run); returns each request's
        ``ClaimRound``."""
        from ..claims import ClaimEntry, ClaimRound

        t0 = time.perf_counter()
        by_peers: dict[tuple[int, ...], list[ClaimEntry]] = {}
        for rid in names:
            if not self.transfers[rid]:
                continue
            local, _ = self.ids(self.requests[rid])
            peers = tuple(sorted({self.link.rank_of(t.peer) for t in self.transfers[rid]}))
            by_peers.setdefault(peers, []).append(ClaimEntry(f"{rid}@{tag}", b"", rid, local, True))
        rounds: dict[str, Any] = {}
        for peers, entries in by_peers.items():
            targets = {p: self.peers[p] for p in peers}
            claims = ClaimRound(self.ep, targets, entries, "decode", self.payload, algo, self.spec.deadline_s)
            claims.wait()
            rounds.update((e.d_req, claims) for e in entries)
        self.ask_s += time.perf_counter() - t0
        return rounds

    def _timers(self) -> tuple[Any, Any]:
        """``(before, on_result)`` hooks timing one verification check into ``digest_s`` and counting it."""
        started = [0.0]

        def before() -> None:
            started[0] = time.perf_counter()

        def timed(reason: str | None) -> None:
            self.digest_s += time.perf_counter() - started[0]
            self.digested += 1

        return before, timed

    def _pull_check(self, transfers: list[Any], theirs: Any, algo: str) -> Any:
        from ..verify import pull_check

        def digested(seconds: float) -> None:
            self.digest_s += seconds

        def decided(reason: str | None) -> None:
            self.digested += 1

        link = self.link
        return pull_check(
            self.digester,
            link.plan,
            transfers,
            link.rank_of,
            algo,
            theirs,
            self.spec.rank,
            on_digested=digested,
            on_result=decided,
        )

    # ------------------------------------------------------------------ the passive rank

    def expect(self, posted: dict[str, list[str]], payloads: dict[int, bytes], verify: bool) -> None:
        """Push, decode side: await each posted id (``name@tag``) from exactly the writers named for it; with
        ``verify``, compare each writer's digest with this rank's digest of what landed."""
        from ..verify import algorithm, payload_mem_type

        ranks = {name: r for r, (_, name) in self.peers.items()}
        for pid, writers in posted.items():
            check_fn = None
            if verify:
                algo = algorithm(self.table.mem_type, *(payload_mem_type(p) for p in payloads.values()))
                check_fn = self._push_check(pid.split("@")[0], payloads, ranks, algo)
            self.awaited[pid] = self.ep.expect(pid, self.spec.deadline_s, writers=writers, check=check_fn)

    def _push_check(self, rid: str, payloads: dict[int, bytes], ranks: dict[str, int], algo: str) -> Any:
        from ..verify import push_check

        r = self.requests[rid]
        before, timed = self._timers()

        def writer(sender: str) -> tuple[int, bytes, bool, Any]:
            return ranks[sender], payloads[ranks[sender]], True, r.prefill_ids

        return push_check(
            self.mirrors,
            self.digester,
            writer,
            r.decode_ids,
            self.spec.rank,
            lambda _: algo,
            before=before,
            on_result=timed,
        )

    def expect_from(
        self, peers: dict[int, tuple[str, str]], posted: dict[str, list[str]], payloads: dict[int, bytes], verify: bool
    ) -> None:
        """``expect`` with the writing ranks named (``{rank: (address, endpoint name)}``)."""
        self.peers = dict(peers)
        self.expect(posted, payloads, verify)

    def progress(self) -> list[dict[str, Any]]:
        """Progress the endpoint once: answer digest asks, report awaited requests that ended."""
        from ..claims import ClaimEntry, serve_claims
        from ..transport import RequestState

        ev = self.ep.poll()

        def lookup(entry: ClaimEntry) -> tuple[Any, float] | str:
            r = self.requests.get(entry.req.split("@")[0])
            return (r.prefill_ids, 0.0) if r is not None else f"no request {entry.req!r} here"

        t0 = time.perf_counter()
        answered = serve_claims(self.ep, ev.control, lookup, self.mirrors, self.digester)
        if answered:
            self.digest_s += time.perf_counter() - t0
            self.digested += answered
        out = []
        now = time.monotonic()
        for pid in [p for p, h in self.awaited.items() if h.finished]:
            h = self.awaited.pop(pid)
            ok = h.state is RequestState.DONE
            out.append({"id": pid, "t": now, "ok": ok, "error": "" if ok else str(h.error)})
        return out

    # ------------------------------------------------------------------ checks and the rest

    def refill(self, seed: int) -> None:
        """Write this rank's pattern (``seed``) into every byte of its pools again."""
        fill(self.views, seed, self.spec.chunk)
        self.device.sync()

    def check(self, overlays: list[tuple[int, U64]], seed: int | None = None) -> dict[str, Any]:
        """Compare every byte of the pools with this rank's pattern plus what ``overlays`` (``(source seed,
        (src, dst, len) moves)``) moved in, on the device."""
        self.device.sync()
        res = check(self.views, seed or self.spec.seed, [Overlay(s, m) for s, m in overlays], self.spec.chunk)
        return res.to_dict()

    def request_bytes(self, name: str) -> int:
        """Bytes request ``name``'s planned transfers move (posting rank)."""
        return sum(self.link.transfer_bytes(t) for t in self.transfers[name])

    def flip(self, address: int) -> None:
        """Fault injection (tests): flip one bit of the pool byte at ``address``."""
        v = next(v for v in self.views if v.base <= address < v.base + v.nbytes)
        v.flat[address - v.base] ^= 1
        self.device.sync()

    def copy_seconds(self, nbytes: int, repeats: int) -> float:
        return copy_seconds(self.device, nbytes, repeats)

    def stats(self) -> dict[str, Any]:
        return {"digest_s": self.digest_s, "digested": self.digested}

    def close(self) -> dict[str, int]:
        """Close the link and endpoint (NIXL handles all released), then free the pools."""
        counts: dict[str, int] = {}
        if getattr(self, "link", None) is not None:
            self.link.close()
        if getattr(self, "ep", None) is not None:
            self.ep.close()
            counts = self.ep.handle_counts()
        for name in ("pools", "views", "digester", "table"):
            if hasattr(self, name):
                delattr(self, name)
        if hasattr(self, "device"):
            self.device.release()
        return counts


def _flush_c_stdio() -> None:
    """Flush C's stdio buffers (UCX writes its reports through them) so the log file is complete."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def serve(conn: Any, log_path: str, env: dict[str, str]) -> None:
    """A rank process: stdout and stderr to ``log_path``, ``env`` set, then commands until ``exit``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    rank: Rank | None = None
    broken = False  # progressing failed: reported once, tried again after the next command
    while True:
        if rank is not None and getattr(rank, "ep", None) is not None and not broken and not conn.poll(0):
            try:
                for e in rank.progress():
                    conn.send(("event", "landed", e))
            except Exception:  # noqa: BLE001 - the step reads the event and records it
                conn.send(("event", "error", traceback.format_exc()[-2000:]))
                broken = True
            time.sleep(POLL_SLEEP_S)
            continue
        if not conn.poll(0.05):
            continue
        cmd, kwargs = conn.recv()
        broken = False
        if cmd == "exit":
            _flush_c_stdio()
            conn.send(("ok", cmd, None))
            return
        try:
            if cmd == "setup":
                rank = Rank(kwargs["spec"])
                result: Any = rank.setup()
            elif cmd == "transports":
                from .ucx import transports

                _flush_c_stdio()
                result = transports(log_path)
            else:
                assert rank is not None, f"command {cmd!r} before setup"
                try:
                    result = getattr(rank, cmd)(**kwargs)
                finally:
                    if cmd == "close":
                        rank = None
            conn.send(("ok", cmd, result))
        except Exception as exc:  # noqa: BLE001 - the step records it and goes on
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            conn.send(("error", cmd, f"{detail}\n{traceback.format_exc()[-3000:]}"))
