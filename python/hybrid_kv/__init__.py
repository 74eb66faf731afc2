"""hybrid-kv: KV-cache transfer planning for P/D disaggregation of hybrid (MLA + SSM) models over NIXL.

The planning core is Rust (``hybrid_kv._core``); this package adds the torch adapter, the NIXL transport
and the command line. Everything that computes a descriptor or an id happens in Rust. Every exception is in
``hybrid_kv.errors``, rooted at ``HybridKvError``.
"""

from ._core import (
    MirrorPlan,
    PeerPlan,
    Plan,
    RankTransfer,
    RegionTable,
    StreamSchedule,
    __version__,
    compat_hash,
    decode_meta,
    handshake_findings,
    handshake_target_ranks,
    meta_fingerprint,
    plan_scenario,
    validate_handshake,
)
from .errors import HandshakeError, HybridKvError, LayoutError, PlanError
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
    "__version__",
    "build_region_table",
    "compat_hash",
    "decode_meta",
    "handshake_findings",
    "handshake_target_ranks",
    "layer",
    "meta_fingerprint",
    "plan_scenario",
    "rank_layout",
    "validate_handshake",
]
