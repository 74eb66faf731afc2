"""The core's limits, as the native module defines them (``rust/py/limits.rs`` exports the Rust constants): what
the command line bounds while parsing, what the pre-flight report (:mod:`hybrid_kv.preflight`) checks before it sizes
anything, and what the connector's wire formats bound (a ticket, a registration or a claim naming more groups than
``MAX_GROUPS`` is refused); and ``MAX_REQUEST_ID_CHARS``, the longest request id any message may carry."""

from __future__ import annotations

from ._core import MAX_BLOCK_TOKENS, MAX_GROUPS, MAX_NUM_BLOCKS, MAX_TP_SIZE

__all__ = ["MAX_BLOCK_TOKENS", "MAX_GROUPS", "MAX_NUM_BLOCKS", "MAX_REQUEST_ID_CHARS", "MAX_TP_SIZE"]

MAX_REQUEST_ID_CHARS = 1024
"""The longest request id a control message, claim, ticket or NIXL notification may carry."""
