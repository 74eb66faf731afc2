"""What the scheduler half hands its workers each step (picklable plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["BlockIds", "HybridKvMetadata", "RecvReq", "SendLease"]

BlockIds = list[list[int]]


@dataclass
class RecvReq:
    """A decode request whose KV comes from a prefill engine (pull: READ it; push: register and await it).

    Every ``remote_*`` field comes from the prefill's verified ticket (``tickets``), never from the API
    client. ``refused``: the reason the request's ``kv_transfer_params`` were refused (its remote fields are
    then empty); the worker fails such a request at once, through the failed-load path.
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


@dataclass
class HybridKvMetadata(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]  # vLLM is untyped where it is not installed
    """One step's work for the workers.

    ``recv``: decode requests to load. ``send``: prefill requests whose blocks are now leased to a decode
    engine. ``aborted``: prefill requests freed without a transfer.
    """

    recv: dict[str, RecvReq] = field(default_factory=dict)
    send: dict[str, SendLease] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
