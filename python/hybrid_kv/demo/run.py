"""The demo's coordinator: the "scheduler" that starts the ranks, hands out requests, and collects the verdict.

The coordinator allocates every request's logical block ids on both engines (disjoint across groups and
requests, with unallocated blocks between requests so untouched memory is checked too), starts one process
per rank, relays side-channel addresses (service discovery), and tells ranks when to fill, transfer and
verify. It never touches KV bytes: ranks move them over NIXL and check them themselves.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import LayoutError, PlanError, TransferError
from ..presets import get_preset
from .content import Request, Side
from .worker import WorkerSpec, memcpy_gbps

__all__ = ["PHASES", "PROGRESS", "DemoConfig", "DemoResult", "Event", "make_requests", "process_context", "run_demo"]

Event = Callable[[str, dict[str, Any]], None]

PHASES = ("startup", "handshake", "fill", "planning", "transfer", "verify", "floor", "shutdown")
"""The demo's phases, in order: each is timed by the coordinator from its command to the last rank's answer."""
PROGRESS = ("ready", "connected", "request_filled", "planned", "request_done", "pool_verified", "floor", "closed")
"""Rank messages that advance the current phase's progress by one."""


@dataclass
class DemoConfig:
    """What to run: model, TP sizes, block sizes, mode, and the batch."""

    preset: str = "tiny-kimi-linear"
    prefill_tp: int = 2
    decode_tp: int = 1
    mode: str = "pull"
    requests: int = 16
    tokens: int = 4000
    prefill_block_size: int | None = None
    decode_block_size: int | None = None
    num_blocks: int | None = None
    seed: int = 0
    timeout_s: float = 120.0
    corrupt: bool = False
    """Fault injection for tests: rank 0 of one side flips one byte before verifying (where: ``corrupt_at``)."""
    corrupt_at: str = "received"
    """``received``: a byte decode received; ``hole``: a decode byte no request names; ``prefill``: a prefill
    byte (which must be unchanged after the transfer); ``landed``: a byte of the first request's first decode
    block, flipped after its bytes landed and before decode rank 0 digests them (``verify`` must catch it)."""
    start_method: str = "spawn"
    """How rank processes start: ``spawn``, or ``forkserver`` (one server imports torch once and forks every
    rank from it: much faster startup when many ranks start on few cores)."""

    verify: str = "all"
    """Which requests are verified end to end (``hybrid_kv.verify``): ``off``, ``all`` or ``sampled:N``."""
    split_cores: bool = False
    """Prefill ranks on the first half of the cores this process may use, decode ranks on the other half (as P
    and D on machines of their own, so neither side's work takes the other's cores); needs 2 cores."""

    def validate(self) -> tuple[Side, Side]:
        """Check the arguments before any process starts; returns the ``(prefill, decode)`` sides."""
        from ..verify_policy import VerifyPolicy

        preset = get_preset(self.preset)
        try:
            VerifyPolicy.parse(self.verify)
        except ValueError as exc:
            raise LayoutError(str(exc)) from None
        if self.mode not in ("pull", "push"):
            raise LayoutError(f"mode must be 'pull' or 'push', got {self.mode!r}")
        if self.corrupt_at not in ("received", "hole", "prefill", "landed"):
            raise LayoutError(f"corrupt_at must be 'received', 'hole', 'prefill' or 'landed', got {self.corrupt_at!r}")
        if self.start_method not in ("spawn", "forkserver"):
            raise LayoutError(f"start method must be 'spawn' or 'forkserver', got {self.start_method!r}")
        if self.split_cores and len(usable_cores()) < 2:
            raise LayoutError(f"split_cores needs 2 cores, this process may use {len(usable_cores())}")
        if self.requests < 1 or self.tokens < 1:
            raise LayoutError(f"need at least one request of at least one token, got {self.requests} x {self.tokens}")
        preset.check_tp(self.prefill_tp, "prefill")
        preset.check_tp(self.decode_tp, "decode")
        lo, hi = sorted((self.prefill_tp, self.decode_tp))
        if hi % lo:
            raise PlanError(f"prefill TP {self.prefill_tp} and decode TP {self.decode_tp}: one must divide the other")
        pg = preset.geometry(self.prefill_tp, kernel_block_size=self.prefill_block_size)
        dg = preset.geometry(self.decode_tp, kernel_block_size=self.decode_block_size)
        n_p = self.num_blocks or _pool_size(preset.group_kinds(), pg.logical_block_size, self)
        n_d = self.num_blocks or _pool_size(preset.group_kinds(), dg.logical_block_size, self)
        return Side(preset, pg, n_p), Side(preset, dg, n_d)


