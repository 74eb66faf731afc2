//! Emitting a request's descriptor ids. [`Slots`] lists, once per peer plan, every (region, attention
//! group) and (SSM stream, group) pair in id order with both sides' id bases; [`Slots::request`] turns one
//! request's trimmed windows into per-group id lists, and [`Slots::emit`] writes every slot of a route
//! from them with one add per id.
//!
//! Coalesced regions with equal unit counts share one chunk-row layout (the same rows, at different flat
//! starts), so a group's chunk ids are resolved once per layout and request, not once per region: a slot
//! then adds its region's base to each relative id (the chunk rows' base for chunks, the region's own
//! units' base for lone units).
//!
//! Every slot is one (region, group) pair, i.e. one layer's pages or states in one tensor: [`Slots::emit_staged`]
//! writes each slot's ids to the stage its pair belongs to, so a request's stages are exactly its ids cut by
//! (region, group), each id once.

use super::heads::piece_ids;
use super::ids::{window_units, IdSpace};
use super::runs::{chunk_runs, Run, UnitCursor};
use super::stages::StageMap;
use super::trim::Window;
use crate::core::coalesce::ChunkStarts;
use crate::core::region::GroupKind;
use crate::core::units::BlockUnits;

/// Id slots of a peer plan, in emission order.
#[derive(Debug, Clone)]
pub(crate) struct Slots {
    attn: Vec<AttnSlot>,
    ssm: Vec<SsmSlot>,
    /// Relative chunk layouts `(local, remote)` (starts minus the first), shared by regions of equal counts.
    layouts: Vec<(ChunkStarts, ChunkStarts)>,
    /// Per group: the layouts its coalesced slots use (empty: not coalesced anywhere).
    group_layouts: Vec<Vec<usize>>,
    /// Per group: how many of its slots are coalesced and how many take one id per unit (or state).
    slot_counts: Vec<(usize, usize)>,
    /// Units cut per head: `(local units, remote units)` per kernel block and the descriptors of each unit (its
    /// heads, times each head's parts).
    per_head: Option<((u64, u64), u64)>,
    /// Units cut per head: the distinct `(local, remote)` kernel-block counts of the regions (one, unless pools
    /// differ in size), by which piece ids are laid out.
    piece_layouts: Vec<(u64, u64)>,
}

/// One region's attention ids of one group.
#[derive(Debug, Clone, Copy)]
struct AttnSlot {
    group: usize,
    region: usize,
    /// Flat starts of the region's unit descriptors, local and remote.
    start: (u64, u64),
    /// Units cut per head: the index of the region's kernel-block counts in `Slots::piece_layouts`.
    piece_layout: usize,
    /// Coalesced: the index into the group's layouts and the flat starts of the region's chunk rows.
    chunks: Option<(usize, (u64, u64))>,
}

/// One SSM piece's (or whole state's) ids of one group.
#[derive(Debug, Clone, Copy)]
struct SsmSlot {
    group: usize,
    region: usize,
    start: (u64, u64),
}

/// One request's ids of one group, relative to a slot's bases.
#[derive(Debug, Default)]
pub(crate) struct GroupIds {
    /// Transferred units (attention) or states (SSM).
    len: usize,
    /// Coalesced groups whose runs save at least a quarter of the ids.
    chunked: Option<ChunkedIds>,
    /// Unit (attention) or state (SSM) ids, local and remote, where some slot takes one id per unit.
    units: (Vec<u64>, Vec<u64>),
    /// Units cut per head: piece ids relative to a region's start, local and remote, per piece layout (written
    /// instead of `units`).
    pieces: Vec<(Vec<u64>, Vec<u64>)>,
}

/// A coalesced group's runs: per run whether it is a chunk (else a lone unit), and the runs' ids relative
/// to a slot's bases, `(local, remote)` per layout of the group.
#[derive(Debug)]
struct ChunkedIds {
    is_chunk: Vec<bool>,
    per_layout: Vec<(Vec<u64>, Vec<u64>)>,
}

/// The transferred windows of one request: each side's logical ids, windows and units per logical block.
pub(crate) struct Windows<'a> {
    pub(crate) local: (&'a [Vec<u64>], &'a [Window], u64),
    pub(crate) remote: (&'a [Vec<u64>], &'a [Window], u64),
}

