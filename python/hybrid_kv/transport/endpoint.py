"""``Endpoint``: one NIXL agent, its registered memory and prepped tables, its peers and requests.

The endpoint is driven by ``poll()``; it never starts NIXL's progress thread (it busy-spins a core,
see the NIXL notes §4.3) and every NIXL call happens on the thread that calls the endpoint's
methods. The only background threads are ZeroMQ ones: the side-channel server and one short-lived
thread per handshake in flight. NIXL has no transfer timeouts, so every request carries a deadline
that ``poll()`` enforces.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq
from nixl._api import nixl_agent, nixl_agent_config

from . import notifications
from .errors import HandshakeError, TransferError
from .requests import ControlMessage, Op, PeerKey, PollResult, RemoteEvent, RequestHandle, RequestState, Transfer
from .side_channel import ChannelError, SideChannelServer, fetch_meta, send_control
from .tables import DescTable, check_ids, expand_strided, registration_array

__all__ = ["Endpoint"]

_LOCAL = "NIXL_INIT_AGENT"
_LANDED_MEMORY = 4096  # passive completions remembered for a later expect()


def _nixl_errors() -> tuple[type[BaseException], ...]:
    """Every exception type the NIXL bindings raise (they share no base class)."""
    import nixl._bindings as bindings

    found = [
        obj
        for name in dir(bindings)
        if name.startswith("nixl") and isinstance(obj := getattr(bindings, name), type) and issubclass(obj, Exception)
    ]
    return tuple(found)


NIXL_ERRORS = _nixl_errors()
# NIXL also reports bad arguments through ValueError / TypeError / KeyError / IndexError
_CALL_ERRORS: tuple[type[BaseException], ...] = (*NIXL_ERRORS, ValueError, TypeError, KeyError, IndexError)
_DISCONNECT = tuple(t for t in NIXL_ERRORS if t.__name__ == "nixlRemoteDisconnectError")

_strided_ok: bool | None = None  # whether this NIXL accepts (N, 5) tables; detected once per process


@dataclass(eq=False)
class _Peer:
    key: PeerKey
    address: str
    rank: int
    tables_fn: Callable[[bytes], Mapping[str, npt.ArrayLike]]
    validate: Callable[[bytes], object] | None
    timeout_s: float
    deadline: float
    state: str = "connecting"  # connecting | ready | down
    reason: str = ""
    agent_name: str | None = None
    payload: bytes = b""
    tables: dict[str, DescTable] = field(default_factory=dict)
    dlists: dict[str, Any] = field(default_factory=dict)
    thread: threading.Thread | None = None
    result: tuple[bytes, bytes] | BaseException | None = None


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
        self._reg: Any = None
        self._local: dict[str, Any] = {}
        self._tables: dict[str, DescTable] = {}
        self._peers: dict[PeerKey, _Peer] = {}
        self._requests: dict[str, RequestHandle] = {}
        self._zombies: list[Any] = []  # xfer handles NIXL refused to release (still in progress)
        self._events = PollResult()
        self._controls: collections.deque[ControlMessage] = collections.deque()
        self._parts: dict[tuple[str, str], set[int]] = {}
        self._landed: collections.OrderedDict[str, set[str]] = collections.OrderedDict()
        self._closed = False

        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        try:
            params = {"ucx_error_handling_mode": ucx_error_handling_mode} if backend == "UCX" else {}
            self._agent.create_backend(backend, params)
            self._reg_rows = registration_array(registration)
            self._reg = self._agent.register_memory(self._reg_rows, mem_type)
            self._tables = {key: DescTable(key, np.asarray(rows)) for key, rows in local_tables.items()}
            self._local = {key: self._prep(_LOCAL, table) for key, table in self._tables.items()}
            self._nixl_md: bytes = self._agent.get_agent_metadata()
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

    def handle_counts(self) -> dict[str, int]:
        """Live NIXL objects owned by this endpoint; all zero after ``close()``."""
        return {
            "xfer": sum(x is not None for r in self._requests.values() for x in r._xfers),
            "zombie_xfer": len(self._zombies),
            "local_dlists": len(self._local),
            "remote_dlists": sum(len(p.dlists) for p in self._peers.values()),
            "remote_agents": sum(p.agent_name is not None for p in self._peers.values()),
            "registrations": int(self._reg is not None),
        }

    def close(self) -> None:
        """Release everything this endpoint owns (idempotent); live requests are failed and peers told."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._server is not None:
            self._server.close()
        for req in list(self._requests.values()):
            if not req.finished:
                self._fail(req, "endpoint closed")
        self._requests.clear()
        self._reap_zombies()
        for peer in self._peers.values():
            if peer.thread is not None:
                peer.thread.join(1.0)
            self._drop_remote(peer)
        self._peers.clear()
        for dlist in self._local.values():
            self._quiet(dlist.release)
        self._local.clear()
        if self._reg is not None:
            self._quiet(lambda: self._agent.deregister_memory(self._reg))
            self._reg = None
        if self._zombies:  # NIXL frees them when the agent is destroyed
            self._zombies.clear()
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
        old = self._peers.pop(peer, None)
        if old is not None:
            for req in self._live_for(old.key):
                self._fail(req, f"peer {peer!r} is reconnecting")
            self._drop_remote(old)
        state = _Peer(peer, address, rank, tables, validate, timeout_s, time.monotonic() + timeout_s)
        thread = threading.Thread(
            target=self._handshake, args=(state, timeout_s), name=f"hkv-handshake-{peer}", daemon=True
        )
        state.thread = thread
        self._peers[peer] = state
        thread.start()

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
                refusing the peer's metadata or tables.
        """
        self.begin_connect(peer, address, tables, rank=rank, validate=validate, timeout_s=timeout_s)
        state = self._peers[peer]
        while state.state == "connecting":
            if state.thread is not None:
                state.thread.join(0.002)
            self._progress()
        if state.state == "down":
            raise HandshakeError(state.reason)
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
        if op not in ("READ", "WRITE"):
            raise TransferError(f"op must be 'READ' or 'WRITE', got {op!r}", request_id=request_id)
        if request_id in self._requests:
            raise TransferError(f"request id {request_id!r} is already in flight", request_id=request_id)
        checked = tuple(self._check_transfer(request_id, Transfer(*t)) for t in transfers)
        if not checked:
            raise TransferError(f"request {request_id!r} has no transfers", request_id=request_id)
        req = RequestHandle(request_id, op, checked, time.monotonic() + deadline_s)
        self._requests[request_id] = req
        if all(self._peers[t.peer].state == "ready" for t in checked):
            self._start(req)
        return req

    def expect(self, request_id: str, deadline_s: float, senders: int = 1) -> RequestHandle:
        """Await a peer-initiated request (push mode: the peer WRITEs into us).

        It completes once ``senders`` distinct peers have each landed all their transfers for
        ``request_id`` (reported in ``PollResult.done``); it fails on their failure notice or the deadline.
        """
        self._check_open()
        if request_id in self._requests:
            raise TransferError(f"request id {request_id!r} is already in flight", request_id=request_id)
        req = RequestHandle(request_id, None, (), time.monotonic() + deadline_s, RequestState.POSTED, _senders=senders)
        req._seen = self._landed.pop(request_id, set())
        self._requests[request_id] = req
        self._maybe_passive_done(req)
        return req

    def poll(self) -> PollResult:
        """Progress everything once and return what happened since the last call (never blocks)."""
        self._check_open()
        self._progress()
        events, self._events = self._events, PollResult()
        return events

    # ------------------------------------------------------------------ internals: progress

    def _progress(self) -> None:
        now = time.monotonic()
        while self._controls:
            self._events.control.append(self._controls.popleft())
        for peer in list(self._peers.values()):
            if peer.state == "connecting" and (peer.result is not None or now > peer.deadline):
                self._finish_handshake(peer)
        self._drain_notifs()
        for req in list(self._requests.values()):
            if req.state is RequestState.POSTED and req.op is not None:
                self._check(req)
        now = time.monotonic()
        for req in list(self._requests.values()):
            if not req.finished and now > req.deadline:
                self._fail(req, self._deadline_reason(req))
        self._reap_zombies()

    def _check(self, req: RequestHandle) -> None:
        for i, xfer in enumerate(req._xfers):
            if req._done[i] or xfer is None:
                continue
            try:
                status = self._agent.check_xfer_state(xfer)
            except _CALL_ERRORS as exc:
                self._on_nixl_error(req, req.transfers[i].peer, exc)
                return
            if status == "DONE":
                req._done[i] = True
                self._release(req, i)
            elif status == "ERR":
                self._fail(req, f"transfer {i} to peer {req.transfers[i].peer!r} reported ERR")
                return
        if all(req._done):
            self._finish(req)

    def _drain_notifs(self) -> None:
        notifs = self._agent.get_new_notifs()  # also progresses the passive side (NIXL notes §4.3)
        for raw_sender, msgs in notifs.items():
            sender = raw_sender.decode() if isinstance(raw_sender, bytes) else str(raw_sender)
            for msg in msgs:
                notice = notifications.parse(msg)
                if notice is None:
                    self._events.notifs.append((sender, msg))
                elif notice.kind == "done":
                    self._on_part(sender, notice)
                else:
                    self._parts.pop((sender, notice.request_id), None)
                    self._events.remote_failed.append(RemoteEvent(sender, notice.request_id, notice.reason))
                    req = self._requests.get(notice.request_id)
                    if req is not None and req.op is None and not req.finished:
                        self._fail(req, f"peer {sender!r} failed: {notice.reason}", notify=False)

    def _on_part(self, sender: str, notice: notifications.Notice) -> None:
        key = (sender, notice.request_id)
        parts = self._parts.setdefault(key, set())
        parts.add(notice.index)
        if len(parts) < notice.count:
            return
        del self._parts[key]
        self._events.remote_done.append(RemoteEvent(sender, notice.request_id))
        req = self._requests.get(notice.request_id)
        if req is not None and req.op is None and not req.finished:
            req._seen.add(sender)
            self._maybe_passive_done(req)
        else:
            self._landed.setdefault(notice.request_id, set()).add(sender)
            while len(self._landed) > _LANDED_MEMORY:
                self._landed.popitem(last=False)

    def _maybe_passive_done(self, req: RequestHandle) -> None:
        if len(req._seen) >= req._senders:
            req.state = RequestState.DONE
            del self._requests[req.request_id]
            self._events.done.append(req.request_id)

    # ------------------------------------------------------------------ internals: handshake

    def _handshake(self, peer: _Peer, timeout_s: float) -> None:
        """Handshake thread: only ZeroMQ here; NIXL work happens in ``_finish_handshake``."""
        try:
            peer.result = fetch_meta(self._ctx, peer.address, peer.rank, self.name, timeout_s, self._stop)
        except BaseException as exc:
            peer.result = exc

    def _finish_handshake(self, peer: _Peer) -> None:
        where = f"peer {peer.key!r} at {peer.address}"
        result = peer.result
        if result is None:
            return self._peer_down(peer, f"handshake with {where} failed: no reply within {peer.timeout_s:g} s")
        if isinstance(result, BaseException):
            return self._peer_down(peer, f"handshake with {where} failed: {result}")
        payload, nixl_md = result
        peer.payload = payload
        if peer.validate is not None:
            try:
                peer.validate(payload)
            except Exception as exc:
                return self._peer_down(peer, f"handshake with {where} rejected: {exc}")
        try:
            name = self._agent.add_remote_agent(nixl_md)
            peer.agent_name = name.decode() if isinstance(name, bytes) else str(name)
            for key, rows in peer.tables_fn(payload).items():
                table = DescTable(key, np.asarray(rows))
                peer.tables[key] = table
                peer.dlists[key] = self._prep(peer.agent_name, table)
        except Exception as exc:  # NIXL errors and whatever the user's tables callback raises
            return self._peer_down(peer, f"handshake with {where} failed: {type(exc).__name__}: {exc}")
        peer.state = "ready"
        for req in self._live_for(peer.key):
            if req.state is RequestState.QUEUED:
                self._start_if_ready(req)

    def _peer_down(self, peer: _Peer, reason: str) -> None:
        peer.state = "down"
        peer.reason = reason
        for req in self._live_for(peer.key):
            self._fail(req, reason, notify=False)
        self._drop_remote(peer)

    def _drop_remote(self, peer: _Peer) -> None:
        for dlist in peer.dlists.values():
            self._quiet(dlist.release)
        peer.dlists.clear()
        if peer.agent_name is not None:
            self._quiet(lambda: self._agent.remove_remote_agent(peer.agent_name))
            peer.agent_name = None

    # ------------------------------------------------------------------ internals: posting

    def _check_transfer(self, rid: str, t: Transfer) -> Transfer:
        local = self._tables.get(t.local_key)
        if local is None:
            raise TransferError(f"unknown local table {t.local_key!r}; known: {sorted(self._tables)}", request_id=rid)
        peer = self._peers.get(t.peer)
        if peer is None:
            raise TransferError(f"peer {t.peer!r} is not connected", request_id=rid)
        if peer.state == "down":
            raise TransferError(f"peer {t.peer!r} is down: {peer.reason}", request_id=rid)
        try:
            local_ids = check_ids(t.local_ids, local, "local")
            remote_ids = np.asarray(t.remote_ids)  # checked once the peer's tables are known
            if peer.state == "ready":
                remote_ids = self._check_remote(peer, t.remote_key, t.remote_ids, local, local_ids)
        except TransferError as exc:
            raise TransferError(f"request {rid!r}: {exc}", request_id=rid) from None
        except (ValueError, TypeError, OverflowError) as exc:
            raise TransferError(f"request {rid!r}: bad descriptor ids: {exc}", request_id=rid) from exc
        return Transfer(t.peer, t.local_key, t.remote_key, local_ids, remote_ids)

    def _check_remote(
        self, peer: _Peer, key: str, ids: npt.ArrayLike, local: DescTable, local_ids: npt.NDArray[np.int32]
    ) -> npt.NDArray[np.int32]:
        remote = peer.tables.get(key)
        if remote is None:
            raise TransferError(f"unknown remote table {key!r} of peer {peer.key!r}; known: {sorted(peer.tables)}")
        remote_ids = check_ids(ids, remote, "remote")
        if remote_ids.size != local_ids.size:
            raise TransferError(f"{local_ids.size} local ids but {remote_ids.size} remote ids")
        mismatch = local.lengths(local_ids) != remote.lengths(remote_ids)
        if np.any(mismatch):
            k = int(np.argmax(mismatch))
            raise TransferError(
                f"descriptor length mismatch at pair {k}: local {local.key!r}[{local_ids[k]}] is "
                f"{local.lengths(local_ids[k : k + 1])[0]} B, remote {key!r}[{remote_ids[k]}] is "
                f"{remote.lengths(remote_ids[k : k + 1])[0]} B"
            )
        return remote_ids

    def _start_if_ready(self, req: RequestHandle) -> None:
        if any(self._peers[t.peer].state != "ready" for t in req.transfers):
            return
        try:  # remote ids could not be checked while the handshake was pending
            checked = []
            for t in req.transfers:
                remote_ids = self._check_remote(
                    self._peers[t.peer], t.remote_key, t.remote_ids, self._tables[t.local_key], t.local_ids
                )
                checked.append(t._replace(remote_ids=remote_ids))
        except TransferError as exc:
            self._fail(req, str(exc), notify=False)
            return
        req.transfers = tuple(checked)
        self._start(req)

    def _start(self, req: RequestHandle) -> None:
        per_peer = collections.Counter(t.peer for t in req.transfers)
        index: collections.Counter[PeerKey] = collections.Counter()
        req._xfers = [None] * len(req.transfers)
        req._done = [False] * len(req.transfers)
        req.state = RequestState.POSTED
        assert req.op is not None
        for i, t in enumerate(req.transfers):  # make every handle before posting any
            peer = self._peers[t.peer]
            msg = notifications.done_message(req.request_id, index[t.peer], per_peer[t.peer])
            index[t.peer] += 1
            try:
                req._xfers[i] = self._agent.make_prepped_xfer(
                    req.op,
                    self._local[t.local_key],
                    t.local_ids,
                    peer.dlists[t.remote_key],
                    t.remote_ids,
                    notif_msg=msg,
                )
            except _CALL_ERRORS as exc:
                self._on_nixl_error(req, t.peer, exc)
                return
        for i, xfer in enumerate(req._xfers):
            try:
                status = self._agent.transfer(xfer)
            except _CALL_ERRORS as exc:
                self._on_nixl_error(req, req.transfers[i].peer, exc)
                return
            if status == "ERR":
                self._fail(req, f"posting transfer {i} to peer {req.transfers[i].peer!r} returned ERR")
                return
            if status == "DONE":
                req._done[i] = True
                self._release(req, i)
        if all(req._done):
            self._finish(req)

    # ------------------------------------------------------------------ internals: completion

    def _finish(self, req: RequestHandle) -> None:
        req.state = RequestState.DONE
        del self._requests[req.request_id]
        self._events.done.append(req.request_id)

    def _on_nixl_error(self, req: RequestHandle, peer_key: PeerKey, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}".strip()
        if _DISCONNECT and isinstance(exc, _DISCONNECT):
            peer = self._peers[peer_key]
            peer.state = "down"
            peer.reason = f"peer {peer_key!r} disconnected ({reason})"
            for other in self._live_for(peer_key):
                self._fail(other, peer.reason, notify=False)
            return
        self._fail(req, f"NIXL error with peer {peer_key!r}: {reason}")

    def _fail(self, req: RequestHandle, reason: str, notify: bool = True) -> None:
        if req.finished:
            return
        failed = [t for i, t in enumerate(req.transfers) if not (i < len(req._done) and req._done[i])]
        for i in range(len(req._xfers)):
            self._release(req, i)
        req.state = RequestState.FAILED
        req.error = TransferError(
            f"request {req.request_id!r} failed: {reason}", request_id=req.request_id, failed=failed
        )
        self._requests.pop(req.request_id, None)
        self._events.failed.append(req.error)
        if notify and req.op is not None:
            msg = notifications.fail_message(req.request_id, reason.replace("\n", " "))
            for key in req.peers:
                peer = self._peers.get(key)
                if peer is not None and peer.state == "ready" and peer.agent_name is not None:
                    self._quiet(functools.partial(self._agent.send_notif, peer.agent_name, msg))

    def _release(self, req: RequestHandle, i: int) -> None:
        xfer = req._xfers[i]
        if xfer is None:
            return
        req._xfers[i] = None
        try:
            self._agent.release_xfer_handle(xfer)
        except _CALL_ERRORS:
            self._zombies.append(xfer)  # still in progress and not cancellable yet: retry later

    def _reap_zombies(self) -> None:
        alive = []
        for xfer in self._zombies:
            try:
                self._agent.release_xfer_handle(xfer)
            except _CALL_ERRORS:
                alive.append(xfer)
        self._zombies = alive

    # ------------------------------------------------------------------ internals: helpers

    def _prep(self, agent_name: str, table: DescTable) -> Any:
        rows = table.rows if (table.strided and self._strided_supported()) else expand_strided(table.rows)
        return self._agent.prep_xfer_dlist(agent_name, rows, self.mem_type)

    def _strided_supported(self) -> bool:
        """Detect once whether ``prep_xfer_dlist`` takes ``(N, 5)`` strided rows (nixl >= 1.5)."""
        global _strided_ok
        if _strided_ok is None:
            addr, _, dev = (int(v) for v in self._reg_rows[0])
            probe = np.array([[addr, 1, dev, 1, 1]], dtype=np.uint64)
            try:
                self._agent.prep_xfer_dlist(_LOCAL, probe, self.mem_type).release()
                _strided_ok = True
            except (ValueError, TypeError):
                _strided_ok = False
            except NIXL_ERRORS:
                _strided_ok = True  # the form was parsed; only the probe address was unknown
        return _strided_ok

    def _live_for(self, key: PeerKey) -> list[RequestHandle]:
        return [r for r in self._requests.values() if not r.finished and key in r.peers]

    def _deadline_reason(self, req: RequestHandle) -> str:
        if req.op is None:
            return f"deadline exceeded: {len(req._seen)} of {req._senders} senders completed"
        if req.state is RequestState.QUEUED:
            return "deadline exceeded while waiting for a handshake"
        return f"deadline exceeded with {sum(req._done)} of {len(req.transfers)} transfers done"

    def _serve_meta(self, rank: int) -> tuple[bytes, bytes]:
        payload = self._provider(rank) if self._provider is not None else b""
        return payload, self._nixl_md

    def _on_control(self, sender: str, payload: bytes) -> None:
        self._controls.append(ControlMessage(sender, payload))  # deque.append is thread-safe

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"endpoint {self.name!r} is closed")

    @staticmethod
    def _quiet(fn: Callable[[], object]) -> None:
        try:
            fn()
        except _CALL_ERRORS:
            pass
