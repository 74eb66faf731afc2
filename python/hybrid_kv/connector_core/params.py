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

Concurrent push (the router sends a request to the prefill and the decode engine at once, so the decode can
register before the prefill's forward ends and the prefill streams its KV): no ticket exists yet. The router
puts a fresh random capability in both requests' params (``hkv_stream``: 32 lowercase hex digits, 128 bits)
and the prefill engine's address in the decode's (the NixlConnector-style ``remote_engine_id``,
``remote_host``, ``remote_port``, ``tp_size``). The decode acts on them only in push mode, dials only a host
inside the allowed peer networks, and uses a capability once; it registers its own blocks for its own
request and names no prefill block, so there is nothing for a signature to protect: the capability is what
joins the two requests (a prefill writes a request only to the first decode engine presenting the
capability its own request carries, see ``stream_regs``). An address from an API client is dialled only if it
is a known peer engine: listed in the ``peer_engines`` setting (``ENGINE@HOST:PORT``), or named by a signed ticket
this decode already verified (``KnownEngines``). Used capabilities live in their own store (``SpentCaps``), which
evicts rather than refuses, so no number of client requests can make the decode refuse a signed ticket.
ARCHITECTURE.md's threat model has the analysis.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from ..errors import TicketError
from ..limits import MAX_TP_SIZE
from ..wire import Name
from .tickets import MAX_TICKET_CHARS, TICKET_FIELD, SpentCaps, SpentTickets, Ticket, TicketKey

__all__ = [
    "STREAM_FIELD",
    "KnownEngines",
    "RecvParams",
    "StreamGrant",
    "StreamParams",
    "TransferParams",
    "parse_engines",
    "parse_networks",
    "stream_cap",
]

log = logging.getLogger("hybrid_kv.connector_core.params")

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


STREAM_FIELD = "hkv_stream"
"""The ``kv_transfer_params`` key of a concurrent push's capability (in the prefill's and the decode's params)."""
CapText = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]


class RecvParams(msgspec.Struct):
    """The fields of a decode request's ``kv_transfer_params`` this connector reads (others are ignored)."""

    do_remote_prefill: bool
    hkv_ticket: Annotated[str, msgspec.Meta(max_length=MAX_TICKET_CHARS)]


class StreamParams(msgspec.Struct):
    """A concurrent push's fields of a decode request's ``kv_transfer_params`` (others are ignored)."""

    do_remote_prefill: bool
    hkv_stream: CapText
    remote_engine_id: Name
    remote_host: Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
    remote_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)]


class _PrefillStream(msgspec.Struct):
    hkv_stream: CapText


@dataclass(frozen=True)
class StreamGrant:
    """What a decode acts on for a concurrent push: the capability and the prefill engine to register with."""

    cap: bytes
    engine_id: str
    host: str
    port: int
    tp_size: int


def stream_cap(params: Any) -> bytes | None:
    """A prefill request's concurrent-push capability (``None``: its params carry none).

    Raises:
        TicketError: the params carry a malformed one (the message says why).
    """
    if not isinstance(params, dict) or STREAM_FIELD not in params:
        return None
    try:
        return bytes.fromhex(msgspec.convert(params, _PrefillStream, strict=True).hkv_stream)
    except msgspec.ValidationError as exc:
        raise TicketError(f"kv_transfer_params {STREAM_FIELD!r} malformed: {exc}") from None


def parse_networks(spec: str | Sequence[str] | None) -> tuple[IpNetwork, ...] | None:
    """The ``peer_networks`` setting: comma-separated CIDRs (``None``/empty: any peer address)."""
    if spec is None:
        return None
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec)]
    items = [s for s in items if s]
    if not items:
        return None
    return tuple(ipaddress.ip_network(s, strict=False) for s in items)


EngineAddress = tuple[str, str, int]
"""A peer engine as an API client names it: ``(engine id, side-channel host, side-channel port of TP rank 0)``."""

