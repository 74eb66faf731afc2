"""Plain Python-loop builds: one ``append`` per descriptor into a list of ``(addr, len, device)`` tuples.

This is how every table was built before vLLM PR #48209 and how the split ("per-source") local
tables for P_TP > D_TP are still built: ``src_blocks_data.tolist()`` and a loop over every local
descriptor for every source rank . Written from the formulas of vLLM 0.33's NIXL connector.
The lists are what NIXL's ``get_xfer_descs`` / ``prep_xfer_dlist`` accept as they are.
"""

from __future__ import annotations

from .geometry import Geometry

Desc = tuple[int, int, int]


def local_descs(g: Geometry, bsr: int = 1) -> list[Desc]:
    """B.5: region-major attention descriptors, then the SSM sub-streams per logical block."""
    dev = g.device
    out: list[Desc] = []
    append = out.append
    for r in range(g.num_regions):
        base = int(g.bases[r])
        stride = int(g.strides[r])
        sub = int(g.block_lens[r]) // bsr
        for k in range(int(g.num_blocks[r])):
            blk = base + k * stride
            for s in range(bsr):
                append((blk + s * sub, sub, dev))
    page_stride_ppl = g.ppl
    for i in g.ssm_regions.tolist():
        base = int(g.bases[i])
        page = int(g.strides[i]) * page_stride_ppl
        for off, ln in g.streams:
            for b in range(g.num_logical_blocks):
                append((base + b * page + off, ln, dev))
    return out


def split_descs(
    local: list[Desc],
    num_fa: int,
    fa_replicated: list[bool],
    fa_num_splits: int,
    fa_slot: int,
    ssm_num_splits: int,
    p_idx: int,
) -> list[Desc]:
    """B.7: the local table of one source rank. FA descriptors are kept whole when replicated (MLA),
    else cut to the source's head slot; SSM descriptors are cut to chunk ``p_idx``."""
    out: list[Desc] = []
    append = out.append
    for j, (addr, ln, dev) in enumerate(local):
        if j < num_fa:
            if fa_replicated[j]:
                append((addr, ln, dev))
            else:
                chunk = ln // fa_num_splits
                append((addr + fa_slot * chunk, chunk, dev))
        else:
            chunk = ln // ssm_num_splits
            append((addr + p_idx * chunk, chunk, dev))
    return out


def fa_desc_replicated(g: Geometry, num_fa: int) -> list[bool]:
    """Per-descriptor REPLICATE flag of the FA part (pre-0.33 ``_fa_desc_replicated``)."""
    per = num_fa // g.num_regions if g.num_regions else 0
    out: list[bool] = []
    for flag in g.is_mla.tolist():
        out.extend([flag] * per)
    return out
