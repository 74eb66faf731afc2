"""Verified transfers: a digest of each side of a request's byte moves, compared end to end.

A plan's byte moves are ``(initiator range, peer range, len)``. Each side digests its own ranges of the same
moves, in move order, so the two digests agree whatever the TP sizes, block sizes and layouts, and any
corrupted or stale byte (a NIXL or driver fault, a block reused too early, a stray write, a wrong id) turns
into a failed request instead of wrong output. The passive side gets the moves by rebuilding its initiator's
plan from the two handshake payloads (``hybrid_kv.MirrorPlan``), so nothing layout-specific is hashed.

What is digested: the concatenation, in move order, of one rank pair's bytes (all its transfers' moves, in
plan order). How moves are cut does not change a digest; their order does. Two algorithms:

- ``xxh3``: XXH3-64 of the byte stream's 256 KiB segments, on a pool of threads, combined by XXH3-64 (in Rust with
  the GIL released, ``RegionTable.digest``), for host memory on both sides.
- ``wsum``: two position-weighted sums modulo ``2**31 - 1`` (byte ``b`` at stream offset ``k`` adds
  ``b * w`` and ``b * w**2`` with ``w = k mod p + 1``), computed with torch by gathering the ranges where the
  memory is (``wsum_digest``), so device memory is digested on its device. A flipped byte always changes it
  (``w`` is never 0 modulo the prime); used whenever a side's memory is not host memory.

Both sides choose the algorithm from the two sides' memory types (``algorithm``). ``VerifyPolicy``
(``verify_policy``, importable without the transport's extras) is the ``verify`` setting: ``off``, ``all``, or
``sampled:N`` (every Nth request). In pull the passive side's digest rides on the lease claim the initiator
makes before its READ: the claim is answered ``ok`` at once and the digest follows in a second answer, taken while
the READ runs and the lease still holds the blocks (``hybrid_kv.claims``); ``pull_check`` compares it once the READ
landed (waiting for it when needed). In push it rides in the writers' done-notices. One protocol for the connector,
the demo, the tests and the benchmarks.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt

from ._core import MirrorPlan, PeerPlan, RegionTable, decode_meta
from .transport.requests import NOT_YET, CheckVerdict, PeerKey, Transfer
from .verify_policy import MAX_SAMPLE_EVERY, VerifyPolicy

__all__ = [
    "ALGORITHMS",
    "MAX_SAMPLE_EVERY",
    "WSUM_PRIME",
    "Digester",
    "MirrorCache",
    "RankPairDigest",
    "VerifyPolicy",
    "algorithm",
    "compare",
    "initiator_digests",
    "payload_mem_type",
    "peer_digest",
    "pull_check",
    "push_check",
    "mismatch_reason",
    "to_hex",
    "wsum_digest",
]

ALGORITHMS = ("xxh3", "wsum")
WSUM_PRIME = (1 << 31) - 1
_CHUNK = 1 << 22  # wsum: bytes gathered per reduction (each product < 2**39, a chunk's sum < 2**63)

U64 = npt.NDArray[np.uint64]


def algorithm(*mem_types: str) -> str:
    """The digest both sides use: ``xxh3`` when every side's memory is host memory (``DRAM``), else ``wsum``."""
    return "xxh3" if all(m.upper() == "DRAM" for m in mem_types) else "wsum"


class RankPairDigest(NamedTuple):
    """One side's digest of one rank pair's moves, with what it covered."""

    digest: int
    bytes: int
    moves: int


def mismatch_reason(prefill_rank: int, decode_rank: int, nbytes: int, moves: int) -> str:
    """The failure reason of a request whose digests differ (rank pair ``(prefill rank, decode rank)``)."""
    return f"digest mismatch: {nbytes} bytes in {moves} moves of rank pair ({prefill_rank}, {decode_rank})"


# ---------------------------------------------------------------------------------------------- computing digests