impl Slots {
    /// Slots of `region_groups` (attention groups per region) and, per SSM group, one slot per entry of
    /// `ssm_bases` (the flat `(local, remote)` starts of every SSM piece row, or of every whole-state row), the
    /// region of each in `ssm_regions`; `chunks` are the per-region chunk starts of the coalesced regions.
    pub(crate) fn new(
        groups: &[GroupKind],
        region_groups: &[Vec<usize>],
        (ssm_bases, ssm_regions): (&[(u64, u64)], &[usize]),
        (local, remote): (&IdSpace, &IdSpace),
        chunks: &[Option<(ChunkStarts, ChunkStarts)>],
        units: BlockUnits,
    ) -> Slots {
        let mut layouts: Vec<(ChunkStarts, ChunkStarts)> = Vec::new();
        let mut group_layouts = vec![Vec::new(); groups.len()];
        let mut slot_counts = vec![(0, 0); groups.len()];
        let mut attn = Vec::new();
        let mut piece_layouts: Vec<(u64, u64)> = Vec::new();
        for (r, gs) in region_groups.iter().enumerate() {
            let blocks = (local.region_blocks[r], remote.region_blocks[r]);
            let piece_layout = piece_layouts.iter().position(|&b| b == blocks).unwrap_or_else(|| {
                piece_layouts.push(blocks);
                piece_layouts.len() - 1
            });
            // The region's layout index and chunk bases, shared by all its groups.
            let coalesced = chunks[r].as_ref().map(|(lc, rc)| {
                // Regions of equal unit counts share one layout: compared in place, built once (a relative
                // copy of both sides' starts per region was a tenth of a DeepSeek-V3 peer plan's construction).
                let c = layouts
                    .iter()
                    .position(|(l, r)| lc.relative_is(l) && rc.relative_is(r))
                    .unwrap_or_else(|| {
                        layouts.push((lc.split_base().1, rc.split_base().1));
                        layouts.len() - 1
                    });
                (c, (lc.base(), rc.base()))
            });
            for &g in gs {
                let chunks = coalesced.map(|(c, bases)| {
                    let used = &mut group_layouts[g];
                    let i = used.iter().position(|&u| u == c).unwrap_or_else(|| {
                        used.push(c);
                        used.len() - 1
                    });
                    (i, bases)
                });
                let counts = &mut slot_counts[g];
                *(if chunks.is_some() { &mut counts.0 } else { &mut counts.1 }) += 1;
                let start = (local.region_start[r], remote.region_start[r]);
                attn.push(AttnSlot {
                    group: g,
                    region: r,
                    start,
                    piece_layout,
                    chunks,
                });
            }
        }
        let ssm_groups: Vec<usize> = (0..groups.len()).filter(|&g| groups[g] == GroupKind::Ssm).collect();
        for &g in &ssm_groups {
            slot_counts[g].1 = ssm_bases.len();
        }
        debug_assert_eq!(ssm_bases.len(), ssm_regions.len());
        let ssm = ssm_bases
            .iter()
            .enumerate()
            .flat_map(|(k, &start)| {
                let region = ssm_regions.get(k).copied().unwrap_or(0);
                ssm_groups.iter().map(move |&group| SsmSlot { group, region, start })
            })
            .collect();
        Slots {
            attn,
            ssm,
            layouts,
            group_layouts,
            slot_counts,
            per_head: units
                .per_head
                .map(|_| ((units.local_sub, units.remote_sub), units.per_unit())),
            piece_layouts,
        }
    }

    /// Whether some region's runs are coalesced into chunk descriptors.
    pub(crate) fn coalesced(&self) -> bool {
        !self.layouts.is_empty()
    }

    /// Per group, the ids of one request's windows `w`.
    pub(crate) fn request(&self, groups: &[GroupKind], w: &Windows<'_>) -> Vec<GroupIds> {
        let ((lids, lw, lu), (rids, rw, ru)) = (w.local, w.remote);
        (0..groups.len())
            .map(|g| {
                let len = lw[g].len as usize;
                if !groups[g].is_attention() {
                    let units = (lw[g].of(&lids[g]).to_vec(), rw[g].of(&rids[g]).to_vec());
                    return GroupIds {
                        len,
                        chunked: None,
                        units,
                        pieces: Vec::new(),
                    };
                }
                // Chunks only where they save at least a quarter of the ids.
                let chunked = (!self.group_layouts[g].is_empty())
                    .then(|| {
                        let mut runs = Vec::new();
                        let (l, r) = (
                            UnitCursor::new(&lids[g], lu, lw[g]),
                            UnitCursor::new(&rids[g], ru, rw[g]),
                        );
                        chunk_runs(l, r, len * 3 / 4, &mut runs).then_some(runs)
                    })
                    .flatten()
                    .map(|runs| self.chunked_ids(g, &runs));
                let units = if chunked.is_none() || self.slot_counts[g].1 > 0 {
                    (window_units(&lids[g], lu, lw[g]), window_units(&rids[g], ru, rw[g]))
                } else {
                    Default::default()
                };
                if let Some(((l_sub, r_sub), hp)) = self.per_head {
                    let pieces: Vec<_> = self
                        .piece_layouts
                        .iter()
                        .map(|&(lb, rb)| (piece_ids(&units.0, l_sub, hp, lb), piece_ids(&units.1, r_sub, hp, rb)))
                        .collect();
                    return GroupIds {
                        len: len * hp as usize,
                        chunked: None,
                        units: Default::default(),
                        pieces,
                    };
                }
                GroupIds {
                    len,
                    chunked,
                    units,
                    pieces: Vec::new(),
                }
            })
            .collect()
    }

