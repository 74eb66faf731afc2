"""One posting rank's planner against a peer engine, as transport inputs: ``RankPlanner``.

The posting rank (decode in pull mode, prefill in push mode) builds one ``PeerPlan`` against the peer engine
from the handshake payloads of the ranks it talks to; the planner gives the local tables to prep, each peer's
remote table, and per request the ``Transfer`` tuples the transport posts. Every count (descriptors, bytes)
comes from the Rust core; nothing here looks inside a table. Used by the demo workers and usable by any
connector that drives ``hybrid_kv.transport``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from ._core import PeerPlan, RegionTable, StreamSchedule
from .transport.requests import Transfer

__all__ = ["RankPlanner"]

U64 = npt.NDArray[np.uint64]


class RankPlanner:
    """One posting rank's plan against the peer engine.

    Attributes:
        plan_: the ``PeerPlan`` (tables and mapping, built once).
        local_tables: every local table as strided ``(rows, 5)`` rows, keyed as transfers name them.
    """

    def __init__(
        self,
        table: RegionTable,
        payloads: Mapping[int, bytes],
        mode: str,
        *,
        coalesce: bool = True,
        own_payload: bytes | None = None,
        expected_engine_id: str | None = None,
        expected_tp_size: int | None = None,
    ) -> None:
        """``payloads``: each peer rank's handshake payload (decoded once, in Rust, by ``PeerPlan``), validated
        against ``own_payload`` first when that is given; ``expected_engine_id`` and ``expected_tp_size``, when
        given, are what the peer engine must say it is.

        Raises:
            HandshakeError: a payload does not decode, or is incompatible with ``own_payload``.
            PlanError: the two sides cannot be planned together.
        """
        ordered = [payloads[r] for r in sorted(payloads)]
        self.plan_ = PeerPlan(
            table,
            ordered,
            mode,
            coalesce=coalesce,
            own_payload=own_payload,
            expected_engine_id=expected_engine_id,
            expected_tp_size=expected_tp_size,
        )
        self.local_tables: dict[str, U64] = {key: self.plan_.local_rows(key) for key in self.plan_.table_keys}

    def remote_tables(self, rank: int) -> dict[str, U64]:
        """The tables to prep against peer ``rank`` (keyed as transfers name them)."""
        return {"remote": self.plan_.remote_rows(rank)}

    def plan(self, local_ids: Sequence[Sequence[int]], remote_ids: Sequence[Sequence[int]]) -> list[Transfer]:
        """One request's transfers (empty when there is nothing to move)."""
        plan = self.plan_.plan(local_ids, remote_ids)
        return [Transfer(t.remote_rank, t.local_table, "remote", t.local_ids, t.remote_ids) for t in plan.transfers]

    def plan_staged(
        self, local_ids: Sequence[Sequence[int]], remote_ids: Sequence[Sequence[int]], schedule: StreamSchedule
    ) -> list[list[Transfer]]:
        """One request's transfers cut into ``schedule``'s stages (``PeerPlan.plan_staged``): one list per stage,
        together exactly ``plan``'s id pairs, with the same tables."""
        return [
            [Transfer(t.remote_rank, t.local_table, "remote", t.local_ids, t.remote_ids) for t in p.transfers]
            for p in self.plan_.plan_staged(local_ids, remote_ids, schedule)
        ]

    def transfer_bytes(self, t: Transfer) -> int:
        """Bytes a transfer moves (its local descriptors' lengths, summed in Rust)."""
        return self.plan_.local_bytes(t.local_key, t.local_ids)

    def table_shapes(self) -> dict[str, dict[str, int]]:
        """Every local table: strided rows as prepped and descriptors once expanded."""
        return {
            k: {"rows": int(v.shape[0]), "descriptors": self.plan_.table_descriptors(k)}
            for k, v in self.local_tables.items()
        }

    def remote_descriptors(self, rank: int) -> int:
        """Descriptors (expanded) of peer ``rank``'s table."""
        return self.plan_.remote_table_descriptors(rank)
