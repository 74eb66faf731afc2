"""``SharedPreps``: local tables that several scopes hold, checked and prepped once.

Every peer engine's ``PeerPlan`` of a rank holds the same coalesced base table, and ``PeerPlan.local_rows``
returns it as one read-only array (the same object from every plan). An agent that gets that array again for
another scope reuses the first scope's check and prepped dlist instead of checking and prepping its rows again,
and releases the dlist with the last scope holding it. Only read-only arrays are shared: a table handed over
writable could be changed between two scopes. Nothing here talks to NIXL; the agent preps and releases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .tables import CheckedTable

__all__ = ["SharedPreps"]


@dataclass
class _Shared:
    table: CheckedTable  # its rows are the shared array, held so that id() is not reused while it lives
    dlist: Any
    holders: int


class SharedPreps:
    """The prepped dlists of read-only tables, by array identity, with the number of scopes holding each."""

    def __init__(self) -> None:
        self._by_id: dict[int, _Shared] = {}

    def acquire(self, rows: object) -> tuple[CheckedTable, Any] | None:
        """The check and dlist of ``rows`` if that very array was prepped before (now held once more), else
        ``None``."""
        entry = self._by_id.get(id(rows))
        if entry is None or entry.table.rows is not rows:
            return None
        entry.holders += 1
        return entry.table, entry.dlist

    def add(self, given: object, table: CheckedTable, dlist: Any) -> None:
        """Record a first check and dlist, held by one scope, when ``given`` is a read-only ndarray the check
        kept as it was (anything else is not shared)."""
        if isinstance(given, np.ndarray) and not given.flags.writeable and table.rows is given:
            self._by_id[id(given)] = _Shared(table, dlist, 1)

    def shared(self, table: CheckedTable) -> bool:
        """Whether ``table`` is a shared one (``release`` decides when its dlist goes)."""
        entry = self._by_id.get(id(table.rows))
        return entry is not None and entry.table is table

    def release(self, table: CheckedTable) -> Any:
        """One scope less holds shared ``table``; returns its dlist when that was the last (to be released),
        else ``None``."""
        key = id(table.rows)
        entry = self._by_id[key]
        entry.holders -= 1
        if entry.holders > 0:
            return None
        del self._by_id[key]
        return entry.dlist

    def __len__(self) -> int:
        return len(self._by_id)
