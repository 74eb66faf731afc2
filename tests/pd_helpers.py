"""Helpers for tests/test_pd_transfers.py: Kimi-like ranks on torch CPU tensors, a prefill rank process, and a
decode rank driving a ``hybrid_kv.transport.Endpoint`` with ``hybrid_kv.PeerPlan`` plans.

Rank memory, its content and the expected decode bytes come from the demo (``hybrid_kv.demo.content``), the
spawn-able peer plumbing (queues, signals, reaping, pumping) from ``tests/_peers.py``. The prefill
process is started from the demo's forkserver context (torch is imported once, ranks are forked from it).
Engines here are TP 1 so that a peer engine is one process: the TP matrix itself is covered by the demo runs.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import time
from typing import Any

import numpy as np
from _peers import Peer, pump

from hybrid_kv import HandshakeError, PeerPlan, RegionTable, validate_handshake  # noqa: E402
from hybrid_kv.claims import (  # noqa: E402
    Claim,
    ClaimEntry,
    ClaimRound,
    DigestDue,
    answer_claim,
    answer_messages,
    claim_digests,
    decode_claim_message,
    instance_of,
    serve_claims,
    take_digests,
)
from hybrid_kv.demo.content import Content, Request, Side, expect_decode, fill_prefill, random_bytes  # noqa: E402
from hybrid_kv.demo.run import process_context  # noqa: E402
from hybrid_kv.transport import Endpoint, Transfer  # noqa: E402
from hybrid_kv.verify import Digester, MirrorCache, compare, initiator_digests, pull_check  # noqa: E402

__all__ = ["DecodeRank", "KimiRank", "PrefillProcess", "RogueWriter", "ZERO", "pump"]

PRESET = "tiny-kimi-linear"
ZERO = {"xfer": 0, "zombie_xfer": 0, "local_dlists": 0, "remote_dlists": 0, "remote_agents": 0, "registrations": 0}


class KimiRank:
    """One TP-1 rank's HMA pool as torch CPU tensors (MLA + KDA layers sharing each tensor), filled with
    reproducible garbage, with its region table and handshake payload."""

    def __init__(self, role: str, num_blocks: int, seed: int, preset: str = PRESET, mode: str = "pull") -> None:
        from hybrid_kv.presets import get_preset
        from hybrid_kv.torch_adapter import region_table_from_tensors

        p = get_preset(preset)
        self.role = role
        self.side = Side(p, p.geometry(1), num_blocks)
        geo = self.side.geometry
        self.tensors, layers, _ = p.torch_layers(1, 0, num_blocks)  # the tensors own the memory: keep them
        self.pools = [t.numpy().reshape(-1) for t in self.tensors]
        for i, pool in enumerate(self.pools):
            pool[:] = random_bytes(seed, (7, int(role == "decode"), i), pool.size)
        self.table: RegionTable = region_table_from_tensors(
            layers,
            logical_block_size=geo.logical_block_size,
            kernel_block_size=geo.kernel_block_size,
            num_logical_blocks=num_blocks,
            tp_rank=0,
            tp_size=1,
            total_num_kv_heads=p.attention.num_kv_heads,
        )
        self.payload: bytes = self.table.handshake_payload(p.engine_info(role, mode))

    def snapshot(self) -> list[np.ndarray]:
        return [p.copy() for p in self.pools]


# ---------------------------------------------------------------------------------------------- prefill process


def prefill_main(
    name: str, preset: str, num_blocks: int, seed: int, requests: list[Request], out: Any, cmds: Any
) -> None:
    """A prefill rank: fills ``requests`` from the logical model, serves its metadata, answers READs and claims
    with digests (``hybrid_kv.claims``, with its own ids of the request named) until told to stop; reports
    ``("closed", handle_counts, unchanged)`` after closing its endpoint.

    Commands: ``"stop"``; ``("rewrite", rid)``: after digesting ``rid`` for an ask, re-write a byte of its
    first block before answering (a block reused between the digest and the READ), reported ``("rewrote",
    rid)``; ``("hold", rid)``: confirm a claim of ``rid`` at once but hold its digest (reported ``("holding",
    rid)``), still serving its endpoint, until ``("release", rid)`` comes."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    rank = KimiRank("prefill", num_blocks, seed, preset)
    for r in requests:
        fill_prefill(rank.pools, rank.side, 0, r, Content(rank.side.preset, seed, r.index, r.content_tokens), seed)
    filled = rank.snapshot()
    by_rid = {r.rid: r for r in requests}
    rewrite: set[str] = set()
    hold: set[str] = set()
    released: set[str] = set()
    held: dict[str, tuple[str, str, list[DigestDue]]] = {}  # rid -> (answer address, claimer, digests owed)
    rewrote = False
    digester, mirrors = Digester(rank.table, rank.tensors), MirrorCache(rank.payload)
    end = time.monotonic() + 60.0  # never outlive a broken test for long
    ep = Endpoint(
        name, rank.table.registration(), {"whole": rank.table.local_rows()}, metadata_provider=lambda r: rank.payload
    )
    with ep:
        out.put(("ready", ep.address, os.getpid()))
        while time.monotonic() < end:
            try:
                cmd = cmds.get_nowait()
            except queue.Empty:
                cmd = None
            if cmd == "stop":
                break
            if isinstance(cmd, tuple) and cmd[0] == "rewrite":
                rewrite.add(cmd[1])
            if isinstance(cmd, tuple) and cmd[0] == "hold":
                hold.add(cmd[1])
            if isinstance(cmd, tuple) and cmd[0] == "release":
                released.add(cmd[1])
            ev = ep.poll()
            for e in ev.remote_done:
                out.put(("remote_done", e.sender, e.request_id))
            for e in ev.remote_failed:
                out.put(("remote_failed", e.sender, e.request_id, e.reason))

            def lookup(entry: ClaimEntry) -> tuple[Any, float] | str:
                r = by_rid.get(entry.req)
                return (r.prefill_ids, 0.0) if r is not None else f"no request {entry.req!r}"

            def after_digest(entry: ClaimEntry, own: Any) -> None:
                nonlocal rewrote
                if entry.req in rewrite:  # the block is re-written after its digest, before the READ
                    rank.pools[0][own[0][0] * rank.side.geometry.page_bytes] ^= 0x5A
                    rewrote = True
                    out.put(("rewrote", entry.req))

            controls = [c for c in ev.control if not _hold_claim(ep, c, hold, held, lookup, out)]
            serve_claims(ep, controls, lookup, mirrors, digester, after_digest=after_digest)
            for rid in released & set(held):  # the held digest answers go now
                address, sender, due = held.pop(rid)
                for msg in answer_messages(take_digests(due, mirrors, digester), instance_of(ep.metadata)):
                    ep.courier.send(address, msg, sender, timeout_s=10.0, attempts=3)
            time.sleep(0.0005)
    unchanged = all(np.array_equal(a, b) for a, b in zip(rank.pools, filled, strict=True))
    out.put(("closed", ep.handle_counts(), unchanged or rewrote))