def _byte_views(tensors: Sequence[Any]) -> list[tuple[int, int, Any]]:
    """``(base, nbytes, flat uint8 tensor)`` of every distinct storage under ``tensors``, sorted by base."""
    import torch

    seen: dict[int, tuple[int, int, Any]] = {}
    for t in tensors:
        st = t.untyped_storage()
        base = int(st.data_ptr())
        if base not in seen:
            flat = torch.empty(0, dtype=torch.uint8, device=t.device)
            flat.set_(st, 0, (st.nbytes(),), (1,))
            seen[base] = (base, int(st.nbytes()), flat)
    return sorted(seen.values(), key=lambda v: v[0])


def wsum_digest(views: Sequence[tuple[int, int, Any]], moves: U64, column: int) -> int:
    """The ``wsum`` digest of ``moves[:, column]`` ranges (each ``moves[:, 2]`` long), gathered from ``views``
    (``(base, nbytes, flat uint8 tensor)``, sorted by base: ``Digester`` makes them from tensors) on the views'
    device, ``_CHUNK`` bytes per reduction: a Python step per chunk, never per move or byte.

    Raises:
        ValueError: a range outside every view.
    """
    import torch

    moves = np.asarray(moves, dtype=np.uint64).reshape(-1, 3)
    lens = moves[:, 2].astype(np.int64)
    keep = lens > 0
    addrs, lens = moves[keep, column].astype(np.int64), lens[keep]
    starts = np.cumsum(lens) - lens  # each move's offset in the stream
    # cut moves longer than a chunk into chunk-sized pieces (vectorized)
    pieces = (lens + _CHUNK - 1) // _CHUNK
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    k = np.arange(int(pieces.sum()), dtype=np.int64) - first
    rep = np.repeat(np.arange(lens.size), pieces)
    p_addr = addrs[rep] + k * _CHUNK
    p_pos = starts[rep] + k * _CHUNK
    p_len = np.minimum(lens[rep] - k * _CHUNK, _CHUNK)
    bases = np.array([v[0] for v in views], dtype=np.int64)
    which = np.searchsorted(bases, p_addr, side="right") - 1
    ends = np.array([v[0] + v[1] for v in views], dtype=np.int64)
    bad = (which < 0) | (p_addr + p_len > ends[np.maximum(which, 0)])
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"range {int(p_addr[i]):#x}+{int(p_len[i])} is not inside the digested memory")
    s1 = s2 = 0
    group = np.cumsum(p_len) // _CHUNK  # consecutive pieces of about one chunk (each group under 2 chunks)
    for v in np.unique(which):
        base, _, flat = views[int(v)]
        sel = which == v
        for g in np.unique(group[sel]):
            m = sel & (group == g)
            off = torch.as_tensor(p_addr[m] - base, device=flat.device)
            pos = torch.as_tensor(p_pos[m], device=flat.device)
            ln = torch.as_tensor(p_len[m], device=flat.device)
            total = int(p_len[m].sum())
            within = torch.arange(total, device=flat.device) - torch.repeat_interleave(torch.cumsum(ln, 0) - ln, ln)
            b = flat[torch.repeat_interleave(off, ln) + within].to(torch.int64)
            w = (torch.repeat_interleave(pos, ln) + within) % WSUM_PRIME + 1
            s1 = (s1 + int((b * w).sum())) % WSUM_PRIME
            s2 = (s2 + int((b * (w * w % WSUM_PRIME)).sum())) % WSUM_PRIME
    return (s1 << 32) | s2