def usable_cores() -> list[int]:
    """The cores this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def core_share(role: str) -> tuple[int, ...]:
    """``split_cores``: the prefill ranks' cores (the first half) or the decode ranks' (the rest)."""
    cores = usable_cores()
    half = len(cores) // 2
    return tuple(cores[:half] if role == "prefill" else cores[half:])


@dataclass
class DemoResult:
    """What happened: sizes, timings, and the verdict."""

    config: dict[str, Any]
    prefill: dict[str, Any]
    decode: dict[str, Any]
    requests: int = 0
    tokens: list[int] = field(default_factory=list)
    bytes_moved: int = 0
    descriptor_ids: int = 0  # ids the plans handed NIXL
    descriptors: int = 0  # descriptors NIXL posted, after merging ids consecutive on both sides (telemetry)
    nixl_transfers: int = 0
    peers: dict[str, list[int]] = field(default_factory=dict)
    tables: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    startup_s: float = 0.0
    plan_setup_s: float = 0.0
    handshake_s: float = 0.0
    plan_s: float = 0.0
    transfer_s: float = 0.0
    """The slowest active rank's transfer, verification excluded (its time posting and waiting for NIXL)."""
    transfer_total_s: float = 0.0
    """The slowest active rank's transfer with the verification it ran on the way (asking, digesting)."""
    verify_s: float = 0.0
    gbps: float = 0.0
    """``bytes_moved / transfer_s``."""
    memcpy_gbps: float = 0.0
    floor_s: float = 0.0
    """The NIXL floor: the slowest active rank posting the same transfers again with bare NIXL calls on the same
    handles (``Endpoint.post_raw``), after verification."""
    floor_descriptors: int = 0
    """Descriptors NIXL posted in the floor pass (telemetry; equal to ``descriptors``)."""
    floor_gbps: float = 0.0
    """``bytes_moved / floor_s``."""
    bytes_verified: int = 0
    """Decode memory compared with the logical model (every byte of every decode rank)."""
    prefill_bytes_verified: int = 0
    """Prefill memory checked unchanged since it was filled (every byte of every prefill rank)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Wall time of each phase as the coordinator saw it, in order (:data:`PHASES`), in seconds."""
    other_s: float = 0.0
    """Coordinator time outside every phase (argument checks, request allocation, the memcpy reference)."""
    total_s: float = 0.0
    """Wall time of the whole run: the phases plus ``other_s``."""
    problems: list[str] = field(default_factory=list)
    verified: bool = False
    verify: str = "off"
    """The ``verify`` setting the transfers ran with (end-to-end digests, ``hybrid_kv.verify``)."""
    digested_requests: int = 0
    """Requests whose digests were compared on the decode ranks (each decode rank's count, summed)."""
    digest_s: float = 0.0
    """Time the slowest decode rank spent digesting (what landed, or what it wrote into in push)."""
    peer_digest_s: float = 0.0
    """Time the slowest prefill rank spent digesting (pull: after answering the claims, while the READs run; push:
    before its WRITEs)."""
    digest_wait_s: float = 0.0
    """Pull: time the slowest decode rank's checks waited for prefill digests still on their way (what the prefill's
    digests added to the transfer)."""
    claim_s: float = 0.0
    """Pull: the slowest decode rank's claim round trip before its READs (one message per prefill rank for the
    batch, as the connector claims every lease; the prefill's digests of verified requests follow it)."""
    verified_bytes: int = 0
    """Bytes of the requests verified end to end (what the checking ranks digested)."""
    digest_mismatches: list[str] = field(default_factory=list)
    """Requests failed by a digest mismatch, as ``decode rank R: <the failure>`` (each is also a problem)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _requests_tokens(cfg: DemoConfig) -> list[int]:
    """Request lengths from ``tokens`` down to about half of it (odd lengths exercise partial blocks)."""
    return [max(1, cfg.tokens - (i * cfg.tokens) // (2 * cfg.requests)) for i in range(cfg.requests)]


def _blocks_needed(kinds: list[str], logical: int, tokens: list[int]) -> int:
    att = sum(k != "ssm" for k in kinds)
    ssm = len(kinds) - att
    return sum(att * max(1, math.ceil(t / logical)) + ssm + 1 for t in tokens)  # +1: a hole after each request


def _pool_size(kinds: list[str], logical: int, cfg: DemoConfig) -> int:
    need = _blocks_needed(kinds, logical, _requests_tokens(cfg))
    return need + max(2, need // 4)


def make_requests(cfg: DemoConfig, prefill: Side, decode: Side) -> list[Request]:
    """Every request with its logical block ids per group on both sides (ascending, a free block between requests)."""
    kinds = prefill.preset.group_kinds()
    tokens = _requests_tokens(cfg)
    for side, name in ((prefill, "prefill"), (decode, "decode")):
        need = _blocks_needed(kinds, side.geometry.logical_block_size, tokens)
        if need > side.num_blocks:
            raise LayoutError(f"{name} pool of {side.num_blocks} blocks is too small for the batch (needs {need})")
    nxt = {"prefill": 0, "decode": 0}

    def alloc(side: Side, name: str, t: int) -> list[list[int]]:
        out = []
        for kind in kinds:
            n = 1 if kind == "ssm" else side.logical_blocks_for(t)
            out.append(list(range(nxt[name], nxt[name] + n)))
            nxt[name] += n
        nxt[name] += 1
        return out

    reqs = []
    for i, t in enumerate(tokens):
        p, d = alloc(prefill, "prefill", t), alloc(decode, "decode", t)
        att = next((g for g, k in enumerate(kinds) if k != "ssm"), 0)
        content = max(prefill.attention_tokens(len(p[att])), decode.attention_tokens(len(d[att])))
        reqs.append(Request(i, f"req-{i}", t, p, d, content))
    return reqs


def process_context(start_method: str = "spawn") -> Any:
    """The multiprocessing context rank processes start from: ``spawn``, or ``forkserver`` whose server imports
    torch and the worker once (ranks are forked from it; nothing in it has touched NIXL or started a thread)."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":  # no effect once this process's server runs (same modules anyway)
        ctx.set_forkserver_preload(["torch", "hybrid_kv.demo.worker"])
    return ctx


