"""Request bookkeeping: what was asked (``Transfer``), its live state (``RequestHandle``), and
what one ``Endpoint.poll()`` reports (``PollResult``)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from ..errors import TransferError

__all__ = [
    "NOT_YET",
    "Check",
    "CheckVerdict",
    "ControlMessage",
    "Op",
    "PeerKey",
    "PollResult",
    "RemoteEvent",
    "RequestHandle",
    "RequestState",
    "Transfer",
    "TransferStats",
]

Op = Literal["READ", "WRITE"]


class CheckVerdict(enum.Enum):
    """What a request's check may answer besides a failure reason (``str``) or ``None`` (passed)."""

    NOT_YET = "not yet"
    """The check cannot decide yet (the peer's digest is still on its way): it is asked again at every
    ``poll()`` until it decides or the request's deadline passes."""


NOT_YET = CheckVerdict.NOT_YET
Check = Callable[..., str | None | CheckVerdict]
"""A request's check: ``None`` (complete it), a failure reason, or ``NOT_YET`` (ask again at the next poll)."""
PeerKey = int | str | tuple[str, int]
"""What an endpoint knows a connected peer by: any key its caller picks (a peer link uses ``(scope, rank)``)."""


class Transfer(NamedTuple):
    """One batch of descriptor pairs between this endpoint and one peer, as the planner emits it.

    Attributes:
        peer: the key the peer was connected under (the remote rank, or a peer link's ``(scope, rank)``).
        local_key: name of a local table (``"whole"``, ``"split:0"``...).
        remote_key: name of one of the peer's tables.
        local_ids: int32 descriptor ids into the local table.
        remote_ids: int32 descriptor ids into the remote table, paired with ``local_ids``.
    """

    peer: PeerKey
    local_key: str
    remote_key: str
    local_ids: npt.NDArray[np.int32]
    remote_ids: npt.NDArray[np.int32]


class RequestState(enum.Enum):
    """Lifecycle of a request: waiting for a handshake, in flight, or finished."""

    QUEUED = "queued"
    POSTED = "posted"
    DONE = "done"
    FAILED = "failed"


@dataclass
class TransferStats:
    """What NIXL reports for a request's completed transfers (its telemetry), summed over them.

    Attributes:
        transfers: transfers that completed.
        descriptors: descriptors NIXL posted, after merging ids consecutive on both sides.
        bytes: bytes moved.
        post_s: time NIXL spent posting (summed).
        transfer_s: the longest transfer's duration from post to completion.
    """

    transfers: int = 0
    descriptors: int = 0
    bytes: int = 0
    post_s: float = 0.0
    transfer_s: float = 0.0

    def add(self, telemetry: Any) -> None:
        """Add one completed transfer's ``get_xfer_telemetry()`` record."""
        self.transfers += 1
        self.descriptors += int(telemetry.descCount)
        self.bytes += int(telemetry.totalBytes)
        self.post_s += float(telemetry.postDuration) / 1e6
        self.transfer_s = max(self.transfer_s, float(telemetry.xferDuration) / 1e6)


@dataclass(eq=False)
class RequestHandle:
    """A request posted with ``Endpoint.post`` (or awaited with ``Endpoint.expect``).

    Attributes:
        request_id: the caller's id.
        op: ``"READ"`` (pull), ``"WRITE"`` (push), or ``None`` for a passively awaited request.
        transfers: the checked transfers, ids as int32 arrays.
        deadline: ``time.monotonic()`` value after which the request fails.
        state: current ``RequestState``.
        error: the ``TransferError`` once failed.
        stats: NIXL's telemetry of the transfers completed so far (active requests).
    """

    request_id: str
    op: Op | None
    transfers: tuple[Transfer, ...]
    deadline: float
    state: RequestState = RequestState.QUEUED
    error: TransferError | None = None
    stats: TransferStats = field(default_factory=TransferStats)
    # one slot per transfer: the NIXL xfer handle while it exists, whether it was posted and reached DONE
    _xfers: list[Any] = field(default_factory=list, repr=False)
    _posted: list[bool] = field(default_factory=list, repr=False)
    _done: list[bool] = field(default_factory=list, repr=False)
    _notifs: list[bytes] = field(default_factory=list, repr=False)  # each transfer's done-notice
    # staged requests (``Endpoint.post(..., stages=)``): each transfer's stage, and the stages released so far
    # (transfers of stages ``< _released`` are posted); ``None`` for a request posted whole
    _stage: tuple[int, ...] | None = field(default=None, repr=False)
    _released: int = 0
    # passive requests: senders still owed, senders seen (with the digest their notices carried)
    _senders: int = 0
    _seen: dict[str, int | None] = field(default_factory=dict, repr=False)
    # verification (``hybrid_kv.verify``): the digest each peer's done-notices carry (active), and the check run
    # once the request's bytes all landed: active ``() -> reason | None``, passive ``(digests by sender) -> ...``
    digests: dict[PeerKey, int] = field(default_factory=dict, repr=False)
    check: Check | None = field(default=None, repr=False)
    checking: bool = field(default=False, repr=False)  # every byte landed; its check answered NOT_YET so far

    @property
    def released(self) -> int | None:
        """Staged requests: how many stages were released (their transfers posted, or queued behind a
        handshake); ``None`` for a request posted whole."""
        return None if self._stage is None else self._released

    @property
    def finished(self) -> bool:
        """Whether the request is DONE or FAILED."""
        return self.state in (RequestState.DONE, RequestState.FAILED)

    @property
    def peers(self) -> frozenset[PeerKey]:
        """The peers this request moves data with."""
        return frozenset(t.peer for t in self.transfers)


class RemoteEvent(NamedTuple):
    """A peer's request that touched our memory finished (``reason`` is empty when it succeeded)."""

    sender: str
    request_id: str
    reason: str = ""


class ControlMessage(NamedTuple):
    """An opaque control payload received on the side channel, with the sender's endpoint name.

    ``sender`` is authenticated with the shared secret (it is the name the sending endpoint gave, and any
    holder of the secret may give any name): act on a request only for the peer it belongs to, e.g.
    connect back with ``Endpoint.connect(..., expected_name=sender)`` or check ``Endpoint.peer_of(sender)``.
    """

    sender: str
    payload: bytes


@dataclass
class PollResult:
    """Everything that happened since the previous ``poll()``.

    Attributes:
        done: ids of this endpoint's requests whose every transfer reached DONE.
        failed: one ``TransferError`` per failed request (``.request_id``, ``.failed`` set).
        remote_done: requests of other endpoints whose data fully landed (or was fully read).
        remote_failed: requests of other endpoints that reported failure.
        control: control messages received on the side channel.
        notifs: NIXL notifications that are not hybrid-kv's, as ``(sender, message)``.
        side_channel_restarted: side-channel processes started to replace one that died (``side_channel=
            "process"``; a dead one is logged and replaced in the background, on the same address).
        settled: ids of this endpoint's failed requests that were not ``settled`` when they failed (NIXL would not
            cancel a transfer of theirs) and whose transfers NIXL has released since: nothing of them can land
            any more, so their buffers may be reused.
    """

    done: list[str] = field(default_factory=list)
    failed: list[TransferError] = field(default_factory=list)
    remote_done: list[RemoteEvent] = field(default_factory=list)
    remote_failed: list[RemoteEvent] = field(default_factory=list)
    control: list[ControlMessage] = field(default_factory=list)
    notifs: list[tuple[str, bytes]] = field(default_factory=list)
    side_channel_restarted: int = 0
    settled: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return any(
            (self.done, self.failed, self.remote_done, self.remote_failed, self.control, self.notifs, self.settled)
        )
