"""hybrid-kv: KV-cache transfer planning for P/D disaggregation of hybrid (MLA + SSM) models over NIXL.

The planning core is Rust (``hybrid_kv._core``); this package adds the torch adapter, the NIXL transport
and the command line. Everything that computes a descriptor or an id happens in Rust.
"""

from ._core import (
    HandshakeError,
    HybridKvError,
    LayoutError,
    MirrorPlan,
    PeerPlan,
    Plan,
    PlanError,
    RankTransfer,
    RegionTable,
    StreamSchedule,
    TransferError,
    __version__,
    compat_hash,
    decode_meta,
    encode_meta,
    handshake_findings,
    handshake_target_ranks,
    meta_fingerprint,
    plan_scenario,
    validate_handshake,
)
from .layout import build_region_table, layer, rank_layout

__all__ = [
    "HandshakeError",
    "HybridKvError",
    "LayoutError",
    "MirrorPlan",
    "PeerPlan",
    "Plan",
    "PlanError",
    "RankTransfer",
    "RegionTable",
    "StreamSchedule",
    "TransferError",
    "__version__",
    "compat_hash",
    "decode_meta",
    "encode_meta",
    "handshake_findings",
    "handshake_target_ranks",
    "meta_fingerprint",
    "plan_scenario",
    "validate_handshake",
    "build_region_table",
    "layer",
    "rank_layout",
]
