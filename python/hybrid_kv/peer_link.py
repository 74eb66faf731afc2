"""One posting rank's link to one peer engine: fetch -> validate and plan -> connect, in one place.

A link is built in two steps because they run on different threads:

- ``prepare_link`` (any thread; network and Rust only): fetch every target rank's side-channel reply once,
  then validate and plan from exactly those payload bytes (``PeerPlan(own_payload=...)``, each payload decoded
  once in Rust). Each fetch that times out is tried again (up to ``MAX_ATTEMPTS``) while the link's deadline
  allows.
- ``attach_link`` (the endpoint's thread; NIXL): prep the plan's local tables as the link's own scope of the
  shared endpoint (the KV cache stays registered once, by the endpoint), then connect every target rank from
  the reply already fetched (no second fetch, so validation, plan and the loaded agent see the same bytes).

``PeerLink.close`` releases exactly what the link added: its peers (remote tables, remote agents) and its
local table scope. The demo's ranks and the vLLM connector's workers both link through here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ._core import PeerPlan, RegionTable, StreamSchedule, handshake_target_ranks
from .errors import HandshakeError
from .transport.requests import PeerKey, Transfer

if TYPE_CHECKING:
    from .transport.endpoint import Endpoint
    from .transport.side_channel import MetaReply

__all__ = [
    "PeerLink",
    "PreparedLink",
    "attach_link",
    "fetch_replies",
    "link_peer",
    "prepare_link",
    "rank_address",
    "target_addresses",
]

log = logging.getLogger("hybrid_kv.peer_link")

U64 = npt.NDArray[np.uint64]

RETRY_PAUSE_S = 0.2
"""Pause between two fetch attempts of one rank's reply."""

MAX_ATTEMPTS = 3
"""Fetch attempts per rank at most (a host that never answers fails after these, not only at the deadline)."""

MIN_ATTEMPT_S = 0.5
"""A fetch that timed out is tried again only if the deadline leaves at least this long for the new attempt."""


def fetch_replies(
    addresses: Mapping[int, str],
    sender: str,
    timeout_s: float,
    *,
    deadline: float | None = None,
    secret: bytes | str | None = None,
    names: Mapping[int, str] | None = None,
    insecure: bool = False,
) -> dict[int, MetaReply]:
    """Each rank's side-channel reply, fetched once (authenticated; see ``channel_client.fetch_reply``): the
    public way to get a peer's handshake payload (``reply.payload``) before planning and connecting.

    ``secret``: the deployment's secret (``None``: ``HYBRID_KV_SECRET``); ``insecure=True`` fetches from
    endpoints made with ``insecure=True`` (trusted networks only; ``secret`` must then be ``None``).

    A fetch gets ``timeout_s`` per attempt; one that gets no reply in time is tried again (up to
    ``MAX_ATTEMPTS`` attempts) while ``deadline`` (``time.monotonic()``; ``None``: one attempt) leaves room for
    another pause and attempt.
    Any other failure (authentication, the peer's error, a protocol mismatch) is not retried.
    ``names``: each rank's endpoint name, where known: the request names it (``to``), any other endpoint
    refuses it, and a reply from another name is refused.

    Raises:
        HandshakeError: a rank's reply could not be fetched; the message names the rank and address.
    """
    import zmq

    from .errors import ChannelError
    from .transport.channel_client import fetch_reply

    ctx: Any = zmq.Context()
    replies: dict[int, MetaReply] = {}
    try:
        for rank, address in addresses.items():
            attempt = 1
            while True:
                per_try = timeout_s if deadline is None else max(0.05, min(timeout_s, deadline - time.monotonic()))
                t0 = time.monotonic()
                try:
                    to = None if names is None else names.get(rank)
                    replies[rank] = fetch_reply(
                        ctx, address, rank, sender, per_try, secret=secret, to=to, insecure=insecure
                    )
                    break
                except ChannelError as exc:
                    timed_out = time.monotonic() - t0 >= 0.95 * per_try  # no reply in time (not a refusal)
                    left = 0.0 if deadline is None else deadline - time.monotonic()
                    if not timed_out or attempt >= MAX_ATTEMPTS or left < RETRY_PAUSE_S + MIN_ATTEMPT_S:
                        raise HandshakeError(
                            f"{sender}: fetching rank {rank}'s metadata from {address} failed "
                            f"(attempt {attempt}): {exc}"
                        ) from exc
                    log.warning(
                        "%s: rank %d at %s did not answer within %.3g s (attempt %d); retrying, %.1f s left",
                        sender,
                        rank,
                        address,
                        per_try,
                        attempt,
                        left,
                    )
                    attempt += 1
                    time.sleep(RETRY_PAUSE_S)
    finally:
        ctx.destroy(linger=0)
    return replies