class _Ranks:
    """The rank processes and their queues."""

    def __init__(self, cfg: DemoConfig, prefill: Side, decode: Side, events: Event) -> None:
        from . import worker

        self.cfg = cfg
        self.events = events
        ctx = process_context(cfg.start_method)
        secret = os.environ.get("HYBRID_KV_SECRET") or secrets.token_hex(32)  # the ranks' side-channel secret
        self.outbox: Any = ctx.Queue()
        self.procs: dict[tuple[str, int], Any] = {}
        self.inboxes: dict[tuple[str, int], Any] = {}
        self.inbox_msgs: dict[str, dict[tuple[str, int], tuple[Any, ...]]] = {}
        sides = {
            "prefill": (prefill, decode, cfg.prefill_block_size),
            "decode": (decode, prefill, cfg.decode_block_size),
        }
        for role, (side, other, kb) in sides.items():
            other_kb = cfg.decode_block_size if role == "prefill" else cfg.prefill_block_size
            for rank in range(side.tp):
                spec = WorkerSpec(
                    role,
                    rank,
                    cfg.mode,
                    cfg.preset,
                    side.tp,
                    other.tp,
                    side.num_blocks,
                    kb,
                    cfg.seed,
                    cfg.timeout_s,
                    cfg.verify,
                    cfg.corrupt and cfg.corrupt_at == "landed",
                    core_share(role) if cfg.split_cores else None,
                )
                inbox = ctx.Queue()
                proc = ctx.Process(
                    target=worker.main,
                    args=(spec, inbox, self.outbox, (other_kb, other.num_blocks), secret),
                    name=f"hybrid-kv-{spec.name}",
                    daemon=True,
                )
                proc.start()
                self.procs[(role, rank)] = proc
                self.inboxes[(role, rank)] = inbox

    def keys(self, role: str | None = None) -> list[tuple[str, int]]:
        return [k for k in self.procs if role is None or k[0] == role]

    def send(self, keys: list[tuple[str, int]], *cmd: Any) -> None:
        for k in keys:
            self.inboxes[k].put(cmd)

    def collect(self, kind: str, keys: list[tuple[str, int]]) -> dict[tuple[str, int], tuple[Any, ...]]:
        """Wait for one ``kind`` message from each of ``keys`` (other messages are dispatched meanwhile)."""
        got = self.inbox_msgs.setdefault(kind, {})
        end = time.monotonic() + self.cfg.timeout_s
        while not all(k in got for k in keys):
            left = end - time.monotonic()
            if left <= 0:
                missing = ", ".join(f"{r} rank {n}" for r, n in keys if (r, n) not in got)
                raise TransferError(f"timed out after {self.cfg.timeout_s:g} s waiting for {kind!r} from {missing}")
            try:
                msg = self.outbox.get(timeout=min(left, 0.5))
            except queue.Empty:  # noqa: PERF203
                dead = [k for k, p in self.procs.items() if not p.is_alive() and k not in got]
                if dead and kind != "closed":
                    r, n = dead[0]
                    code = self.procs[dead[0]].exitcode
                    raise TransferError(f"{r} rank {n} exited unexpectedly (exit code {code})") from None
                continue
            mkind, role, rank, *payload = msg
            if mkind == "error":
                raise TransferError(f"{role} rank {rank}: {payload[0]}")
            if mkind in PROGRESS and (mkind != "request_done" or role == "decode"):  # a request done: as decode has it
                self.events("advance", {"kind": mkind, "role": role, "rank": rank})
            if mkind in ("request_done", "request_filled", "pool_verified"):
                continue
            self.inbox_msgs.setdefault(mkind, {})[(role, rank)] = tuple(payload)
        return {k: got[k] for k in keys}

    def close(self, clean: bool) -> None:
        """Finish (clean) or stop every rank, then reap the processes."""
        self.events("stage", {"name": "shutdown: ranks closing", "total": len(self.procs)})
        self.send(self.keys(), "finish" if clean else "stop")
        if clean:
            try:
                self.collect("closed", self.keys())
            except TransferError:
                pass
        for p in self.procs.values():
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)