def _hold_claim(ep: Any, c: Any, hold: set[str], held: dict[str, Any], lookup: Any, out: Any) -> bool:
    """A claim of a held request: confirmed now, its digest kept in ``held``; whether ``c`` was one."""
    try:
        msg = decode_claim_message(c.payload)
    except ValueError:
        return False
    if not isinstance(msg, Claim) or not {e.req for e in msg.entries} & hold:
        return False
    results, _, due = answer_claim(msg, lookup, True)
    address = f"tcp://{msg.host}:{msg.port}"
    for m in answer_messages(results, instance_of(ep.metadata)):
        ep.courier.send(address, m, c.sender, timeout_s=10.0, attempts=3)
    for d in due:
        held[d.entry.req] = (address, c.sender, [d])
        out.put(("holding", d.entry.req))
    return True


class PrefillProcess(Peer):
    """A prefill rank in its own process; ``expect``/``stop``/``signal``/``kill`` and reaping come from the
    transport tests' ``Peer``. ``stop()`` returns the rank's handle counts after close."""

    def __init__(self, name: str, seed: int, requests: list[Request], num_blocks: int, preset: str = PRESET) -> None:
        ctx = process_context("forkserver")
        self.name = name
        self.seed = seed
        self.out = ctx.Queue()
        self.cmds = ctx.Queue()
        args = (name, preset, num_blocks, seed, requests, self.out, self.cmds)
        self.proc = ctx.Process(target=prefill_main, args=args, daemon=True)
        self.proc.start()
        msg = self.out.get(timeout=30)
        assert msg[0] == "ready", msg
        self.address: str = msg[1]
        self.memory_unchanged: bool | None = None

    def stop(self) -> dict[str, int]:
        """Close the rank; returns its handle counts after close (``memory_unchanged`` says whether every byte
        of its pools is still what it was filled with)."""
        self.cmds.put("stop")
        msg = self.expect("closed", 10.0)
        self.proc.join(10)
        self.memory_unchanged = bool(msg[2])
        return dict(msg[1])


