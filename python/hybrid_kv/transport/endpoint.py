"""``Endpoint``: one NIXL agent, its registered memory and prepped tables, its peers and requests.

Memory is registered once, when the endpoint is created; peers added later bring only their own tables: a
named scope of local tables (``add_local_tables``, e.g. one peer engine's ``PeerPlan`` tables) that the peers
connected with ``local_scope=`` post from, and each peer's remote tables. ``disconnect`` and
``remove_local_tables`` release exactly those handles, so one endpoint serves any number of peer engines.

The endpoint is driven by ``poll()``; it never starts NIXL's progress thread (it busy-spins a core).
Every NIXL call happens inside one of the endpoint's methods, and those hold the endpoint's lock: the agent
is created without NIXL's own thread synchronisation (its default without a listener thread), so two threads
may use one endpoint (a worker polling while a poster thread releases the stages of a streamed request,
``release``) but never call into the agent at the same time. ``send_control`` (the side channel only, and it
may wait on the network) takes no lock. The endpoint's own background threads are ZeroMQ ones: the
side-channel server and one short-lived thread per handshake in flight (fetching only; the NIXL part of a
handshake runs in ``poll()``). NIXL has no transfer timeouts, so every request carries a deadline that
``poll()`` enforces.

The endpoint wires together ``Agent`` (the NIXL agent and the handles it owns), ``Peers``
(handshakes and peer state), ``InFlight`` (posting, progress, completion and failure of requests)
and ``Inbox`` (notifications from peers). Its methods are grouped by concept: the connections to peers are in
``endpoint_peers``, the requests in ``endpoint_requests``, the state and lock they share in ``endpoint_base``;
this module holds its construction, lifecycle, local table scopes and control messages.

Every byte a peer sends is untrusted: side-channel frames are authenticated with the deployment's
shared secret (``auth``), bounded in size, and bound to the peer's NIXL agent (``peers``); see
ARCHITECTURE.md, "Threat model / trust boundary".
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping
from types import TracebackType

import numpy.typing as npt
import zmq

from ..errors import ChannelError, ChannelTimeout, HandshakeError, TransferError
from ..hugepages import HugePageReport
from . import netif
from .agent import CALL_ERRORS, Agent, log
from .auth import resolve_secret
from .channel_client import send_control
from .channel_process import SideChannelProcess
from .channel_server import SideChannelServer
from .courier import Courier
from .endpoint_base import locked
from .endpoint_peers import PeerConnections
from .endpoint_requests import RequestMethods
from .inbox import Inbox
from .inflight import InFlight
from .peers import Peer, Peers
from .requests import ControlMessage
from .seconds import check_seconds

__all__ = ["MAX_CONTROL_ATTEMPTS", "MAX_QUEUED_CONTROLS", "Endpoint"]


MAX_QUEUED_CONTROLS = 1024
"""Control messages queued until the owner's next ``poll()``; past that, new ones are refused (the
sender gets a ``TransferError`` saying the queue is full) and the overflow is logged."""
MAX_CONTROL_ATTEMPTS = 5
"""Most attempts ``send_control`` makes for one message (the first gets 1/31 of its timeout at this many)."""


class Endpoint(PeerConnections, RequestMethods):
    """One side (a prefill or decode rank) of KV transfers: a NIXL agent plus a handshake side channel.

    Args:
        name: the NIXL agent name; unique among all endpoints that talk to each other.
        registration: ``(N, 3)`` uint64 ``(addr, len, device)`` regions to register, once.
        local_tables: ``{key: (N, 5) or (N, 3) uint64 table}``, each prepped once (the default scope, which peers
            connected without ``local_scope`` post from; may be empty).
        mem_type: NIXL memory type of the registration and tables (``"DRAM"``, ``"VRAM"``...).
        metadata_provider: ``rank -> payload bytes`` served to peers during their handshake
            (called from the side-channel thread; must be thread-safe), or ``{rank: payload}`` (the only form
            ``side_channel="process"`` takes: its replies are fixed at start). ``None`` serves ``b""``.
        listen: the address of this endpoint, ``tcp://IPV4:PORT`` (port 0 = any free port): the side
            channel binds it and UCX is restricted to the network interface owning that IPv4 address
            (``UCX_NET_DEVICES``, set while the backend is created; see ``netif``; ``tcp://*:PORT``
            restricts nothing). ``None``: no side channel, and UCX restricted to loopback.
        secret: the deployment's shared side-channel secret (``str`` or ``bytes``, at least 32 bytes, not
            degenerate; see ``auth``); ``None`` reads ``HYBRID_KV_SECRET``. The side channel's CURVE keys derive
            from it: every side-channel connection is authenticated and encrypted (``curve``).
        insecure: ``True`` runs the side channel without authentication (``secret`` must be ``None``;
            ``HYBRID_KV_SECRET`` is ignored): any process reaching the port can then read the NIXL metadata
            and so read and write the registered memory.
        backend: NIXL backend plugin.
        ucx_error_handling_mode: ``"peer"`` (default) turns a dead peer into an error instead of a
            hang, at the cost of excluding shared-memory transports that cannot report it.
        side_channel: ``"thread"`` (default) serves the side channel from a thread of this process;
            ``"process"`` from a child process (``channel_process``: its own GIL and every core of the cpuset),
            so a process whose main thread spins with the GIL (a vLLM worker) still answers handshakes in time;
            control messages come back through a local pipe that ``poll()`` drains.
        huge_pages: ``DRAM`` registrations and transparent huge pages (``hybrid_kv.hugepages``: CMA moves
            huge pages about twice as fast as 4 KiB pages). ``"advise"`` (default) asks for huge pages on
            later faults (free); ``"collapse"`` also moves pages already faulted in onto huge pages now (about
            one copy of the regions at start-up; for pools not allocated with ``hybrid_kv.hugepages.zeros``);
            ``"off"`` leaves the memory alone. What happened is in ``Endpoint.huge_pages``; memory contents
            never change.

    Raises:
        ValueError: a side channel without a secret (and not ``insecure``), a secret too short, or a
            ``listen`` address that is malformed or not on this machine.
        ChannelError: the side channel cannot bind ``listen``.

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
        metadata_provider: Callable[[int], bytes] | Mapping[int, bytes] | None = None,
        listen: str | None = "tcp://127.0.0.1:0",
        secret: bytes | str | None = None,
        insecure: bool = False,
        backend: str = "UCX",
        ucx_error_handling_mode: str = "peer",
        huge_pages: str = "advise",
        side_channel: str = "thread",
    ) -> None:
        who = f"endpoint {name!r}"
        if huge_pages not in ("off", "advise", "collapse"):
            raise ValueError(f"{who}: huge_pages must be 'off', 'advise' or 'collapse', got {huge_pages!r}")
        if side_channel not in ("thread", "process"):
            raise ValueError(f"{who}: side_channel must be 'thread' or 'process', got {side_channel!r}")
        if side_channel == "process" and not isinstance(metadata_provider, Mapping | None):
            raise ValueError(f"{who}: side_channel='process' serves fixed replies: pass metadata_provider as a dict")
        self._key = resolve_secret(secret, insecure=insecure, required=listen is not None, what=who)
        net_device = netif.interface_of(netif.listen_host(listen))
        self.name = name
        self.mem_type = mem_type
        self._provider = metadata_provider
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._stop = threading.Event()
        self._server: SideChannelServer | SideChannelProcess | None = None
        self._controls: collections.deque[ControlMessage] = collections.deque()
        self._controls_overflowed = False  # the current overflow was logged
        self._courier: Courier | None = None
        self._closed = False
        self._lock = threading.RLock()  # held by every method that calls into the agent (see the module doc)

        self._agent = Agent(name, mem_type)
        self._peers = Peers(
            self._agent,
            self._ctx,
            name,
            self._stop,
            key=self._key,
            on_ready=self._on_peer_ready,
            on_down=self._on_peer_down,
            on_drop=self._on_peer_dropped,
        )
        self._requests = InFlight(self._agent, self._peers)
        self._inbox = Inbox(self._agent, self._requests)
        try:
            self._agent.open(registration, local_tables, backend, ucx_error_handling_mode, net_device, huge_pages)
            if listen is not None and side_channel == "process":
                payloads = dict(metadata_provider) if isinstance(metadata_provider, Mapping) else {}
                self._server = SideChannelProcess(
                    listen, payloads, self._agent.metadata, name=name, key=self._key, max_queued=MAX_QUEUED_CONTROLS
                )
            elif listen is not None:
                self._server = SideChannelServer(listen, self._serve_meta, self._on_control, name=name, key=self._key)
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
    def metadata(self) -> bytes:
        """This endpoint's NIXL agent metadata (what peers load; new with every process)."""
        return bytes(self._agent.metadata)

    @property
    def huge_pages(self) -> HugePageReport | None:
        """What advising the registered regions to huge pages did (``None``: ``"off"``, or not ``DRAM``)."""
        return self._agent.huge_pages

    @property
    def strided_rows_supported(self) -> bool:
        """Whether this NIXL preps ``(N, 5)`` strided rows as they are (nixl >= 1.5).

        Where it does not, strided tables are expanded to ``(N, 3)`` before prepping; plans for such an
        endpoint are best built with ``PeerPlan(..., coalesce=False)``, whose tables have no chunk rows
        (expanded, chunk rows make a table about 7x larger).
        """
        return self._agent.strided_supported()

    @locked
    def handle_counts(self) -> dict[str, int]:
        """Live NIXL objects owned by this endpoint; all zero after ``close()``."""
        remote_dlists, remote_agents = self._peers.counts()
        return {
            "xfer": self._requests.xfer_count(),
            "zombie_xfer": len(self._agent.zombies),
            "local_dlists": self._agent.local_dlist_count(),
            "remote_dlists": remote_dlists,
            "remote_agents": remote_agents,
            "registrations": int(self._agent.registered),
        }

    @locked
    def close(self) -> None:
        """Release everything this endpoint owns (idempotent); live requests are failed and peers told."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._courier is not None:
            self._courier.close()
        if self._server is not None:
            self._server.close()
        self._requests.fail_all("endpoint closed")
        self._agent.reap_zombies()
        self._peers.close()
        self._agent.close()
        self._ctx.destroy(linger=0)

    # ------------------------------------------------------------------ local table scopes

    @locked
    def add_local_tables(self, scope: str, tables: Mapping[str, npt.ArrayLike]) -> None:
        """Prep ``tables`` (``{key: (N, 5) or (N, 3) uint64 table}``) as the named scope ``scope``, against the
        memory registered at creation (nothing is registered again).

        Peers connected with ``local_scope=scope`` post from these tables (a transfer's ``local_key`` names one
        of them). All or nothing: a table that fails its checks or NIXL's prep releases what was prepped.

        Raises:
            ValueError: an empty or existing scope name, or a malformed table.
            TransferError: the endpoint is closed, or NIXL refused a table (its error is chained).
        """
        self._check_open()
        if not scope:
            raise ValueError(f"endpoint {self.name!r}: a local table scope needs a name")
        try:
            self._agent.add_scope(scope, tables)
        except CALL_ERRORS as exc:
            if isinstance(exc, ValueError):
                raise ValueError(f"endpoint {self.name!r}: {exc}") from exc
            raise TransferError(f"endpoint {self.name!r}: NIXL refused a table of scope {scope!r}: {exc}") from exc

    @locked
    def remove_local_tables(self, scope: str) -> None:
        """Release the named scope's prepped tables (unknown scopes are ignored).

        Raises:
            TransferError: a peer still posts from the scope (``disconnect`` it first; the message names it).
        """
        self._check_open()
        users = sorted(str(p.key) for p in self._peers if p.scope == scope)
        if users:
            raise TransferError(
                f"endpoint {self.name!r}: local table scope {scope!r} is still used by peer(s) {', '.join(users)}; "
                "disconnect them first"
            )
        self._agent.remove_scope(scope)

    @locked
    def local_scopes(self) -> list[str]:
        """The named local table scopes, sorted."""
        return sorted(self._agent.scopes)

    # ------------------------------------------------------------------ handshake

    @property
    def courier(self) -> Courier:
        """This endpoint's ``Courier``: control messages delivered off the caller's thread, in order per destination,
        each with a deadline (started on first use, closed with the endpoint).

        Raises:
            TransferError: the endpoint is closed.
        """
        self._check_open()
        with self._lock:
            if self._courier is None:
                self._courier = Courier(self._ctx, self.name, self._key)
            return self._courier

    def send_control(
        self,
        address: str,
        payload: bytes,
        timeout_s: float = 5.0,
        *,
        expected_name: str | None = None,
        attempts: int = 1,
    ) -> None:
        """Deliver an opaque control payload to the endpoint serving ``address`` and wait for its ack.

        The receiver sees this endpoint's name as the authenticated ``ControlMessage.sender``.
        ``expected_name``: the endpoint meant; the message names it, and any other endpoint refuses it
        before acting on it. ``attempts`` (1 to ``MAX_CONTROL_ATTEMPTS``): a message not acknowledged in time is
        sent again on a fresh connection, each attempt given twice the time of the one before and all of them
        ``timeout_s`` together; an unacknowledged message may still have arrived, so the receiver may see it
        more than once (retry only messages it treats idempotently). Any other failure is not retried.

        Raises:
            ValueError: ``attempts`` out of range.
            TransferError: a payload over ``side_channel.MAX_CONTROL_BYTES``, no acknowledgement within
                ``timeout_s``, failed authentication, an unexpected acknowledging endpoint, or an error
                from the peer (e.g. its control queue is full).
        """
        self._check_open()
        timeout_s = check_seconds(timeout_s, "timeout_s")
        if not 1 <= attempts <= MAX_CONTROL_ATTEMPTS:
            raise ValueError(f"attempts must be 1 to {MAX_CONTROL_ATTEMPTS}, got {attempts}")
        unit = timeout_s / (2**attempts - 1)
        for i in range(attempts):
            try:
                acked_by = send_control(
                    self._ctx, address, payload, self.name, unit * 2**i, key=self._key, to=expected_name
                )
                break
            except ChannelTimeout as exc:
                if i + 1 == attempts:
                    tries = f" ({attempts} attempts)" if attempts > 1 else ""
                    raise TransferError(
                        f"control message to {address} failed: no acknowledgement within {timeout_s:g} s{tries}"
                    ) from exc
            except ChannelError as exc:
                raise TransferError(f"control message to {address} failed: {exc}") from exc
        if expected_name is not None and acked_by != expected_name:
            raise TransferError(
                f"control message to {address} was acknowledged by {acked_by!r}, expected {expected_name!r}"
            )

    def controls_waiting(self) -> bool:
        """Whether an authenticated control message waits for the next ``poll()`` (never blocks): an owner that
        progresses only while it has work checks this, so that a peer's message never waits for its next step."""
        if self._controls:
            return True
        return isinstance(self._server, SideChannelProcess) and self._server.has_controls()

    # ------------------------------------------------------------------ internals

    def _progress(self) -> None:
        if isinstance(self._server, SideChannelProcess):
            self._requests.events.side_channel_restarted += self._server.restarted()
            for sender, payload in self._server.take_controls(MAX_QUEUED_CONTROLS):
                self._requests.events.control.append(ControlMessage(sender, payload))
        while self._controls:
            self._requests.events.control.append(self._controls.popleft())
        self._controls_overflowed = False
        self._peers.finish_due()
        self._inbox.drain()
        self._requests.progress()
        self._agent.reap_zombies()
        self._requests.settle()

    def _on_peer_ready(self, peer: Peer) -> None:
        self._requests.start_queued(peer.key)

    def _on_peer_down(self, peer: Peer) -> None:
        self._requests.fail_peer(peer.key, peer.reason, notify=False)
        if peer.agent_name is not None:
            self._inbox.forget(peer.agent_name)

    def _on_peer_dropped(self, agent_name: str) -> None:
        self._inbox.forget(agent_name)

    def _serve_meta(self, rank: int) -> tuple[bytes, bytes]:
        provider = self._provider
        if isinstance(provider, Mapping):
            if rank not in provider:
                raise ValueError(f"this side channel serves TP rank(s) {sorted(provider)}, not {rank}")
            return provider[rank], self._agent.metadata
        payload = provider(rank) if provider is not None else b""
        return payload, self._agent.metadata

    def _on_control(self, sender: str, payload: bytes) -> None:
        """Queue an authenticated control message (side-channel thread); refuse it when the queue is full."""
        if len(self._controls) >= MAX_QUEUED_CONTROLS:  # only this thread appends, so the queue cannot overshoot
            if not self._controls_overflowed:
                self._controls_overflowed = True
                log.warning(
                    "endpoint %r: control queue full (%d messages not yet polled); refusing control messages "
                    "(first refused: from %r) until poll() drains it",
                    self.name,
                    MAX_QUEUED_CONTROLS,
                    sender,
                )
            raise OverflowError(
                f"control queue of {self.name!r} is full: {len(self._controls)} messages not yet polled "
                f"(limit {MAX_QUEUED_CONTROLS})"
            )
        self._controls.append(ControlMessage(sender, payload))  # deque.append is thread-safe
