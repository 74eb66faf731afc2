"""The demo's only contact with the planner: ``validated_planner``, one ``RankPlanner`` per posting rank.

``RankPlanner`` lives in :mod:`hybrid_kv.planner` (a library module the connector can use too); the demo
builds it from payloads the handshake has accepted.
"""

from __future__ import annotations

from collections.abc import Mapping

from .._core import RegionTable
from ..planner import RankPlanner

__all__ = ["RankPlanner", "validated_planner"]


def validated_planner(
    table: RegionTable, own_payload: bytes, payloads: Mapping[int, bytes], mode: str, *, coalesce: bool = True
) -> RankPlanner:
    """Validate every peer rank's payload against ours, then plan from exactly those bytes (each decoded once,
    in Rust, by ``PeerPlan(..., own_payload=...)``).

    Nothing is planned from a payload the handshake has not accepted; connect with the replies these payloads
    came in (``Endpoint.connect(..., reply=...)``) so the connection is bound to the same bytes.

    Raises:
        HandshakeError: a peer's payload is incompatible or malformed; the message starts with its rank and
            ``findings`` lists every failed check.
    """
    return RankPlanner(table, payloads, mode, coalesce=coalesce, own_payload=own_payload)
