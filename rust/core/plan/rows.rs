//! Rows appended to a peer plan's tables when it coalesces: chunk rows for runs of dense attention units
//! (`coalesce.rs`) and whole-state rows for SSM states contiguous on both sides (`state_rows.rs`). Appended
//! rows never move an existing descriptor id, and a table they would push past int32 ids is left as it was.

use std::sync::Arc;

use super::ids::{IdSpace, ID_LIMIT};
use super::key::TableKey;
use crate::core::coalesce::{dense_row, with_chunk_rows, ChunkStarts, ChunkedBase};
use crate::core::descs::DescTable;
use crate::core::region::RegionTable;
use crate::core::state_rows::with_state_rows;

/// Per-region chunk starts `(local, remote)` of the regions coalesced on both sides.
pub(super) type RegionChunks = Vec<Option<(ChunkStarts, ChunkStarts)>>;

/// The flat id of each SSM region's first whole state, local and remote.
pub(super) type StateStarts = (Vec<u64>, Vec<u64>);

/// Append chunk rows for the remote ranks in `chunk_ranks` (`None`: no chunk rows, the units of per-head pieces
/// not being consecutive descriptors), then whole-state rows. Returns each region's chunk starts and, when plans
/// use whole-state rows, where each SSM region's states start on both sides.
pub(super) fn append_rows(
    local: &RegionTable,
    local_tables: &mut [(TableKey, Arc<DescTable>)],
    remote_tables: &mut [(u32, DescTable)],
    chunk_ranks: Option<&[u32]>,
    region_groups: &[Vec<usize>],
    l_side: (&IdSpace, &[u64]),
    r_side: (&IdSpace, &[u64]),
) -> (RegionChunks, Option<StateStarts>) {
    let chunks = match chunk_ranks {
        Some(ranks) => add_chunk_rows(local, local_tables, remote_tables, ranks, region_groups, l_side, r_side),
        None => vec![None; region_groups.len()],
    };
    let states = add_state_rows(local, local_tables, remote_tables, &local.ssm_streams_per_region());
    (chunks, states)
}

