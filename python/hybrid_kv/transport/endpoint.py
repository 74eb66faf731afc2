"""``Endpoint``: one NIXL agent, its registered memory and prepped tables, its peers and requests.

The endpoint is driven by ``poll()``; it never starts NIXL's progress thread (it busy-spins a core,
see the NIXL notes §4.3) and every NIXL call happens on the thread that calls the endpoint's
methods. The only background threads are ZeroMQ ones: the side-channel server and one short-lived
thread per handshake in flight. NIXL has no transfer timeouts, so every request carries a deadline
that ``poll()`` enforces.

The endpoint wires together ``Agent`` (the NIXL agent and the handles it owns), ``Peers``
(handshakes and peer state), ``InFlight`` (posting, progress, completion and failure of requests)
and ``Inbox`` (notifications from peers).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any

import numpy.typing as npt
import zmq

from .agent import Agent
from .errors import HandshakeError, TransferError
from .inbox import Inbox
from .inflight import InFlight
from .peers import Peer, Peers
from .requests import ControlMessage, Op, PeerKey, PollResult, RequestHandle, Transfer
from .side_channel import ChannelError, SideChannelServer, send_control

__all__ = ["Endpoint"]


class Endpoint:
    """One side (a prefill or decode rank) of KV transfers: a NIXL agent plus a handshake side channel.

    Args:
        name: the NIXL agent name; unique among all endpoints that talk to each other.
        registration: ``(N, 3)`` uint64 ``(addr, len, device)`` regions to register, once.
        local_tables: ``{key: (N, 5) or (N, 3) uint64 table}``, each prepped once.
        mem_type: NIXL memory type of the registration and tables (``"DRAM"``, ``"VRAM"``...).
        metadata_provider: ``rank -> payload bytes`` served to peers during their handshake
            (called from the side-channel thread; must be thread-safe). ``None`` serves ``b""``.
        listen: ZeroMQ address for the side channel (port 0 = any), or ``None`` for no server.
        backend: NIXL backend plugin.
        ucx_error_handling_mode: ``"peer"`` (default) turns a dead peer into an error instead of a
            hang, at the cost of excluding shared-memory transports that cannot report it.

    The endpoint is a context manager; ``close()`` fails live requests, releases every xfer and
    dlist handle, removes remote agents, deregisters memory and stops the side channel.
    """

    def __init__(
        self,
        name: str,
        registration: npt.ArrayLike,
        local_tables: Mapping[str, npt.ArrayLike],
        *,
        mem_type: str = "DRAM",
        metadata_provider: Callable[[int], bytes] | None = None,
        listen: str | None = "tcp://127.0.0.1:0",
        backend: str = "UCX",
        ucx_error_handling_mode: str = "peer",
    ) -> None:
        self.name = name
        self.mem_type = mem_type
        self._provider = metadata_provider
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._stop = threading.Event()
        self._server: SideChannelServer | None = None
        self._controls: collections.deque[ControlMessage] = collections.deque()
        self._closed = False

        self._agent = Agent(name, mem_type)
        self._peers = Peers(
            self._agent,
            self._ctx,
            name,
            self._stop,
            on_ready=self._on_peer_ready,
            on_down=self._on_peer_down,
            on_drop=self._on_peer_dropped,
        )
        self._requests = InFlight(self._agent, self._peers)
        self._inbox = Inbox(self._agent, self._requests)
        try:
            self._agent.open(registration, local_tables, backend, ucx_error_handling_mode)
            if listen is not None:
                self._server = SideChannelServer(self._ctx, listen, self._serve_meta, self._on_control)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def address(self) -> str:
        """The side channel's bound address (``tcp://host:port``)."""
        if self._server is None:
            raise HandshakeError(f"endpoint {self.name!r} has no side channel")
        return self._server.address

    @property
    def strided_rows_supported(self) -> bool:
        """Whether this NIXL preps ``(N, 5)`` strided rows as they are (nixl >= 1.5).

        Where it does not, strided tables are expanded to ``(N, 3)`` before prepping; plans for such an
        endpoint are best built with ``PeerPlan(..., coalesce=False)``, whose tables have no chunk rows
        (expanded, chunk rows make a table about 7x larger).
        """
        return self._agent.strided_supported()

    def handle_counts(self) -> dict[str, int]:
        """Live NIXL objects owned by this endpoint; all zero after ``close()``."""
        remote_dlists, remote_agents = self._peers.counts()
        return {
            "xfer": self._requests.xfer_count(),
            "zombie_xfer": len(self._agent.zombies),
            "local_dlists": len(self._agent.local),
            "remote_dlists": remote_dlists,
            "remote_agents": remote_agents,
            "registrations": int(self._agent.registered),
        }

    def close(self) -> None:
        """Release everything this endpoint owns (idempotent); live requests are failed and peers told."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._server is not None:
            self._server.close()
        self._requests.fail_all("endpoint closed")
        self._agent.reap_zombies()
        self._peers.close()
        self._agent.close()
        self._ctx.destroy(linger=0)

    # ------------------------------------------------------------------ handshake

    def begin_connect(
        self,
        peer: PeerKey,
        address: str,
        tables: Callable[[bytes], Mapping[str, npt.ArrayLike]],
        *,
        rank: int = 0,
        validate: Callable[[bytes], object] | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        """Start connecting to ``peer`` in the background; requests posted to it wait for the result.

        Args:
            peer: the key transfers will use for this peer (e.g. its rank).
            address: the peer endpoint's side-channel address.
            tables: ``payload -> {key: table}``: the peer's descriptor tables (the planner's remote
                tables), prepped against the peer's agent.
            rank: which rank's metadata to ask the peer for.
            validate: called with the peer's payload; any exception rejects the peer.
            timeout_s: the whole handshake's deadline.

        A failed handshake fails every request waiting on it. Reconnecting an existing key drops the
        old connection first (its prepped tables are stale once the remote agent is removed).
        """
        self._check_open()
        old = self._peers.pop(peer)
        if old is not None:
            self._requests.fail_peer(old.key, f"peer {peer!r} is reconnecting")
            self._peers.drop(old)
        self._peers.begin(peer, address, tables, rank, validate, timeout_s)

    def connect(
        self,
        peer: PeerKey,
        address: str,
        tables: Callable[[bytes], Mapping[str, npt.ArrayLike]],
        *,
        rank: int = 0,
        validate: Callable[[bytes], object] | None = None,
        timeout_s: float = 5.0,
    ) -> bytes:
        """Connect to ``peer`` and wait (driving progress) until ready; returns the peer's payload.

        Raises:
            HandshakeError: timeout, protocol mismatch, the peer's error, a rejected payload, or NIXL
                refusing the peer's metadata or tables. Its ``findings`` attribute lists what
                ``validate`` found, as ``(check, local, remote, detail)``, when that rejected the payload
                with a ``HandshakeError`` (``validate_handshake`` does); it is empty otherwise.
        """
        self.begin_connect(peer, address, tables, rank=rank, validate=validate, timeout_s=timeout_s)
        state = self._peers[peer]
        while state.state == "connecting":
            if state.thread is not None:
                state.thread.join(0.002)
            self._progress()
        if state.state == "down":
            err = HandshakeError(state.reason)
            err.findings = list(state.findings)  # what validate_handshake found, if that rejected the peer
            raise err
        return state.payload

    def peer_state(self, peer: PeerKey) -> tuple[str, str]:
        """``(state, reason)`` of ``peer``: state is ``connecting``, ``ready`` or ``down``."""
        state = self._peers.get(peer)
        if state is None:
            return ("unknown", f"peer {peer!r} was never connected")
        return (state.state, state.reason)

    def remote_agent(self, peer: PeerKey) -> str | None:
        """The NIXL agent name of a connected peer (senders in ``PollResult`` use these names)."""
        state = self._peers.get(peer)
        return None if state is None else state.agent_name

    def send_control(self, address: str, payload: bytes, timeout_s: float = 5.0) -> None:
        """Deliver an opaque control payload to the endpoint serving ``address`` and wait for its ack.

        Raises:
            TransferError: no acknowledgement within ``timeout_s`` or an error from the peer.
        """
        self._check_open()
        try:
            send_control(self._ctx, address, payload, self.name, timeout_s)
        except ChannelError as exc:
            raise TransferError(f"control message to {address} failed: {exc}") from exc

    # ------------------------------------------------------------------ requests

    def post(
        self,
        request_id: str,
        transfers: Iterable[Transfer | tuple[Any, ...]],
        op: Op,
        deadline_s: float,
    ) -> RequestHandle:
        """Check and post a request: every transfer READs (pull) or WRITEs (push) with one peer.

        Ids are checked against the tables (and descriptor lengths pairwise) before anything is
        posted. A request to a peer still connecting is queued until its handshake ends.

        Raises:
            TransferError: bad op, duplicate request id, unknown peer or table, peer down, an id out
                of range (the message names it and the limit), or descriptor lengths that differ.
        """
        self._check_open()
        return self._requests.post(request_id, transfers, op, deadline_s)

    def expect(self, request_id: str, deadline_s: float, senders: int = 1) -> RequestHandle:
        """Await a peer-initiated request (push mode: the peer WRITEs into us).

        It completes once ``senders`` distinct peers have each landed all their transfers for
        ``request_id`` (reported in ``PollResult.done``); it fails on their failure notice or the deadline.
        """
        self._check_open()
        self._requests.ensure_new(request_id)
        return self._requests.expect(request_id, deadline_s, senders, self._inbox.take_landed(request_id))

    def poll(self) -> PollResult:
        """Progress everything once and return what happened since the last call (never blocks)."""
        self._check_open()
        self._progress()
        return self._requests.take_events()

    # ------------------------------------------------------------------ internals

    def _progress(self) -> None:
        while self._controls:
            self._requests.events.control.append(self._controls.popleft())
        self._peers.finish_due()
        self._inbox.drain()
        self._requests.progress()
        self._agent.reap_zombies()

    def _on_peer_ready(self, peer: Peer) -> None:
        self._requests.start_queued(peer.key)

    def _on_peer_down(self, peer: Peer) -> None:
        self._requests.fail_peer(peer.key, peer.reason, notify=False)
        if peer.agent_name is not None:
            self._inbox.forget(peer.agent_name)

    def _on_peer_dropped(self, agent_name: str) -> None:
        self._inbox.forget(agent_name)

    def _serve_meta(self, rank: int) -> tuple[bytes, bytes]:
        payload = self._provider(rank) if self._provider is not None else b""
        return payload, self._agent.metadata

    def _on_control(self, sender: str, payload: bytes) -> None:
        self._controls.append(ControlMessage(sender, payload))  # deque.append is thread-safe

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"endpoint {self.name!r} is closed")