@dataclass
class PreparedLink:
    """A link's plan against the peer engine, built from the replies fetched once (``prepare_link``) and not yet
    connected: the ``PeerPlan`` (built once), the local tables to prep and, per request, the transfers to post
    (peers keyed by rank until the link is attached). Every count comes from the Rust core; nothing here looks
    inside a table.

    Attributes:
        engine_id: the peer engine.
        targets: the peer ranks this rank talks to.
        addresses: each target rank's side-channel address.
        replies: each target rank's reply, as fetched (validated and planned from).
        plan: the ``PeerPlan``.
        local_tables: every local table as strided ``(rows, 5)`` rows, keyed as transfers name them.
    """

    engine_id: str
    targets: list[int]
    addresses: dict[int, str]
    replies: dict[int, MetaReply]
    plan: PeerPlan
    local_tables: dict[str, U64] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.local_tables:
            self.local_tables = {key: self.plan.local_rows(key) for key in self.plan.table_keys}

    def key(self, rank: int) -> PeerKey:
        """The peer key of target ``rank`` (the rank itself until the link is attached)."""
        return rank

    def rank_of(self, key: PeerKey) -> int:
        """The target rank of one of this link's peer keys.

        Raises:
            ValueError: ``key`` is not one of this link's keys.
        """
        if not (isinstance(key, int) and key in self.addresses):
            raise ValueError(f"peer key {key!r} is not a target rank of the link to {self.engine_id!r}")
        return key

    def peer_keys(self) -> list[PeerKey]:
        return [self.key(r) for r in self.targets]

    def transfers(self, local_ids: Sequence[Sequence[int]], remote_ids: Sequence[Sequence[int]]) -> list[Transfer]:
        """One request's transfers, addressed to this link's peers (empty when nothing moves)."""
        return self._addressed(self.plan.plan(local_ids, remote_ids).transfers)

    def staged_transfers(
        self, local_ids: Sequence[Sequence[int]], remote_ids: Sequence[Sequence[int]], schedule: StreamSchedule
    ) -> list[list[Transfer]]:
        """One request's transfers cut into ``schedule``'s stages (``PeerPlan.plan_staged``; one list per stage,
        possibly empty), addressed to this link's peers: together exactly ``transfers``'s id pairs."""
        return [self._addressed(p.transfers) for p in self.plan.plan_staged(local_ids, remote_ids, schedule)]

    def _addressed(self, planned: Sequence[Any]) -> list[Transfer]:
        return [Transfer(self.key(t.remote_rank), t.local_table, "remote", t.local_ids, t.remote_ids) for t in planned]

    def remote_tables(self, rank: int) -> dict[str, U64]:
        """The tables to prep against peer ``rank`` (keyed as transfers name them)."""
        return {"remote": self.plan.remote_rows(rank)}

    def transfer_bytes(self, t: Transfer) -> int:
        """Bytes a transfer moves (its local descriptors' lengths, summed in Rust)."""
        return int(self.plan.local_bytes(t.local_key, t.local_ids))

    def table_shapes(self) -> dict[str, dict[str, int]]:
        """Every local table: strided rows as prepped and descriptors once expanded."""
        return {
            k: {"rows": int(v.shape[0]), "descriptors": self.plan.table_descriptors(k)}
            for k, v in self.local_tables.items()
        }

    def remote_descriptors(self, rank: int) -> int:
        """Descriptors (expanded) of peer ``rank``'s table."""
        return int(self.plan.remote_table_descriptors(rank))


