//! Remote descriptor tables: what one local rank addresses in one remote rank's memory.
//!
//! The flat layout mirrors the local table (B.5): every region's attention descriptors (one per remote kernel
//! unit), then per SSM region, per conv sub-projection and the temporal state, one descriptor per remote
//! logical block. Attention descriptors of a region are either the whole remote unit (MLA, or the local rank
//! needing every head the remote holds) or the local rank's head slice of it; SSM descriptors are the local
//! rank's channel / dim-0 share of a larger remote state, or the whole smaller remote share.

use super::error::{exact_div, mismatch, PlanError};
use super::heads::{filler_rows, k_rows_of, piece_rows, Pages};
use crate::core::alias::alias_roots;
use crate::core::descs::{DescTable, StridedRow};
use crate::core::kv_layout::PageOrder;
use crate::core::meta::{AgentMeta, RegionMeta};
use crate::core::region::{hosts_attention, GroupKind, Region, RegionTable};
use crate::core::spec::{ConvLayout, ConvSplit, StatePart};
use crate::core::tp::TpMapping;
use crate::core::units::BlockUnits;

/// KV heads one rank of a `tp`-rank engine holds (`max(1, K / tp)`).
pub fn heads_per_rank(total_kv_heads: u64, tp: u32) -> u64 {
    (total_kv_heads / u64::from(tp)).max(1)
}

/// Remote SSM sub-streams `(offset, len)` read by the local rank in a region holding `part` of each state (the
/// whole state for `None`): the conv sub-projections (with an `sd` conv state, per conv row), then the temporal
/// state (C.5). With the local TP at least the remote TP the local rank's slice of each larger remote stream;
/// otherwise every remote stream whole.
///
/// # Errors
/// `Mismatch` when the remote state sizes are not the local ones scaled by the TP ratio, or the conv layouts
/// (and rows, for `sd`) differ.
pub fn remote_ssm_streams(
    local: &RegionTable,
    remote: &AgentMeta,
    mapping: &TpMapping,
    part: Option<&StatePart>,
) -> Result<Vec<(u64, u64)>, PlanError> {
    let Some(split) = &local.conv_split else {
        return Ok(Vec::new());
    };
    let ratio = mapping.tp_ratio;
    let scale = |v: u64| -> Option<u64> {
        if ratio > 0 {
            v.checked_mul(ratio as u64)
        } else {
            let abs = ratio.unsigned_abs();
            (v % abs == 0).then_some(v / abs)
        }
    };
    let expected: Option<Vec<u64>> = split
        .proj_bytes
        .iter()
        .chain([&split.ssm_bytes])
        .map(|&v| scale(v))
        .collect();
    let got: Vec<u64> = remote
        .conv_proj_bytes
        .iter()
        .copied()
        .chain([remote.ssm_sizes.1])
        .collect();
    if expected.as_ref() != Some(&got) || remote.ssm_sizes.0 != remote.conv_proj_bytes.iter().sum::<u64>() {
        return Err(mismatch(
            format!("SSM stream bytes (conv sub-projections, temporal) at TP ratio {ratio}; remote must be local scaled by the ratio"),
            split.proj_bytes.iter().chain([&split.ssm_bytes]).collect::<Vec<_>>(),
            got,
        ));
    }
    let sd = split.conv_layout == ConvLayout::Sd;
    if split.conv_layout != remote.conv_layout || (sd && split.conv_rows != remote.conv_rows) {
        return Err(mismatch(
            "conv state layout (layout, rows)",
            (split.conv_layout, split.conv_rows),
            (remote.conv_layout, remote.conv_rows),
        ));
    }
    if sd && got.iter().take(got.len() - 1).any(|&b| b % split.conv_rows.max(1) != 0) {
        return Err(mismatch(
            "conv sub-projection bytes (a whole number of sd conv rows)",
            split.conv_rows,
            &remote.conv_proj_bytes,
        ));
    }
    // The remote state as the remote rank lays it out: the local split's structure at the remote's sizes.
    // (its conv layout was checked equal above, and its rows too where they matter, `sd`)
    let remote_split = ConvSplit {
        conv_rows: split.conv_rows,
        ..remote.conv_split()
    };
    let local_offset = if ratio > 0 {
        u64::from(mapping.tp_rank) % ratio as u64
    } else {
        0
    };
    Ok(remote_split
        .part_streams(part)
        .into_iter()
        .map(|(base, remote_len)| {
            if ratio > 0 {
                let local_len = remote_len / ratio as u64;
                (base + local_offset * local_len, local_len)
            } else {
                (base, remote_len)
            }
        })
        .collect())
}

