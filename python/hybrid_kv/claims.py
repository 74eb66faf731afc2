"""Lease claims: the initiator of a pull asks the rank holding the blocks to confirm them before it READs.

A READ is only as safe as the blocks it names: a decode holding a prefill's ticket could otherwise read
blocks the prefill has since given to another request (a ticket replayed at a second decode engine, or read
after its lease ended). So, before any READ, the decode rank sends a ``Claim`` for the request to every prefill
rank it reads from, and posts the READ only once each answered ``ok``: the prefill answers ``ok`` only while it
holds the request's blocks under a lease carrying the claim's grant, for the claiming engine (the first to
claim holds it; the connector's ``leases``), and says until when (``expires_at``).

Verified transfers ride on the same round trip without lengthening it: an entry asking for a digest is answered
``ok`` at once with ``follows`` set, and the prefill's digest of its side of the request's moves (rebuilt from the
claim's payload and ids and its own lease's ids: ``verify``) follows in a second answer, taken after the first was
sent, while the initiator's READ runs and the lease still holds the blocks (the initiator releases them only after
its check). So verification adds hashing, never a round trip, and the prefill's hashing overlaps the READ.

Claims and answers are batched: one ``Claim`` per prefill rank per step holds every request the decode rank
starts in that step (``ClaimBatcher``), one ``ClaimAnswers`` per decode rank per step the answers. Each answer
also names the answering rank's instance (a digest of its NIXL agent metadata, which every process start
changes), so an initiator can tell that the rank behind a name restarted since it connected.

Written once for the vLLM connector and the demo; no vLLM import.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, Any, NamedTuple

import msgspec

from .errors import ClaimError
from .transport.side_channel import MAX_CONTROL_BYTES
from .verify import MAX_PAYLOAD_BYTES, Algo, MirrorCache, peer_digest
from .wire import MAX_TICKET_CHARS, BlockIdLists, Count, Hex64, Host, Limits, Name, Port, RequestId, WallTime, decode

__all__ = [
    "MAX_CLAIM_ENTRIES",
    "TAG_FIELD",
    "Claim",
    "ClaimAnswers",
    "ClaimBatcher",
    "ClaimEntry",
    "ClaimResult",
    "ClaimRound",
    "DigestDue",
    "decode_claim_message",
    "encode",
    "answer_claim",
    "claim_digests",
    "serve_claims",
    "instance_of",
    "take_digests",
    "split_entries",
]

TAG_FIELD = "hkv"
"""The tag field of every hybrid-kv control message (the connector's union shares it)."""
MAX_CLAIM_ENTRIES = 1024
"""Most requests in one ``Claim`` or ``ClaimAnswers``."""
BATCH_BYTES = MAX_CONTROL_BYTES * 3 // 4
"""A batch is cut into messages of about this many bytes at most (below the side channel's limit)."""

Instance = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{0,64}$")]
SmallGrant = Annotated[bytes, msgspec.Meta(max_length=16)]


class ClaimEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request claimed: the holder's request id and grant, the initiator's request id and (for a digest) its
    block ids; ``ticket``: the holder's own signed ticket for it (the vLLM connector), so that the holder can
    confirm a lease its worker has not been told about yet (its scheduler finished the request a step ago)."""

    req: RequestId
    grant: SmallGrant
    d_req: RequestId
    ids: BlockIdLists = []
    digest: bool = False
    ticket: Annotated[str, msgspec.Meta(max_length=MAX_TICKET_CHARS)] = ""


class Claim(msgspec.Struct, tag="claim", tag_field=TAG_FIELD, frozen=True, forbid_unknown_fields=True):
    """Initiator -> holder: confirm these leases for engine ``engine`` and answer to ``host:port``.

    ``payload`` (the initiator rank's handshake payload), ``coalesce`` and ``algo`` are what a digest needs; the
    payload is empty when no entry asks for one."""

    entries: Annotated[list[ClaimEntry], msgspec.Meta(min_length=1, max_length=MAX_CLAIM_ENTRIES)]
    engine: Name
    host: Host
    port: Port
    payload: Annotated[bytes, msgspec.Meta(max_length=MAX_PAYLOAD_BYTES)] = b""
    coalesce: bool = True
    algo: Algo = "xxh3"


class ClaimResult(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The holder's answer for one request: ``ok`` with the lease's end (wall clock), or ``error``. A claim asking
    for a digest gets two: ``ok`` with ``follows`` at once, then the digest (``digest`` empty and ``error`` set
    when it could not be taken)."""

    d_req: RequestId
    ok: bool
    error: Annotated[str, msgspec.Meta(max_length=512)] = ""
    expires_at: WallTime = 0.0
    digest: Hex64 = ""
    bytes: Count = 0
    moves: Count = 0
    follows: bool = False


class ClaimAnswers(msgspec.Struct, tag="claim_answers", tag_field=TAG_FIELD, frozen=True, forbid_unknown_fields=True):
    """Holder -> initiator: the results of claims, and the answering rank's instance (``instance_of``)."""

    results: Annotated[list[ClaimResult], msgspec.Meta(min_length=1, max_length=MAX_CLAIM_ENTRIES)]
    instance: Instance = ""


LIMITS = Limits(max_bytes=MAX_CONTROL_BYTES, max_len=1 << 20, max_str=MAX_TICKET_CHARS, max_depth=6)
"""Pre-scan bounds of a claim message (the deepest: ``Claim`` -> entries -> entry -> ids -> group -> id)."""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Claim | ClaimAnswers)


def encode(msg: Claim | ClaimAnswers) -> bytes:
    return _encoder.encode(msg)


def decode_claim_message(data: bytes) -> Claim | ClaimAnswers:
    """A claim or its answers from untrusted bytes; raises ``ClaimError`` (only) naming what is wrong."""
    return decode(_decoder, data, LIMITS, ClaimError, "not a claim message")


def instance_of(nixl_metadata: bytes) -> str:
    """A rank's instance: 16 hex digits of the SHA-256 of its NIXL agent metadata (new with every process)."""
    return hashlib.sha256(nixl_metadata).hexdigest()[:16]


def entry_size(entry: ClaimEntry) -> int:
    """An upper bound of the bytes ``entry`` takes in a message."""
    return 64 + len(entry.req) + len(entry.d_req) + len(entry.ticket) + sum(5 * len(g) + 5 for g in entry.ids)


def split_entries(entries: Sequence[Any], size: Callable[[Any], int], budget: int) -> Iterator[list[Any]]:
    """``entries`` cut into consecutive batches of at most ``MAX_CLAIM_ENTRIES`` whose sizes sum to ``budget`` at
    most (an entry larger than the budget goes alone)."""
    batch: list[Any] = []
    used = 0
    for e in entries:
        n = size(e)
        if batch and (len(batch) >= MAX_CLAIM_ENTRIES or used + n > budget):
            yield batch
            batch, used = [], 0
        batch.append(e)
        used += n
    if batch:
        yield batch


def claim_messages(
    entries: Sequence[ClaimEntry], engine: str, host: str, port: int, payload: bytes, coalesce: bool, algo: str
) -> list[bytes]:
    """The encoded ``Claim`` messages carrying ``entries`` (several when they would not fit one)."""
    with_digest = any(e.digest for e in entries)
    body = payload if with_digest else b""
    budget = max(1, BATCH_BYTES - len(body))
    return [
        encode(Claim(batch, engine, host, port, body if any(e.digest for e in batch) else b"", coalesce, algo))
        for batch in split_entries(entries, entry_size, budget)
    ]


def answer_messages(results: Sequence[ClaimResult], instance: str) -> list[bytes]:
    """The encoded ``ClaimAnswers`` messages carrying ``results``."""
    return [
        encode(ClaimAnswers(batch, instance))
        for batch in split_entries(results, lambda r: 128 + len(r.d_req) + len(r.error), BATCH_BYTES)
    ]


class ClaimBatcher:
    """The claims an initiator rank queues during one step, per destination (address, endpoint meant); ``take``
    hands them over as encoded messages."""

    def __init__(self) -> None:
        self._by_dest: dict[tuple[str, str], list[ClaimEntry]] = {}

    def add(self, address: str, to: str, entry: ClaimEntry) -> None:
        self._by_dest.setdefault((address, to), []).append(entry)

    def __bool__(self) -> bool:
        return bool(self._by_dest)

    def take(self) -> dict[tuple[str, str], list[ClaimEntry]]:
        out, self._by_dest = self._by_dest, {}
        return out


class DigestDue(NamedTuple):
    """A digest the holder owes: ``entry`` of ``claim`` was answered ``ok`` with ``follows``; ``own_ids`` are the
    holder's own block ids of the request (never the claimer's word)."""

    entry: ClaimEntry
    claim: Claim
    own_ids: Sequence[Sequence[int]]
    expires_at: float


def take_digests(
    due: Sequence[DigestDue],
    mirrors: MirrorCache,
    digester: Any,
    after_digest: Callable[[ClaimEntry, Sequence[Sequence[int]]], None] | None = None,
) -> list[ClaimResult]:
    """The second answers of ``due``: each request's digest (or why none); never raises (the inputs are
    untrusted). ``after_digest`` runs after each (tests: fault injection)."""
    out = []
    for d in due:
        digest, nbytes, moves, error = peer_digest(
            mirrors, digester, d.claim.payload, d.claim.coalesce, d.entry.ids, d.own_ids, d.claim.algo
        )
        out.append(ClaimResult(d.entry.d_req, True, error, d.expires_at, digest, nbytes, moves))
        if after_digest is not None:
            after_digest(d.entry, d.own_ids)
    return out


Lookup = Callable[[ClaimEntry], "tuple[Sequence[Sequence[int]], float] | str | None"]
"""The holder's verdict on one entry: ``(its own block ids of the request, the lease's end)`` when confirmed, the
reason when refused, ``None`` when it does not hold the request yet."""


def answer_claim(
    claim: Claim,
    lookup: Lookup,
    can_digest: bool,
    *,
    only: str | None = None,
) -> tuple[list[ClaimResult], set[str], list[DigestDue]]:
    """The holder's first answers to ``claim``'s entries (``only``: that request's alone), the requests it does not
    hold yet (kept by the caller until it does), and the digests it owes (``take_digests``, once these answers
    were sent; ``can_digest``: whether this rank takes digests at all). Never raises for any claim. The one
    responder of the connector and the demo."""
    results: list[ClaimResult] = []
    early: set[str] = set()
    due: list[DigestDue] = []
    for entry in claim.entries:
        if only is not None and entry.req != only:
            continue
        got = lookup(entry)
        if got is None:
            early.add(entry.req)
        elif isinstance(got, str):
            results.append(ClaimResult(entry.d_req, False, got))
        else:
            own_ids, expires_at = got
            if not entry.digest:
                results.append(ClaimResult(entry.d_req, True, expires_at=expires_at))
            elif not can_digest:
                results.append(ClaimResult(entry.d_req, True, "this rank takes no digests", expires_at=expires_at))
            else:
                results.append(ClaimResult(entry.d_req, True, expires_at=expires_at, follows=True))
                due.append(DigestDue(entry, claim, own_ids, expires_at))
    return results, early, due


def serve_claims(
    ep: Any,
    controls: Sequence[Any],
    lookup: Lookup,
    mirrors: MirrorCache | None,
    digester: Any,
    *,
    after_digest: Callable[[ClaimEntry, Sequence[Sequence[int]]], None] | None = None,
) -> int:
    """A holder without leases of its own (the demo's, a test's or a benchmark's prefill rank): answer the claims
    among ``controls`` (an ``Endpoint.poll()``'s ``control``) through ``ep``'s courier, every first answer before
    any digest is taken; returns the entries answered. Other messages are left alone."""
    answered = 0
    instance = instance_of(ep.metadata)
    owed: list[tuple[str, str, list[DigestDue]]] = []
    can_digest = mirrors is not None and digester is not None
    for c in controls:
        try:
            msg = decode_claim_message(c.payload)
        except ClaimError:
            continue
        if not isinstance(msg, Claim):
            continue
        results, _, due = answer_claim(msg, lookup, can_digest)
        answered += len(results)
        address = f"tcp://{msg.host}:{msg.port}"
        for out in answer_messages(results, instance):
            ep.courier.send(address, out, c.sender, timeout_s=10.0, attempts=3)
        if due:
            owed.append((address, c.sender, due))
    for address, sender, due in owed:
        assert mirrors is not None
        for out in answer_messages(take_digests(due, mirrors, digester, after_digest), instance):
            ep.courier.send(address, out, sender, timeout_s=10.0, attempts=3)
    return answered


class ClaimRound:
    """An initiator's claims of ``entries`` from each target rank (``rank -> (address, endpoint name)``), one message
    per rank for all of them, answered to ``ep``'s side channel: first ``ok`` (``wait``), then, for an entry asking
    for one, the rank's digest (``feed`` takes it from later polls; ``theirs`` hands it to ``pull_check``)."""

    def __init__(
        self,
        ep: Any,
        targets: dict[int, tuple[str, str]],
        entries: Sequence[ClaimEntry],
        engine: str,
        payload: bytes,
        algo: str,
        timeout_s: float,
        *,
        coalesce: bool = True,
    ) -> None:
        self.ep = ep
        self.timeout_s = timeout_s
        self._names = {name: rank for rank, (_, name) in targets.items()}
        host, port = ep.address.removeprefix("tcp://").rsplit(":", 1)
        for out in claim_messages(entries, engine, host, int(port), payload, coalesce, algo):
            for address, name in targets.values():
                ep.courier.send(address, out, name, timeout_s=timeout_s, attempts=3)
        self._unconfirmed = {(e.d_req, r) for e in entries for r in targets}
        self._owed = {(e.d_req, r) for e in entries if e.digest for r in targets}
        self.digests: dict[str, dict[int, tuple[int | None, str]]] = {e.d_req: {} for e in entries}

    def feed(self, controls: Sequence[Any]) -> list[Any]:
        """Take the answers among ``controls`` (from the ranks asked); returns the other messages.

        Raises:
            RuntimeError: a claim was refused.
        """
        rest = []
        for c in controls:
            msg: Claim | ClaimAnswers | None
            try:
                msg = decode_claim_message(c.payload)
            except ClaimError:
                msg = None
            if not isinstance(msg, ClaimAnswers) or c.sender not in self._names:
                rest.append(c)
                continue
            for res in msg.results:
                key = (res.d_req, self._names[c.sender])
                if key in self._unconfirmed:
                    if not res.ok:
                        raise RuntimeError(f"{c.sender} refused the claim of {res.d_req!r}: {res.error}")
                    self._unconfirmed.discard(key)
                if key in self._owed and res.ok and not res.follows:
                    self._owed.discard(key)
                    self.digests[res.d_req][key[1]] = (int(res.digest, 16) if res.digest else None, res.error)
        return rest

    def theirs(self, d_req: str) -> Callable[[int], tuple[int | None, str] | None]:
        """Rank ``r``'s digest of request ``d_req`` for ``pull_check``: ``None`` while it is on its way."""
        got = self.digests[d_req]
        return lambda rank: got.get(rank)

    def wait(self, *, digests: bool = False, on_control: Callable[[Any], None] | None = None) -> None:
        """Poll ``ep`` until every rank confirmed every entry (``digests``: and sent every digest asked for);
        other control messages go to ``on_control``.

        Raises:
            TimeoutError: an answer did not come within the round's timeout.
            RuntimeError: a claim was refused or not delivered.
        """
        end = time.monotonic() + self.timeout_s
        while self._unconfirmed or (digests and self._owed):
            for c in self.feed(self.ep.poll().control):
                if on_control is not None:
                    on_control(c)
            lost = [d for d in self.ep.courier.take() if not d.delivered]
            if lost:
                raise RuntimeError(f"a claim was not delivered: {lost[0].reason}")
            if time.monotonic() > end:
                left = sorted(self._unconfirmed or self._owed)
                raise TimeoutError(f"no claim answer for {left[:4]} within {self.timeout_s:g} s")
            time.sleep(0.0002)


def claim_digests(
    ep: Any,
    targets: dict[int, tuple[str, str]],
    entries: Sequence[ClaimEntry],
    engine: str,
    payload: bytes,
    algo: str,
    timeout_s: float,
    *,
    coalesce: bool = True,
    on_control: Callable[[Any], None] | None = None,
) -> dict[str, dict[int, tuple[int | None, str]]]:
    """A ``ClaimRound`` waited out: every rank's confirmation and digest of every entry. Returns, per initiator
    request, each rank's ``(digest or None, error)`` (none for an entry that asked for no digest); other control
    messages go to ``on_control``.

    Raises:
        TimeoutError: an answer did not come within ``timeout_s``.
        RuntimeError: a claim was refused or not delivered.
    """
    claims = ClaimRound(ep, targets, entries, engine, payload, algo, timeout_s, coalesce=coalesce)
    claims.wait(digests=True, on_control=on_control)
    return claims.digests