/// Append chunk rows: to the base local table for every attention region dense in it (so the base table
/// depends on the local rank alone and can be prepped before any handshake, see
/// [`RegionTable::coalesced_local_table`](crate::core::RegionTable::coalesced_local_table)), to the split tables for the attention regions dense in all of
/// them (MLA, kept whole), and to the remote tables for the regions dense there and in the local tables the
/// routes use. Returns the per-region chunk starts of the regions coalesced on both sides (none at all when a
/// table would outgrow int32 ids; every table is then left as it was).
fn add_chunk_rows(
    local_rank: &RegionTable,
    local_tables: &mut [(TableKey, Arc<DescTable>)],
    remote_tables: &mut [(u32, DescTable)],
    attention_ranks: &[u32],
    region_groups: &[Vec<usize>],
    (l_space, l_counts): (&IdSpace, &[u64]),
    (r_space, r_counts): (&IdSpace, &[u64]),
) -> RegionChunks {
    let none = || vec![None; region_groups.len()];
    let dense = |tables: &[&DescTable], starts: &[u64], counts: &[u64]| -> Vec<bool> {
        (0..region_groups.len())
            .map(|r| {
                !region_groups[r].is_empty() && tables.iter().all(|t| dense_row(t, starts[r], counts[r]).is_some())
            })
            .collect()
    };
    let locals: Vec<&DescTable> = local_tables.iter().map(|(_, t)| &**t).collect();
    let base_mask = dense(&locals[..1], &l_space.region_start, l_counts);
    // Every route uses a split table when there are any, else the base table.
    let used_mask = if locals.len() > 1 {
        dense(&locals[1..], &l_space.region_start, l_counts)
    } else {
        base_mask.clone()
    };
    let remotes: Vec<&DescTable> = remote_tables.iter().map(|(_, t)| t).collect();
    let remote_mask: Vec<bool> = dense(&remotes, &r_space.region_start, r_counts)
        .iter()
        .zip(&used_mask)
        .map(|(&r, &l)| r && l)
        .collect();
    // The base table's chunk rows depend on the local rank alone: built once per rank, shared by its plans.
    let local: Vec<Arc<ChunkedBase>> = local_tables
        .iter()
        .enumerate()
        .map(|(i, (_, t))| {
            if i == 0 {
                local_rank
                    .chunked_bases
                    .with_chunk_rows(t, &l_space.region_start, l_counts, &base_mask)
            } else {
                let (c, s) = with_chunk_rows(t, &l_space.region_start, l_counts, &used_mask);
                Arc::new((Arc::new(c), s))
            }
        })
        .collect();
    let remote: Vec<Option<_>> = remote_tables
        .iter()
        .map(|(rank, t)| {
            attention_ranks
                .contains(rank)
                .then(|| with_chunk_rows(t, &r_space.region_start, r_counts, &remote_mask))
        })
        .collect();
    let Some((_, remote_starts)) = remote.iter().flatten().next() else {
        // No route exchanges attention, so no chunk id is ever planned; the base table still gets its chunk
        // rows, since it depends on the local rank alone (prepped before any handshake).
        if let Some(base) = local.first().filter(|b| b.0.len() <= ID_LIMIT) {
            local_tables[0].1 = Arc::clone(&base.0);
        }
        return none();
    };
    if local.iter().any(|b| b.0.len() > ID_LIMIT) || remote.iter().flatten().any(|(t, _)| t.len() > ID_LIMIT) {
        return none();
    }
    // Chunk starts depend only on the region counts and the mask, so all split (all remote) tables agree.
    let used = if local.len() > 1 { &local[1].1 } else { &local[0].1 };
    let chunks = used
        .iter()
        .zip(remote_starts)
        .zip(&remote_mask)
        .map(|((l, r), &m)| if m { l.clone().zip(r.clone()) } else { None })
        .collect();
    for ((_, t), c) in local_tables.iter_mut().zip(&local) {
        *t = Arc::clone(&c.0);
    }
    for ((_, t), c) in remote_tables.iter_mut().zip(remote) {
        if let Some((c, _)) = c {
            *t = c;
        }
    }
    chunks
}

/// Append whole-state rows (`state_rows.rs`) to the base local table (always, as
/// [`RegionTable::coalesced_local_table`](crate::core::RegionTable::coalesced_local_table) does) and, when the routes use the base table for SSM state (no split
/// tables) and every remote table's pieces are contiguous too (equal TP), to the remote tables. Returns the
/// flat id of each SSM region's first state on both sides when plans use them.
fn add_state_rows(
    local_rank: &RegionTable,
    local_tables: &mut [(TableKey, Arc<DescTable>)],
    remote_tables: &mut [(u32, DescTable)],
    streams: &[usize],
) -> Option<StateStarts> {
    // The chunked base table is the rank's own, so its joined form is built once and shared too.
    let (base, local_starts) = local_rank.chunked_bases.with_state_rows(&local_tables[0].1, streams)?;
    if base.len() > ID_LIMIT {
        return None;
    }
    local_tables[0].1 = base;
    if local_tables.len() > 1 {
        return None; // SSM state moves through split tables, in shares
    }
    let remote: Vec<(DescTable, Vec<u64>)> = remote_tables
        .iter()
        .map(|(_, t)| with_state_rows(t, streams).filter(|(t, _)| t.len() <= ID_LIMIT))
        .collect::<Option<_>>()?;
    let remote_starts = remote.first()?.1.clone();
    if remote.iter().any(|(_, s)| *s != remote_starts) {
        return None;
    }
    for ((_, t), (joined, _)) in remote_tables.iter_mut().zip(remote) {
        *t = joined;
    }
    Some((local_starts, remote_starts))
}