def prepare_link(
    table: RegionTable,
    own_payload: bytes,
    addresses: Mapping[int, str],
    mode: str,
    *,
    sender: str,
    timeout_s: float,
    deadline: float | None = None,
    coalesce: bool = True,
    engine_id: str = "",
    expected_tp_size: int | None = None,
    secret: bytes | str | None = None,
    names: Mapping[int, str] | None = None,
    insecure: bool = False,
) -> PreparedLink:
    """Fetch every target rank's reply once and plan from exactly those payloads (validated against
    ``own_payload``; ``engine_id`` and ``expected_tp_size``, when given, must be what the peer says it is;
    ``names``, each rank's endpoint name where known, binds each fetch to it: see ``fetch_replies``).

    Runs no NIXL call, so it may run on any thread.

    Raises:
        HandshakeError: a fetch failed, or a payload is incompatible or malformed (``findings`` set).
        PlanError: the two sides cannot be planned together.
    """
    replies = fetch_replies(
        addresses, sender, timeout_s, deadline=deadline, secret=secret, names=names, insecure=insecure
    )
    plan = PeerPlan(
        table,
        [replies[r].payload for r in sorted(replies)],
        mode,
        coalesce=coalesce,
        own_payload=own_payload,
        expected_engine_id=engine_id or None,
        expected_tp_size=expected_tp_size,
    )
    return PreparedLink(engine_id, sorted(addresses), dict(addresses), replies, plan)


@dataclass
class PeerLink(PreparedLink):
    """A connected link: the peer engine's ranks as peers of a shared endpoint, posting from the link's scope,
    peers keyed ``(scope, rank)``.

    Attributes:
        scope: the endpoint's local table scope holding this link's tables.
        ep: the shared endpoint.
    """

    scope: str = field(kw_only=True)
    ep: Endpoint = field(kw_only=True, repr=False)
    connect_s: float = field(default=0.0, kw_only=True)
    _closed: bool = field(default=False, kw_only=True, repr=False)

    def key(self, rank: int) -> tuple[str, int]:
        """The endpoint's peer key of target ``rank``: ``(scope, rank)``."""
        return (self.scope, rank)

    def rank_of(self, key: PeerKey) -> int:
        """The target rank of one of this link's peer keys.

        Raises:
            ValueError: ``key`` is not one of this link's keys.
        """
        if not (isinstance(key, tuple) and key[0] == self.scope and key[1] in self.addresses):
            raise ValueError(f"peer key {key!r} is not one of link {self.scope!r}'s")
        return key[1]

    def close(self) -> None:
        """Disconnect the link's peers and release its scope (idempotent); the endpoint stays open."""
        if self._closed:
            return
        self._closed = True
        for key in self.peer_keys():
            self.ep.disconnect(key, "was unlinked")
        self.ep.remove_local_tables(self.scope)


def _remote_tables(link: PreparedLink, rank: int) -> Callable[[bytes], Mapping[str, U64]]:
    """The ``tables`` callback of ``Endpoint.connect``: rank ``rank``'s remote table in ``link``'s plan."""

    def tables(payload: bytes) -> Mapping[str, U64]:
        return link.remote_tables(rank)

    return tables