# ---------------------------------------------------------------------------------------------- decode rank


class DecodeRank:
    """The decode rank under test (in this process): pulls requests from TP-1 prefill engines.

    Its local table is the region table's coalesced whole-block table (chunk rows for every dense attention
    region: what a plan against a TP-1 peer prepares, whichever peer; checked against every real plan).
    Every handshake is validated with ``validate_handshake``; the remote table of a peer comes from a
    ``PeerPlan`` built from the payload it sent.
    """

    def __init__(self, name: str, num_blocks: int, seed: int) -> None:
        self.rank = KimiRank("decode", num_blocks, seed)
        self.local = {"whole": self.rank.table.local_rows(coalesce=True)}
        self.ep = Endpoint(name, self.rank.table.registration(), self.local)
        self.plans: dict[str, PeerPlan] = {}
        self.addresses: dict[str, str] = {}
        self.digester = Digester(self.rank.table, self.rank.tensors)

    def _validate(self, payload: bytes) -> None:
        validate_handshake(self.rank.payload, payload)

    def _tables(self, peer: str, payload: bytes) -> dict[str, np.ndarray]:
        plan = PeerPlan(self.rank.table, [payload], "pull")
        for key in plan.table_keys:
            if key not in self.local or not np.array_equal(plan.local_rows(key), self.local[key]):
                raise HandshakeError(
                    f"peer {peer!r}: the plan needs local table {key!r}, which differs from the prepped one"
                )
        self.plans[peer] = plan
        return {"remote": plan.remote_rows(0)}

    def begin_connect(self, peer: str, address: str, timeout_s: float) -> None:
        self.ep.begin_connect(
            peer, address, lambda p: self._tables(peer, p), validate=self._validate, timeout_s=timeout_s
        )

    def connect(self, peer: str, address: str, timeout_s: float) -> None:
        self.ep.connect(peer, address, lambda p: self._tables(peer, p), validate=self._validate, timeout_s=timeout_s)
        self.addresses[peer] = address

    def pull_verified(
        self,
        peer: str,
        req: Request,
        deadline_s: float,
        *,
        prefill_ids: list[list[int]] | None = None,
        before_check: Any = None,
    ) -> Any:
        """A verified READ of ``req``: claim it from ``peer`` with its digest (it digests the blocks it holds for the
        request), post once answered, compare this side's digest once the READ is done. ``prefill_ids``: the
        remote ids this side reads (default: the request's); ``before_check``: called once the READ landed,
        before this side digests (fault injection)."""
        entry = ClaimEntry(req.rid, b"", req.rid, req.decode_ids, True)
        target = {0: (self.addresses[peer], self.ep.remote_agent(peer))}  # the name it answers as: its agent's
        got = claim_digests(self.ep, target, [entry], "decode", self.rank.payload, "xxh3", 5.0)
        digest, error = got[req.rid][0]
        assert digest is not None and not error, (digest, error)
        transfers = self.transfers(peer, dataclasses.replace(req, prefill_ids=prefill_ids or req.prefill_ids))
        theirs = digest

        def check() -> str | None:
            if before_check is not None:
                before_check()
            mine = initiator_digests(self.digester, self.plans[peer], transfers, lambda p: 0, "xxh3")[peer]
            return compare(mine, theirs, 0, 0)

        return self.ep.post(req.rid, transfers, "READ", deadline_s, check=check)

    def pull_overlapped(
        self, peer: str, req: Request, deadline_s: float, *, before_check: Any = None
    ) -> tuple[Any, ClaimRound, list[str]]:
        """A verified READ as the connector and the demo run it: claim ``req`` from ``peer`` asking its digest,
        post once confirmed (the digest follows), check with ``pull_check`` (waiting for the digest). Returns the
        handle, the claim round (``feed`` it the polls' control messages) and the check's verdicts so far."""
        entry = ClaimEntry(req.rid, b"", req.rid, req.decode_ids, True)
        target = {0: (self.addresses[peer], self.ep.remote_agent(peer))}
        claims = ClaimRound(self.ep, target, [entry], "decode", self.rank.payload, "xxh3", 5.0)
        claims.wait()
        transfers = self.transfers(peer, req)
        inner = pull_check(
            self.digester,
            self.plans[peer],
            transfers,
            lambda p: 0,
            "xxh3",
            claims.theirs(req.rid),
            0,
            before=before_check,
        )
        verdicts: list[str] = []

        def check() -> Any:
            v = inner()
            verdicts.append("not yet" if v is not None and not isinstance(v, str) else str(v))
            return v

        return self.ep.post(req.rid, transfers, "READ", deadline_s, check=check), claims, verdicts

    def transfers(self, peer: str, req: Request, plan: PeerPlan | None = None) -> list[Transfer]:
        """A request's READs from ``peer`` (planned with ``plan``, by default the peer's own)."""
        p = (plan or self.plans[peer]).plan(req.decode_ids, req.prefill_ids)
        return [Transfer(peer, t.local_table, "remote", t.local_ids, t.remote_ids) for t in p.transfers]

    def pull(self, peer: str, req: Request, deadline_s: float, plan: PeerPlan | None = None) -> Any:
        return self.ep.post(req.rid, self.transfers(peer, req, plan), "READ", deadline_s)

    def expected(self, before: list[np.ndarray], landed: list[tuple[Request, int]], prefill: Side) -> list[np.ndarray]:
        """Decode memory after ``landed`` ``(request, prefill seed)`` pairs, starting from ``before``."""
        want = before
        for req, seed in landed:
            c = Content(prefill.preset, seed, req.index, req.content_tokens)
            want = expect_decode(want, self.rank.side, prefill, 0, [req], [c])
        return want

    def blocks_mask(self, reqs: list[Request]) -> np.ndarray:
        """Byte mask (per tensor) of every decode block named by ``reqs``."""
        page = self.rank.side.geometry.page_bytes
        mask = np.zeros(self.rank.pools[0].size, dtype=bool)
        for r in reqs:
            for b in (b for g in r.decode_ids for b in g):
                mask[b * page : (b + 1) * page] = True
        return mask