class Digester:
    """Digests one rank's side of byte moves with ``algo``: ``xxh3`` through ``RegionTable.digest`` (host
    memory), ``wsum`` through torch over ``tensors`` (the tensors holding the table's regions, on any device).

    Args:
        table: the rank's region table (its regions bound what may be read).
        tensors: the tensors whose storages hold the regions (needed for ``wsum``).
    """

    def __init__(self, table: RegionTable, tensors: Sequence[Any] = ()) -> None:
        self.table = table
        self.mem_type = table.mem_type
        self._tensors = list(tensors)
        self._views: list[tuple[int, int, Any]] | None = None
        self._lock = threading.Lock()

    def digest(self, moves: U64, side: str, algo: str) -> RankPairDigest:
        """This rank's digest of ``moves`` (its addresses in column ``side``: ``"local"`` or ``"remote"``).

        Raises:
            ValueError: an unknown algorithm, ``xxh3`` of device memory, ``wsum`` without tensors, or a range
                outside this rank's memory.
        """
        moves = np.ascontiguousarray(moves, dtype=np.uint64).reshape(-1, 3)
        nbytes = int(moves[:, 2].sum())
        if algo == "xxh3":
            d = self.table.digest(moves, side)
        elif algo == "wsum":
            if side not in ("local", "remote"):
                raise ValueError(f"side must be 'local' or 'remote', got {side!r}")
            d = wsum_digest(self._byte_views(), moves, 0 if side == "local" else 1)
        else:
            raise ValueError(f"unknown digest algorithm {algo!r}; known: {', '.join(ALGORITHMS)}")
        return RankPairDigest(int(d), nbytes, int(moves.shape[0]))

    def _byte_views(self) -> list[tuple[int, int, Any]]:
        with self._lock:
            if self._views is None:
                if not self._tensors:
                    raise ValueError("the wsum digest needs the tensors holding the regions (Digester(tensors=...))")
                self._views = _byte_views(self._tensors)
            return self._views


class MirrorCache:
    """``MirrorPlan`` per initiator payload (and ``coalesce``), built once each, at most ``size`` kept (the
    least recently used goes first): a passive rank digests request after request from the same initiators."""

    def __init__(self, own_payload: bytes, size: int = 64) -> None:
        self.own_payload = own_payload
        self.size = size
        self._plans: collections.OrderedDict[tuple[bytes, bool], MirrorPlan] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, initiator_payload: bytes, coalesce: bool) -> MirrorPlan:
        """The mirror of the initiator that sent ``initiator_payload``; raises ``HandshakeError`` / ``PlanError``."""
        key = (bytes(initiator_payload), bool(coalesce))
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = MirrorPlan(self.own_payload, key[0], coalesce=key[1])
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)
        return plan


# ---------------------------------------------------------------------------------------------- both sides


def initiator_digests(
    digester: Digester,
    plan: PeerPlan,
    transfers: Sequence[Transfer],
    rank_of: Callable[[PeerKey], int],
    algo: str,
) -> dict[PeerKey, RankPairDigest]:
    """The initiator's digest of each peer's moves in ``transfers`` (its side: the local column), resolved
    through ``plan`` (one binding call per transfer, one per peer for the digest)."""
    by_peer: dict[PeerKey, list[U64]] = {}
    for t in transfers:
        moves = plan.resolve(t.local_key, rank_of(t.peer), t.local_ids, t.remote_ids)
        by_peer.setdefault(t.peer, []).append(moves)
    return {peer: digester.digest(np.concatenate(ms), "local", algo) for peer, ms in by_peer.items()}


def compare(mine: RankPairDigest, theirs: int | None, prefill_rank: int, decode_rank: int) -> str | None:
    """``None`` when the peer's digest equals ours, else the failure reason (a missing digest is a mismatch)."""
    if theirs is not None and theirs == mine.digest:
        return None
    reason = mismatch_reason(prefill_rank, decode_rank, mine.bytes, mine.moves)
    return reason if theirs is not None else f"{reason} (the peer sent no digest)"


def peer_digest(
    cache: MirrorCache,
    digester: Digester,
    initiator_payload: bytes,
    coalesce: bool,
    initiator_ids: Sequence[Sequence[int]],
    own_ids: Sequence[Sequence[int]],
    algo: str,
) -> tuple[str, int, int, str]:
    """The passive rank's digest of its side of one request's moves with an initiator, the moves rebuilt from
    the initiator's payload and ids and ``own_ids`` (this rank's ids for the request, never the asker's word):
    ``(hex digest, bytes, moves, "")``, or ``("", 0, 0, why)``; never raises (the inputs are untrusted)."""
    try:
        mirror = cache.get(initiator_payload, coalesce)
        d = digester.digest(mirror.moves(initiator_ids, own_ids), "remote", algo)
        return to_hex(d.digest), d.bytes, d.moves, ""
    except Exception as exc:  # noqa: BLE001 - untrusted input: the asker learns why, this rank goes on
        return "", 0, 0, f"{type(exc).__name__}: {exc}"[:512]


