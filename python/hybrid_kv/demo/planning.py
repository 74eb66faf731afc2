"""The demo's only contact with the planner: one ``PeerPlan`` per active rank, turned into transport inputs.

The active rank (decode in pull mode, prefill in push mode) builds one plan against the peer engine from the
handshake payloads of the ranks it talks to; the plan gives the local tables to prep, each peer's remote
table, and per request the ``Transfer`` tuples the transport posts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .._core import PeerPlan, RegionTable, handshake_target_ranks
from ..transport import Transfer

U64 = npt.NDArray[np.uint64]


def handshake_targets(rank: int, tp: int, remote_tp: int) -> list[int]:
    """The peer ranks a rank exchanges data with (reference C.2)."""
    return list(handshake_target_ranks(rank, tp, remote_tp))


class RankPlanner:
    """One active rank's plan against the peer engine."""

    def __init__(self, table: RegionTable, payloads: dict[int, bytes], mode: str) -> None:
        self.plan_ = PeerPlan(table, [payloads[r] for r in sorted(payloads)], mode)
        self.local_tables: dict[str, U64] = dict(self.plan_.local_tables())
        self._lengths = {k: _lengths(v) for k, v in self.local_tables.items()}

    def remote_tables(self, rank: int) -> dict[str, U64]:
        """The tables to prep against peer ``rank`` (keyed as transfers name them)."""
        return {"remote": self.plan_.remote_table(rank)}

    def plan(self, local_ids: list[list[int]], remote_ids: list[list[int]]) -> list[Transfer]:
        """One request's transfers (empty when there is nothing to move)."""
        plan: Any = self.plan_.plan(local_ids, remote_ids)
        return [
            Transfer(int(t.remote_rank), str(t.local_table), "remote", t.local_ids, t.remote_ids)
            for t in plan.transfers
        ]

    def transfer_bytes(self, t: Transfer) -> int:
        """Bytes a transfer moves (sum of its local descriptors' lengths)."""
        return int(self._lengths[t.local_key][np.asarray(t.local_ids, dtype=np.int64)].sum())

    def table_shapes(self) -> dict[str, dict[str, int]]:
        """Every local table: strided rows as prepped and descriptors once expanded."""
        return {
            k: {"rows": int(v.shape[0]), "descriptors": int(self._lengths[k].size)}
            for k, v in self.local_tables.items()
        }

    def remote_descriptors(self, rank: int) -> int:
        """Descriptors (expanded) of peer ``rank``'s table."""
        return int(_lengths(self.plan_.remote_table(rank)).size)


def _lengths(rows: U64) -> npt.NDArray[np.uint64]:
    """Length of every descriptor of a table, in flattened id order."""
    if rows.shape[1] == 3:
        return rows[:, 1].copy()
    return np.repeat(rows[:, 1], rows[:, 4].astype(np.int64))
