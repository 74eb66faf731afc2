"""Byte patterns the kit fills KV pools with, and the byte-exact check of a pool, both run where the memory is.

Every byte of a rank's pool holds ``byte(seed, address)``: a hash of the rank's seed and the byte's own virtual
address. A transfer's byte move ``(src, dst, len)`` from a rank with seed ``s`` must therefore leave the
destination byte at ``dst + i`` holding ``byte(s, src + i)``, and every byte no move names must still hold the
destination rank's own pattern: a misplaced, stale, shifted or missing byte differs with probability 255/256,
so any corrupted range is found. ``check`` compares every byte of the pools against that expectation on the
pools' device (torch, a fixed number of tensor operations per chunk of bytes, no step per move or byte in
Python) and reports the first difference with what was expected there.

The expectation of a chunk is built without gathers: a difference array over the chunk adds, at each move's
first byte, the change of "key" (seed and address offset) the move brings and removes it after its last byte;
its cumulative sum gives every byte's key. Moves into one rank must not overlap (a plan never writes a byte
twice); ``check`` refuses overlapping moves as a finding rather than guessing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["MAX_SEED", "CheckResult", "Overlay", "View", "byte_pattern", "check", "fill", "rows_pattern", "views_of"]

MAX_SEED = (1 << 12) - 1
"""Seeds are 1..MAX_SEED: ``seed << 48`` plus a 48-bit address stays far from int64 overflow in every sum."""
_M32 = 0xFFFFFFFF
_ADDR_BITS = 48


class View(NamedTuple):
    """One pool as the check sees it: its base address, byte count and a flat ``uint8`` tensor over it."""

    base: int
    nbytes: int
    flat: Any


class Overlay(NamedTuple):
    """Bytes a rank with ``seed`` moved into this rank: ``moves[:, 0]`` source, ``moves[:, 1]`` destination
    addresses, ``moves[:, 2]`` lengths."""

    seed: int
    moves: npt.NDArray[np.uint64]


@dataclass
class CheckResult:
    """What ``check`` found: bytes compared, bytes that differ, the first difference described, and the moves
    (bytes) it expected from peers."""

    bytes: int = 0
    mismatched: int = 0
    first: str | None = None
    moved_bytes: int = 0
    moves: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "bytes_checked": self.bytes,
            "bytes_mismatched": self.mismatched,
            "first_mismatch": self.first,
            "bytes_from_peers": self.moved_bytes,
            "moves": self.moves,
            "seconds": self.seconds,
        }


def _seed(seed: int) -> int:
    if not 1 <= seed <= MAX_SEED:
        raise ValueError(f"pattern seed must be 1 to {MAX_SEED}, got {seed}")
    return seed << _ADDR_BITS


def _hash(g: Any) -> Any:
    """``uint8`` pattern bytes of int64 keys ``g`` (``seed << 48 | address``); ``g`` is overwritten."""
    import torch

    hi = g >> 32
    g.bitwise_and_(_M32)
    hi.mul_(0x9E3779B1).bitwise_and_(_M32)  # hi < 2**29: the product stays below 2**61
    g.bitwise_xor_(hi)
    for _ in range(2):
        torch.bitwise_right_shift(g, 16, out=hi)
        g.bitwise_xor_(hi).mul_(0x45D9F3B).bitwise_and_(_M32)
    torch.bitwise_right_shift(g, 16, out=hi)
    g.bitwise_xor_(hi).bitwise_and_(0xFF)
    return g.to(torch.uint8)


def byte_pattern(seed: int, start: int, n: int, device: Any = "cpu") -> Any:
    """The pattern bytes of addresses ``start .. start + n`` of a rank with ``seed`` (a ``uint8`` tensor)."""
    import torch

    g = torch.arange(start, start + n, dtype=torch.int64, device=device)
    g.add_(_seed(seed))
    return _hash(g)


def views_of(tensors: Sequence[Any]) -> list[View]:
    """A ``View`` of each tensor's whole storage (distinct storages only), sorted by address."""
    import torch

    seen: dict[int, View] = {}
    for t in tensors:
        st = t.untyped_storage()
        base = int(st.data_ptr())
        if base not in seen:
            flat = torch.empty(0, dtype=torch.uint8, device=t.device)
            flat.set_(st, 0, (st.nbytes(),), (1,))
            seen[base] = View(base, int(st.nbytes()), flat)
    return sorted(seen.values(), key=lambda v: v.base)


def fill(views: Sequence[View], seed: int, chunk: int) -> None:
    """Write the pattern of ``seed`` into every byte of ``views``, ``chunk`` bytes per step."""
    for v in views:
        for off in range(0, v.nbytes, chunk):
            n = min(chunk, v.nbytes - off)
            v.flat[off : off + n].copy_(byte_pattern(seed, v.base + off, n, v.flat.device))


