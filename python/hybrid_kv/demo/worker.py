"""One prefill or decode rank of the demo, run in its own (spawned) process.

The rank allocates its HMA pool as torch CPU tensors from the preset, builds its region table and handshake
metadata, and opens a NIXL endpoint. The *passive* side (prefill in pull mode, decode in push mode) only
registers memory and serves its metadata; the *active* side fetches the metadata of the peer ranks it talks
to, builds its plan (local and remote descriptor tables), connects and validates the handshake, then plans
and posts every request (READ in pull mode, WRITE in push mode). Decode ranks finally compare every byte
of their pools with what :mod:`.content` says they must hold; prefill ranks check that not one of their bytes
changed since they were filled.

Messages to the coordinator are tuples ``(kind, role, rank, *payload)`` on one shared queue; commands come
on the rank's own queue. Any failure is reported as ``("error", role, rank, message)`` and ends the process.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..claims import ClaimEntry, ClaimRound, serve_claims
from ..transport.requests import NOT_YET
from ..verify import VerifyPolicy, initiator_digests, pull_check, push_check
from .content import Content, Request, Side, expect_decode, fill_prefill, random_bytes, region_mismatch

__all__ = ["POLL_SLEEP_S", "WorkerSpec", "main", "memcpy_gbps", "side_of"]

POLL_SLEEP_S = 0.0002


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to set itself up (picklable)."""

    role: str  # "prefill" | "decode"
    rank: int
    mode: str  # "pull" | "push"
    preset: str
    tp: int
    remote_tp: int
    num_blocks: int
    kernel_block_size: int | None
    seed: int
    deadline_s: float
    verify: str = "off"
    """``VerifyPolicy`` text: which requests are verified end to end (``hybrid_kv.verify``)."""
    corrupt_landed: bool = False
    """Fault injection (tests): decode rank 0 flips a byte of the first request's first block once it landed,
    before its digest is checked."""
    cpus: tuple[int, ...] | None = None
    """The cores this rank runs on (``DemoConfig.split_cores``); ``None``: any."""

    @property
    def active(self) -> bool:
        """Whether this rank posts the transfers (decode pulls, prefill pushes)."""
        return (self.role == "decode") == (self.mode == "pull")

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"


def side_of(spec: WorkerSpec, tp: int, kernel_block_size: int | None, num_blocks: int) -> Side:
    from ..presets import get_preset

    preset = get_preset(spec.preset)
    return Side(preset, preset.geometry(tp, kernel_block_size=kernel_block_size), num_blocks)


