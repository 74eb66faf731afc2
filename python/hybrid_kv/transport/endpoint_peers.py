"""An endpoint's connections to its peers: the handshake (``begin_connect``, ``connect``), ``disconnect``, and
what is known of each peer (the state machine itself is ``peers.Peers``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy.typing as npt

from ..errors import HandshakeError
from .endpoint_base import EndpointBase, locked
from .requests import PeerKey
from .seconds import check_seconds
from .side_channel import MetaReply

__all__ = ["PeerConnections"]


class PeerConnections(EndpointBase):
    """The peer methods of ``Endpoint``."""

    @locked
    def begin_connect(
        self,
        peer: PeerKey,
        address: str,
        tables: Callable[[bytes], Mapping[str, npt.ArrayLike]],
        *,
        rank: int = 0,
        validate: Callable[[bytes], object] | None = None,
        timeout_s: float = 5.0,
        expected_payload: bytes | None = None,
        expected_name: str | None = None,
        reply: MetaReply | None = None,
        local_scope: str | None = None,
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
            expected_payload: if given, the peer must serve exactly these bytes (e.g. the payload a plan
                was built from in an earlier fetch), else it is refused.
            expected_name: if given, the peer must be the endpoint of that name (its authenticated
                side-channel name, which is also its NIXL agent name), else it is refused.
            reply: the peer's reply already fetched (``channel_client.fetch_reply``, authenticated): the
                handshake runs from it instead of fetching again, so validate, tables and the loaded agent
                all see exactly the bytes the caller planned from (one fetch per peer).
            local_scope: the named local table scope (``add_local_tables``) this peer's transfers post from;
                ``None``: the endpoint's own tables.

        The peer's side-channel name must equal the name of the NIXL agent its metadata loads, and an
        agent may be connected under one key only: a second key is refused (naming the first) unless the
        first is down, whose agent is then unloaded (a restarted peer). A failed handshake fails every
        request waiting on it. Reconnecting an existing key drops the old connection first (its prepped
        tables are stale once the remote agent is removed).
        """
        self._check_open()
        timeout_s = check_seconds(timeout_s, "timeout_s")
        if local_scope is not None and local_scope not in self._agent.scopes:
            raise ValueError(f"endpoint {self.name!r}: unknown local table scope {local_scope!r}")
        old = self._peers.pop(peer)
        if old is not None:
            self._requests.fail_peer(old.key, f"peer {peer!r} is reconnecting")
            self._peers.drop(old)
        self._peers.begin(
            peer, address, tables, rank, validate, timeout_s, expected_payload, expected_name, reply, local_scope
        )

    @locked
    def connect(
        self,
        peer: PeerKey,
        address: str,
        tables: Callable[[bytes], Mapping[str, npt.ArrayLike]],
        *,
        rank: int = 0,
        validate: Callable[[bytes], object] | None = None,
        timeout_s: float = 5.0,
        expected_payload: bytes | None = None,
        expected_name: str | None = None,
        reply: MetaReply | None = None,
        local_scope: str | None = None,
    ) -> bytes:
        """Connect to ``peer`` and wait (driving progress) until ready; returns the peer's payload.

        Arguments as ``begin_connect``.

        Raises:
            HandshakeError: timeout, protocol mismatch, failed authentication (``peer at ADDR failed
                authentication``), the peer's error, a rejected or unexpected payload or name, an agent
                already connected under another key, or NIXL refusing the peer's metadata or tables. Its
                ``findings`` attribute lists what ``validate`` found, as ``(check, local, remote, detail)``,
                when that rejected the payload with a ``HandshakeError`` (``validate_handshake`` does); it is
                empty otherwise.
        """
        self.begin_connect(
            peer,
            address,
            tables,
            rank=rank,
            validate=validate,
            timeout_s=timeout_s,
            expected_payload=expected_payload,
            expected_name=expected_name,
            reply=reply,
            local_scope=local_scope,
        )
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

    @locked
    def disconnect(self, peer: PeerKey, reason: str = "was disconnected") -> None:
        """Forget ``peer``: fail its live requests (telling it), release its remote tables and unload its NIXL
        agent. Nothing else is touched (its local table scope stays until ``remove_local_tables``). Unknown
        peers are ignored."""
        self._check_open()
        old = self._peers.pop(peer)
        if old is not None:
            self._requests.fail_peer(old.key, f"peer {peer!r} {reason}")
            self._peers.drop(old)

    @locked
    def peer_state(self, peer: PeerKey) -> tuple[str, str]:
        """``(state, reason)`` of ``peer``: state is ``connecting``, ``ready`` or ``down``."""
        state = self._peers.get(peer)
        if state is None:
            return ("unknown", f"peer {peer!r} was never connected")
        return (state.state, state.reason)

    @locked
    def remote_agent(self, peer: PeerKey) -> str | None:
        """The NIXL agent name of a connected peer (senders in ``PollResult`` use these names)."""
        state = self._peers.get(peer)
        return None if state is None else state.agent_name

    @locked
    def peer_of(self, agent_name: str) -> PeerKey | None:
        """The key of the peer connected to agent ``agent_name`` (at most one), or ``None``.

        Use it to check that a ``ControlMessage.sender`` or a notification's sender is the peer a request
        belongs to.
        """
        holder = self._peers.holder(agent_name)
        return None if holder is None else holder.key