# ---------------------------------------------------------------------------------------------- a third process


def rogue_main(address: str, addr: int, length: int, out: Any, cmds: Any) -> None:
    """A third NIXL agent holding the secret: on ``"write"`` it WRITEs ``length`` garbage bytes at ``addr`` of
    the endpoint serving ``address`` (connecting first) and reports ``("written",)`` once landed."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    buf = np.full(length, 0xA5, dtype=np.uint8)
    reg = np.array([[buf.ctypes.data, length, 0]], dtype=np.uint64)
    with Endpoint("rogue", reg, {"src": reg.copy()}) as ep:
        ep.connect("victim", address, lambda p: {"dst": np.array([[addr, length, 0]], dtype=np.uint64)}, timeout_s=5.0)
        out.put(("ready",))
        end = time.monotonic() + 60.0
        n = 0
        while time.monotonic() < end:
            try:
                cmd = cmds.get(timeout=0.01)
            except queue.Empty:
                ep.poll()
                continue
            if cmd == "stop":
                break
            n += 1
            one = np.zeros(1, dtype=np.int32)
            ep.post(f"rogue-{n}", [("victim", "src", "dst", one, one)], "WRITE", 5.0)
            ev = pump(ep, lambda e: e.done or e.failed, 5.0)
            out.put(("written",) if ev.done else ("failed", str(ev.failed)))


class RogueWriter(Peer):
    """``rogue_main`` in its own process: ``write()`` lands its garbage in the victim's memory and returns."""

    def __init__(self, address: str, addr: int, length: int) -> None:
        ctx = process_context("forkserver")
        self.out = ctx.Queue()
        self.cmds = ctx.Queue()
        self.proc = ctx.Process(target=rogue_main, args=(address, addr, length, self.out, self.cmds), daemon=True)
        self.proc.start()
        self.pending: Any = None

    def wait_ready(self, victim: Endpoint) -> None:
        """Pump the victim endpoint (it must answer the rogue's handshake) until the rogue is connected."""
        end = time.monotonic() + 30.0
        while time.monotonic() < end:
            victim.poll()
            try:
                msg = self.out.get(timeout=0.01)
            except queue.Empty:
                continue
            assert msg == ("ready",), msg
            return
        raise AssertionError("the rogue writer did not connect")

    def write(self, victim: Endpoint) -> None:
        """WRITE the garbage now and wait until it landed. Called from inside the victim's ``poll()`` (a
        request's check), so the victim's UCX worker is progressed directly (its notifications, the rogue's
        own done-notice among them, are read and dropped: a pulling decode receives no others)."""
        self.cmds.put("write")
        end = time.monotonic() + 10.0
        while time.monotonic() < end:
            victim._agent.nixl.get_new_notifs()
            try:
                msg = self.out.get(timeout=0.001)
            except queue.Empty:
                continue
            assert msg == ("written",), msg
            return
        raise AssertionError("the rogue write did not land")
