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
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from ._core import RegionTable, StreamSchedule, handshake_target_ranks
from .errors import HandshakeError
from .planner import RankPlanner
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
    """A link's plan, built from the replies fetched once (``prepare_link``); not yet connected."""

    engine_id: str
    targets: list[int]
    addresses: dict[int, str]
    replies: dict[int, MetaReply]
    planner: RankPlanner


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
    planner = RankPlanner(
        table,
        {r: reply.payload for r, reply in replies.items()},
        mode,
        coalesce=coalesce,
        own_payload=own_payload,
        expected_engine_id=engine_id or None,
        expected_tp_size=expected_tp_size,
    )
    return PreparedLink(engine_id, sorted(addresses), dict(addresses), replies, planner)


@dataclass
class PeerLink:
    """A connected link: the peer engine's ranks as peers of a shared endpoint, posting from the link's scope.

    Attributes:
        engine_id: the peer engine.
        scope: the endpoint's local table scope holding this link's tables (its peer keys are ``(scope, rank)``).
        targets: the peer ranks connected, each under ``key(rank)``.
        addresses: each target rank's side-channel address.
        planner: the ``RankPlanner`` (``planner.plan_`` is the ``PeerPlan``).
        ep: the shared endpoint.
    """

    engine_id: str
    scope: str
    targets: list[int]
    addresses: dict[int, str]
    planner: RankPlanner
    ep: Endpoint
    connect_s: float = 0.0
    _closed: bool = field(default=False, repr=False)

    @property
    def plan(self) -> Any:
        """The ``PeerPlan`` against the peer engine."""
        return self.planner.plan_

    @property
    def rows(self) -> dict[str, U64]:
        """The local tables (strided rows) prepped in this link's scope, by key."""
        return self.planner.local_tables

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

    def peer_keys(self) -> list[tuple[str, int]]:
        return [self.key(r) for r in self.targets]

    def _addressed(self, t: Transfer) -> Transfer:
        """A planned transfer (its peer the remote rank, as the planner emits it) addressed to this link's peer."""
        return t._replace(peer=self.key(cast(int, t.peer)))

    def transfers(self, local_ids: Sequence[Sequence[int]], remote_ids: Sequence[Sequence[int]]) -> list[Transfer]:
        """One request's transfers, addressed to this link's peers (empty when nothing moves)."""
        return [self._addressed(t) for t in self.planner.plan(local_ids, remote_ids)]

    def staged_transfers(
        self, local_ids: Sequence[Sequence[int]], remote_ids: Sequence[Sequence[int]], schedule: StreamSchedule
    ) -> list[list[Transfer]]:
        """One request's transfers cut into ``schedule``'s stages (one list per stage, possibly empty), addressed
        to this link's peers: together exactly ``transfers``."""
        return [
            [self._addressed(t) for t in stage] for stage in self.planner.plan_staged(local_ids, remote_ids, schedule)
        ]

    def close(self) -> None:
        """Disconnect the link's peers and release its scope (idempotent); the endpoint stays open."""
        if self._closed:
            return
        self._closed = True
        for key in self.peer_keys():
            self.ep.disconnect(key, "was unlinked")
        self.ep.remove_local_tables(self.scope)


def _remote_tables(planner: RankPlanner, rank: int) -> Callable[[bytes], Mapping[str, U64]]:
    """The ``tables`` callback of ``Endpoint.connect``: rank ``rank``'s remote table in ``planner``."""

    def tables(payload: bytes) -> Mapping[str, U64]:
        return planner.remote_tables(rank)

    return tables


def attach_link(ep: Endpoint, prepared: PreparedLink, scope: str, *, timeout_s: float) -> PeerLink:
    """Prep the prepared link's local tables as ``scope`` of ``ep`` and connect every target rank from its
    fetched reply (call on ``ep``'s thread). On failure everything added is released again.

    Raises:
        HandshakeError: NIXL refused the peer's metadata or tables, or a reply was not the peer expected.
    """
    planner = prepared.planner
    t0 = time.perf_counter()
    ep.add_local_tables(scope, planner.local_tables)
    link = PeerLink(prepared.engine_id, scope, prepared.targets, prepared.addresses, planner, ep)
    try:
        for r in prepared.targets:
            ep.connect(
                link.key(r),
                prepared.addresses[r],
                _remote_tables(planner, r),
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
    validate it against ``own_payload`` and plan from it (``RankPlanner``), prep the plan's local tables as
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


def target_addresses(host: str, base_port: int, local_rank: int, local_tp: int, remote_tp: int) -> dict[int, str]:
    """Side-channel addresses of the peer ranks ``local_rank`` handshakes with (rank ``r`` at ``base_port + r``)."""
    targets = handshake_target_ranks(local_rank, local_tp, remote_tp)
    return {int(r): f"tcp://{host}:{base_port + int(r)}" for r in targets}
