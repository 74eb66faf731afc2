"""The notification messages a request's initiator sends to the passive peer.

Each posted NIXL transfer carries ``hkv:done:<index>:<count>:<request_id>``; NIXL delivers it to
the remote agent after that transfer's bytes landed, so the passive side knows a request is complete
once it has seen all ``count`` indices from that sender. A failed request sends a standalone
``hkv:fail:<request_id>:<reason>`` where the peer is still reachable. The request id goes last so
that it may contain colons.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Notice", "done_message", "fail_message", "parse"]

_DONE = "hkv:done:"
_FAIL = "hkv:fail:"


@dataclass(frozen=True)
class Notice:
    """A parsed notification: ``kind`` is ``"done"`` (with ``index``/``count``) or ``"fail"`` (with ``reason``)."""

    kind: str
    request_id: str
    index: int = 0
    count: int = 0
    reason: str = ""


def done_message(request_id: str, index: int, count: int) -> bytes:
    """The message carried by transfer ``index`` of the ``count`` transfers of a request to one peer."""
    return f"{_DONE}{index}:{count}:{request_id}".encode()


def fail_message(request_id: str, reason: str) -> bytes:
    """The standalone message telling a peer that ``request_id`` failed (``reason`` has no newlines)."""
    # request ids may contain ':' but reasons are free text, so escape the separator in the id
    return f"{_FAIL}{request_id.replace('%', '%25').replace(':', '%3A')}:{reason}".encode()


def parse(msg: bytes) -> Notice | None:
    """Decode a hybrid-kv notification, or ``None`` for any other message."""
    try:
        text = msg.decode()
    except UnicodeDecodeError:
        return None
    if text.startswith(_DONE):
        parts = text[len(_DONE) :].split(":", 2)
        if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
            return Notice("done", parts[2], index=int(parts[0]), count=int(parts[1]))
        return None
    if text.startswith(_FAIL):
        rid, _, reason = text[len(_FAIL) :].partition(":")
        return Notice("fail", rid.replace("%3A", ":").replace("%25", "%"), reason=reason)
    return None