def rows_pattern(pool: Any, rows: Any, seed: int) -> Any:
    """The pattern of ``seed`` over rows ``rows`` (a 1-D int64 tensor on the pool's device) of ``pool``, a
    ``(blocks, page_bytes)`` tensor: a ``(len(rows), page_bytes)`` uint8 tensor for ``pool.index_copy_(0, rows,
    ...)``, which is what a layer writing its KV pages does."""
    import torch

    page = pool.shape[1]
    start = torch.arange(page, dtype=torch.int64, device=pool.device)
    g = (rows.to(torch.int64) * page + pool.data_ptr()).unsqueeze(1) + start.unsqueeze(0)
    g.add_(_seed(seed))
    return _hash(g.view(-1)).view(-1, page)


def _sorted_moves(base_seed: int, overlays: Sequence[Overlay]) -> tuple[npt.NDArray[np.int64], ...]:
    """Every overlay move as ``(dst, end, delta)`` sorted by destination; ``delta`` is the change of key the
    move brings (its source key minus the destination's own key)."""
    dst, end, delta = [np.zeros(0, dtype=np.int64)] * 3
    parts = []
    for ov in overlays:
        m = np.asarray(ov.moves, dtype=np.uint64).reshape(-1, 3).astype(np.int64)
        m = m[m[:, 2] > 0]
        parts.append((m[:, 1], m[:, 1] + m[:, 2], _seed(ov.seed) + m[:, 0] - m[:, 1] - base_seed))
    if parts:
        dst, end, delta = (np.concatenate([p[i] for p in parts]) for i in range(3))
    order = np.argsort(dst, kind="stable")
    return dst[order], end[order], delta[order]


def check(views: Sequence[View], seed: int, overlays: Sequence[Overlay], chunk: int) -> CheckResult:
    """Compare every byte of ``views`` (one rank's pools, own pattern ``seed``) with what it must hold after the
    ``overlays`` moved bytes in, ``chunk`` bytes per step on the pools' device.

    A move outside the pools, or two moves writing one byte, is a finding (``first``) as a differing byte is.
    """
    import time

    import torch

    t0 = time.perf_counter()
    own = _seed(seed)
    dst, end, delta = _sorted_moves(own, overlays)
    out = CheckResult(moved_bytes=int((end - dst).sum()), moves=int(dst.size))
    if dst.size > 1 and bool((end[:-1] > dst[1:]).any()):
        i = int(np.argmax(end[:-1] > dst[1:]))
        out.first = f"moves overlap: [{dst[i]:#x}, {end[i]:#x}) and [{dst[i + 1]:#x}, {end[i + 1]:#x})"
    inside = np.zeros(dst.size, dtype=bool)
    for v in views:
        lo_v, hi_v = np.searchsorted(dst, v.base, "left"), np.searchsorted(dst, v.base + v.nbytes, "left")
        inside[lo_v:hi_v] = end[lo_v:hi_v] <= v.base + v.nbytes
    if out.first is None and not inside.all():
        i = int(np.argmin(inside))
        out.first = f"{int((~inside).sum())} moves land outside the pools, first at {dst[i]:#x}"
    for v in views:
        dev = v.flat.device
        for off in range(0, v.nbytes, chunk):
            lo, n = v.base + off, min(chunk, v.nbytes - off)
            hi = lo + n
            # moves that intersect [lo, hi): sorted and disjoint, so ends are sorted too
            a, b = np.searchsorted(end, lo, "right"), np.searchsorted(dst, hi, "left")
            d = torch.zeros(n + 1, dtype=torch.int64, device=dev)
            if b > a:
                starts = torch.as_tensor(np.maximum(dst[a:b], lo) - lo, device=dev)
                stops = torch.as_tensor(np.minimum(end[a:b], hi) - lo, device=dev)
                dl = torch.as_tensor(delta[a:b], device=dev)
                d.index_add_(0, starts, dl)
                d.index_add_(0, stops, -dl)
            g = torch.cumsum(d[:n], 0)
            g.add_(torch.arange(lo, hi, dtype=torch.int64, device=dev)).add_(own)
            diff = _hash(g) != v.flat[off : off + n]
            bad = int(diff.sum())
            out.bytes += n
            if bad:
                out.mismatched += bad
                if out.first is None:
                    out.first = _describe(v, off + int(torch.nonzero(diff)[0]), seed, dst, end, delta, own)
    out.seconds = time.perf_counter() - t0
    return out


def _describe(
    v: View,
    off: int,
    seed: int,
    dst: npt.NDArray[np.int64],
    end: npt.NDArray[np.int64],
    delta: npt.NDArray[np.int64],
    own: int,
) -> str:
    """The first differing byte: where it is, what it holds, what it must hold and why."""
    addr = v.base + off
    got = int(v.flat[off])
    i = int(np.searchsorted(dst, addr, "right")) - 1
    if i >= 0 and addr < end[i]:
        key = addr + own + int(delta[i])
        src_seed, src = key >> _ADDR_BITS, key & ((1 << _ADDR_BITS) - 1)
        want = int(byte_pattern(src_seed, src, 1)[0])
        why = f"the byte moved from address {src:#x} of the rank with seed {src_seed}"
    else:
        want = int(byte_pattern(seed, addr, 1)[0])
        why = "unchanged (no move names it)"
    return f"byte at {addr:#x} (pool at {v.base:#x} + {off}) holds {got}, expected {want}: {why}"
