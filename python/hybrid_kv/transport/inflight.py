"""``InFlight``: an endpoint's live requests, from checking and posting to completion or failure.

Active requests (``post``) carry one NIXL xfer handle per transfer; each handle is released as soon
as its transfer is DONE or the request fails. A staged request (``post(..., stages=)``) is checked whole
but posts a transfer only once its stage is released (``release``): its done-notices are numbered over the
whole request, so the peer sees it done only when every stage landed, and a failure fails all of it.
Passive requests (``expect``) complete once enough senders' done-notices arrived (see ``inbox``). What
happens is collected in ``events`` until the endpoint's next ``poll()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import TransferError
from . import notifications
from .agent import CALL_ERRORS, DISCONNECT, Agent
from .peers import Peer, Peers
from .requests import NOT_YET, Check, Op, PeerKey, PollResult, RequestHandle, RequestState, Transfer
from .tables import CheckedTable, check_ids, check_pairs

__all__ = ["InFlight"]

log = logging.getLogger(__name__)


class InFlight:
    """The requests of one endpoint that are queued, posted or awaited, by request id.

    Args:
        agent: the endpoint's NIXL agent (local tables, xfer handles, notifications).
        peers: the endpoint's peers (their state, tables and dlists).
    """

    def __init__(self, agent: Agent, peers: Peers) -> None:
        self._agent = agent
        self._peers = peers
        self._by_id: dict[str, RequestHandle] = {}
        # failed request -> (its handles NIXL would not release yet, the peers to tell, the fail-notice)
        self._unsettled: dict[str, tuple[list[Any], list[str], bytes]] = {}
        self.events = PollResult()

    def take_events(self) -> PollResult:
        """What happened since the previous call."""
        events, self.events = self.events, PollResult()
        return events

    def xfer_count(self) -> int:
        """Live xfer handles held by requests."""
        return sum(x is not None for r in self._by_id.values() for x in r._xfers)

    # ------------------------------------------------------------------ new requests

    def ensure_new(self, request_id: str) -> None:
        """Raise ``TransferError`` if ``request_id`` is already in flight."""
        if request_id in self._by_id:
            raise TransferError(f"request id {request_id!r} is already in flight", request_id=request_id)

    def post(
        self,
        request_id: str,
        transfers: Iterable[Transfer | tuple[Any, ...]],
        op: Op,
        deadline_s: float,
        digests: Mapping[PeerKey, int] | None = None,
        check: Check | None = None,
        stages: Sequence[int] | None = None,
    ) -> RequestHandle:
        """Check and post an active request (see ``Endpoint.post``); its deadline starts once checked."""
        if op not in ("READ", "WRITE"):
            raise TransferError(f"op must be 'READ' or 'WRITE', got {op!r}", request_id=request_id)
        self.ensure_new(request_id)
        checked = tuple(self._check_transfer(request_id, t if type(t) is Transfer else Transfer(*t)) for t in transfers)
        if not checked:
            raise TransferError(f"request {request_id!r} has no transfers", request_id=request_id)
        stage = None
        if stages is not None:
            stage = tuple(int(k) for k in stages)
            if len(stage) != len(checked) or any(k < 0 for k in stage):
                raise TransferError(
                    f"request {request_id!r}: {len(stage)} stages for {len(checked)} transfers (one non-negative "
                    "stage per transfer)",
                    request_id=request_id,
                )
        req = RequestHandle(request_id, op, checked, time.monotonic() + deadline_s, _stage=stage)
        req.digests = dict(digests or {})
        req.check = check
        self._by_id[request_id] = req
        if all(self._peers[t.peer].state == "ready" for t in checked):
            self._start(req)
        return req

    def expect(
        self,
        request_id: str,
        deadline_s: float,
        senders: int,
        seen: Mapping[str, int | None],
        check: Check | None = None,
    ) -> RequestHandle:
        """Await a passive request from ``senders`` peers, ``seen`` of which already landed everything (with the
        digests their notices carried); ``check`` is run on the digests by sender once all landed."""
        req = RequestHandle(request_id, None, (), time.monotonic() + deadline_s, RequestState.POSTED, _senders=senders)
        req._seen = dict(seen)
        req.check = check
        self._by_id[request_id] = req
        self._complete_if_all_senders(req)
        return req

    def release(self, request_id: str, stages: int) -> bool:
        """Post the transfers of staged request ``request_id`` whose stage is below ``stages`` (those not
        posted yet; a request still waiting for a handshake posts them when it starts). Returns whether the
        request is staged and live (a finished or unknown request is left alone)."""
        req = self._by_id.get(request_id)
        if req is None or req.finished or req._stage is None:
            return False
        if stages > req._released:
            req._released = stages
            if req.state is RequestState.POSTED:
                self._post_due(req)
        return True

    def cancel(self, request_id: str, reason: str) -> bool:
        """Fail live request ``request_id`` now (telling its peers); whether it was live."""
        req = self._by_id.get(request_id)
        if req is None or req.finished:
            return False
        self.fail(req, reason)
        return True

    # ------------------------------------------------------------------ progress

    def progress(self) -> None:
        """Check every posted transfer, then fail the requests whose deadline passed."""
        for req in list(self._by_id.values()):
            if req.state is RequestState.POSTED and req.op is not None:
                self._check(req)
            elif req.checking and not req.finished:  # a passive request whose check said NOT_YET
                self._complete_if_all_senders(req)
        now = time.monotonic()
        for req in list(self._by_id.values()):
            if not req.finished and now > req.deadline:
                self.fail(req, self._deadline_reason(req))

    def start_queued(self, peer: PeerKey) -> None:
        """Start the requests that were waiting for ``peer``'s handshake (and now wait for no other)."""
        for req in self._live_for(peer):
            if req.state is RequestState.QUEUED:
                self._start_if_ready(req)

    def passive_landed(self, request_id: str, sender: str, digest: int | None = None) -> bool:
        """``sender`` landed all its transfers for ``request_id`` (its notices carried ``digest``); whether a
        passive request took it."""
        req = self._by_id.get(request_id)
        if req is None or req.op is not None or req.finished:
            return False
        req._seen[sender] = digest
        self._complete_if_all_senders(req)
        return True

    def passive_failed(self, request_id: str, sender: str, reason: str) -> bool:
        """``sender`` reported ``request_id`` failed: fail the passive request awaiting it; whether one did."""
        req = self._by_id.get(request_id)
        if req is not None and req.op is None and not req.finished:
            # a writer's fail-notice is its last word (``fail`` sends it only with nothing of its in flight)
            settled = len(set(req._seen) | {sender}) >= req._senders
            self.fail(req, f"peer {sender!r} failed: {reason}", notify=False, settled=settled)
            return True
        return False

    # ------------------------------------------------------------------ failure

    def fail_peer(self, peer: PeerKey, reason: str, notify: bool = True) -> None:
        """Fail every live request that moves data with ``peer``."""
        for req in self._live_for(peer):
            self.fail(req, reason, notify=notify)

    def fail_all(self, reason: str) -> None:
        """Fail every live request and forget them all (the endpoint is closing)."""
        for req in list(self._by_id.values()):
            if not req.finished:
                self.fail(req, reason)
        self._by_id.clear()

    def fail(self, req: RequestHandle, reason: str, notify: bool = True, settled: bool = False) -> None:
        """Fail ``req``: release its handles, report it, and (``notify``) tell its ready peers once nothing of it
        is in flight: a fail-notice is our last word on the request (a decode frees its blocks on it), so with a
        transfer NIXL would not cancel the notice waits until NIXL released it (``settle``). ``settled`` (passive
        requests; an active one is settled when every handle was released): see ``TransferError.settled``."""
        if req.finished:
            return
        failed = [t for i, t in enumerate(req.transfers) if not (i < len(req._done) and req._done[i])]
        handles = [x for x in req._xfers if x is not None]
        for i in range(len(req._xfers)):
            self._release(req, i)
        zombies = {id(z) for z in self._agent.zombies}
        stuck = [x for x in handles if id(x) in zombies]
        if req.op is not None:  # ours: settled when nothing of it is in flight any more
            settled = not stuck
        req.state = RequestState.FAILED
        req.error = TransferError(
            f"request {req.request_id!r} failed: {reason}", request_id=req.request_id, failed=failed, settled=settled
        )
        self._by_id.pop(req.request_id, None)
        self.events.failed.append(req.error)
        told: list[str] = []
        if notify and req.op is not None:
            peers = (self._peers.get(key) for key in req.peers)
            told = [p.agent_name for p in peers if p is not None and p.state == "ready" and p.agent_name is not None]
        msg = notifications.fail_message(req.request_id, reason.replace("\n", " "))
        if stuck:
            log.warning(
                "hybrid-kv: request %r failed with %d transfer(s) NIXL would not cancel; its peers are told once NIXL "
                "releases them",
                req.request_id,
                len(stuck),
            )
            self._unsettled[req.request_id] = (stuck, told, msg)
            return
        for name in told:
            self._agent.send_notif_quietly(name, msg)

    def settle(self) -> None:
        """Report (``events.settled``) the failed requests whose stuck handles NIXL has released since, and send
        their fail-notices now."""
        if not self._unsettled:
            return
        zombies = {id(z) for z in self._agent.zombies}
        for rid, (stuck, told, msg) in list(self._unsettled.items()):
            if not any(id(x) in zombies for x in stuck):
                del self._unsettled[rid]
                self.events.settled.append(rid)
                for name in told:
                    self._agent.send_notif_quietly(name, msg)

    # ------------------------------------------------------------------ checks before posting

    def _check_transfer(self, rid: str, t: Transfer) -> Transfer:
        peer = self._peers.get(t.peer)
        if peer is None:
            raise TransferError(f"peer {t.peer!r} is not connected", request_id=rid)
        if peer.state == "down":
            raise TransferError(f"peer {t.peer!r} is down: {peer.reason}", request_id=rid)
        local = self._agent.table(peer.scope, t.local_key)
        if local is None:
            known = self._agent.table_keys(peer.scope)
            where = "" if peer.scope is None else f" in scope {peer.scope!r} (peer {t.peer!r})"
            raise TransferError(f"unknown local table {t.local_key!r}{where}; known: {known}", request_id=rid)
        try:
            if peer.state == "ready":
                local_ids, remote_ids = self._check_remote(peer, t.remote_key, t.remote_ids, local, t.local_ids)
            else:  # remote ids are checked once the peer's tables are known
                local_ids, remote_ids = check_ids(t.local_ids, local, "local"), np.asarray(t.remote_ids)
        except TransferError as exc:
            raise TransferError(f"request {rid!r}: {exc}", request_id=rid) from None
        except (ValueError, TypeError, OverflowError) as exc:
            raise TransferError(f"request {rid!r}: bad descriptor ids: {exc}", request_id=rid) from exc
        return Transfer(t.peer, t.local_key, t.remote_key, local_ids, remote_ids)

    @staticmethod
    def _check_remote(
        peer: Peer, key: str, ids: npt.ArrayLike, local: CheckedTable, local_ids: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """Both sides' ids checked against their tables and pairwise (``check_pairs``)."""
        remote = peer.tables.get(key)
        if remote is None:
            raise TransferError(f"unknown remote table {key!r} of peer {peer.key!r}; known: {sorted(peer.tables)}")
        return check_pairs(local, local_ids, remote, ids)

    # ------------------------------------------------------------------ posting and checking

    def _start_if_ready(self, req: RequestHandle) -> None:
        if any(self._peers[t.peer].state != "ready" for t in req.transfers):
            return
        try:  # remote ids could not be checked while the handshake was pending
            checked = []
            for t in req.transfers:
                peer = self._peers[t.peer]
                local = self._agent.table(peer.scope, t.local_key)
                if local is None:  # its scope was removed while the request waited
                    raise TransferError(f"local table {t.local_key!r} of scope {peer.scope!r} was removed")
                local_ids, remote_ids = self._check_remote(peer, t.remote_key, t.remote_ids, local, t.local_ids)
                checked.append(t._replace(local_ids=local_ids, remote_ids=remote_ids))
        except TransferError as exc:
            self.fail(req, str(exc), notify=False)
            return
        req.transfers = tuple(checked)
        self._start(req)

    def _start(self, req: RequestHandle) -> None:
        per_peer: dict[PeerKey, int] = {}
        for t in req.transfers:
            per_peer[t.peer] = per_peer.get(t.peer, 0) + 1
        index = dict.fromkeys(per_peer, 0)
        n = len(req.transfers)
        req._xfers, req._posted, req._done = [None] * n, [False] * n, [False] * n
        req._notifs = []
        for t in req.transfers:  # numbered over the whole request: the peer counts every stage
            req._notifs.append(
                notifications.done_message(req.request_id, index[t.peer], per_peer[t.peer], req.digests.get(t.peer))
            )
            index[t.peer] += 1
        req.state = RequestState.POSTED
        self._post_due(req)

    def _post_due(self, req: RequestHandle) -> None:
        """Post every transfer of ``req`` that is due (all of them; for a staged request, those of released
        stages) and not posted yet: every handle is made before any is posted."""
        assert req.op is not None
        stage = req._stage
        due = [
            i for i in range(len(req.transfers)) if not req._posted[i] and (stage is None or stage[i] < req._released)
        ]
        if not due:
            return
        for i in due:
            t = req.transfers[i]
            peer = self._peers[t.peer]
            try:
                req._xfers[i] = self._agent.nixl.make_prepped_xfer(
                    req.op,
                    self._agent.dlist(peer.scope, t.local_key),
                    t.local_ids,
                    peer.dlists[t.remote_key],
                    t.remote_ids,
                    notif_msg=req._notifs[i],
                )
            except CALL_ERRORS as exc:
                self._on_nixl_error(req, t.peer, exc)
                return
        for i in due:
            req._posted[i] = True
            try:
                status = self._agent.nixl.transfer(req._xfers[i])
            except CALL_ERRORS as exc:
                self._on_nixl_error(req, req.transfers[i].peer, exc)
                return
            if not self._settle(req, i, status, posting=True):
                return
        self._finish_if_done(req)

    def _check(self, req: RequestHandle) -> None:
        for i, xfer in enumerate(req._xfers):
            if req._done[i] or xfer is None:
                continue
            try:
                status = self._agent.nixl.check_xfer_state(xfer)
            except CALL_ERRORS as exc:
                self._on_nixl_error(req, req.transfers[i].peer, exc)
                return
            if not self._settle(req, i, status, posting=False):
                return
        self._finish_if_done(req)

    def _settle(self, req: RequestHandle, i: int, status: str, *, posting: bool) -> bool:
        """Apply transfer ``i``'s NIXL status (from posting it or checking it); ``False`` once ``req`` failed."""
        if status == "ERR":
            peer = req.transfers[i].peer
            if posting:
                self.fail(req, f"posting transfer {i} to peer {peer!r} returned ERR")
            else:
                self.fail(req, f"transfer {i} to peer {peer!r} reported ERR")
            return False
        if status == "DONE":
            req._done[i] = True
            xfer = req._xfers[i]
            try:
                req.stats.add(self._agent.nixl.get_xfer_telemetry(xfer))
            except CALL_ERRORS:
                pass  # telemetry is a report, never a reason to fail a transfer that completed
            self._release(req, i)
        return True

    def _release(self, req: RequestHandle, i: int) -> None:
        xfer = req._xfers[i]
        if xfer is not None:
            req._xfers[i] = None
            self._agent.release_xfer(xfer)

    def _on_nixl_error(self, req: RequestHandle, peer_key: PeerKey, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}".strip()
        if DISCONNECT and isinstance(exc, DISCONNECT):  # fails every request with that peer, req included
            self._peers.mark_down(self._peers[peer_key], f"peer {peer_key!r} disconnected ({reason})")
            return
        self.fail(req, f"NIXL error with peer {peer_key!r}: {reason}")

    # ------------------------------------------------------------------ completion

    def _finish_if_done(self, req: RequestHandle) -> None:
        if all(req._done):
            self._verified_complete(req, ())

    def _complete_if_all_senders(self, req: RequestHandle) -> None:
        if len(req._seen) >= req._senders:
            self._verified_complete(req, (dict(req._seen),))

    def _verified_complete(self, req: RequestHandle, args: tuple[Any, ...]) -> None:
        """Complete ``req``, or fail it when its check finds a reason (a digest mismatch); a check that raises
        fails the request too, never the caller of ``poll()``."""
        if req.check is not None:
            try:
                reason = req.check(*args)
            except Exception as exc:  # noqa: BLE001 - a broken check fails its request only
                reason = f"verification failed: {type(exc).__name__}: {exc}"
            if reason is NOT_YET:  # asked again at the next progress, until the deadline
                req.checking = True
                return
            if reason is not None:
                self.fail(req, reason, notify=req.op is not None)
                return
        self._complete(req)

    def _complete(self, req: RequestHandle) -> None:
        req.state = RequestState.DONE
        del self._by_id[req.request_id]
        self.events.done.append(req.request_id)

    def _live_for(self, key: PeerKey) -> list[RequestHandle]:
        return [r for r in self._by_id.values() if not r.finished and key in r.peers]

    @staticmethod
    def _deadline_reason(req: RequestHandle) -> str:
        if req.checking:
            return "deadline exceeded waiting for its check (every byte landed; the peer's digest never came)"
        if req.op is None:
            return f"deadline exceeded: {len(req._seen)} of {req._senders} senders completed"
        if req.state is RequestState.QUEUED:
            return "deadline exceeded while waiting for a handshake"
        staged = "" if req._stage is None else f" ({req._released} stages released)"
        return f"deadline exceeded with {sum(req._done)} of {len(req.transfers)} transfers done{staged}"