def payload_mem_type(payload: bytes) -> str:
    """The memory type (``DRAM``/``VRAM``) a handshake payload advertises (decoded as untrusted bytes)."""
    return str(decode_meta(payload)["mem_type"])


# ---------------------------------------------------------------------------------------------- pull check

MAX_PAYLOAD_BYTES = 512 << 10
"""The largest initiator payload a claim may carry (the passive side rebuilds the initiator's plan from it)."""

Algo = Annotated[str, msgspec.Meta(pattern="^(xxh3|wsum)$")]

Theirs = Callable[[int], "tuple[int | None, str] | None"]
"""The passive rank's digest for prefill rank ``r`` and why none (``(None, why)``: none will come), or ``None``
while it is still on its way."""


def to_hex(digest: int) -> str:
    """A digest as it travels: 16 lowercase hex digits."""
    return f"{digest:016x}"


def pull_check(
    digester: Digester,
    plan: PeerPlan,
    transfers: Sequence[Transfer],
    rank_of: Callable[[PeerKey], int],
    algo: str,
    theirs: Theirs,
    decode_rank: int,
    *,
    before: Callable[[], None] | None = None,
    on_digested: Callable[[float], None] | None = None,
    on_result: Callable[[str | None], None] | None = None,
) -> Callable[[], str | None | CheckVerdict]:
    """The check a pull initiator hands ``Endpoint.post(check=)``: once its READ landed, its digest of each prefill
    rank's moves against that rank's (``theirs``: from its claim answers, which may come while the READ runs);
    the first mismatch is the failure reason. This rank digests once, when the bytes landed, and answers
    ``NOT_YET`` (asked again at the next poll) while a prefill rank's digest is still on its way.
    ``before`` runs first (fault injection in tests), ``on_digested`` gets the seconds this rank spent digesting,
    ``on_result`` the outcome (counters)."""
    mine: dict[PeerKey, RankPairDigest] | None = None

    def check() -> str | None | CheckVerdict:
        nonlocal mine
        if mine is None:
            if before is not None:
                before()
            t0 = time.perf_counter()
            mine = initiator_digests(digester, plan, transfers, rank_of, algo)
            if on_digested is not None:
                on_digested(time.perf_counter() - t0)
        answers: dict[PeerKey, tuple[int | None, str]] = {}
        for peer in mine:
            answer = theirs(rank_of(peer))
            if answer is None:
                return NOT_YET
            answers[peer] = answer
        reason = None
        for peer, d in mine.items():
            p_rank = rank_of(peer)
            digest, error = answers[peer]
            reason = compare(d, digest, p_rank, decode_rank)
            if reason is not None:
                reason += f" ({error})" if error else ""
                break
        if on_result is not None:
            on_result(reason)
        return reason

    return check


Writer = Callable[[str], tuple[int, bytes, bool, Sequence[Sequence[int]]]]
"""A push writer by its agent name: ``(its prefill rank, its handshake payload, its coalesce setting, its ids)``."""


def push_check(
    mirrors: MirrorCache,
    digester: Digester,
    writer: Writer,
    own_ids: Sequence[Sequence[int]],
    decode_rank: int,
    algo: Callable[[bytes], str],
    *,
    before: Callable[[], None] | None = None,
    on_result: Callable[[str | None], None] | None = None,
) -> Callable[[dict[str, int | None]], str | None]:
    """The check a push receiver hands ``Endpoint.expect(check=)``: once every writer's bytes landed, each writer's
    digest (from its done-notices) against this rank's digest of its side of the writer's moves, rebuilt from the
    writer's payload and ids (``MirrorCache``); ``algo`` picks the algorithm from a writer's payload. ``before``
    runs first (fault injection in tests), ``on_result`` gets the outcome (counters, timers)."""

    def check(digests: dict[str, int | None]) -> str | None:
        if before is not None:
            before()
        reason = None
        for sender, theirs in sorted(digests.items()):
            p_rank, payload, coalesce, their_ids = writer(sender)
            moves = mirrors.get(payload, coalesce).moves(their_ids, own_ids)
            reason = compare(digester.digest(moves, "remote", algo(payload)), theirs, p_rank, decode_rank)
            if reason is not None:
                break
        if on_result is not None:
            on_result(reason)
        return reason

    return check
