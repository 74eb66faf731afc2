"""NumPy builds of the descriptor tables and per-request ids, the way vLLM does since PR #48209.

Every table is an ``(N, 3)`` ``uint64`` array ``(addr, len, device)`` made by broadcasting an
``arange`` of block indices against per-region columns, then stacked column by column; ids are the
broadcast sums of D.3. Written from the formulas in the reference (B.5, B.7, C.4, C.5, D.3), not from
vLLM's source. Good-faith NumPy: no Python loop over descriptors, only over regions or streams.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from .geometry import U64, Geometry

I64 = npt.NDArray[np.int64]


def _stack(addrs: U64, lens: U64, device: int) -> U64:
    """``(N, 3)`` table from an address column and a length column."""
    out = np.empty((addrs.size, 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = lens
    out[:, 2] = device
    return out


def fa_local(g: Geometry, bsr: int = 1) -> tuple[U64, U64]:
    """B.5 part 1: region-major, then kernel block, then sub-block (addresses and lengths)."""
    sub = g.block_lens // np.uint64(bsr)
    nb = int(g.num_blocks[0])
    if not np.all(g.num_blocks == nb):  # per-region counts: one broadcast per region
        parts = [fa_local_region(g, r, bsr) for r in range(g.num_regions)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    k = np.arange(nb, dtype=np.uint64)
    addrs = g.bases[:, None] + k[None, :] * g.strides[:, None]
    if bsr > 1:
        s = np.arange(bsr, dtype=np.uint64)
        addrs = addrs[:, :, None] + s[None, None, :] * sub[:, None, None]
    lens = np.broadcast_to(sub.reshape((-1,) + (1,) * (addrs.ndim - 1)), addrs.shape)
    return addrs.reshape(-1), lens.reshape(-1)


def fa_local_region(g: Geometry, r: int, bsr: int) -> tuple[U64, U64]:
    sub = g.block_lens[r] // np.uint64(bsr)
    k = np.arange(int(g.num_blocks[r]), dtype=np.uint64)
    s = np.arange(bsr, dtype=np.uint64)
    addrs = (g.bases[r] + k[:, None] * g.strides[r] + s[None, :] * sub).reshape(-1)
    return addrs, np.full(addrs.size, sub, dtype=np.uint64)


def ssm_local(g: Geometry) -> tuple[U64, U64]:
    """B.5 part 2: per SSM region, per sub-stream, one descriptor per logical block."""
    if not g.has_ssm:
        empty = np.empty(0, dtype=np.uint64)
        return empty, empty
    idx = g.ssm_regions
    b = np.arange(g.num_logical_blocks, dtype=np.uint64)
    blk = g.bases[idx, None] + b[None, :] * (g.strides[idx] * np.uint64(g.ppl))[:, None]  # (S, L)
    offs = np.array([o for o, _ in g.streams], dtype=np.uint64)
    lens = np.array([n for _, n in g.streams], dtype=np.uint64)
    addrs = blk[:, None, :] + offs[None, :, None]  # (S, C+1, L)
    return addrs.reshape(-1), np.broadcast_to(lens[None, :, None], addrs.shape).reshape(-1)


def local_descs(g: Geometry, bsr: int = 1) -> U64:
    """The local table as ``(N, 3)`` (PR #48209 form)."""
    fa_a, fa_l = fa_local(g, bsr)
    if not g.has_ssm:
        return _stack(fa_a, fa_l, g.device)
    ssm_a, ssm_l = ssm_local(g)
    return _stack(np.concatenate([fa_a, ssm_a]), np.concatenate([fa_l, ssm_l]), g.device)


def local_rows(g: Geometry, bsr: int = 1) -> U64:
    """The local table as ``(rows, 5)`` strided rows (vLLM 0.33.0 form), for bsr == 1 or abutting sub-blocks."""
    sub = g.block_lens // np.uint64(bsr)
    r = g.num_regions
    fa = np.empty((r, 5), dtype=np.uint64)
    fa[:, 0] = g.bases
    fa[:, 1] = sub
    fa[:, 2] = g.device
    fa[:, 3] = g.strides // np.uint64(bsr)
    fa[:, 4] = g.num_blocks * np.uint64(bsr)
    if not g.has_ssm:
        return fa
    idx = g.ssm_regions
    n = len(g.streams)
    ssm = np.empty((len(idx), n, 5), dtype=np.uint64)
    ssm[:, :, 0] = g.bases[idx, None] + np.array([o for o, _ in g.streams], dtype=np.uint64)[None, :]
    ssm[:, :, 1] = np.array([ln for _, ln in g.streams], dtype=np.uint64)[None, :]
    ssm[:, :, 2] = g.device
    ssm[:, :, 3] = (g.strides[idx] * np.uint64(g.ppl))[:, None]
    ssm[:, :, 4] = g.num_logical_blocks
    return np.concatenate([fa, ssm.reshape(-1, 5)])


# ----------------------------------------------------------------------------------------------------
# Per-request ids (D.3) and the logical -> kernel expansion.


def logical_to_kernel(ids: npt.ArrayLike, ppl: int) -> I64:
    """Kernel block ids of logical blocks ``ids``: ``b*ppl + j`` for ``j < ppl``, in order."""
    a = np.asarray(ids, dtype=np.int64)
    if ppl == 1:
        return a
    return (a[:, None] * ppl + np.arange(ppl, dtype=np.int64)[None, :]).reshape(-1)


def compute_desc_ids(
    groups: Sequence[tuple[bool, npt.ArrayLike]],
    num_regions: int,
    nb: int,
    num_ssm_streams: int,
    num_logical_blocks: int,
) -> I64:
    """D.3: ids of one side's descriptors for a request, group by group.

    ``groups`` lists ``(is_attention, ids)`` in group order; attention ids are kernel ids, SSM ids are
    logical ids. ``nb`` is the (bsr-expanded) kernel blocks per region, ``num_ssm_streams`` is
    ``n_ssm_regions * (n_conv + 1)``.
    """
    fa_total = num_regions * nb
    parts = []
    for is_attn, ids in groups:
        a = np.asarray(ids, dtype=np.int64)
        if is_attn:
            parts.append((np.arange(num_regions, dtype=np.int64)[:, None] * nb + a[None, :]).reshape(-1))
        else:
            s = np.arange(num_ssm_streams, dtype=np.int64)[:, None] * num_logical_blocks
            parts.append((fa_total + s + a[None, :]).reshape(-1))
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


# ----------------------------------------------------------------------------------------------------
# One request, end to end: expansion, prefix-cache pairing (D.5) and ids of every transfer (D.3).


class Side:
    """Descriptor-id geometry of one side's table (what ``_compute_desc_ids`` is given)."""

    def __init__(
        self, num_regions: int, nb: int, ppl: int, num_ssm_streams: int, num_logical_blocks: int, logical_tokens: int
    ) -> None:
        self.num_regions = num_regions
        self.nb = nb
        self.ppl = ppl
        self.num_ssm_streams = num_ssm_streams
        self.num_logical_blocks = num_logical_blocks
        self.logical_tokens = logical_tokens

    @classmethod
    def of(cls, g: Geometry, logical_tokens: int) -> Side:
        return cls(
            g.num_regions,
            g.num_kernel_blocks,
            g.ppl,
            len(g.ssm_regions) * len(g.streams),
            g.num_logical_blocks,
            logical_tokens,
        )


def _pair(is_attn: bool, same_tokens: bool, d: I64, p: I64) -> tuple[I64, I64]:
    """D.5: the parts of the decode list ``d`` and prefill list ``p`` that are transferred."""
    nd, np_ = d.size, p.size
    if nd == 0:
        return d[:0], p[:0]
    if not is_attn:
        return (d, p[np_ - nd :]) if nd <= np_ else (d[:np_], p)
    if same_tokens and nd < np_:
        return d, p[np_ - nd :]
    n = min(nd, np_)
    return d[:n], p[:n]


def plan_request(
    is_attention: Sequence[bool],
    routes: Sequence[tuple[int, Sequence[bool]]],
    local: Side,
    remote: Side,
    local_ids: Sequence[Sequence[int]],
    remote_ids: Sequence[Sequence[int]],
    pull: bool = True,
) -> list[tuple[int, npt.NDArray[np.int32], npt.NDArray[np.int32]]]:
    """The ``(remote_rank, local ids, remote ids)`` of every transfer of one request.

    ``routes`` gives, per remote rank, which groups it exchanges (from the TP mapping); ids are logical
    block ids per group as the scheduler hands them over (Python lists).
    """
    same = local.logical_tokens == remote.logical_tokens
    lk: list[I64] = []
    rk: list[I64] = []
    for g, attn in enumerate(is_attention):
        lo = logical_to_kernel(local_ids[g], local.ppl) if attn else np.asarray(local_ids[g], dtype=np.int64)
        ro = logical_to_kernel(remote_ids[g], remote.ppl) if attn else np.asarray(remote_ids[g], dtype=np.int64)
        if pull:
            lo, ro = _pair(attn, same, lo, ro)
        else:
            ro, lo = _pair(attn, same, ro, lo)
        lk.append(lo)
        rk.append(ro)
    out = []
    for rank, mask in routes:
        groups_l = [(is_attention[g], lk[g]) for g in range(len(mask)) if mask[g]]
        groups_r = [(is_attention[g], rk[g]) for g in range(len(mask)) if mask[g]]
        li = compute_desc_ids(groups_l, local.num_regions, local.nb, local.num_ssm_streams, local.num_logical_blocks)
        ri = compute_desc_ids(
            groups_r, remote.num_regions, remote.nb, remote.num_ssm_streams, remote.num_logical_blocks
        )
        if li.size:
            out.append((rank, li.astype(np.int32), ri.astype(np.int32)))
    return out
