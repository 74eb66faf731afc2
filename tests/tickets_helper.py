"""Tickets as a test (holding the deployment secret, or as an attacker without it) writes them: re-issued with
changed fields, forged without the key, or raw msgpack that no ``Ticket`` struct could hold."""

from __future__ import annotations

import base64
import os
from typing import Any

import msgspec

from hybrid_kv.connector_core.tickets import TICKET_FIELD, Ticket, TicketKey


def deployment_key() -> TicketKey:
    """The ticket key of this test deployment (``HYBRID_KV_SECRET``)."""
    return TicketKey(os.environ["HYBRID_KV_SECRET"].encode())


def ticket_of(params: dict[str, Any], key: TicketKey | None = None) -> Ticket:
    return (key or deployment_key()).open(params[TICKET_FIELD])


def reissue(params: dict[str, Any], key: TicketKey | None = None, **changes: Any) -> dict[str, Any]:
    """``params`` with their ticket re-issued under ``key`` (default: the deployment's) with ``changes``."""
    ticket = msgspec.structs.replace(ticket_of(params), **changes)
    return dict(params, **{TICKET_FIELD: (key or deployment_key()).issue(ticket)})


def raw_ticket(fields: list[Any], tag: bytes = b"") -> str:
    """A ticket whose body is the msgpack array ``fields`` as given (any types), with ``tag``."""
    enc = msgspec.msgpack.Encoder()
    body = enc.encode(fields)
    return base64.urlsafe_b64encode(enc.encode([body, tag])).rstrip(b"=").decode()


def ticket_fields(ticket: Ticket) -> list[Any]:
    """``ticket``'s fields in wire order (to alter one with a value of any type)."""
    return [getattr(ticket, f) for f in ticket.__struct_fields__]