/// Build the descriptor table of `remote`'s memory as seen by the local rank of `local`.
///
/// `units` says how both sides' kernel blocks are cut into the common token unit.
///
/// # Errors
/// `Mismatch` (with both sides' values) when region counts, names, groups, SSM regions, per-token attention
/// bytes or SSM state sizes disagree; `NotSupported` when a head-sliced attention page would have to be cut
/// into sub-blocks; `Indivisible` for pages that do not split evenly.
pub fn remote_table(
    local: &RegionTable,
    remote: &AgentMeta,
    mapping: &TpMapping,
    units: BlockUnits,
) -> Result<DescTable, PlanError> {
    check_regions(local, remote)?;
    let dev = u64::from(remote.device_id);
    let heads_l = heads_per_rank(mapping.total_kv_heads, local.tp_size);
    let heads_r = heads_per_rank(mapping.total_kv_heads, remote.tp_size);
    let fa_splits = mapping.attn_ranks.len() as u64;
    let mut rows = Vec::with_capacity(local.regions.len() + local.ssm_regions.len() * 4);
    let mut num_fa = 0u64;
    for (lr, rr) in local.regions.iter().zip(&remote.regions) {
        if let Some(hp) = units.per_head {
            let pages = Pages {
                name: &rr.name,
                base: rr.base,
                block_len: rr.block_len,
                block_stride: rr.block_stride,
                num_blocks: rr.num_blocks,
                device: dev,
            };
            rows.extend(if !hosts_attention(lr.group, &local.groups) {
                filler_rows(pages, units.remote_pieces())?
            } else {
                check_cells(local, remote, (lr, rr), (heads_l, heads_r))?;
                // A local rank holding fewer heads reads (or writes) its slice of the remote page.
                let first = if mapping.tp_ratio > 0 {
                    mapping.rank_offset_factor * heads_l
                } else {
                    0
                };
                piece_rows(
                    pages,
                    heads_r,
                    (first, hp),
                    units.remote_sub,
                    k_rows_of(rr.is_mla, units)?,
                )?
            });
            num_fa += rr.num_blocks * units.remote_pieces();
            continue;
        }
        let r_unit = exact_div(
            || format!("remote kernel page of region {}", rr.name),
            rr.block_len,
            units.remote_sub,
        )?;
        let l_unit = exact_div(
            || format!("local kernel page of region {}", lr.name),
            lr.block_len,
            units.local_sub,
        )?;
        let (offset, len) = if !hosts_attention(lr.group, &local.groups) {
            (0, r_unit)
        } else {
            let (hl, hr) = if lr.is_mla { (1, 1) } else { (heads_l, heads_r) };
            check_cells(local, remote, (lr, rr), (hl, hr))?;
            // Token-major pages: a unit is a token range of every head; under a head split a unit is one token
            // (`BlockUnits::for_pages`), a heads-major page of one token, and is sliced by heads below.
            let token_major = local.page_order == PageOrder::TokenMajor;
            if token_major && hl != hr && units.unit_tokens != 1 {
                return Err(PlanError::NotSupported(format!(
                    "attention region {} has token-major (NHD) pages with {hl} (local) / {hr} (remote) heads per rank; \
                     their head split must be planned per token",
                    lr.name
                )));
            }
            if lr.is_mla || (token_major && hl == hr) {
                (0, l_unit)
            } else {
                let num_reads = if mapping.tp_ratio < 0 { fa_splits } else { 1 };
                let len = exact_div(|| format!("local kernel unit of region {}", lr.name), l_unit, num_reads)?;
                (mapping.rank_offset_factor * l_unit, len)
            }
        };
        if offset + len > r_unit {
            return Err(mismatch(
                format!(
                    "attention slice [{offset}, +{len}) of region {} within the remote unit",
                    lr.name
                ),
                l_unit,
                r_unit,
            ));
        }
        let count = rr.num_blocks * units.remote_sub;
        num_fa += count;
        let addr = rr.base.checked_add(offset).ok_or_else(|| PlanError::AddressOverflow {
            what: format!("remote region {}", rr.name),
            addr: rr.base,
            len: offset,
        })?;
        if units.remote_sub == 1 || rr.block_stride == rr.block_len {
            let stride = if units.remote_sub == 1 { rr.block_stride } else { r_unit };
            rows.push(StridedRow {
                addr,
                len,
                device: dev,
                stride,
                count,
            });
        } else {
            for k in 0..rr.num_blocks {
                rows.push(StridedRow {
                    addr: addr + k * rr.block_stride,
                    len,
                    device: dev,
                    stride: r_unit,
                    count: units.remote_sub,
                });
            }
        }
    }
    for &i in &local.ssm_regions {
        let rr = &remote.regions[i];
        for (off, len) in remote_ssm_streams(local, remote, mapping, rr.state_part.as_ref())? {
            rows.push(StridedRow {
                addr: rr.base + off,
                len,
                device: dev,
                stride: rr.block_stride * remote.ppl,
                // the remote's states: its logical blocks, or a state tensor's own slots
                count: rr.states.unwrap_or(remote.num_logical_blocks),
            });
        }
    }
    Ok(DescTable::new(rows, num_fa))
}

