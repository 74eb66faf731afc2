"""The demo's only contact with the planner: one ``PeerPlan`` per active rank, turned into transport inputs.

The active rank (decode in pull mode, prefill in push mode) builds one plan against the peer engine from the
handshake payloads of the ranks it talks to; the plan gives the local tables to prep, each peer's remote
table, and per request the ``Transfer`` tuples the transport posts.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .._core import PeerPlan, RegionTable
from ..transport import Transfer

U64 = npt.NDArray[np.uint64]


def validated_planner(
    table: RegionTable, own_payload: bytes, payloads: dict[int, bytes], mode: str, *, coalesce: bool = True
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


class RankPlanner:
    """One active rank's plan against the peer engine."""

    def __init__(
        self,
        table: RegionTable,
        payloads: dict[int, bytes],
        mode: str,
        *,
        coalesce: bool = True,
        own_payload: bytes | None = None,
    ) -> None:
        """``payloads``: each peer rank's handshake payload (decoded once, in Rust, by ``PeerPlan``), validated
        against ``own_payload`` first when that is given."""
        ordered = [payloads[r] for r in sorted(payloads)]
        self.plan_ = PeerPlan(table, ordered, mode, coalesce=coalesce, own_payload=own_payload)
        self.local_tables: dict[str, U64] = {key: self.plan_.local_rows(key) for key in self.plan_.table_keys}
        self._index = {k: _RowIndex(v) for k, v in self.local_tables.items()}

    def remote_tables(self, rank: int) -> dict[str, U64]:
        """The tables to prep against peer ``rank`` (keyed as transfers name them)."""
        return {"remote": self.plan_.remote_rows(rank)}

    def plan(self, local_ids: list[list[int]], remote_ids: list[list[int]]) -> list[Transfer]:
        """One request's transfers (empty when there is nothing to move)."""
        plan = self.plan_.plan(local_ids, remote_ids)
        return [Transfer(t.remote_rank, t.local_table, "remote", t.local_ids, t.remote_ids) for t in plan.transfers]

    def transfer_bytes(self, t: Transfer) -> int:
        """Bytes a transfer moves (sum of its local descriptors' lengths)."""
        return self._index[t.local_key].bytes_of(t.local_ids)

    def table_shapes(self) -> dict[str, dict[str, int]]:
        """Every local table: strided rows as prepped and descriptors once expanded."""
        return {k: {"rows": int(v.shape[0]), "descriptors": self._index[k].count} for k, v in self.local_tables.items()}

    def remote_descriptors(self, rank: int) -> int:
        """Descriptors (expanded) of peer ``rank``'s table."""
        return _RowIndex(self.plan_.remote_rows(rank)).count


class _RowIndex:
    """Descriptor lengths of an ``(N, 3)`` or strided ``(N, 5)`` table without expanding it."""

    def __init__(self, rows: U64) -> None:
        counts = np.ones(rows.shape[0], dtype=np.int64) if rows.shape[1] == 3 else rows[:, 4].astype(np.int64)
        self.ends = np.cumsum(counts)
        self.lens = rows[:, 1].astype(np.int64)
        self.count = int(self.ends[-1]) if self.ends.size else 0

    def bytes_of(self, ids: npt.ArrayLike) -> int:
        """Total length of the descriptors ``ids`` (flattened ids)."""
        row = np.searchsorted(self.ends, np.asarray(ids, dtype=np.int64), side="right")
        return int(self.lens[row].sum())
