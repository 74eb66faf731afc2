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

from .errors import TransferError

__all__ = ["CheckedTable", "check_ids", "registration_array"]

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
    _ends: npt.NDArray[np.int64] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        rows = _as_u64(self.rows, f"table {self.key!r}")
        if rows.shape[1] not in (3, 5):
            raise ValueError(f"table {self.key!r} must have 3 or 5 columns, got {rows.shape[1]}")
        if rows.shape[1] == 5 and np.any(rows[:, 4] == 0):
            raise ValueError(f"table {self.key!r} has a strided row with count 0")
        counts = rows[:, 4].astype(np.int64) if rows.shape[1] == 5 else np.ones(rows.shape[0], dtype=np.int64)
        ends = np.cumsum(counts)
        size = int(ends[-1])
        if size > _MAX_DESCS:
            raise ValueError(f"table {self.key!r} has {size} descriptors, more than the {_MAX_DESCS} NIXL can index")
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "_ends", ends)

    @property
    def strided(self) -> bool:
        """Whether the table is in the ``(N, 5)`` strided form."""
        return bool(self.rows.shape[1] == 5)

    def lengths(self, ids: I32) -> npt.NDArray[np.uint64]:
        """Byte length of each descriptor in ``ids`` (ids must already be in range)."""
        row = np.searchsorted(self._ends, ids, side="right")
        lengths: npt.NDArray[np.uint64] = self.rows[row, 1]
        return lengths


def check_ids(ids: npt.ArrayLike, table: CheckedTable, side: str) -> I32:
    """Return ``ids`` as a 1-D int32 C-contiguous array after checking them against ``table``.

    Raises:
        TransferError: empty, not 1-D, non-integer, or an id outside ``[0, table.size)``; the
            message names the first offending id and the limit.
    """
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0:
        raise TransferError(f"{side} ids for table {table.key!r} must be a non-empty 1-D array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TransferError(f"{side} ids for table {table.key!r} must be integers, got dtype {arr.dtype}")
    bad = (arr < 0) | (arr >= table.size)
    if np.any(bad):
        first = int(arr[np.argmax(bad)])
        raise TransferError(
            f"{side} descriptor id {first} out of range for table {table.key!r} of {table.size} descriptors"
        )
    return np.ascontiguousarray(arr, dtype=np.int32)


def _as_u64(descs: npt.ArrayLike, what: str) -> U64:
    arr = np.asarray(descs)
    if arr.ndim != 2 or arr.shape[0] == 0:
        raise ValueError(f"{what} must be a non-empty 2-D array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must have an integer dtype, got {arr.dtype}")
    if arr.dtype != np.uint64 and np.any(arr < 0):
        raise ValueError(f"{what} has negative values")
    return np.ascontiguousarray(arr, dtype=np.uint64)
