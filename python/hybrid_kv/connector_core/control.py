"""The control messages the connector's workers exchange over hybrid-kv's side channel, typed and bounded.

A control message arrives authenticated (a holder of the deployment secret sent it, under the name it
claims: ``ControlMessage.sender``) but its contents are still untrusted: ``decode`` accepts exactly one of
the structs below (a tagged union, msgpack through msgspec: every field typed and range-checked, unknown
fields refused) and raises ``ControlError`` for anything else, so no payload can raise out of
``get_finished()`` as anything but a refusal the worker logs.

Every message about a prefill request carries the ``grant`` of the ticket the prefill issued for it
(``tickets``): the prefill acts on it only if the grant is the one it leased (``leases.LeaseBook``).

- ``Release`` (decode -> prefill, pull): this decode rank is done with the request's blocks; the prefill
  frees them once ``consumers`` distinct ranks released them.
- ``Renew`` (decode -> prefill): the decode is still connecting; keep the blocks until ``until`` (bounded by
  the ticket's ``max_expires_at``).
- ``PushReg`` (decode -> prefill, push): write the request into these decode blocks of engine ``engine``
  (sent by that engine's rank, which the prefill checks against the sender's name), never after ``until``
  (wall clock): the decode stops waiting then and may reuse its blocks, so the prefill posts nothing for it
  once too little of that is left, and its WRITEs' deadline ends before it. ``instance`` is the registering
  rank's (``claims.instance_of``): a prefill linked to an older instance of that rank links again first.
- ``StreamReg`` (decode -> prefill, concurrent push): as ``PushReg``, for a request the router sent to both
  engines at once: it names the prefill request by the router's capability ``cap`` (``params``), not by a
  ticket, which does not exist yet (the prefill acts on it only for the request of its own that carries the
  same capability: ``stream_regs``). With ``verify`` the prefill does not stream: a digest must be of final
  bytes, so it pushes the request whole after its forward, digests in its notices.
- ``PushPlan`` (prefill -> decode, push): whether this sender writes to the receiving rank (and, when the
  decode asked for verification, the sender's payload, from which the decode rebuilds its moves).
- ``Claim`` / ``ClaimAnswers`` (pull, ``hybrid_kv.claims``): before any READ, the decode rank claims the
  request's lease from each prefill rank it reads from (its grant, for its engine) and reads once each
  confirmed; with ``verify`` the answer carries the prefill's digest.
"""

from __future__ import annotations

import collections
import logging
from typing import Annotated

import msgspec

from ..claims import TAG_FIELD, Claim, ClaimAnswers, Instance
from ..errors import ControlError
from ..transport.side_channel import MAX_CONTROL_BYTES
from ..verify import MAX_PAYLOAD_BYTES
from ..wire import (
    GRANT_BYTES,
    MAX_TICKET_CHARS,
    BlockIdLists,
    Grant,
    Host,
    Limits,
    Name,
    Port,
    RequestId,
    TpSize,
    WallTime,
)
from ..wire import decode as decode_wire

__all__ = [
    "CAP_BYTES",
    "Cap",
    "Claim",
    "ClaimAnswers",
    "Control",
    "ControlError",
    "PushPlan",
    "PushReg",
    "Refusals",
    "Release",
    "Renew",
    "StreamReg",
    "decode",
    "encode",
    "rank_of",
    "worker_name",
]

log = logging.getLogger("hybrid_kv.connector_core.control")

CAP_BYTES = GRANT_BYTES
"""Bytes of a concurrent-push capability (128 random bits, as a grant)."""
Cap = Annotated[bytes, msgspec.Meta(min_length=CAP_BYTES, max_length=CAP_BYTES)]


class Release(msgspec.Struct, tag="release", tag_field=TAG_FIELD, frozen=True, forbid_unknown_fields=True):
    req: RequestId
    grant: Grant
    consumers: TpSize


class Renew(msgspec.Struct, tag="renew", tag_field=TAG_FIELD, frozen=True, forbid_unknown_fields=True):
    req: RequestId
    grant: Grant
    until: WallTime


