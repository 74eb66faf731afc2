"""What a prefill or decode engine hands its transfer workers about one request (plain, picklable data; no vLLM)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlockIds", "RecvReq", "SendLease", "StreamSend"]

BlockIds = list[list[int]]


@dataclass
class RecvReq:
    """A decode request whose KV comes from a prefill engine (pull: READ it; push: register and await it).

    Every ``remote_*`` field comes from the prefill's verified ticket (``tickets``), never from the API
    client, except for a concurrent push (``cap`` set): the router's capability and the prefill engine's address,
    checked by ``params`` (the decode then only registers its own blocks there, ``control.StreamReg``).
    ``refused``: the reason the request's ``kv_transfer_params`` were refused (its remote fields are then empty);
    the worker fails such a request at once, through the failed-load path.
    """

    request_id: str
    local_block_ids: BlockIds
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: BlockIds
    remote_host: str
    remote_port: int
    remote_tp_size: int
    # wall-clock time (``time.time()``) after which the prefill engine may free the remote blocks (its lease);
    # a read that ends later (less ``LEASE_MARGIN_S``) may have read reused blocks and counts as failed. A
    # decode still connecting renews it (``control.Renew``), up to ``max_lease_expires_at``.
    lease_expires_at: float | None = None
    max_lease_expires_at: float | None = None
    grant: bytes = b""  # the ticket's grant: every control message about this request carries it
    refused: str | None = None
    verify: bool = False  # check this request's transfer digests end to end (the scheduler's ``verify`` choice)
    cap: bytes = b""  # a concurrent push's capability (then no ticket, remote_request_id and remote_block_ids)
    ticket: str = (
        ""  # the verified ticket's text: claims carry it (the prefill confirms a lease it was not told of yet)
    )
    # the request is gone here (aborted or rejected before it loaded): only tell the prefill engine to free its
    # blocks; vLLM no longer knows the request, so it is never reported finished or failed
    release_only: bool = False

    @classmethod
    def refusal(cls, request_id: str, local_block_ids: BlockIds, reason: str) -> RecvReq:
        return cls(request_id, local_block_ids, "", "", [], "", 0, 0, refused=reason)


@dataclass
class SendLease:
    """A prefill request whose blocks are leased to a decode engine: what its ticket granted."""

    block_ids: BlockIds
    lease_s: float
    grant: bytes
    max_extension_s: float
    cap: bytes = b""  # the request's concurrent-push capability: a decode's ``StreamReg`` with it registers


@dataclass
class StreamSend:
    """A prefill request in its last prefill step that a decode may have registered for (concurrent push): the
    worker may post its KV layer by layer during this step's forward (``stream``)."""

    cap: bytes
    block_ids: BlockIds  # its transferable blocks per transfer group, as the lease will hold them
