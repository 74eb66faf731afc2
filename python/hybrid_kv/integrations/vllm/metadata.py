"""What the scheduler half hands its workers each step (picklable plain data) and the control messages
workers exchange over hybrid-kv's side channel."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["HybridKvMetadata", "RecvReq", "decode_control", "encode_control"]

BlockIds = list[list[int]]


@dataclass
class RecvReq:
    """A decode request whose KV comes from a prefill engine (pull: READ it; push: register and await it)."""

    request_id: str
    local_block_ids: BlockIds
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: BlockIds
    remote_host: str
    remote_port: int
    remote_tp_size: int
    # wall-clock time (``time.time()``) after which the prefill engine may free the remote blocks (its lease);
    # a read that ends later (less ``LEASE_MARGIN_S``) may have read reused blocks and counts as failed
    lease_expires_at: float | None = None


@dataclass
class HybridKvMetadata(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]  # vLLM is untyped where it is not installed
    """One step's work for the workers.

    ``recv``: decode requests to load. ``send``: prefill requests whose blocks are now leased to a decode
    engine (``(block ids per group, lease seconds)``). ``aborted``: prefill requests freed without a transfer.
    """

    recv: dict[str, RecvReq] = field(default_factory=dict)
    send: dict[str, tuple[BlockIds, float]] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)


def encode_control(kind: str, **fields: Any) -> bytes:
    return json.dumps({"hkv_vllm": kind, **fields}, separators=(",", ":")).encode()


def decode_control(payload: bytes) -> dict[str, Any] | None:
    """A control message of this connector, or ``None`` for anything else (malformed included)."""
    try:
        msg = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None
    return msg if isinstance(msg, dict) and isinstance(msg.get("hkv_vllm"), str) else None