MAX_KNOWN_ENGINES = 4096
"""Engines learned from signed tickets that a decode remembers (the least recently seen is forgotten first)."""


def parse_engines(spec: str | Sequence[str] | None) -> frozenset[EngineAddress]:
    """The ``peer_engines`` setting: comma-separated ``ENGINE_ID@HOST:PORT`` (an IPv6 host in brackets).

    Raises:
        ValueError: an entry that is not of that form (the message names it).
    """
    if spec is None:
        return frozenset()
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec)]
    out = set()
    for item in (s for s in items if s):
        engine, at, address = item.rpartition("@")
        host, colon, port = address.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not (at and engine and colon and host and port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"{item!r} is not ENGINE_ID@HOST:PORT")
        out.add((engine, host, int(port)))
    return frozenset(out)


@dataclass
class KnownEngines:
    """The peer engines a decode may dial for an API client: those configured (``peer_engines``) and those named
    by signed tickets it verified (a ticket is the prefill engine's own word on where it listens)."""

    configured: frozenset[EngineAddress] = frozenset()
    learned: collections.OrderedDict[EngineAddress, None] = field(default_factory=collections.OrderedDict)

    def learn(self, ticket: Ticket) -> None:
        key = (ticket.engine_id, ticket.host, ticket.port)
        self.learned[key] = None
        self.learned.move_to_end(key)
        while len(self.learned) > MAX_KNOWN_ENGINES:
            self.learned.popitem(last=False)

    def __contains__(self, engine: object) -> bool:
        return engine in self.configured or engine in self.learned


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
        engines: the configured peer engines (``peer_engines``) a concurrent push may name.
    """

    key: TicketKey
    mode: str
    num_groups: int
    networks: tuple[IpNetwork, ...] | None = None
    stream_ttl_s: float = 600.0
    """How long a used capability is remembered (the decode's wait plus the prefill's lease, at least)."""
    engines: frozenset[EngineAddress] = frozenset()

    def __post_init__(self) -> None:
        self.spent = SpentTickets()
        self.spent_caps = SpentCaps()
        self.known = KnownEngines(self.engines)

    def check(self, params: Any, max_blocks: Sequence[int], now: float) -> Ticket | StreamGrant | str:
        """The verified ticket in ``params`` (or, without one, the concurrent push's checked capability and
        prefill address), or why they are refused (one line). Never raises.

        ``max_blocks``: per transfer group, the most blocks this request can hold (a ticket naming more
        is refused before anything is sized by it). ``now``: wall-clock time. A returned ticket or capability is
        spent.
        """
        try:
            if isinstance(params, dict) and TICKET_FIELD not in params and STREAM_FIELD in params:
                return self._check_stream(params, now)
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
        if self.key.signed:
            self.known.learn(ticket)
        return ticket

    def _check_stream(self, params: dict[str, Any], now: float) -> StreamGrant:
        if self.mode != "push":
            raise TicketError(f"{STREAM_FIELD!r} (a concurrent push) needs push mode; this engine runs {self.mode}")
        try:
            fields = msgspec.convert(params, StreamParams, strict=True)
        except msgspec.ValidationError as exc:
            raise TicketError(f"kv_transfer_params of a concurrent push malformed: {exc}") from None
        where = f"concurrent push from {fields.remote_engine_id!r}"
        if not host_allowed(fields.remote_host, self.networks):
            raise TicketError(f"{where} names host {fields.remote_host!r}, outside the allowed peer networks")
        address = (fields.remote_engine_id, fields.remote_host, fields.remote_port)
        if address not in self.known:
            raise TicketError(
                f"{where} at {fields.remote_host}:{fields.remote_port} is not a known peer engine (list it in the "
                "peer_engines setting as ENGINE_ID@HOST:PORT)"
            )
        cap = bytes.fromhex(fields.hkv_stream)
        self.spent_caps.spend(cap, now + self.stream_ttl_s, now, f"{where}: its capability")
        return StreamGrant(cap, fields.remote_engine_id, fields.remote_host, fields.remote_port, fields.tp_size)
