"""The core's limits, as the native module defines them (``rust/py/limits.rs`` exports the Rust constants): what
the command line bounds while parsing, what the pre-flight report (:mod:`hybrid_kv.preflight`) checks before it sizes
anything, and what the connector's wire formats bound (a ticket, a registration or a claim naming more groups than
``MAX_GROUPS`` is refused)."""

from __future__ import annotations

from ._core import MAX_BLOCK_TOKENS, MAX_GROUPS, MAX_NUM_BLOCKS, MAX_TP_SIZE

__all__ = ["MAX_BLOCK_TOKENS", "MAX_GROUPS", "MAX_NUM_BLOCKS", "MAX_TP_SIZE"]
