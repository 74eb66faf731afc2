//! Failed descriptors back to blocks: which local logical blocks (per group) the bytes of some local
//! descriptors belong to, so a failed transfer invalidates exactly the blocks it may have left unwritten.
//!
//! Mapped by address, not by id formula, so every row kind resolves the same way: unit and sub-block rows,
//! split pieces, SSM stream rows (one per logical block), chunk rows (a run of blocks) and whole-state rows.
//! A region's logical block `b` is the bytes `[base + b * ppl * stride, base + (b + 1) * ppl * stride)`
//! (what the local tables are cut from), so padded pages (`stride > len`) map right too.

use super::error::PlanError;
use super::key::TableKey;
use super::PeerPlan;
use crate::core::region::{GroupKind, RegionTable};

/// Where every local region's logical blocks lie, and the groups whose blocks they are.
#[derive(Debug, Clone, Default)]
pub(crate) struct BlockMap {
    /// Regions ascending by base address.
    regions: Vec<BlockRegion>,
    groups: usize,
}

#[derive(Debug, Clone)]
struct BlockRegion {
    base: u64,
    /// Bytes per logical block (`ppl * block_stride`).
    logical_bytes: u64,
    /// Logical blocks in the region.
    logical_blocks: u64,
    /// Groups whose ids address the region: its attention groups, and every SSM group if it holds SSM state.
    groups: Vec<usize>,
}

impl BlockMap {
    /// The block map of `local`; `region_groups` are the attention groups whose pages each region holds.
    pub(crate) fn new(local: &RegionTable, region_groups: &[Vec<usize>]) -> BlockMap {
        let ppl = local.geometry.ppl.max(1);
        let ssm: Vec<usize> = (0..local.groups.len())
            .filter(|&g| local.groups[g] == GroupKind::Ssm)
            .collect();
        let mut regions: Vec<BlockRegion> = local
            .regions
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let mut groups = region_groups[i].clone();
                if local.ssm_regions.contains(&i) {
                    groups.extend(&ssm);
                }
                groups.sort_unstable();
                groups.dedup();
                BlockRegion {
                    base: r.base,
                    // In range: the region's kernel blocks were checked to fit the address space when built.
                    logical_bytes: r.block_stride.saturating_mul(ppl),
                    logical_blocks: r.num_blocks / ppl,
                    groups,
                }
            })
            .collect();
        regions.sort_by_key(|r| r.base);
        // aliases of one tensor (same base and stride): one entry, every alias's groups
        regions.dedup_by(|later, first| {
            let same = later.base == first.base;
            if same {
                first.groups.append(&mut later.groups);
                first.groups.sort_unstable();
                first.groups.dedup();
            }
            same
        });
        BlockMap {
            regions,
            groups: local.groups.len(),
        }
    }

    /// Add to `out[g]` every logical block of group `g` that the bytes `[addr, addr + len)` fall in.
    fn touch(&self, addr: u64, len: u64, out: &mut [Vec<u64>]) {
        let i = self.regions.partition_point(|r| r.base <= addr);
        let Some(r) = i.checked_sub(1).map(|i| &self.regions[i]) else {
            return;
        };
        if r.logical_bytes == 0 || len == 0 {
            return;
        }
        let off = addr - r.base;
        let first = off / r.logical_bytes;
        if first >= r.logical_blocks {
            return;
        }
        let last = (off.saturating_add(len - 1) / r.logical_bytes).min(r.logical_blocks - 1);
        for &g in &r.groups {
            out[g].extend(first..=last);
        }
    }
}

impl PeerPlan {
    /// The local logical block ids, per group (in group order, each ascending and unique), whose bytes local
    /// descriptors `ids` of table `key` move: what a failed transfer with these local ids leaves unknown.
    ///
    /// A block id of a group is listed when some descriptor touches that block's bytes in a region the group's
    /// ids address; a region shared by several groups lists the block under each of them (a request names
    /// each block in one group only, see [`PlanError::SharedBlock`], so intersecting with the request's ids
    /// per group gives exactly its failed blocks).
    ///
    /// # Errors
    /// `BadTransfer` when `key` is not a local table or an id is outside it (naming the id and the size).
    pub fn failed_blocks(&self, key: TableKey, ids: &[i32]) -> Result<Vec<Vec<u64>>, PlanError> {
        let table = self
            .local_table(key)
            .ok_or_else(|| PlanError::BadTransfer(format!("no local table {key}")))?;
        let mut out = vec![Vec::new(); self.blocks.groups];
        for &id in ids {
            let (addr, len) = u64::try_from(id).ok().and_then(|i| table.desc(i)).ok_or_else(|| {
                PlanError::BadTransfer(format!(
                    "local descriptor id {id} is out of range for table {key} of {} descriptors",
                    table.len()
                ))
            })?;
            self.blocks.touch(addr, len, &mut out);
        }
        for blocks in &mut out {
            blocks.sort_unstable();
            blocks.dedup();
        }
        Ok(out)
    }
}
