"""What several sections share: a NIXL agent, the ``PeerPlan`` binding and its tables, KiB."""

from __future__ import annotations

from typing import Any

import hybrid_kv as hk


def nixl_agent(name: str, telemetry: bool = False) -> Any:
    """A NIXL agent on UCX with its progress thread off; ``telemetry`` turns on per-transfer telemetry."""
    from nixl._api import nixl_agent as agent_cls
    from nixl._api import nixl_agent_config

    # Progress thread off: it busy-polls and would steal one of the two cores.
    return agent_cls(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"], capture_telemetry=telemetry))


KIB = 1024  # the "K" of request lengths: a 4K-token request is 4 * KIB tokens


def peer_plan_binding() -> Any:
    """``hybrid_kv.PeerPlan`` (None until the plan binding is built into the extension)."""
    return getattr(hk, "PeerPlan", None) or getattr(hk._core, "PeerPlan", None)


def local_tables(peer: Any) -> list[tuple[str, Any]]:
    """Every local table of a ``PeerPlan`` as strided rows, keyed as transfers name them."""
    return [(k, peer.local_rows(k)) for k in peer.table_keys]
