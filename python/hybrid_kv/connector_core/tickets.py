"""Signed transfer tickets: what a prefill engine grants a decode engine, and nothing an API client can change.

In vLLM the prefill's ``kv_transfer_params`` travel through the API client (a router, or anyone who can reach
the decode server's HTTP port) to the decode engine, so every field a client hands over is untrusted. A
prefill engine therefore puts what it grants into a ticket (``kv_transfer_params["hkv_ticket"]``) and MACs it
with a key derived from the deployment secret (``HYBRID_KV_SECRET``: HKDF-SHA256 with its own label, so the
ticket key is never the side-channel key); a decode engine acts only on a ticket whose tag verifies, and
only on the ticket's fields: which engine and host to dial, which remote blocks to read, which request to
release and with which grant.

Encoding: the ``Ticket`` struct as a msgpack array (msgspec), then ``[body, tag]`` as a msgpack array
(``tag`` = HMAC-SHA256 over ``body``, 32 bytes; empty in ``insecure`` mode), URL-safe base64 without padding.

``grant`` is 16 random bytes naming this one grant: the prefill frees, renews or pushes a request only for
a control message carrying it (``control``), so in ``insecure`` mode too (no key: tickets are unsigned and
their fields are only range-checked) a client cannot release another client's request without having seen
its ticket.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import heapq
import hmac
import math
from typing import Annotated, Literal

import msgspec
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..errors import TicketError
from ..limits import MAX_TP_SIZE
from ..wire import (
    MAX_BLOCKS_PER_GROUP,
    MAX_TICKET_CHARS,
    BlockIdLists,
    Grant,
    Host,
    Limits,
    Name,
    Port,
    RequestId,
    WallTime,
)
from ..wire import decode as decode_wire

__all__ = [
    "ALREADY_USED",
    "MAX_LIVE_CAPS",
    "MAX_SPENT_TICKETS",
    "MAX_TICKET_CHARS",
    "TICKET_FIELD",
    "TICKET_INFO",
    "SpentCaps",
    "SpentTickets",
    "Ticket",
    "TicketError",
    "TicketKey",
]

TICKET_FIELD = "hkv_ticket"
"""The ``kv_transfer_params`` key holding the ticket."""
TICKET_VERSION = 1
TICKET_INFO = b"hybrid-kv/vllm transfer ticket v1"
"""HKDF ``info`` label of the ticket key (distinct from every other use of the secret)."""
TAG_BYTES = 32
ALREADY_USED = "was already used"
"""The end of the refusal of a ticket or capability used before."""
MAX_SPENT_TICKETS = 1 << 17
"""Live (unexpired) signed tickets a decode remembers as used; past that, new tickets are refused until some
expire. Only a prefill engine issues tickets (one per request it served), so reaching it takes a prefill rate of
``MAX_SPENT_TICKETS`` requests per lease time; API clients cannot fill it."""
MAX_LIVE_CAPS = 1 << 16
"""Concurrent-push capabilities a decode remembers as used; API clients choose them, so past this the one that
expires first is forgotten (never refusing a new one, and never touching the signed tickets' store)."""

LIMITS = Limits(max_bytes=MAX_TICKET_CHARS, max_len=MAX_BLOCKS_PER_GROUP, max_str=1024, max_depth=3)
"""Pre-scan bounds of a ticket's envelope and body (the deepest: body -> block ids -> group)."""


class Ticket(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """What a prefill engine grants for one finished request."""

    version: int
    engine_id: Name  # the prefill engine
    request_id: RequestId  # the prefill's request id (releases and renewals name it)
    grant: Grant  # random; names this grant in every control message about it
    block_ids: BlockIdLists  # the prefill's blocks per transfer group
    host: Host  # side channel of its TP rank 0
    port: Port
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)]
    num_tokens: Annotated[int, msgspec.Meta(ge=0, lt=2**40)]
    expires_at: WallTime  # wall clock: the lease ends (the prefill may free the blocks)
    max_expires_at: WallTime  # the latest a renewal while the decode connects may push ``expires_at`` to
    mode: Literal["pull", "push"]


