"""A decode request's ``kv_transfer_params``, parsed and checked once, never trusted.

They arrive in the decode server's HTTP request body, so any API client writes them. ``TransferParams``
reads them (``check``) into either a ``Ticket`` the decode may act on, or the one-line reason the request
is refused; nothing here raises for any input, and nothing but the verified ticket's fields is acted on
(the NixlConnector-style fields beside it are for routers and ignored).

What is checked, in order: the params' shape (a mapping whose ``hkv_ticket`` is a string), the ticket's
signature (``tickets``), its fields' types and ranges, its mode (this engine's), its group count (this
engine's transfer groups), each group's length (at most what the request can hold here, see
``max_blocks``), that its lease has not ended, its host against the allowed peer networks, and that it was
not used before (``SpentTickets``).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from .tickets import MAX_TICKET_CHARS, TICKET_FIELD, SpentTickets, Ticket, TicketError, TicketKey

__all__ = ["RecvParams", "TransferParams", "parse_networks"]

log = logging.getLogger("hybrid_kv.integrations.vllm.params")

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class RecvParams(msgspec.Struct):
    """The fields of a decode request's ``kv_transfer_params`` this connector reads (others are ignored)."""

    do_remote_prefill: bool
    hkv_ticket: Annotated[str, msgspec.Meta(max_length=MAX_TICKET_CHARS)]


def parse_networks(spec: str | Sequence[str] | None) -> tuple[IpNetwork, ...] | None:
    """The ``peer_networks`` setting: comma-separated CIDRs (``None``/empty: any peer address)."""
    if spec is None:
        return None
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec)]
    items = [s for s in items if s]
    if not items:
        return None
    return tuple(ipaddress.ip_network(s, strict=False) for s in items)


def host_allowed(host: str, networks: tuple[IpNetwork, ...] | None) -> bool:
    """Whether a peer's advertised ``host`` is inside ``networks`` (a host name never is, once they are set)."""
    if networks is None:
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(ip in net for net in networks)


@dataclass
class TransferParams:
    """The decode side's checks of ``kv_transfer_params`` (one per scheduler).

    Args:
        key: opens tickets (keyed by the deployment secret, or unkeyed in ``insecure`` mode).
        mode: this engine's transfer mode; a ticket for the other mode is refused.
        num_groups: this engine's transfer groups; a ticket must name exactly as many.
        networks: the peer networks a ticket's host must be in (``None``: any).
    """

    key: TicketKey
    mode: str
    num_groups: int
    networks: tuple[IpNetwork, ...] | None = None

    def __post_init__(self) -> None:
        self.spent = SpentTickets()

    def check(self, params: Any, max_blocks: Sequence[int], now: float) -> Ticket | str:
        """The verified ticket in ``params``, or why it is refused (one line). Never raises.

        ``max_blocks``: per transfer group, the most blocks this request can hold (a ticket naming more
        is refused before anything is sized by it). ``now``: wall-clock time. A returned ticket is spent.
        """
        try:
            ticket = self._check(params, max_blocks, now)
        except TicketError as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - a defect here must fail one request, never the engine
            log.exception("hybrid-kv: unexpected error checking kv_transfer_params")
            return f"kv_transfer_params could not be checked: {type(exc).__name__}"
        return ticket

    def _check(self, params: Any, max_blocks: Sequence[int], now: float) -> Ticket:
        if not isinstance(params, dict):
            raise TicketError(f"kv_transfer_params must be a mapping, got {type(params).__name__}")
        if TICKET_FIELD not in params:
            raise TicketError(f"kv_transfer_params carry no {TICKET_FIELD!r} (a hybrid-kv prefill engine issues one)")
        try:
            fields = msgspec.convert(params, RecvParams, strict=True)
        except msgspec.ValidationError as exc:
            raise TicketError(f"kv_transfer_params malformed: {exc}") from None
        ticket = self.key.open(fields.hkv_ticket)
        where = f"ticket of {ticket.engine_id!r}/{ticket.request_id!r}"
        if ticket.mode != self.mode:
            raise TicketError(f"{where} is for {ticket.mode} mode; this engine runs {self.mode}")
        if len(ticket.block_ids) != self.num_groups:
            raise TicketError(f"{where} names {len(ticket.block_ids)} groups; this engine has {self.num_groups}")
        for g, (ids, most) in enumerate(zip(ticket.block_ids, max_blocks, strict=True)):
            if len(ids) > most:
                raise TicketError(f"{where} names {len(ids)} blocks in group {g}; this request holds at most {most}")
        if ticket.expires_at <= now:
            raise TicketError(f"{where}: its lease ended {now - ticket.expires_at:.1f} s ago")
        if not host_allowed(ticket.host, self.networks):
            raise TicketError(f"{where} names host {ticket.host!r}, outside the allowed peer networks")
        self.spent.spend(ticket, now)
        return ticket
