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
  (sent by that engine's rank, which the prefill checks against the sender's name).
- ``StreamReg`` (decode -> prefill, concurrent push): as ``PushReg``, for a request the router sent to both
  engines at once: it names the prefill request by the router's capability ``cap`` (``params``), not by a
  ticket, which does not exist yet (the prefill acts on it only for the request of its own that carries the
  same capability: ``leases.LeaseBook``), and says until when the decode waits (``until``: its blocks may be
  reused after it, so the prefill's writes must end before it, whatever the prefill's queue). With ``verify``
  the prefill does not stream: a digest must be of final bytes, so it pushes the request whole after its
  forward, digests in its notices.
- ``PushPlan`` (prefill -> decode, push): whether this sender writes to the receiving rank (and, when the
  decode asked for verification, the sender's payload, from which the decode rebuilds its moves).
- ``VerifyAsk`` (decode -> prefill, pull, ``verify``): digest your side of this request's moves with this
  decode rank (rebuilt from its payload and block ids; the prefill's own ids are its lease's) and answer to
  this rank's side channel; sent before the READ is posted.
- ``VerifyAnswer`` (prefill -> decode): the digest (16 hex digits), or why there is none.
"""

from __future__ import annotations

import collections
import logging
from typing import Annotated

import msgspec

from ...limits import MAX_TP_SIZE
from ...verify import MAX_PAYLOAD_BYTES, Algo
from .tickets import GRANT_BYTES, BlockIdLists, Grant, Name, RequestId, WallTime

__all__ = [
    "CAP_BYTES",
    "Cap",
    "Control",
    "ControlError",
    "PushPlan",
    "PushReg",
    "Refusals",
    "Release",
    "Renew",
    "StreamReg",
    "VerifyAnswer",
    "VerifyAsk",
    "decode",
    "encode",
    "rank_of",
    "writer_names",
]

log = logging.getLogger("hybrid_kv.integrations.vllm.control")

TAG_FIELD = "hkv_vllm"

CAP_BYTES = GRANT_BYTES
"""Bytes of a concurrent-push capability (128 random bits, as a grant)."""
Cap = Annotated[bytes, msgspec.Meta(min_length=CAP_BYTES, max_length=CAP_BYTES)]
TpSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class ControlError(ValueError):
    """A control payload that is not one of this connector's messages (the message says why)."""


class Release(msgspec.Struct, tag="release", tag_field=TAG_FIELD, frozen=True, forbid_unknown_fields=True):
    req: RequestId
    grant: Grant
    consumers: TpSize


class Renew(msgspec.Struct, tag="renew", tag_field=TAG_FIELD, frozen=True, forbid_unknown_fields=True):
    req: RequestId
    grant: Grant
    until: WallTime


Host = Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
Payload = Annotated[bytes, msgspec.Meta(max_length=MAX_PAYLOAD_BYTES)]
Hex = Annotated[str, msgspec.Meta(pattern="^([0-9a-f]{16})?$")]
Count = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


class PushReg(msgspec.Struct, tag="push_reg", tag_field=TAG_FIELD, frozen=True, forbid_unknown_fields=True):
    p_req: RequestId
    grant: Grant
    d_req: RequestId
    ids: BlockIdLists
    engine: Name
    host: Host
    port: Port  # side channel of the decode engine's TP rank 0
    tp: TpSize
    verify: bool = False  # the decode checks this request's digests (the writers put theirs in their notices)


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


class PushPlan(msgspec.Struct, tag="push_plan", tag_field=TAG_FIELD, frozen=True, forbid_unknown_fields=True):
    d_req: RequestId
    writes: bool
    payload: Payload = b""  # verified requests: the writer's handshake payload
    coalesce: bool = True  # ... and its coalesce setting (its moves are cut by it)


class VerifyAsk(msgspec.Struct, tag="verify_ask", tag_field=TAG_FIELD, frozen=True, forbid_unknown_fields=True):
    req: RequestId  # the prefill request
    grant: Grant
    d_req: RequestId  # the decode request (echoed)
    ids: BlockIdLists  # the decode rank's block ids
    payload: Payload  # the decode rank's handshake payload
    coalesce: bool
    algo: Algo
    host: Host  # the decode rank's side channel, where the answer goes
    port: Port


class VerifyAnswer(msgspec.Struct, tag="verify_answer", tag_field=TAG_FIELD, frozen=True, forbid_unknown_fields=True):
    d_req: RequestId
    digest: Hex  # empty with ``error``
    bytes: Count
    moves: Count
    error: Annotated[str, msgspec.Meta(max_length=512)] = ""


Control = Release | Renew | PushReg | PushPlan | StreamReg | VerifyAsk | VerifyAnswer

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Control)


def encode(msg: Control) -> bytes:
    return _encoder.encode(msg)


def decode(payload: bytes) -> Control:
    """The control message in ``payload`` (untrusted); raises ``ControlError`` naming what is wrong."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ControlError(f"not a hybrid-kv control message: {exc}") from None


def rank_of(sender: str, engine_id: str, tp_size: int) -> int | None:
    """The TP rank whose worker of ``engine_id`` is named ``sender`` (``<engine>-tp<rank>``), else ``None``."""
    prefix = f"{engine_id}-tp"
    tail = sender[len(prefix) :] if sender.startswith(prefix) else ""
    if not (tail.isascii() and tail.isdigit()) or len(tail) > 4 or (len(tail) > 1 and tail[0] == "0"):
        return None
    rank = int(tail)
    return rank if rank < tp_size else None


def writer_names(engine_id: str, ranks: list[int], own_engine: str) -> dict[str, int]:
    """The names (side-channel sender = NIXL agent) that may answer and write a push request of
    ``engine_id``'s ``ranks`` into ``own_engine``, with the rank each stands for: a rank's worker
    ``<engine>-tp<rank>``, or its per-peer endpoint ``<engine>-tp<rank>-><own_engine>``."""
    out = {f"{engine_id}-tp{r}": r for r in ranks}
    out.update({f"{engine_id}-tp{r}->{own_engine}": r for r in ranks})
    return out


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
