"""The notification messages a request's initiator sends to the passive peer.

Each posted NIXL transfer carries ``hkv:done:<index>:<count>:<request_id>``; NIXL delivers it to
the remote agent after that transfer's bytes landed, so the passive side knows a request is complete
once it has seen all ``count`` indices from that sender. A verified request (``hybrid_kv.verify``) carries
``hkv:dgst:<index>:<count>:<digest>:<request_id>`` instead: the same notice with the sender's digest of its
side of the rank pair's moves (16 lowercase hex digits, the same in each of the request's notices to that
peer). A failed request sends a standalone
``hkv:fail:<request_id>:<reason>`` where the peer is still reachable. The request id goes last so
that it may contain colons.

Notifications come from any agent that loaded our NIXL metadata, so ``parse`` reads them as hostile
bytes: at most ``MAX_NOTICE_BYTES``, strict UTF-8, indices in ASCII decimal without leading zeros,
``index < count <= MAX_NOTICE_COUNT``, a non-empty request id of at most ``MAX_REQUEST_ID_CHARS``; anything
else is not a hybrid-kv notice (``None``). It never raises.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..limits import MAX_REQUEST_ID_CHARS

__all__ = [
    "MAX_NOTICE_BYTES",
    "MAX_NOTICE_COUNT",
    "MAX_REQUEST_ID_CHARS",
    "Notice",
    "done_message",
    "fail_message",
    "parse",
]

_DONE = "hkv:done:"
_DGST = "hkv:dgst:"
_FAIL = "hkv:fail:"
MAX_NOTICE_COUNT = 4096
"""Most transfers one request may post to one peer (each carries one done-notice)."""
MAX_REASON_CHARS = 512
"""A fail-notice's reason is cut to this many characters."""
MAX_NOTICE_BYTES = len(_FAIL) + 3 * MAX_REQUEST_ID_CHARS + 1 + 4 * MAX_REASON_CHARS

_DONE_RE = re.compile(r"hkv:done:(0|[1-9][0-9]{0,3}):([1-9][0-9]{0,3}):(.+)", re.DOTALL | re.ASCII)
_DGST_RE = re.compile(r"hkv:dgst:(0|[1-9][0-9]{0,3}):([1-9][0-9]{0,3}):([0-9a-f]{16}):(.+)", re.DOTALL | re.ASCII)


@dataclass(frozen=True)
class Notice:
    """A parsed notification: ``kind`` is ``"done"`` (with ``index``/``count``, and ``digest`` when it carries
    one) or ``"fail"`` (with ``reason``)."""

    kind: str
    request_id: str
    index: int = 0
    count: int = 0
    reason: str = ""
    digest: int | None = None


def done_message(request_id: str, index: int, count: int, digest: int | None = None) -> bytes:
    """The message carried by transfer ``index`` of the ``count`` transfers of a request to one peer, with the
    sender's digest of the rank pair when given."""
    if digest is not None:
        return f"{_DGST}{index}:{count}:{digest:016x}:{request_id}".encode()
    return f"{_DONE}{index}:{count}:{request_id}".encode()


def fail_message(request_id: str, reason: str) -> bytes:
    """The standalone message telling a peer that ``request_id`` failed (``reason`` has no newlines)."""
    # request ids may contain ':' but reasons are free text, so escape the separator in the id
    rid = request_id.replace("%", "%25").replace(":", "%3A")
    return f"{_FAIL}{rid}:{reason[:MAX_REASON_CHARS]}".encode()


def parse(msg: bytes) -> Notice | None:
    """Decode a hybrid-kv notification, or ``None`` for any other message (malformed ones included)."""
    if not isinstance(msg, bytes | bytearray) or len(msg) > MAX_NOTICE_BYTES:
        return None
    try:
        text = bytes(msg).decode("utf-8")
    except UnicodeDecodeError:
        return None
    if text.startswith((_DONE, _DGST)):
        m = _DONE_RE.fullmatch(text) or _DGST_RE.fullmatch(text)
        if m is None:
            return None
        index, count, rid = int(m[1]), int(m[2]), m[m.lastindex or 0]
        digest = int(m[3], 16) if m.re is _DGST_RE else None
        if not index < count <= MAX_NOTICE_COUNT or len(rid) > MAX_REQUEST_ID_CHARS:
            return None
        return Notice("done", rid, index=index, count=count, digest=digest)
    if text.startswith(_FAIL):
        raw, sep, reason = text[len(_FAIL) :].partition(":")
        rid = raw.replace("%3A", ":").replace("%25", "%")
        if not sep or not rid or len(rid) > MAX_REQUEST_ID_CHARS:
            return None
        return Notice("fail", rid, reason=reason[:MAX_REASON_CHARS])
    return None
