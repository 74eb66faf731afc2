"""The core's limits as Python constants: what the command line bounds while parsing and what the pre-flight
report (:mod:`hybrid_kv.preflight`) checks before it sizes anything. Each mirrors a Rust constant."""

from __future__ import annotations

__all__ = ["MAX_BLOCK_TOKENS", "MAX_GROUPS", "MAX_NUM_BLOCKS", "MAX_TP_SIZE"]

MAX_TP_SIZE = 1024
"""Largest TP size (``MAX_TP_SIZE`` in ``rust/core/tp.rs``; TP mappings allocate per rank)."""
MAX_NUM_BLOCKS = 2**31 - 1
"""Most logical blocks in a pool: descriptor ids are int32 (``MAX_NUM_BLOCKS`` in ``rust/core/scenario/bounds.rs``)."""
MAX_BLOCK_TOKENS = 2**20
"""Largest logical or kernel block in tokens (``MAX_BLOCK_TOKENS`` in ``rust/core/scenario/bounds.rs``)."""
MAX_GROUPS = 64
"""Most KV-cache groups (``MAX_GROUPS`` in ``rust/core/handshake/wellformed.rs``): a ticket, a registration or a
claim naming more is refused."""