def attach_link(ep: Endpoint, prepared: PreparedLink, scope: str, *, timeout_s: float) -> PeerLink:
    """Prep the prepared link's local tables as ``scope`` of ``ep`` and connect every target rank from its
    fetched reply (call on ``ep``'s thread). On failure everything added is released again.

    Raises:
        HandshakeError: NIXL refused the peer's metadata or tables, or a reply was not the peer expected.
    """
    t0 = time.perf_counter()
    ep.add_local_tables(scope, prepared.local_tables)
    fields = (prepared.engine_id, prepared.targets, prepared.addresses, prepared.replies, prepared.plan)
    link = PeerLink(*fields, prepared.local_tables, scope=scope, ep=ep)
    try:
        for r in prepared.targets:
            ep.connect(
                link.key(r),
                prepared.addresses[r],
                _remote_tables(link, r),
                rank=r,
                timeout_s=timeout_s,
                reply=prepared.replies[r],  # the bytes validated and planned from, not fetched again
                local_scope=scope,
            )
    except BaseException:
        link.close()
        raise
    link.connect_s = time.perf_counter() - t0
    return link


def link_peer(
    ep: Endpoint,
    table: RegionTable,
    own_payload: bytes,
    addresses: Mapping[int, str],
    mode: str,
    *,
    scope: str,
    sender: str,
    timeout_s: float,
    deadline: float | None = None,
    coalesce: bool = True,
    engine_id: str = "",
    expected_tp_size: int | None = None,
    secret: bytes | str | None = None,
    insecure: bool = False,
) -> PeerLink:
    """Link one posting rank to one peer engine: fetch each target rank's payload once (``fetch_replies``),
    validate it against ``own_payload`` and plan from it (``PeerPlan``), prep the plan's local tables as
    ``scope`` of ``ep`` and connect every target rank (``attach_link``). Call on ``ep``'s thread.

    Args:
        ep: this rank's endpoint (its KV cache registered once, at creation).
        table: this rank's region table; ``own_payload`` its ``handshake_payload``.
        addresses: the side-channel address of every peer rank this rank talks to, by rank
            (``handshake_target_ranks`` says which; ``target_addresses`` builds them for consecutive ports).
        mode: ``"pull"`` (this rank READs: decode) or ``"push"`` (this rank WRITEs: prefill).
        scope: a name for this link's tables and peers on ``ep`` (one per peer engine).
        sender: this rank's name in the side-channel requests.
        timeout_s: per fetch and per connection; ``deadline`` (``time.monotonic()``) bounds the retries.
        engine_id / expected_tp_size: what the peer engine must say it is (checked when given).
        secret / insecure: as ``fetch_replies`` (and as ``ep`` was made).

    Returns:
        The ``PeerLink``: ``link.transfers(local_ids, remote_ids)`` gives one request's transfers for
        ``ep.post(request_id, transfers, "READ" | "WRITE", deadline_s)``; ``link.close()`` unlinks.

    Raises:
        HandshakeError: a fetch failed, a payload is incompatible (``findings``), or NIXL refused the peer.
        PlanError: the two sides cannot be planned together.
    """
    prepared = prepare_link(
        table,
        own_payload,
        addresses,
        mode,
        sender=sender,
        timeout_s=timeout_s,
        deadline=deadline,
        coalesce=coalesce,
        engine_id=engine_id,
        expected_tp_size=expected_tp_size,
        secret=secret,
        insecure=insecure,
    )
    return attach_link(ep, prepared, scope, timeout_s=timeout_s)


def rank_address(host: str, base_port: int, rank: int) -> str:
    """The side-channel address of TP rank ``rank`` of an engine whose rank 0 listens on ``host:base_port``: each
    rank listens on ``base_port + rank``."""
    return f"tcp://{host}:{base_port + rank}"


def target_addresses(host: str, base_port: int, local_rank: int, local_tp: int, remote_tp: int) -> dict[int, str]:
    """Side-channel addresses of the peer ranks ``local_rank`` handshakes with (``rank_address`` of each)."""
    targets = handshake_target_ranks(local_rank, local_tp, remote_tp)
    return {int(r): rank_address(host, base_port, int(r)) for r in targets}