class _Clock:
    """Wall time of each phase, measured back to back: a phase ends where the next one starts."""

    def __init__(self, events: Event) -> None:
        self.events = events
        self.phases: dict[str, float] = {}
        self.current: tuple[str, float] | None = None

    def start(self, phase: str, name: str, total: int) -> None:
        self.stop()
        self.current = (phase, time.perf_counter())
        self.events("stage", {"name": name, "total": total})

    def stop(self) -> None:
        if self.current is not None:
            phase, t0 = self.current
            self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - t0
            self.current = None


def run_demo(cfg: DemoConfig, events: Event | None = None) -> DemoResult:
    """Run the demo; raises a ``HybridKvError`` for bad arguments or a failed run, returns the result otherwise.

    ``events(kind, info)`` is called with ``stage`` (``{"name", "total"}``: a phase starts, ``total`` steps long)
    and ``advance`` (one step of the current phase done: a rank ready, connected, planned or closed, a request
    filled on a prefill rank or done on an active rank, a tensor verified on a rank).
    """
    t_start = time.perf_counter()
    emit: Event = events or (lambda kind, info: None)
    prefill, decode = cfg.validate()
    requests = make_requests(cfg, prefill, decode)
    result = DemoResult(
        config=asdict(cfg),
        prefill={"tp": prefill.tp, "num_blocks": prefill.num_blocks, **prefill.geometry.to_dict()},
        decode={"tp": decode.tp, "num_blocks": decode.num_blocks, **decode.geometry.to_dict()},
        requests=len(requests),
        tokens=[r.tokens for r in requests],
        verify=cfg.verify,
    )
    active = "decode" if cfg.mode == "pull" else "prefill"
    passive = "prefill" if active == "decode" else "decode"
    n_active = prefill.tp if active == "prefill" else decode.tp
    n_ranks = prefill.tp + decode.tp
    clock = _Clock(emit)
    clock.start("startup", f"start-up: {prefill.tp} prefill + {decode.tp} decode rank processes ready", n_ranks)
    ranks = _Ranks(cfg, prefill, decode, emit)
    clean = False
    try:
        ready = ranks.collect("ready", ranks.keys())
        addresses = {rank: ready[(role, rank)][0] for role, rank in ranks.keys(passive)}
        clock.start("handshake", f"handshake: metadata, plans, NIXL connections ({active} ranks)", n_active)
        ranks.send(ranks.keys(active), "connect", addresses)
        connected = ranks.collect("connected", ranks.keys(active))
        for (role, rank), (targets, setup_s, connect_s, sizes) in connected.items():
            result.peers[f"{role}-{rank}"] = list(targets)
            result.tables[f"{role}-{rank}"] = sizes
            result.plan_setup_s = max(result.plan_setup_s, setup_s)
            result.handshake_s = max(result.handshake_s, connect_s)
        clock.start(
            "fill", f"filling prefill pools: {len(requests)} requests x {prefill.tp} ranks", len(requests) * prefill.tp
        )
        ranks.send(ranks.keys(), "requests", requests)
        ranks.collect("filled", ranks.keys())
        clock.start("planning", f"planning {len(requests)} requests ({active} ranks)", n_active)
        ranks.send(ranks.keys(active), "go")
        ranks.collect("planned", ranks.keys(active))
        clock.start(
            "transfer", f"{cfg.mode}: {len(requests)} requests over NIXL (per decode rank)", len(requests) * decode.tp
        )
        if cfg.mode == "push":
            targets = ranks.collect("targets", ranks.keys("prefill"))
            payloads = {rank: ready[(role, rank)][3] for role, rank in ranks.keys("prefill")}
            for d in range(decode.tp):
                senders = {r.rid: sum(d in t[0][r.rid] for t in targets.values()) for r in requests}
                ranks.send([("decode", d)], "expect", senders, payloads)
        moved = ranks.collect("transferred", ranks.keys(active))
        if cfg.mode == "pull":  # the prefill ranks answered every claim: their digest time is known now
            ranks.send(ranks.keys("prefill"), "report")
        digests = ranks.collect("digests", ranks.keys())
        for (role, rank), (count, secs, mismatches, ask_s, wait_s) in sorted(digests.items()):
            if role == "decode":  # the checking side in both modes
                result.digested_requests += count
                result.digest_s = max(result.digest_s, secs)
                result.claim_s = max(result.claim_s, ask_s)
                result.digest_wait_s = max(result.digest_wait_s, wait_s)
                result.digest_mismatches += [f"decode rank {rank}: {m}" for m in mismatches]
            else:
                result.peer_digest_s = max(result.peer_digest_s, secs)
        for plan_s, transfer_s, ids, posted, nbytes, _n, xfers, total_s, vbytes in moved.values():
            result.plan_s += plan_s
            result.transfer_s = max(result.transfer_s, transfer_s)
            result.transfer_total_s = max(result.transfer_total_s, total_s)
            result.verified_bytes += vbytes
            result.descriptor_ids += ids
            result.descriptors += posted
            result.bytes_moved += nbytes
            result.nixl_transfers += xfers
        tensors = prefill.preset.num_tensors
        clock.start(
            "verify",
            f"verifying every byte: {n_ranks} ranks x {tensors} tensors",
            n_ranks * tensors,
        )
        ranks.send(ranks.keys(), "verify", cfg.corrupt_at if cfg.corrupt and cfg.corrupt_at != "landed" else None)
        verdicts = ranks.collect("verified", ranks.keys())
        for (role, rank), (problem, checked, verify_s) in sorted(verdicts.items()):
            if role == "decode":
                result.bytes_verified += checked
            else:
                result.prefill_bytes_verified += checked
            result.verify_s = max(result.verify_s, verify_s)
            if problem is not None:
                result.problems.append(f"{role} rank {rank}: {problem}")
        result.problems = result.digest_mismatches + result.problems
        result.verified = not result.problems
        clock.start("floor", f"NIXL floor: the same transfers with bare NIXL calls ({active} ranks)", n_active)
        ranks.send(ranks.keys(active), "floor")
        for secs, descs, _nbytes in ranks.collect("floor", ranks.keys(active)).values():
            result.floor_s = max(result.floor_s, secs)
            result.floor_descriptors += descs
        clean = True
    finally:
        clock.stop()
        t0 = time.perf_counter()
        ranks.close(clean)  # emits its own stage: shutdown
        clock.phases["shutdown"] = time.perf_counter() - t0
    result.gbps = result.bytes_moved / result.transfer_s / 1e9 if result.transfer_s else 0.0
    result.floor_gbps = result.bytes_moved / result.floor_s / 1e9 if result.floor_s else 0.0
    result.memcpy_gbps = memcpy_gbps(result.bytes_moved)
    result.phases = {p: clock.phases.get(p, 0.0) for p in PHASES}
    result.startup_s = result.phases["startup"]
    result.total_s = time.perf_counter() - t_start
    result.other_s = max(0.0, result.total_s - sum(result.phases.values()))
    return result