    /// Group `g`'s chunk runs as ids relative to a slot's bases, resolved against each of its layouts.
    fn chunked_ids(&self, g: usize, runs: &[Run]) -> ChunkedIds {
        let rel = |k: u64, j: u32, c: &ChunkStarts| if j == 0 { k } else { c.id(k, j) };
        let per_layout = self.group_layouts[g]
            .iter()
            .map(|&c| {
                let (lc, rc) = &self.layouts[c];
                let local = runs.iter().map(|run| rel(run.l, run.j, lc)).collect();
                let remote = runs.iter().map(|run| rel(run.r, run.j, rc)).collect();
                (local, remote)
            })
            .collect();
        ChunkedIds {
            is_chunk: runs.iter().map(|run| run.j > 0).collect(),
            per_layout,
        }
    }

    /// Append the ids of every slot of the groups in `mask`, local to `lo` and remote to `ro`.
    pub(crate) fn emit(&self, mask: &[bool], ids: &[GroupIds], lo: &mut Vec<i32>, ro: &mut Vec<i32>) {
        let n: usize = (0..ids.len())
            .filter(|&g| mask[g])
            .map(|g| {
                let (chunked, plain) = self.slot_counts[g];
                let per_chunked = ids[g].chunked.as_ref().map_or(ids[g].len, |c| c.is_chunk.len());
                chunked * per_chunked + plain * ids[g].len
            })
            .sum();
        if n == 0 {
            return;
        }
        // Sized once and written through slices: a request's slots are many short lists (one id per slot for
        // a short contiguous request), where `extend`'s per-call setup costs more than the ids.
        let (l0, r0) = (lo.len(), ro.len());
        lo.resize(l0 + n, 0);
        ro.resize(r0 + n, 0);
        let mut out = Unwritten {
            local: &mut lo[l0..],
            remote: &mut ro[r0..],
        };
        for s in self.attn.iter().filter(|s| mask[s.group]) {
            let g = &ids[s.group];
            write_attn(s, g, out.take(attn_len(s, g)));
        }
        for s in self.ssm.iter().filter(|s| mask[s.group]) {
            let g = &ids[s.group];
            write_plain(s.start, &g.units, out.take(g.len));
        }
    }

    /// [`Slots::emit`] cut by stage: the ids of each slot of the groups in `mask` are appended to
    /// `outs[stages.of(region, group)]` (local ids, remote ids), in emission order within each stage.
    pub(crate) fn emit_staged(
        &self,
        mask: &[bool],
        ids: &[GroupIds],
        stages: &StageMap,
        outs: &mut [(Vec<i32>, Vec<i32>)],
    ) {
        let grow = |(lo, ro): &mut (Vec<i32>, Vec<i32>), n: usize| {
            let (l0, r0) = (lo.len(), ro.len());
            lo.resize(l0 + n, 0);
            ro.resize(r0 + n, 0);
            (l0, r0)
        };
        for s in self.attn.iter().filter(|s| mask[s.group]) {
            let (g, out) = (&ids[s.group], &mut outs[stages.of(s.region, s.group)]);
            let (l0, r0) = grow(out, attn_len(s, g));
            write_attn(s, g, (&mut out.0[l0..], &mut out.1[r0..]));
        }
        for s in self.ssm.iter().filter(|s| mask[s.group]) {
            let (g, out) = (&ids[s.group], &mut outs[stages.of(s.region, s.group)]);
            let (l0, r0) = grow(out, g.len);
            write_plain(s.start, &g.units, (&mut out.0[l0..], &mut out.1[r0..]));
        }
    }
}

/// Ids one attention slot emits for group ids `g`: one per run when both are coalesced, else one per unit.
fn attn_len(s: &AttnSlot, g: &GroupIds) -> usize {
    match (s.chunks, &g.chunked) {
        (Some(_), Some(c)) => c.is_chunk.len(),
        _ => g.len,
    }
}

