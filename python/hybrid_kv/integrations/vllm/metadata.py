"""What the scheduler half hands its workers each step (picklable plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...connector_core.requests import BlockIds, RecvReq, SendLease, StreamSend

__all__ = ["BlockIds", "HybridKvMetadata", "RecvReq", "SendLease", "StreamSend"]


@dataclass
class HybridKvMetadata(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]  # vLLM is untyped where it is not installed
    """One step's work for the workers.

    ``recv``: decode requests to load. ``send``: prefill requests whose blocks are now leased to a decode
    engine. ``aborted``: prefill requests freed without a transfer. ``stream``: prefill requests whose last
    prefill step this is, with a capability (they may stream). ``stream_ended``: such requests that ended
    without a lease (aborted): their blocks are held until what was posted for them ended.
    """

    recv: dict[str, RecvReq] = field(default_factory=dict)
    send: dict[str, SendLease] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    stream: dict[str, StreamSend] = field(default_factory=dict)
    stream_ended: set[str] = field(default_factory=set)
