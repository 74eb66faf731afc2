"""An endpoint's requests: post (whole or staged), release, cancel, await a peer's push (``expect``), and the
``poll`` that reports what happened (the bookkeeping itself is ``inflight.InFlight``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import TransferError
from .endpoint_base import EndpointBase, locked
from .raw import RawResult, post_raw
from .requests import Check, Op, PeerKey, PollResult, RequestHandle, Transfer
from .seconds import check_seconds

__all__ = ["RequestMethods"]


class RequestMethods(EndpointBase):
    """The request methods of ``Endpoint``."""

    @locked
    def post(
        self,
        request_id: str,
        transfers: Iterable[Transfer | tuple[Any, ...]],
        op: Op,
        deadline_s: float,
        *,
        digests: Mapping[PeerKey, int] | None = None,
        check: Check | None = None,
        stages: Sequence[int] | None = None,
    ) -> RequestHandle:
        """Check and post a request: every transfer READs (pull) or WRITEs (push) with one peer.

        Ids are checked against the tables (and descriptor lengths pairwise) before anything is
        posted. A request to a peer still connecting is queued until its handshake ends.

        Verified transfers (``hybrid_kv.verify``): ``digests`` gives, per peer, this side's digest of the rank
        pair's moves, carried by every done-notice of the request to that peer (push: the decode compares it
        with its own); ``check`` is called once every transfer is DONE, and a reason it returns (a digest
        mismatch) fails the request instead of completing it (pull: this side compares its digest with the
        peer's). A check that raises fails the request with the exception as the reason; one that answers
        ``NOT_YET`` (the peer's digest is still on its way) is asked again at every ``poll()`` until it decides
        or the deadline passes.

        ``stages``: one stage index per transfer makes the request *staged*: it is checked now, but a
        transfer is posted only once ``release`` released its stage. Done-notices are numbered over the whole
        request, so the peer sees it done once every stage landed; a failure (or the deadline, which runs from
        now) fails the whole request.

        Raises:
            TransferError: bad op, duplicate request id, unknown peer or table, peer down, an id out
                of range (the message names it and the limit), descriptor lengths that differ, or stages that
                are not one non-negative index per transfer.
        """
        self._check_open()
        deadline_s = check_seconds(deadline_s, "deadline_s")
        return self._requests.post(request_id, transfers, op, deadline_s, digests, check, stages)

    @locked
    def release(self, request_id: str, stages: int) -> bool:
        """Post the transfers of staged request ``request_id`` whose stage is below ``stages`` (any thread).

        Returns whether the request is a live staged request (``False``: unknown, finished or failed; nothing
        is posted). A NIXL error fails the request, reported by the next ``poll()`` as any failure.
        """
        self._check_open()
        return self._requests.release(request_id, stages)

    @locked
    def cancel(self, request_id: str, reason: str) -> bool:
        """Fail live request ``request_id`` now, as any failure (its ready peers are told; the next ``poll()``
        reports it); whether it was live. Its posted transfers are cancelled; one NIXL will not cancel may still
        land, and then its peers are not told (a fail-notice says nothing of ours is in flight)."""
        self._check_open()
        return self._requests.cancel(request_id, reason)

    @locked
    def post_raw(self, transfers: Sequence[tuple[Transfer, bytes]], op: Op, timeout_s: float = 60.0) -> RawResult:
        """Measurement only (the NIXL floor): post ``(transfer, tag)`` pairs with bare NIXL calls on the handles
        this endpoint prepped, and wait for all of them (``transport.raw``). Transfers are not checked: pass
        only what ``post`` accepted. It moves real bytes.

        Raises:
            TransferError: an unknown or unready peer or table, or the failure ``raw.post_raw`` reports.
        """
        self._check_open()
        items = []
        for t, tag in transfers:
            peer = self._peers.get(t.peer)
            if peer is None or peer.state != "ready":
                raise TransferError(f"peer {t.peer!r} is not ready")
            try:
                local, remote = self._agent.dlist(peer.scope, t.local_key), peer.dlists[t.remote_key]
            except KeyError as exc:
                raise TransferError(f"no table {exc} for peer {t.peer!r}") from None
            items.append((local, t.local_ids, remote, t.remote_ids, tag))
        return post_raw(self._agent, items, op, timeout_s)

    @locked
    def progress(self) -> None:
        """Progress posted transfers and the side channel's queue without taking the events (any thread):
        what happened stays for the next ``poll()``. Transports that move bytes in software (UCX over TCP)
        move them only while someone progresses the agent."""
        if not self._closed:
            self._progress()

    @locked
    def expect(
        self,
        request_id: str,
        deadline_s: float,
        senders: int = 1,
        *,
        writers: Iterable[str] | None = None,
        check: Check | None = None,
    ) -> RequestHandle:
        """Await a peer-initiated request (push mode: the peer WRITEs into us).

        It completes once ``senders`` distinct peers have each landed all their transfers for
        ``request_id`` (reported in ``PollResult.done``); it fails on their failure notice or the deadline.
        ``writers``: the NIXL agent names of exactly the peers that write it (``senders`` is then their
        number): it completes once each of them landed everything, and only their notices count (anyone
        else's done- or fail-notices for ``request_id`` are dropped).
        ``check``: called once all landed with the digest each sender's notices carried (``None``: none;
        ``inbox.INCONSISTENT``: notices that disagree); a reason it returns fails the request instead.
        A fail-notice for ``request_id`` (from one of ``writers``, when given) that arrived before this call fails
        it at once (reported by the next ``poll()``).
        """
        self._check_open()
        deadline_s = check_seconds(deadline_s, "deadline_s")
        self._requests.ensure_new(request_id)
        names = None if writers is None else frozenset(writers)
        if names is None:
            seen = self._inbox.take_landed(request_id)
            handle = self._requests.expect(request_id, deadline_s, senders, seen, check)
        else:
            seen = self._inbox.expect_from(request_id, names, deadline_s)
            handle = self._requests.expect(request_id, deadline_s, len(names), seen, check)
        early = self._inbox.take_failed(request_id, names)
        if early is not None:  # its fail-notice overtook whatever made us await it
            self._requests.passive_failed(request_id, *early)
        return handle

    @locked
    def poll(self) -> PollResult:
        """Progress everything once and return what happened since the last call (never blocks)."""
        self._check_open()
        self._progress()
        return self._requests.take_events()
