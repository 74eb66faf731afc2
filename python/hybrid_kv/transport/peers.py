"""``Peers``: an endpoint's peers and their handshake state machine.

A peer is ``connecting`` from ``begin()`` until ``finish_due()`` sees its handshake thread's result
(or its deadline pass), then ``ready`` or ``down``; a ready peer goes ``down`` when NIXL reports it
disconnected. The handshake thread only talks ZeroMQ (``fetch_named_meta``); adding the remote agent and
prepping its tables happens in ``finish_due()``, on the endpoint's thread.

A peer's side-channel identity and its NIXL agent are bound together: the (authenticated) name the
side channel answered with must be the name of the agent its metadata loads, and each agent name is
held by at most one peer key. A name held by a ``down`` peer is released (its agent unloaded) when a
new peer claims it, so a restarted process can be connected again; a name held by a live peer is
refused. An agent is only ever unloaded by the peer key that holds it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq

from .agent import Agent
from .channel_client import fetch_named_meta
from .requests import PeerKey
from .side_channel import MetaReply
from .tables import CheckedTable

__all__ = ["Peer", "Peers"]

TablesFn = Callable[[bytes], Mapping[str, npt.ArrayLike]]
Validate = Callable[[bytes], object]


@dataclass(eq=False)
class Peer:
    """One remote endpoint as this endpoint sees it.

    Attributes:
        key: the key transfers use for this peer.
        state: ``connecting``, ``ready`` or ``down``; ``reason`` says why it is down.
        findings: when ``validate`` rejected the payload with a ``HandshakeError``, its findings
            ``(check, local, remote, detail)``; empty otherwise.
        agent_name: the peer's NIXL agent name while this peer holds that agent (loaded).
        expected_payload: if set, the payload the peer must serve, byte for byte.
        expected_name: if set, the name the peer must answer with (and its agent must have).
        payload: the peer's handshake payload once received.
        tables: the peer's descriptor tables; ``dlists`` holds them prepped against its agent.
        scope: the local table scope its transfers' local keys name (``None``: the endpoint's own tables).
    """

    key: PeerKey
    address: str
    rank: int
    tables_fn: TablesFn
    validate: Validate | None
    timeout_s: float
    deadline: float
    expected_payload: bytes | None = None
    expected_name: str | None = None
    scope: str | None = None
    state: str = "connecting"  # connecting | ready | down
    reason: str = ""
    findings: tuple[tuple[str, str, str, str], ...] = ()
    agent_name: str | None = None
    payload: bytes = b""
    tables: dict[str, CheckedTable] = field(default_factory=dict)
    dlists: dict[str, Any] = field(default_factory=dict)
    thread: threading.Thread | None = None
    result: MetaReply | BaseException | None = None


class Peers:
    """The peers of one endpoint, by key.

    Args:
        agent: the endpoint's NIXL agent (remote agents and dlists are loaded into it).
        ctx: the ZeroMQ context handshakes use.
        own_name: this endpoint's name, sent with each metadata request.
        key: the side-channel secret (``None``: unauthenticated).
        stop: set when the endpoint closes; cancels handshakes in flight.
        on_ready: called once a peer's handshake succeeded.
        on_down: called when a peer goes down, before its remote agent is removed.
        on_drop: called with a peer's agent name just before that agent is removed.
    """

    def __init__(
        self,
        agent: Agent,
        ctx: zmq.Context[zmq.Socket[bytes]],
        own_name: str,
        stop: threading.Event,
        *,
        key: bytes | None,
        on_ready: Callable[[Peer], None],
        on_down: Callable[[Peer], None],
        on_drop: Callable[[str], None],
    ) -> None:
        self._agent = agent
        self._ctx = ctx
        self._name = own_name
        self._key = key
        self._stop = stop
        self._on_ready = on_ready
        self._on_down = on_down
        self._on_drop = on_drop
        self._by_key: dict[PeerKey, Peer] = {}

    def get(self, key: PeerKey) -> Peer | None:
        """The peer connected under ``key``, if any."""
        return self._by_key.get(key)

    def __getitem__(self, key: PeerKey) -> Peer:
        """The peer connected under ``key`` (``KeyError`` if none)."""
        return self._by_key[key]

    def __iter__(self) -> Iterator[Peer]:
        """Every peer, iterated over a snapshot (callbacks may change the table meanwhile)."""
        return iter(list(self._by_key.values()))

    def pop(self, key: PeerKey) -> Peer | None:
        """Forget the peer under ``key`` (its remote agent stays loaded until ``drop()``)."""
        return self._by_key.pop(key, None)

    def holder(self, agent_name: str) -> Peer | None:
        """The peer holding (having loaded) the agent ``agent_name``, if any."""
        return next((p for p in self._by_key.values() if p.agent_name == agent_name), None)

    def begin(
        self,
        key: PeerKey,
        address: str,
        tables_fn: TablesFn,
        rank: int,
        validate: Validate | None,
        timeout_s: float,
        expected_payload: bytes | None = None,
        expected_name: str | None = None,
        reply: MetaReply | None = None,
        scope: str | None = None,
    ) -> Peer:
        """Register a ``connecting`` peer under the free ``key`` and start its handshake thread, or, given the
        ``reply`` already fetched from it, finish from that reply on the next ``finish_due()``."""
        deadline = time.monotonic() + timeout_s
        peer = Peer(
            key,
            address,
            rank,
            tables_fn,
            validate,
            timeout_s,
            deadline,
            bytes(expected_payload) if expected_payload is not None else None,
            expected_name,
            scope,
        )
        self._by_key[key] = peer
        if reply is not None:
            peer.result = MetaReply(*reply)
            return peer
        peer.thread = threading.Thread(
            target=self._handshake, args=(peer, timeout_s), name=f"hkv-handshake-{key}", daemon=True
        )
        peer.thread.start()
        return peer

    def finish_due(self) -> None:
        """Finish every handshake whose thread has a result or whose deadline passed."""
        now = time.monotonic()
        for peer in self:
            if peer.state == "connecting" and (peer.result is not None or now > peer.deadline):
                self._finish(peer)

    def mark_down(self, peer: Peer, reason: str) -> None:
        """Mark ``peer`` down with ``reason`` and report it (its remote agent stays loaded)."""
        peer.state = "down"
        peer.reason = reason
        self._on_down(peer)

    def drop(self, peer: Peer) -> None:
        """Release the peer's prepped dlists and remove the remote agent it holds."""
        self._agent.release_dlists(peer.dlists)
        if peer.agent_name is not None:
            self._on_drop(peer.agent_name)
            self._agent.remove_remote(peer.agent_name)
            peer.agent_name = None

    def close(self) -> None:
        """Wait briefly for handshake threads (already cancelled by ``stop``) and drop every peer."""
        for peer in self:
            if peer.thread is not None:
                peer.thread.join(1.0)
            self.drop(peer)
        self._by_key.clear()

    def counts(self) -> tuple[int, int]:
        """``(remote dlists, remote agents)`` currently loaded."""
        peers = self._by_key.values()
        return sum(len(p.dlists) for p in peers), sum(p.agent_name is not None for p in peers)

    def _handshake(self, peer: Peer, timeout_s: float) -> None:
        """Handshake thread: only ZeroMQ here; NIXL work happens in ``_finish``."""
        try:
            peer.result = fetch_named_meta(
                self._ctx,
                peer.address,
                peer.rank,
                self._name,
                timeout_s,
                self._stop,
                key=self._key,
                to=peer.expected_name,
            )
        except BaseException as exc:
            peer.result = exc

    def _finish(self, peer: Peer) -> None:
        reason = self._attach(peer)
        if reason is None:
            peer.state = "ready"
            self._on_ready(peer)
        else:
            self.mark_down(peer, reason)
            self.drop(peer)

    def _attach(self, peer: Peer) -> str | None:
        """Validate the handshake's result, load the remote agent and prep its tables; the failure, if any."""
        where = f"peer {peer.key!r} at {peer.address}"
        result = peer.result
        if result is None:
            return f"handshake with {where} failed: no reply within {peer.timeout_s:g} s"
        if isinstance(result, BaseException):
            return f"handshake with {where} failed: {result}"
        claimed, payload, nixl_md = result
        if peer.expected_name is not None and claimed != peer.expected_name:
            return f"handshake with {where} refused: it is {claimed!r}, expected {peer.expected_name!r}"
        if peer.expected_payload is not None and payload != peer.expected_payload:
            return (
                f"handshake with {where} refused: it served a {len(payload)}-byte payload that differs from the "
                f"expected {len(peer.expected_payload)} bytes"
            )
        peer.payload = payload
        if peer.validate is not None:
            try:
                peer.validate(payload)
            except Exception as exc:
                peer.findings = tuple(getattr(exc, "findings", ()))
                return f"handshake with {where} rejected: {exc}"
        conflict = self._claim(peer, claimed)
        if conflict is not None:
            return f"handshake with {where} refused: {conflict}"
        try:
            loaded = self._agent.add_remote(nixl_md)
        except Exception as exc:  # NIXL refusing the metadata
            return f"handshake with {where} failed: {type(exc).__name__}: {exc}"
        if loaded != claimed:
            if self.holder(loaded) is None:  # loaded by us just now: unload it; never another peer's agent
                self._agent.remove_remote(loaded)
            return f"handshake with {where} refused: it answered as {claimed!r} but its NIXL agent is {loaded!r}"
        peer.agent_name = loaded
        try:
            for key, rows in peer.tables_fn(payload).items():
                table = CheckedTable(key, np.asarray(rows))
                peer.tables[key] = table
                peer.dlists[key] = self._agent.prep(loaded, table)
        except Exception as exc:  # NIXL errors and whatever the user's tables callback raises
            return f"handshake with {where} failed: {type(exc).__name__}: {exc}"
        return None

    def _claim(self, peer: Peer, name: str) -> str | None:
        """Make agent ``name`` free for ``peer``: unload it from a down holder; the conflict with a live one."""
        holder = self.holder(name)
        if holder is None or holder is peer:
            return None
        if holder.state == "down":
            self.drop(holder)  # a dead process's agent: its requests already failed; a restart may reuse the name
            return None
        return (
            f"agent {name!r} is already connected as peer {holder.key!r} ({holder.state}); "
            "reconnect or close that peer first"
        )
