"""Descriptor tables as the planner emits them: checking, sizing and index validation.

A table is a ``uint64`` C-contiguous ndarray of either ``(N, 3)`` rows ``(addr, len, dev)`` or
``(N, 5)`` strided rows ``(addr, len, dev, stride, count)``; a strided row stands for ``count``
descriptors of ``len`` bytes every ``stride`` bytes, and descriptor ids address the flattened list
(row 0's descriptors first). Expanding strided rows for a NIXL without the strided form is the Rust
core's ``hybrid_kv._core.expand_rows``. Nothing here talks to NIXL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .._core import check_transfer_ids
from ..errors import TransferError

__all__ = ["CheckedTable", "check_ids", "check_pairs", "registration_array"]

U64 = npt.NDArray[np.uint64]
I32 = npt.NDArray[np.int32]

_MAX_DESCS = 2**31 - 1  # NIXL indices are int32


def registration_array(descs: npt.ArrayLike) -> U64:
    """Return ``descs`` as a non-empty ``(N, 3)`` uint64 C-contiguous array ``(addr, len, dev)``.

    Raises:
        ValueError: wrong shape, non-integer dtype, negative values or an empty array.
    """
    arr = _as_u64(descs, "registration")
    if arr.shape[1] != 3:
        raise ValueError(f"registration descriptors must have 3 columns (addr, len, dev), got {arr.shape[1]}")
    if np.any(arr[:, 1] == 0):
        raise ValueError("registration descriptor with length 0")
    return arr


@dataclass(frozen=True)
class CheckedTable:
    """One checked descriptor table and the facts needed to validate ids against it (the transport's view of a
    table it was handed; the Rust core's tables are ``hybrid_kv._core`` objects).

    Attributes:
        key: the table's name (``"whole"``, ``"split:0"``...), used in error messages.
        rows: the ``(N, 3)`` or ``(N, 5)`` uint64 array as given.
        size: number of descriptors after flattening.
    """

    key: str
    rows: U64
    size: int = field(init=False)
    _ends: U64 = field(init=False, repr=False)  # one past each row's last flat id
    _lens: U64 = field(init=False, repr=False)  # each row's descriptor length

    def __post_init__(self) -> None:
        rows = _as_u64(self.rows, f"table {self.key!r}")
        if rows.shape[1] not in (3, 5):
            raise ValueError(f"table {self.key!r} must have 3 or 5 columns, got {rows.shape[1]}")
        if rows.shape[1] == 5 and np.any(rows[:, 4] == 0):
            raise ValueError(f"table {self.key!r} has a strided row with count 0")
        if rows.shape[1] == 5 and np.any(rows[:, 4] > _MAX_DESCS):
            raise ValueError(f"table {self.key!r} has a strided row of more than {_MAX_DESCS} descriptors")
        counts = rows[:, 4] if rows.shape[1] == 5 else np.ones(rows.shape[0], dtype=np.uint64)
        ends = np.cumsum(counts, dtype=np.uint64)  # no wrap: at most 2**31 rows of at most 2**31 each
        size = int(ends[-1])
        if size > _MAX_DESCS:
            raise ValueError(f"table {self.key!r} has {size} descriptors, more than the {_MAX_DESCS} NIXL can index")
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "_ends", ends)
        object.__setattr__(self, "_lens", np.ascontiguousarray(rows[:, 1]))

    @property
    def strided(self) -> bool:
        """Whether the table is in the ``(N, 5)`` strided form."""
        return bool(self.rows.shape[1] == 5)

    def lengths(self, ids: I32) -> npt.NDArray[np.uint64]:
        """Byte length of each descriptor in ``ids`` (ids must already be in range)."""
        row = np.searchsorted(self._ends, np.asarray(ids).astype(np.uint64), side="right")
        return self._lens[row]


def check_ids(ids: npt.ArrayLike, table: CheckedTable, side: str) -> I32:
    """Return ``ids`` as a 1-D int32 C-contiguous array after checking them against ``table``.

    Raises:
        TransferError: empty, not 1-D, non-integer, or an id outside ``[0, table.size)``; the
            message names the first offending id and the limit.
    """
    arr = _as_ids(ids, table, side)
    found = check_transfer_ids(table._ends, table._lens, arr)
    if found is not None:
        raise _out_of_range(side, table, int(arr[found[1]]))
    return arr


def check_pairs(
    local: CheckedTable, local_ids: npt.ArrayLike, remote: CheckedTable, remote_ids: npt.ArrayLike
) -> tuple[I32, I32]:
    """Return both id arrays as 1-D int32 C-contiguous arrays after checking each against its table, their
    counts against each other, and that each pair's descriptors have the same length (one Rust call for
    int32 arrays, as the planner emits them).

    Raises:
        TransferError: what ``check_ids`` raises for either side, different counts, or the first pair whose
            descriptor lengths differ (the message names both ids and lengths).
    """
    lids, rids = _as_ids(local_ids, local, "local"), _as_ids(remote_ids, remote, "remote")
    found = check_transfer_ids(local._ends, local._lens, lids, (remote._ends, remote._lens, rids))
    if found is None:
        return lids, rids
    what, k = found
    if what == "local":
        raise _out_of_range("local", local, int(lids[k]))
    if what == "remote":
        raise _out_of_range("remote", remote, int(rids[k]))
    if what == "count":
        raise TransferError(f"{lids.size} local ids but {rids.size} remote ids")
    raise TransferError(
        f"descriptor length mismatch at pair {k}: local {local.key!r}[{lids[k]}] is "
        f"{local.lengths(lids[k : k + 1])[0]} B, remote {remote.key!r}[{rids[k]}] is "
        f"{remote.lengths(rids[k : k + 1])[0]} B"
    )


def _as_ids(ids: npt.ArrayLike, table: CheckedTable, side: str) -> I32:
    """``ids`` as a non-empty 1-D int32 C-contiguous array; ids of a wider type are range-checked here, before
    narrowing them could wrap (int32 ids are range-checked by the caller, in Rust)."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0:
        raise TransferError(f"{side} ids for table {table.key!r} must be a non-empty 1-D array, got shape {arr.shape}")
    if arr.dtype == np.int32:
        return np.ascontiguousarray(arr)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TransferError(f"{side} ids for table {table.key!r} must be integers, got dtype {arr.dtype}")
    bad = (arr < 0) | (arr >= table.size)
    if np.any(bad):
        raise _out_of_range(side, table, int(arr[np.argmax(bad)]))
    return np.ascontiguousarray(arr, dtype=np.int32)


def _out_of_range(side: str, table: CheckedTable, first: int) -> TransferError:
    return TransferError(
        f"{side} descriptor id {first} out of range for table {table.key!r} of {table.size} descriptors"
    )


def _as_u64(descs: npt.ArrayLike, what: str) -> U64:
    arr = np.asarray(descs)
    if arr.ndim != 2 or arr.shape[0] == 0:
        raise ValueError(f"{what} must be a non-empty 2-D array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must have an integer dtype, got {arr.dtype}")
    if arr.dtype != np.uint64 and np.any(arr < 0):
        raise ValueError(f"{what} has negative values")
    return np.ascontiguousarray(arr, dtype=np.uint64)
