"""``Peers``: an endpoint's peers and their handshake state machine.

A peer is ``connecting`` from ``begin()`` until ``finish_due()`` sees its handshake thread's result
(or its deadline pass), then ``ready`` or ``down``; a ready peer goes ``down`` when NIXL reports it
disconnected. The handshake thread only talks ZeroMQ (``fetch_meta``); adding the remote agent and
prepping its tables happens in ``finish_due()``, on the endpoint's thread.
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
from .requests import PeerKey
from .side_channel import fetch_meta
from .tables import DescTable

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
        agent_name: the peer's NIXL agent name while its agent is loaded.
        payload: the peer's handshake payload once received.
        tables: the peer's descriptor tables; ``dlists`` holds them prepped against its agent.
    """

    key: PeerKey
    address: str
    rank: int
    tables_fn: TablesFn
    validate: Validate | None
    timeout_s: float
    deadline: float
    state: str = "connecting"  # connecting | ready | down
    reason: str = ""
    findings: tuple[tuple[str, str, str, str], ...] = ()
    agent_name: str | None = None
    payload: bytes = b""
    tables: dict[str, DescTable] = field(default_factory=dict)
    dlists: dict[str, Any] = field(default_factory=dict)
    thread: threading.Thread | None = None
    result: tuple[bytes, bytes] | BaseException | None = None


class Peers:
    """The peers of one endpoint, by key.

    Args:
        agent: the endpoint's NIXL agent (remote agents and dlists are loaded into it).
        ctx: the ZeroMQ context handshakes use.
        own_name: this endpoint's name, sent with each metadata request.
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
        on_ready: Callable[[Peer], None],
        on_down: Callable[[Peer], None],
        on_drop: Callable[[str], None],
    ) -> None:
        self._agent = agent
        self._ctx = ctx
        self._name = own_name
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

    def begin(
        self, key: PeerKey, address: str, tables_fn: TablesFn, rank: int, validate: Validate | None, timeout_s: float
    ) -> Peer:
        """Register a ``connecting`` peer under the free ``key`` and start its handshake thread."""
        peer = Peer(key, address, rank, tables_fn, validate, timeout_s, time.monotonic() + timeout_s)
        peer.thread = threading.Thread(
            target=self._handshake, args=(peer, timeout_s), name=f"hkv-handshake-{key}", daemon=True
        )
        self._by_key[key] = peer
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
        """Release the peer's prepped dlists and remove its remote agent."""
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
            peer.result = fetch_meta(self._ctx, peer.address, peer.rank, self._name, timeout_s, self._stop)
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
        payload, nixl_md = result
        peer.payload = payload
        if peer.validate is not None:
            try:
                peer.validate(payload)
            except Exception as exc:
                peer.findings = tuple(getattr(exc, "findings", ()))
                return f"handshake with {where} rejected: {exc}"
        try:
            peer.agent_name = self._agent.add_remote(nixl_md)
            for key, rows in peer.tables_fn(payload).items():
                table = DescTable(key, np.asarray(rows))
                peer.tables[key] = table
                peer.dlists[key] = self._agent.prep(peer.agent_name, table)
        except Exception as exc:  # NIXL errors and whatever the user's tables callback raises
            return f"handshake with {where} failed: {type(exc).__name__}: {exc}"
        return None