class _Envelope(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    body: Annotated[bytes, msgspec.Meta(max_length=MAX_TICKET_CHARS)]
    tag: Annotated[bytes, msgspec.Meta(max_length=TAG_BYTES)]


_encode = msgspec.msgpack.Encoder().encode
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_ticket_decoder = msgspec.msgpack.Decoder(Ticket)


def derive_key(secret: bytes) -> bytes:
    """The ticket key: HKDF-SHA256 of the deployment secret under ``TICKET_INFO``."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=TICKET_INFO).derive(secret)


class TicketKey:
    """Issues and opens tickets under one deployment secret (``None``: ``insecure`` mode, unsigned tickets).

    A keyed opener refuses unsigned tickets; an unkeyed one cannot tell a forged ticket from a real one and
    only checks its fields (``insecure`` trusts API clients with the blocks they name).
    """

    def __init__(self, secret: bytes | None) -> None:
        self._key = None if secret is None else derive_key(secret)

    @property
    def signed(self) -> bool:
        return self._key is not None

    def issue(self, ticket: Ticket) -> str:
        body = _encode(ticket)
        mac = b"" if self._key is None else hmac.new(self._key, body, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(_encode(_Envelope(body, mac))).rstrip(b"=").decode("ascii")

    def open(self, text: object) -> Ticket:
        """The ticket in ``text`` (untrusted), verified; raises ``TicketError`` naming what is wrong."""
        if not isinstance(text, str):
            raise TicketError(f"ticket must be a string, got {type(text).__name__}")
        if len(text) > MAX_TICKET_CHARS:
            raise TicketError(f"ticket is {len(text)} characters; at most {MAX_TICKET_CHARS} are accepted")
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError) as exc:
            raise TicketError(f"ticket is not a hybrid-kv ticket: {exc}") from None
        env = decode_wire(_envelope_decoder, raw, LIMITS, TicketError, "ticket is not a hybrid-kv ticket")
        if self._key is not None:
            want = hmac.new(self._key, env.body, hashlib.sha256).digest()
            if not env.tag:
                raise TicketError("ticket is unsigned (issued by an insecure engine) and this engine has a secret")
            if not hmac.compare_digest(want, env.tag):
                raise TicketError("ticket signature does not verify (forged, altered, or another deployment's)")
        ticket = decode_wire(_ticket_decoder, env.body, LIMITS, TicketError, "ticket fields are malformed")
        if ticket.version != TICKET_VERSION:
            raise TicketError(f"ticket version {ticket.version}; this engine reads version {TICKET_VERSION}")
        if not math.isfinite(ticket.expires_at) or not ticket.expires_at <= ticket.max_expires_at:
            raise TicketError(
                f"ticket lease ends at {ticket.expires_at} but may be renewed only to {ticket.max_expires_at}"
            )
        return ticket


class _Spent:
    """Random keys (grants, capabilities) used once, each remembered until its expiry (wall clock), expired ones
    dropped in expiry order whatever the order they came in."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._until: dict[bytes, float] = {}
        self._heap: list[tuple[float, bytes]] = []

    def __len__(self) -> int:
        return len(self._until)

    def _expire(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            until, key = heapq.heappop(self._heap)
            if self._until.get(key) == until:
                del self._until[key]

    def _evict_first(self) -> None:
        while self._heap:
            until, key = heapq.heappop(self._heap)
            if self._until.get(key) == until:
                del self._until[key]
                return

    def _add(self, key: bytes, until: float) -> None:
        self._until[key] = until
        heapq.heappush(self._heap, (until, key))


class SpentTickets(_Spent):
    """Grants of signed tickets a decode engine already acted on: a ticket is used once.

    Each grant is remembered until its ticket's ``max_expires_at`` (after which the ticket is refused as expired
    anyway), at most ``MAX_SPENT_TICKETS`` live ones; past that a new ticket is refused (forgetting a live grant
    would let its ticket be used again).
    """

    def __init__(self, limit: int = MAX_SPENT_TICKETS) -> None:
        super().__init__(limit)

    def spend(self, ticket: Ticket, now: float) -> None:
        """Record ``ticket`` as used at wall-clock ``now``; raises ``TicketError`` if it was already used, or when
        ``MAX_SPENT_TICKETS`` live tickets are remembered."""
        what = f"ticket of {ticket.engine_id!r}/{ticket.request_id!r}"
        self._expire(now)
        if ticket.grant in self._until:
            raise TicketError(f"{what} {ALREADY_USED}")
        if len(self._until) >= self._limit:
            raise TicketError(f"too many live tickets: {self._limit} used and not yet expired")
        self._add(ticket.grant, ticket.max_expires_at)


class SpentCaps(_Spent):
    """Concurrent-push capabilities a decode engine already acted on (a capability pairs two requests once).

    API clients choose capabilities, so this store never refuses for being full: past ``MAX_LIVE_CAPS`` live
    ones, the one expiring first is forgotten. Forgetting one only lets the same capability pair a second
    request of this decode engine, which a prefill ignores (it keeps the first registration per capability).
    """

    def __init__(self, limit: int = MAX_LIVE_CAPS) -> None:
        super().__init__(limit)
        self.evicted = 0

    def spend(self, cap: bytes, until: float, now: float, what: str) -> None:
        """Record ``cap`` as used until wall-clock ``until``; raises ``TicketError`` naming ``what`` if it is."""
        self._expire(now)
        if cap in self._until:
            raise TicketError(f"{what} {ALREADY_USED}")
        while len(self._until) >= self._limit:
            self._evict_first()
            self.evicted += 1
        self._add(cap, until)