/// Write one attention slot's ids into `l` and `r` (exactly [`attn_len`] of each).
fn write_attn(s: &AttnSlot, g: &GroupIds, (l, r): (&mut [i32], &mut [i32])) {
    if let Some(pieces) = g.pieces.get(s.piece_layout) {
        return write_plain(s.start, pieces, (l, r));
    }
    match (s.chunks, &g.chunked) {
        (Some((i, (lb, rb))), Some(ChunkedIds { is_chunk, per_layout })) => {
            let (local, remote) = &per_layout[i];
            let rel = local.iter().zip(remote).zip(is_chunk);
            for ((ol, or), ((&kl, &kr), &chunk)) in l.iter_mut().zip(r).zip(rel) {
                let (bl, br) = if chunk { (lb, rb) } else { s.start };
                (*ol, *or) = ((bl + kl) as i32, (br + kr) as i32);
            }
        }
        _ => write_plain(s.start, &g.units, (l, r)),
    }
}

/// Write unit (or state) ids relative to `start` into `l` and `r`.
fn write_plain(start: (u64, u64), units: &(Vec<u64>, Vec<u64>), (l, r): (&mut [i32], &mut [i32])) {
    l.iter_mut().zip(&units.0).for_each(|(o, &u)| *o = (start.0 + u) as i32);
    r.iter_mut().zip(&units.1).for_each(|(o, &u)| *o = (start.1 + u) as i32);
}

/// The not yet written part of a route's local and remote id lists.
struct Unwritten<'a> {
    local: &'a mut [i32],
    remote: &'a mut [i32],
}

impl<'a> Unwritten<'a> {
    /// The next `n` local and remote ids to write.
    fn take(&mut self, n: usize) -> (&'a mut [i32], &'a mut [i32]) {
        let (l, local) = std::mem::take(&mut self.local).split_at_mut(n);
        let (r, remote) = std::mem::take(&mut self.remote).split_at_mut(n);
        (self.local, self.remote) = (local, remote);
        (l, r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::coalesce::with_chunk_rows;
    use crate::core::descs::{DescTable, StridedRow};

    #[test]
    fn regions_of_different_layouts_and_plain_regions_emit_their_direct_ids() {
        // Three dense regions of 40, 70 and 40 units; the first two coalesced (two layouts), the third not.
        let counts = [40u64, 70, 40];
        let starts = [0u64, 40, 110];
        let rows = (0..3)
            .map(|i| StridedRow {
                addr: 0x10000 * (i as u64 + 1),
                len: 8,
                device: 0,
                stride: 8,
                count: counts[i],
            })
            .collect();
        let table = DescTable::new(rows, 150);
        let (_, chunk_starts) = with_chunk_rows(&table, &starts, &counts, &[true, true, false]);
        let chunks: Vec<_> = chunk_starts.into_iter().map(|c| c.map(|c| (c.clone(), c))).collect();
        let groups = [GroupKind::Attention];
        let region_groups = vec![vec![0], vec![0], vec![0]];
        let space = IdSpace::new(&counts, 150, &[], 1, (1, 1), 16, 40, &region_groups, &groups);
        let units = BlockUnits::new(16, 16).unwrap();
        let slots = Slots::new(&groups, &region_groups, (&[], &[]), (&space, &space), &chunks, units);
        assert_eq!(slots.layouts.len(), 2);
        // Runs of 12, 8 and 2 units consecutive on both sides: three 4-unit chunks, one 8 and one 2.
        let lids = vec![(0..20).chain([30, 31]).collect::<Vec<u64>>()];
        let rids = vec![(5..17).chain(20..28).chain([35, 36]).collect::<Vec<u64>>()];
        let w = [Window::all(22)];
        let windows = Windows {
            local: (&lids, &w, 1),
            remote: (&rids, &w, 1),
        };
        let ids = slots.request(&groups, &windows);
        let (mut lo, mut ro) = (Vec::new(), Vec::new());
        slots.emit(&[true], &ids, &mut lo, &mut ro);

        let mut runs = Vec::new();
        assert!(chunk_runs(
            UnitCursor::new(&lids[0], 1, w[0]),
            UnitCursor::new(&rids[0], 1, w[0]),
            usize::MAX,
            &mut runs,
        ));
        let js: Vec<u32> = runs.iter().map(|r| r.j).collect();
        assert_eq!(js, [2, 2, 2, 3, 1], "{runs:?}");
        let (mut want_l, mut want_r) = (Vec::new(), Vec::new());
        for r in 0..3 {
            if let Some((c, _)) = &chunks[r] {
                for &Run { l, r: rr, j } in &runs {
                    let id = |k: u64| if j == 0 { starts[r] + k } else { c.id(k, j) };
                    want_l.push(id(l) as i32);
                    want_r.push(id(rr) as i32);
                }
            } else {
                want_l.extend(lids[0].iter().map(|&u| (starts[r] + u) as i32));
                want_r.extend(rids[0].iter().map(|&u| (starts[r] + u) as i32));
            }
        }
        assert_eq!((lo, ro), (want_l, want_r));
    }
}