Payload = Annotated[bytes, msgspec.Meta(max_length=MAX_PAYLOAD_BYTES)]


class PushReg(msgspec.Struct, tag="push_reg", tag_field=TAG_FIELD, frozen=True, forbid_unknown_fields=True):
    p_req: RequestId
    grant: Grant
    d_req: RequestId
    ids: BlockIdLists
    engine: Name
    host: Host
    port: Port  # side channel of the decode engine's TP rank 0
    tp: TpSize
    until: WallTime  # the decode stops waiting then (wall clock) and may reuse the blocks: write nothing later
    verify: bool = False  # the decode checks this request's digests (the writers put theirs in their notices)
    instance: Instance = ""  # the registering rank's instance (claims.instance_of)


class StreamReg(msgspec.Struct, tag="stream_reg", tag_field=TAG_FIELD, frozen=True, forbid_unknown_fields=True):
    cap: Cap
    d_req: RequestId
    ids: BlockIdLists
    engine: Name
    host: Host
    port: Port  # side channel of the decode engine's TP rank 0
    tp: TpSize
    until: WallTime  # the decode stops waiting then (wall clock) and may reuse the blocks: write nothing later
    verify: bool = False  # the decode checks this request's digests: then it is pushed whole, not streamed
    instance: Instance = ""  # the registering rank's instance (claims.instance_of)


class PushPlan(msgspec.Struct, tag="push_plan", tag_field=TAG_FIELD, frozen=True, forbid_unknown_fields=True):
    d_req: RequestId
    writes: bool
    payload: Payload = b""  # verified requests: the writer's handshake payload
    coalesce: bool = True  # ... and its coalesce setting (its moves are cut by it)
    ids: BlockIdLists = []  # ... and its own block ids of the request (a concurrent push's decode has no ticket)


Control = Release | Renew | PushReg | PushPlan | StreamReg | Claim | ClaimAnswers

LIMITS = Limits(max_bytes=MAX_CONTROL_BYTES, max_len=1 << 20, max_str=MAX_TICKET_CHARS, max_depth=6)
"""Pre-scan bounds of a control message (the deepest: a ``Claim``'s entries' block ids; the longest string: a
claim's ticket)."""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Control)


def encode(msg: Control) -> bytes:
    return _encoder.encode(msg)


def decode(payload: bytes) -> Control:
    """The control message in ``payload`` (untrusted): pre-scanned (size, lengths, nesting) before it is decoded;
    raises ``ControlError`` naming what is wrong, and nothing else, for any input."""
    return decode_wire(_decoder, payload, LIMITS, ControlError, "not a hybrid-kv control message")


def worker_name(engine_id: str, tp_rank: int) -> str:
    """The endpoint (NIXL agent) name of worker ``tp_rank`` of engine ``engine_id``, ``<engine>-tp<rank>``:
    side-channel requests name the endpoint they are meant for, and every other endpoint refuses them
    (``rank_of`` reads it back)."""
    return f"{engine_id}-tp{tp_rank}"


def rank_of(sender: str, engine_id: str, tp_size: int) -> int | None:
    """The TP rank whose worker of ``engine_id`` is named ``sender`` (``worker_name``), else ``None``."""
    prefix = f"{engine_id}-tp"
    tail = sender[len(prefix) :] if sender.startswith(prefix) else ""
    if not (tail.isascii() and tail.isdigit()) or len(tail) > 4 or (len(tail) > 1 and tail[0] == "0"):
        return None
    rank = int(tail)
    return rank if rank < tp_size else None


class Refusals:
    """Logs refused control messages: the first from each sender, then every 1024th (a flood costs no log)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.count: collections.Counter[str] = collections.Counter()

    def __call__(self, sender: str, reason: str) -> None:
        if len(self.count) >= 4096 and sender not in self.count:
            self.count.clear()  # bounded: a flood of new names restarts the count
        self.count[sender] += 1
        n = self.count[sender]
        if n == 1 or n % 1024 == 0:
            log.warning("hybrid-kv %s: control message from %r refused (%d so far): %s", self.name, sender, n, reason)