/// Bytes per (head, token) must agree on both sides, and each side's kernel page must be exactly its tokens'
/// cells: MLA latents are TP-independent (`heads` 1), GQA cells are per head.
fn check_cells(
    local: &RegionTable,
    remote: &AgentMeta,
    (lr, rr): (&Region, &RegionMeta),
    (hl, hr): (u64, u64),
) -> Result<(), PlanError> {
    let (lk, rk) = (local.geometry.kernel_block_size, remote.kernel_block_size);
    let cell_l = lr.block_len / (lk * hl);
    let cell_r = rr.block_len / (rk * hr);
    if lr.block_len != cell_l * lk * hl || rr.block_len != cell_r * rk * hr || cell_l != cell_r {
        return Err(mismatch(
            format!(
                "kernel page of region {} (bytes for kernel blocks of local {lk} / remote {rk} tokens, {hl} / {hr} heads per rank)",
                lr.name
            ),
            lr.block_len,
            rr.block_len,
        ));
    }
    Ok(())
}

/// The two sides must describe the same caches in the same order.
fn check_regions(local: &RegionTable, remote: &AgentMeta) -> Result<(), PlanError> {
    let names = |it: &mut dyn Iterator<Item = &String>| it.cloned().collect::<Vec<_>>();
    let (ln, rn) = (
        names(&mut local.regions.iter().map(|r| &r.name)),
        names(&mut remote.regions.iter().map(|r| &r.name)),
    );
    if ln != rn {
        return Err(mismatch("regions (first layer of each, in order)", ln, rn));
    }
    if local.groups != remote.groups {
        return Err(mismatch("KV-cache group kinds", &local.groups, &remote.groups));
    }
    let lg: Vec<Option<u32>> = local.regions.iter().map(|r| r.group).collect();
    let rg: Vec<Option<u32>> = remote.regions.iter().map(|r| r.group).collect();
    if lg != rg {
        return Err(mismatch("region groups", lg, rg));
    }
    let ls: Vec<u32> = local.ssm_regions.iter().map(|&i| i as u32).collect();
    if ls != remote.ssm_regions {
        return Err(mismatch("SSM regions", ls, &remote.ssm_regions));
    }
    let lp: Vec<_> = local.regions.iter().map(|r| &r.state_part).collect();
    let rp: Vec<_> = remote.regions.iter().map(|r| &r.state_part).collect();
    if lp != rp {
        return Err(mismatch("state parts of the regions (conv, temporal)", lp, rp));
    }
    let roots = |bases: Vec<u64>| alias_roots(&bases);
    let (la, ra) = (
        roots(local.regions.iter().map(|r| r.base).collect()),
        roots(remote.regions.iter().map(|r| r.base).collect()),
    );
    if la != ra {
        return Err(mismatch(
            "regions aliasing one tensor (first region of each base)",
            la,
            ra,
        ));
    }
    if local.groups.contains(&GroupKind::Attention) && remote.page_order() != Some(local.page_order) {
        return Err(mismatch(
            "attention page order (kv_layout)",
            local.page_order.name(),
            &remote.kv_layout,
        ));
    }
    if local.k_rows != remote.k_rows {
        return Err(mismatch("K rows of HKTV pages", local.k_rows, remote.k_rows));
    }
    if local.use_mla != remote.use_mla || local.total_num_kv_heads != remote.total_num_kv_heads {
        return Err(mismatch(
            "model (use_mla, total KV heads)",
            (local.use_mla, local.total_num_kv_heads),
            (remote.use_mla, remote.total_num_kv_heads),
        ));
    }
    Ok(())
}