def main(
    spec: WorkerSpec, inbox: Any, outbox: Any, other_side: tuple[int | None, int], secret: str | None = None
) -> None:
    """Process entry point; ``other_side`` is the peer engine's ``(kernel_block_size, num_blocks)``; ``secret``
    the side-channel secret shared by the demo's ranks (set as this rank process's ``HYBRID_KV_SECRET``)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL's INFO lines would drown the demo's output
    if secret is not None:
        os.environ["HYBRID_KV_SECRET"] = secret
    if spec.cpus is not None:  # before torch and the digests' thread pool size themselves by it
        os.sched_setaffinity(0, spec.cpus)
    try:
        _Worker(spec, inbox, outbox, other_side).run()
    except SystemExit:
        pass  # told to stop
    except BaseException as exc:  # report, never hang the coordinator
        detail = f"{type(exc).__name__}: {exc}"
        outbox.put(("error", spec.role, spec.rank, detail, traceback.format_exc()))


class _Worker:
    def __init__(self, spec: WorkerSpec, inbox: Any, outbox: Any, other_side: tuple[int | None, int]) -> None:
        self.spec = spec
        self.inbox = inbox
        self.outbox = outbox
        self.side = side_of(spec, spec.tp, spec.kernel_block_size, spec.num_blocks)
        self.other = side_of(spec, spec.remote_tp, other_side[0], other_side[1])
        self.ep: Any = None
        self.link: Any = None
        self.requests: list[Request] = []
        self.digest_s = 0.0  # this rank's time computing digests (decode: of what landed; prefill: in claim answers)
        self.ask_s = 0.0  # pull, decode: the claim round trip before the READ (the prefill's digests follow later)
        self.wait_s = 0.0  # pull, decode: time its checks went on deciding after its last request landed
        self._landed_at = self._decided_at = 0.0  # pull, decode: the last request landed (digested) / decided
        self.claims: ClaimRound | None = None  # pull, decode: this batch's claims (their digests come meanwhile)
        self.plans: list[Any] = []  # each request's transfers (active ranks), posted again for the NIXL floor
        self.digested = 0  # requests this rank verified (active ranks) or answered digests for (passive)
        self.mismatches: list[str] = []  # this rank's requests failed by a digest mismatch (only they may fail)

    def send(self, kind: str, *payload: Any) -> None:
        self.outbox.put((kind, self.spec.role, self.spec.rank, *payload))

    def wait(self, kind: str) -> tuple[Any, ...]:
        """Next command of ``kind`` (polling the endpoint meanwhile); ``stop`` ends the process."""
        end = time.monotonic() + self.spec.deadline_s
        while True:
            try:
                cmd = self.inbox.get(timeout=0.002 if self.ep is None else 0)
            except queue.Empty:
                cmd = None
            if cmd is not None:
                if cmd[0] == "stop":
                    raise SystemExit(0)
                if cmd[0] != kind:
                    raise RuntimeError(f"expected command {kind!r}, got {cmd[0]!r}")
                return tuple(cmd[1:])
            if self.ep is not None:
                ev = self.ep.poll()
                self._answer_digests(ev.control)
                self._check_events(ev)
                time.sleep(POLL_SLEEP_S)
            if time.monotonic() > end:
                raise TimeoutError(f"no {kind!r} command within {self.spec.deadline_s:g} s")

    def _check_events(self, ev: Any) -> None:
        """Any failure ends the run, except a digest mismatch: it fails its request alone (reported)."""
        for err in ev.failed:
            if "digest mismatch" not in str(err):
                raise RuntimeError(str(err))
        for e in ev.remote_failed:
            if "digest mismatch" not in e.reason:
                raise RuntimeError(f"peer {e.sender} failed request {e.request_id}: {e.reason}")

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> None:
        import torch

        from ..torch_adapter import region_table_from_tensors
        from ..transport import Endpoint
        from ..verify import Digester, MirrorCache

        torch.set_num_threads(1)
        spec, geo = self.spec, self.side.geometry
        t0 = time.perf_counter()
        pools_t, layers, _ = self.side.preset.torch_layers(
            spec.tp, spec.rank, spec.num_blocks, kernel_block_size=spec.kernel_block_size
        )
        self.tensors = pools_t
        self.pools = [p.numpy().reshape(-1) for p in pools_t]  # views of the tensors' memory
        for i, pool in enumerate(self.pools):  # garbage everywhere: untouched bytes must stay as they are
            pool[:] = random_bytes(spec.seed, (7, int(spec.role == "decode"), spec.rank, i), pool.size)
        self.table = region_table_from_tensors(
            layers,
            logical_block_size=geo.logical_block_size,
            kernel_block_size=geo.kernel_block_size,
            num_logical_blocks=spec.num_blocks,
            tp_rank=spec.rank,
            tp_size=spec.tp,
            total_num_kv_heads=self.side.preset.attention.num_kv_heads,
        )
        self.payload = self.table.handshake_payload(self.side.preset.engine_info(spec.role, spec.mode))
        self.digester = Digester(self.table, self.tensors)
        self.mirrors = MirrorCache(self.payload)
        setup_s = time.perf_counter() - t0
        registration = self.table.registration()
        if not spec.active:
            self.ep = Endpoint(
                spec.name,
                registration,
                {"whole": self.table.local_rows()},
                metadata_provider=lambda rank: self.payload,
            )
            self.send("ready", self.ep.address, setup_s, self.table.num_regions, self.payload)
        else:
            self.send("ready", None, setup_s, self.table.num_regions, self.payload)
            (addresses,) = self.wait("connect")
            self._connect(addresses, registration)
        try:
            self._serve()
        finally:
            counts = self.ep.handle_counts() if self.ep is not None else {}
            if self.ep is not None:
                self.ep.close()
            self.send("closed", counts)
            del pools_t

    def _connect(self, addresses: dict[int, str], registration: Any) -> None:
        from .._core import handshake_target_ranks
        from ..peer_link import attach_link, prepare_link
        from ..transport import Endpoint

        spec = self.spec
        targets = [int(r) for r in handshake_target_ranks(spec.rank, spec.tp, spec.remote_tp)]
        self.ep = Endpoint(spec.name, registration, {})  # the memory is registered once, here
        t0 = time.perf_counter()
        # each peer rank's reply is fetched once: validated, planned from and connected with
        prepared = prepare_link(
            self.table, self.payload, {r: addresses[r] for r in targets}, spec.mode, sender=spec.name, timeout_s=10.0
        )
        plan_setup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.link = attach_link(self.ep, prepared, "peer", timeout_s=10.0)
        connect_s = time.perf_counter() - t0
        self.send("connected", targets, plan_setup_s, connect_s, self.link.table_shapes())

    def _serve(self) -> None:
        spec = self.spec
        (requests,) = self.wait("requests")
        self.requests = requests
        self.contents = [Content(self.side.preset, spec.seed, r.index, r.content_tokens) for r in requests]
        t0 = time.perf_counter()
        if spec.role == "prefill":
            for r, c in zip(requests, self.contents, strict=True):
                fill_prefill(self.pools, self.side, spec.rank, r, c, spec.seed)
                self.send("request_filled", r.rid)
        self.before = [p.copy() for p in self.pools]  # prefill: what must still be there after the transfer
        self.send("filled", time.perf_counter() - t0)  # every rank: pools as they are before the transfer
        if spec.active:
            self.wait("go")
            self._post_all()
        elif spec.role == "decode":  # push: await the prefill ranks' writes
            senders, payloads = self.wait("expect")
            self._await_pushes(senders, payloads)
        else:  # pull: answer the decode ranks' claims until their reads ended (``wait`` answers meanwhile)
            self.wait("report")
        self.send("digests", self.digested, self.digest_s, self.mismatches, self.ask_s, self.wait_s)
        (corrupt,) = self.wait("verify")
        if corrupt is not None and spec.rank == 0:
            self._corrupt(corrupt)
        self._verify()
        if spec.active:
            self.wait("floor")
            self._floor()
        self.wait("finish")

    # ------------------------------------------------------------------ transfers

    def _post_all(self) -> None:
        spec = self.spec
        op = "READ" if spec.mode == "pull" else "WRITE"
        t0 = time.perf_counter()
        plans = []
        for r in self.requests:
            local, remote = (r.decode_ids, r.prefill_ids) if spec.role == "decode" else (r.prefill_ids, r.decode_ids)
            plans.append(self.link.transfers(local, remote))
        plan_s = time.perf_counter() - t0
        self.send("planned", plan_s)
        descs = sum(int(t.local_ids.size) for p in plans for t in p)
        nbytes = sum(self.link.transfer_bytes(t) for p in plans for t in p)
        targets = {
            r.rid: sorted({self.link.rank_of(t.peer) for t in p}) for r, p in zip(self.requests, plans, strict=True)
        }
        if spec.mode == "push":
            self.send("targets", targets)
        self.plans = plans
        pending = set()
        handles = []
        t0 = time.perf_counter()
        checks = self._verification(plans)
        for r, p in zip(self.requests, plans, strict=True):
            if p:
                digests, check = checks.get(r.rid, (None, None))
                handles.append(self.ep.post(r.rid, p, op, spec.deadline_s, digests=digests, check=check))
                pending.add(r.rid)
            else:
                self.send("request_done", r.rid)
        self._wait_done(pending)
        total_s = time.perf_counter() - t0
        # one thread claims, posts, waits and verifies: its time outside the claim round trip and its own digests
        # is the transfer's own
        transfer_s = max(0.0, total_s - self.digest_s - self.ask_s - self.wait_s)
        posted = sum(h.stats.descriptors for h in handles)  # NIXL's telemetry: after it merged the ids
        xfers = sum(len(p) for p in plans)
        vbytes = sum(
            self.link.transfer_bytes(t) for r, p in zip(self.requests, plans, strict=True) if r.rid in checks for t in p
        )
        self.send("transferred", plan_s, transfer_s, descs, posted, nbytes, len(plans), xfers, total_s, vbytes)

    def _floor(self) -> None:
        """The NIXL floor: every request's transfers posted again with bare NIXL calls on this endpoint's handles
        (``Endpoint.post_raw``), after the bytes were verified (it writes the same bytes again)."""
        spec = self.spec
        op = "READ" if spec.mode == "pull" else "WRITE"
        items = []
        for r, p in zip(self.requests, self.plans, strict=True):
            counts: dict[Any, int] = {}
            for t in p:
                counts[t.peer] = counts.get(t.peer, 0) + 1
            items += [(t, f"{counts[t.peer]}:{r.rid}".encode()) for t in p]
        res = self.ep.post_raw(items, op, spec.deadline_s) if items else None
        self.send("floor", res.seconds if res else 0.0, res.descriptors if res else 0, res.bytes if res else 0)

    def _wait_done(self, pending: set[str]) -> None:
        """Poll until every request in ``pending`` completed, reporting each one as it does."""
        while pending:
            ev = self.ep.poll()
            controls = ev.control if self.claims is None else self.claims.feed(ev.control)
            self._answer_digests(controls)
            for rid in ev.done:
                pending.discard(rid)
                self.send("request_done", rid)
            for err in ev.failed:
                if err.request_id in pending and "digest mismatch" in str(err):
                    pending.discard(err.request_id)
                    self.mismatches.append(str(err))
                    self.send("request_done", err.request_id)
            self._check_events(ev)
            if pending:
                time.sleep(POLL_SLEEP_S)

    def _await_pushes(self, senders: dict[str, int], payloads: dict[int, bytes]) -> None:
        pending = set()
        policy = VerifyPolicy.parse(self.spec.verify)
        by_rid = {r.rid: r for r in self.requests}
        for rid, n in senders.items():
            if n:
                check = self._push_check(by_rid[rid], payloads) if policy.selects(by_rid[rid].index) else None
                self.ep.expect(rid, self.spec.deadline_s, senders=n, check=check)
                pending.add(rid)
        self._wait_done(pending)

    # ------------------------------------------------------------------ verification (hybrid_kv.verify)

    def _verification(self, plans: list[list[Any]]) -> dict[str, tuple[dict[Any, int] | None, Any]]:
        """Per verified request: push: this rank's digest per peer (carried by its done-notices); pull: the check
        comparing this rank's digest of what landed with each prefill rank's. In pull every request is first
        claimed from its prefill ranks, verified or not (as the connector does before any READ), and posted once
        confirmed; a verified one's prefill digests follow in second answers, taken while the READs run, and its
        check waits for them."""
        policy = VerifyPolicy.parse(self.spec.verify)
        moving = [(r, p) for r, p in zip(self.requests, plans, strict=True) if p]
        chosen = {r.rid for r, _ in moving if policy.selects(r.index)}
        out: dict[str, tuple[dict[Any, int] | None, Any]] = {}
        if self.spec.mode == "push":
            t0 = time.perf_counter()
            plan, rank_of = self.link.plan, self.link.rank_of
            for r, p in moving:
                if r.rid in chosen:
                    mine = initiator_digests(self.digester, plan, p, rank_of, "xxh3")
                    out[r.rid] = ({k: d.digest for k, d in mine.items()}, None)
            self.digest_s += time.perf_counter() - t0
        elif moving:
            t0 = time.perf_counter()
            self.claims = self._claim([r for r, _ in moving], chosen)
            self.ask_s += time.perf_counter() - t0
            for r, p in moving:
                if r.rid in chosen:
                    out[r.rid] = (None, self._pull_check(r.rid, p, self.claims.theirs(r.rid)))
        self.digested += len(chosen)
        return out

    def _claim(self, requests: list[Request], verified: set[str]) -> ClaimRound:
        """Claim every request from each prefill rank this rank reads from, asking a verified one's digest
        (``hybrid_kv.claims``: one message per prefill rank for the whole batch); wait for the confirmations."""
        targets = {t: (self.link.addresses[t], f"prefill-{t}") for t in self.link.targets}
        entries = [
            ClaimEntry(r.rid, b"", r.rid, r.decode_ids if r.rid in verified else [], r.rid in verified)
            for r in requests
        ]
        claims = ClaimRound(self.ep, targets, entries, "decode", self.payload, "xxh3", self.spec.deadline_s)
        claims.wait()
        return claims

    def _corrupt_landed(self, rid: str) -> None:
        """Fault injection (``corrupt_landed``): flip a byte of the first request's first block on decode rank 0,
        after its bytes landed and before its digest."""
        first = self.requests[0]
        if self.spec.corrupt_landed and self.spec.rank == 0 and rid == first.rid:
            self.pools[0][first.decode_ids[0][0] * self.side.geometry.page_bytes + 3] ^= 0x10

    def _pull_check(self, rid: str, transfers: list[Any], theirs: Any) -> Any:
        def digested(seconds: float) -> None:
            self.digest_s += seconds

        plan, rank_of = self.link.plan, self.link.rank_of
        inner = pull_check(
            self.digester,
            plan,
            transfers,
            rank_of,
            "xxh3",
            theirs,
            self.spec.rank,
            before=lambda: self._corrupt_landed(rid),
            on_digested=digested,
        )
        first = [True]

        def check() -> Any:
            # what the prefill's digests add: the checks still deciding after the last request landed and was
            # digested here (waiting for a prefill digest on its way)
            verdict = inner()
            now = time.perf_counter()
            if first[0]:
                first[0] = False
                self._landed_at = max(self._landed_at, now)
            if verdict is not NOT_YET:
                self._decided_at = max(self._decided_at, now)
                self.wait_s = max(0.0, self._decided_at - self._landed_at)
            return verdict

        return check

    def _push_check(self, r: Request, payloads: dict[int, bytes]) -> Any:
        """The decode's check of a pushed request: each writer's digest against this rank's digest of the bytes
        that landed, the moves rebuilt from the writer's payload (its plan, mirrored)."""

        started = [0.0]

        def before() -> None:
            self._corrupt_landed(r.rid)
            started[0] = time.perf_counter()

        def timed(reason: str | None) -> None:
            self.digest_s += time.perf_counter() - started[0]
            self.digested += 1

        def writer(sender: str) -> tuple[int, bytes, bool, Any]:
            p_rank = int(sender.rsplit("-", 1)[1])
            return p_rank, payloads[p_rank], True, r.prefill_ids

        return push_check(
            self.mirrors,
            self.digester,
            writer,
            r.decode_ids,
            self.spec.rank,
            lambda _: "xxh3",
            before=before,
            on_result=timed,
        )

    def _answer_digests(self, controls: list[Any]) -> None:
        """Prefill in pull mode: answer each decode rank's claims of this batch's requests with their digests."""
        by_rid = {r.rid: r for r in self.requests}

        def lookup(entry: ClaimEntry) -> tuple[Any, float] | str:
            r = by_rid.get(entry.req)
            return (r.prefill_ids, 0.0) if r is not None else f"no request {entry.req!r} here"

        t0 = time.perf_counter()
        answered = serve_claims(self.ep, controls, lookup, self.mirrors, self.digester)
        if answered and self.spec.verify != "off":  # the digests dominate answering a verified claim
            self.digest_s += time.perf_counter() - t0
            self.digested += answered

    def _corrupt(self, where: str) -> None:
        """Fault injection (tests): flip one byte that verification must catch."""
        first = self.requests[0]
        if where == "prefill" and self.spec.role == "prefill":
            block = first.prefill_ids[0][0]  # a source byte: the transfer must not have changed it
        elif where == "received" and self.spec.role == "decode":
            block = first.decode_ids[0][0]
        elif where == "hole" and self.spec.role == "decode":
            block = max(b for g in first.decode_ids for b in g) + 1  # the free block after the first request
        else:
            return
        self.pools[0][block * self.side.geometry.page_bytes] ^= 0xFF

    def _verify(self) -> None:
        """Decode: every byte is what the logical model says. Prefill: not one byte changed (a READ from it or
        a WRITE out of it must leave its memory as it was filled)."""
        t0 = time.perf_counter()
        if self.spec.role == "prefill":
            want = self.before
        else:
            want = expect_decode(self.before, self.side, self.other, self.spec.rank, self.requests, self.contents)
        problem = None
        for region, (pool, expected) in enumerate(zip(self.pools, want, strict=True)):
            problem = problem or region_mismatch(pool, expected, self.side, region)
            self.send("pool_verified", region, int(pool.size))
        checked = sum(p.size for p in self.pools)
        self.send("verified", problem, checked, time.perf_counter() - t0)


def memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    """Best-of-``repeats`` throughput of one contiguous numpy copy of ``nbytes`` (GB/s)."""
    n = max(1, nbytes)
    src = np.ones(n, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return n / best / 1e9
