"""Lease claims: the initiator of a pull asks the rank holding the blocks to confirm them before it READs.

A READ is only as safe as the blocks it names: a decode holding a prefill's ticket could otherwise read
blocks the prefill has since given to another request (a ticket replayed at a second decode engine, or read
after its lease ended). So, before any READ, the decode rank sends a ``Claim`` for the request to every prefill
rank it reads from, and posts the READ only once each answered ``ok``: the prefill answers ``ok`` only while it
holds the request's blocks under a lease carrying the claim's grant, for the claiming engine (the first to
claim holds it; the connector's ``leases``), and says until when (``expires_at``).

Verified transfers ride on the same round trip: an entry asking for a digest gets the prefill's digest of its
side of the request's moves (rebuilt from the claim's payload and ids and its own lease's ids: ``verify``), so
verification adds hashing, not a round trip.

Claims and answers are batched: one ``Claim`` per prefill rank per step holds every request the decode rank
starts in that step (``ClaimBatcher``), one ``ClaimAnswers`` per decode rank per step the answers. Each answer
also names the answering rank's instance (a digest of its NIXL agent metadata, which every process start
changes), so an initiator can tell that the rank behind a name restarted since it connected.

Written once for the vLLM connector and the demo; no vLLM import.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, Any

import msgspec

from .transport.side_channel import MAX_CONTROL_BYTES
from .verify import MAX_PAYLOAD_BYTES, Algo, MirrorCache, peer_digest
from .wire import BlockIdLists, Count, Hex64, Host, Limits, Name, Port, RequestId, WallTime, decode

__all__ = [
    "MAX_CLAIM_ENTRIES",
    "TAG_FIELD",
    "Claim",
    "ClaimAnswers",
    "ClaimBatcher",
    "ClaimEntry",
    "ClaimError",
    "ClaimResult",
    "decode_claim_message",
    "encode",
    "instance_of",
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


class ClaimError(ValueError):
    """Bytes that are not a claim message (the message says why)."""


class ClaimEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request claimed: the holder's request id and grant, the initiator's request id and (for a digest) its
    block ids."""

    req: RequestId
    grant: SmallGrant
    d_req: RequestId
    ids: BlockIdLists = []
    digest: bool = False


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
    """The holder's answer for one request: ``ok`` with the lease's end (wall clock), or ``error``; with a digest
    when asked (``digest`` empty and ``error`` set when it could not be taken)."""

    d_req: RequestId
    ok: bool
    error: Annotated[str, msgspec.Meta(max_length=512)] = ""
    expires_at: WallTime = 0.0
    digest: Hex64 = ""
    bytes: Count = 0
    moves: Count = 0


class ClaimAnswers(msgspec.Struct, tag="claim_answers", tag_field=TAG_FIELD, frozen=True, forbid_unknown_fields=True):
    """Holder -> initiator: the results of claims, and the answering rank's instance (``instance_of``)."""

    results: Annotated[list[ClaimResult], msgspec.Meta(min_length=1, max_length=MAX_CLAIM_ENTRIES)]
    instance: Instance = ""


LIMITS = Limits(max_bytes=MAX_CONTROL_BYTES, max_len=1 << 20, max_str=4096, max_depth=6)
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
    return 64 + len(entry.req) + len(entry.d_req) + sum(5 * len(g) + 5 for g in entry.ids)


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


def result_with_digest(
    entry: ClaimEntry,
    claim: Claim,
    own_ids: Sequence[Sequence[int]],
    expires_at: float,
    mirrors: MirrorCache | None,
    digester: Any,
) -> ClaimResult:
    """The holder's ``ok`` answer to ``entry``, with its digest when asked (``own_ids``: the holder's own ids of
    the request, never the claimer's word); never raises (the inputs are untrusted)."""
    if not entry.digest:
        return ClaimResult(entry.d_req, True, expires_at=expires_at)
    if mirrors is None or digester is None:
        return ClaimResult(entry.d_req, True, "this rank takes no digests", expires_at=expires_at)
    digest, nbytes, moves, error = peer_digest(
        mirrors, digester, claim.payload, claim.coalesce, entry.ids, own_ids, claim.algo
    )
    return ClaimResult(entry.d_req, True, error, expires_at, digest, nbytes, moves)
