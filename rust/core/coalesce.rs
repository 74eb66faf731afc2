//! Coalesced chunk rows: one descriptor for a run of `2^j` consecutive units of a dense region.
//!
//! A plan emits one descriptor id per unit per region, so a long request is mostly runs of consecutive ids
//! (a 128K-token DeepSeek-V3 request: 61 regions x 2048 blocks = 124,928 pairs), which makes planning
//! memory-bound and makes NIXL validate every index before it merges consecutive ones. For every attention
//! region whose unit descriptors are *dense* in a table (one strided row with `len == stride`, so unit `k+1`
//! starts where unit `k` ends) rows are appended after every existing row (after the SSM rows, so the
//! attention/SSM id formulas and `num_fa` are unchanged):
//!
//! ```text
//! for j in 1..=MAX_CHUNK_LOG2, for phase p in 0..2^j:
//!     (base + p*unit, 2^j*unit, dev, 2^j*unit, floor((count - p) / 2^j))     (rows of count 0 skipped)
//! ```
//!
//! The run of `2^j` units starting at unit `k` is then descriptor `k / 2^j` of row `(j, k mod 2^j)`; it
//! exists exactly when `k + 2^j <= count`. Rows of one table may cover the same memory (NIXL 1.5 accepts
//! that; only `len > stride` *inside* one row is refused), and appending rows keeps every existing id valid,
//! since ids index the flat expansion in row order. Every chunk row has `len == stride`.
//!
//! The planner walks a group's paired local and remote units (found on the logical block ids, in
//! `plan/runs.rs`) and, where both are consecutive and the region is dense on *both* sides, cuts each
//! maximal run into equal chunks of the largest `2^j` dividing its length (same `j` on both sides, so pairs
//! keep equal lengths). The chunk ids of one run are consecutive in one row on both sides, so NIXL merges
//! them into one descriptor, as it merges the run's plain ids: never more descriptors than the reference
//! plan. Everything else stays one id per unit. Chunk rows
//! are added to the base local table for every dense attention region (so it depends on the local rank
//! alone and can be prepped before any handshake: [`RegionTable::coalesced_local_table`]), to split tables
//! for the regions dense in all of them (MLA, kept whole; head-sharded split rows are not dense), and to
//! remote tables for the regions dense there and in the local tables the routes use. SSM streams never get
//! chunk rows. `PeerPlan::with_coalescing(.., false)` builds the reference tables and ids (one id per unit, no
//! extra rows) for NIXL < 1.5 users, whose flat `(N, 3)` tables would otherwise grow `J + 1` times.

use std::sync::{Arc, Mutex, PoisonError, Weak};

use super::descs::{DescTable, StridedRow};
use super::error::LayoutError;
use super::region::hosts_attention;
use super::region::RegionTable;
use super::state_rows::with_state_rows;

/// Largest chunk is `2^MAX_CHUNK_LOG2` = 64 units.
///
/// Per request a contiguous run of `n` units costs about `n / 2^J + J` ids, while the flat expansion of a
/// dense region grows from `N` to about `(J + 1) * N` descriptors and its strided form by `2^(J+1) - 2`
/// rows. At 64 a 128K-token DeepSeek-V3 request (2048 blocks per region) needs 32 ids per region instead of
/// 2048 (64x fewer, well below NIXL's per-transfer fixed cost), while the table grows 7x in descriptors and
/// by 126 rows per region: a larger `J` halves an already small id count again for another `N` descriptors
/// and twice the rows.
pub const MAX_CHUNK_LOG2: u32 = 6;

/// Number of chunk rows (nonempty or not) per coalesced region: `2^(J+1) - 2`.
pub const CHUNK_ROWS: usize = (1 << (MAX_CHUNK_LOG2 + 1)) - 2;

/// Flat start of every chunk row of one region, indexed by `2^j - 2 + p`: the region's first chunk start plus
/// starts relative to it, which depend on the region's unit count alone (so regions of equal counts share one
/// copy of them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkStarts {
    base: u64,
    rel: Arc<[u64]>,
    units: u64,
}

impl ChunkStarts {
    /// Descriptor id of the run of `2^j` units (`j >= 1`) starting at unit `k` of the region.
    #[inline]
    pub fn id(&self, k: u64, j: u32) -> u64 {
        let size = 1u64 << j;
        self.base + self.rel[(size - 2 + (k & (size - 1))) as usize] + (k >> j)
    }

    /// The flat start of the region's first chunk row, and the starts relative to it (which depend on the
    /// region's unit count alone, so regions of equal counts share them).
    pub fn split_base(&self) -> (u64, ChunkStarts) {
        let rel = ChunkStarts {
            base: 0,
            rel: Arc::clone(&self.rel),
            units: self.units,
        };
        (self.base, rel)
    }

    /// The flat start of the region's first chunk row.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Whether `rel` is `split_base().1`: the starts of a region of as many units, relative to its first (a
    /// count comparison, since [`relative_starts`] derives them from the count alone).
    pub fn relative_is(&self, rel: &ChunkStarts) -> bool {
        let same = self.units == rel.units;
        debug_assert_eq!(same, *rel == self.split_base().1);
        same
    }
}

/// The chunk rows' starts relative to the first, indexed by `2^j - 2 + p`, of a dense region of `units` units
/// (empty rows included: they take no ids), and how many descriptors they add.
fn relative_starts(units: u64) -> (Arc<[u64]>, u64) {
    let mut rel = Vec::with_capacity(CHUNK_ROWS);
    let mut id = 0u64;
    for j in 1..=MAX_CHUNK_LOG2 {
        for p in 0..1u64 << j {
            rel.push(id);
            id += units.saturating_sub(p) >> j;
        }
    }
    (rel.into(), id)
}

/// The region's dense unit row `(row, unit bytes)` when the flat range `[start, start + count)` of `table`
/// is exactly one row with `len == stride`.
pub fn dense_row(table: &DescTable, start: u64, count: u64) -> Option<StridedRow> {
    let starts = table.row_starts();
    let i = starts.partition_point(|&s| s < start);
    let row = table.rows.get(i)?;
    (starts[i] == start && row.count == count && row.len == row.stride && count >= 2).then_some(*row)
}

/// Append the chunk rows of a dense unit row to `rows`, in `(j, p)` order, rows of count 0 skipped (they add no
/// descriptors).
///
/// A row of at least `2^(J+1) - 1` units (every real region) has no empty chunk row: its rows are written as
/// fixed-length runs, one per `j` with the shift a constant (an iterator chain dividing by the chunk size, and
/// then a shift by a variable, were most of the rows' construction).
fn push_chunk_rows(row: &StridedRow, rows: &mut Vec<StridedRow>) {
    fn run<const J: u32>(row: &StridedRow, rows: &mut Vec<StridedRow>) {
        let len = row.len << J;
        rows.extend((0..1u64 << J).map(|p| StridedRow {
            addr: row.addr + p * row.len,
            len,
            device: row.device,
            stride: len,
            count: (row.count - p) >> J,
        }));
    }
    const _: () = assert!(MAX_CHUNK_LOG2 == 6, "push_chunk_rows writes runs for j = 1..=6");
    if row.count >= (2 << MAX_CHUNK_LOG2) - 1 {
        rows.reserve(CHUNK_ROWS);
        run::<1>(row, rows);
        run::<2>(row, rows);
        run::<3>(row, rows);
        run::<4>(row, rows);
        run::<5>(row, rows);
        run::<6>(row, rows);
        return;
    }
    for j in 1..=MAX_CHUNK_LOG2 {
        for p in 0..1u64 << j {
            let count = row.count.saturating_sub(p) >> j;
            if count > 0 {
                rows.push(StridedRow {
                    addr: row.addr + p * row.len,
                    len: row.len << j,
                    device: row.device,
                    stride: row.len << j,
                    count,
                });
            }
        }
    }
}

/// Append chunk rows for every region `r` with `coalesce[r]` (each must have a [`dense_row`] in `table`;
/// `region_start[r]` is its flat start and `region_count[r]` its unit count). Returns the table and the
/// chunk starts of every coalesced region.
pub fn with_chunk_rows(
    table: &DescTable,
    region_start: &[u64],
    region_count: &[u64],
    coalesce: &[bool],
) -> (DescTable, Vec<Option<ChunkStarts>>) {
    let chunked = coalesce.iter().filter(|&&c| c).count();
    let mut rows = Vec::with_capacity(table.rows.len() + chunked * CHUNK_ROWS);
    rows.extend_from_slice(&table.rows);
    let mut row_starts = Vec::with_capacity(rows.capacity());
    row_starts.extend_from_slice(table.row_starts());
    let mut next = table.len();
    let mut starts = Vec::with_capacity(coalesce.len());
    let mut last: Option<(u64, Arc<[u64]>, u64)> = None; // the relative starts of the last unit count seen
    for r in 0..coalesce.len() {
        let dense = coalesce[r]
            .then(|| dense_row(table, region_start[r], region_count[r]))
            .flatten();
        let Some(row) = dense else {
            starts.push(None);
            continue;
        };
        let (rel, added) = match &last {
            Some((units, rel, added)) if *units == row.count => (Arc::clone(rel), *added),
            _ => {
                let (rel, added) = relative_starts(row.count);
                last = Some((row.count, Arc::clone(&rel), added));
                (rel, added)
            }
        };
        let first = rows.len();
        push_chunk_rows(&row, &mut rows);
        if rows.len() - first == CHUNK_ROWS {
            row_starts.extend(rel.iter().map(|s| next + s));
        } else {
            let counts = rows[first..].iter().map(|c| c.count);
            row_starts.extend(counts.scan(next, |id, c| Some(std::mem::replace(id, *id + c))));
        }
        starts.push(Some(ChunkStarts {
            base: next,
            rel,
            units: row.count,
        }));
        next += added;
    }
    (DescTable::with_starts(rows, table.num_fa, row_starts, next), starts)
}

/// A base local table with its chunk rows, and the chunk starts of every region.
pub type ChunkedBase = (Arc<DescTable>, Vec<Option<ChunkStarts>>);

/// Most base tables a [`ChunkedBases`] keeps: one per local sub-block count a peer's kernel block size asks for
/// (a peer's payload chooses it, so the cache is bounded; the oldest entry goes first).
pub const MAX_CHUNKED_BASES: usize = 4;

/// What [`with_chunk_rows`] was given: `(table, region_start, region_count, coalesce)`.
type ChunkInputs = (DescTable, Vec<u64>, Vec<u64>, Vec<bool>);

/// The chunked base local tables of one rank, built once and shared (`Arc`) by every coalescing
/// [`PeerPlan`](super::plan::PeerPlan) of the rank: they depend on the local rank alone, and building their
/// chunk rows (126 per dense region) was a third of a DeepSeek-V3 peer's table construction.
///
/// An entry is [`with_chunk_rows`] of the inputs stored with it and is used only for equal inputs (61 rows to
/// compare for DeepSeek-V3), so a hit returns exactly what a fresh build would. Not part of a table's identity:
/// clones start empty, and any two caches compare equal.
///
/// It also keeps, per base table it built, that table with its whole-state rows joined (`state_rows.rs`): the
/// table a hybrid model's plans actually hold, so that they share it too (the binding then copies its rows out
/// once and the transport preps it once for every peer engine).
#[derive(Debug, Default)]
pub struct ChunkedBases {
    chunked: Mutex<Vec<(ChunkInputs, Arc<ChunkedBase>)>>,
    joined: Mutex<Vec<JoinedEntry>>,
}

/// A base table (weakly held, compared by pointer), the `(regions, streams)` its state rows were joined for,
/// and what [`with_state_rows`] gave.
type JoinedEntry = (Weak<DescTable>, Vec<usize>, Option<JoinedBase>);

/// A table with whole-state rows joined, and each SSM region's first state id.
pub type JoinedBase = (Arc<DescTable>, Vec<u64>);

impl ChunkedBases {
    /// [`with_chunk_rows`] of these inputs, built once per distinct inputs (at most [`MAX_CHUNKED_BASES`] kept).
    pub fn with_chunk_rows(
        &self,
        table: &DescTable,
        region_start: &[u64],
        region_count: &[u64],
        coalesce: &[bool],
    ) -> Arc<ChunkedBase> {
        let lock = || self.chunked.lock().unwrap_or_else(PoisonError::into_inner);
        let same = |(t, s, c, m): &ChunkInputs| {
            t == table && s[..] == *region_start && c[..] == *region_count && m[..] == *coalesce
        };
        if let Some((_, hit)) = lock().iter().find(|(inputs, _)| same(inputs)) {
            return Arc::clone(hit);
        }
        // Built outside the lock: a slow build never blocks another thread's lookups.
        let (chunked, starts) = with_chunk_rows(table, region_start, region_count, coalesce);
        let built = Arc::new((Arc::new(chunked), starts));
        let mut entries = lock();
        if entries.len() >= MAX_CHUNKED_BASES {
            entries.remove(0);
        }
        let inputs = (
            table.clone(),
            region_start.to_vec(),
            region_count.to_vec(),
            coalesce.to_vec(),
        );
        entries.push((inputs, Arc::clone(&built)));
        built
    }

    /// [`with_state_rows`] of `base`, built once per base table this cache holds (any other table is joined
    /// afresh and not kept).
    pub fn with_state_rows(&self, base: &Arc<DescTable>, streams: &[usize]) -> Option<JoinedBase> {
        let mine = || {
            let chunked = self.chunked.lock().unwrap_or_else(PoisonError::into_inner);
            chunked.iter().any(|(_, b)| Arc::ptr_eq(&b.0, base))
        };
        let join = || with_state_rows(base, streams).map(|(t, s)| (Arc::new(t), s));
        if !mine() {
            return join();
        }
        let lock = || self.joined.lock().unwrap_or_else(PoisonError::into_inner);
        let same = |(w, k, _): &JoinedEntry| std::ptr::eq(w.as_ptr(), Arc::as_ptr(base)) && k[..] == *streams;
        if let Some((_, _, hit)) = lock().iter().find(|e| same(e)) {
            return hit.clone();
        }
        let built = join();
        let mut entries = lock();
        entries.retain(|(w, _, _)| w.strong_count() > 0);
        if entries.len() >= MAX_CHUNKED_BASES {
            entries.remove(0);
        }
        entries.push((Arc::downgrade(base), streams.to_vec(), built.clone()));
        built
    }
}

impl Clone for ChunkedBases {
    fn clone(&self) -> Self {
        ChunkedBases::default()
    }
}

impl PartialEq for ChunkedBases {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for ChunkedBases {}

impl RegionTable {
    /// [`RegionTable::local_table`] with chunk rows for every attention region whose units are dense in it, then
    /// one whole-state row per SSM region (`state_rows.rs`).
    ///
    /// This is the base local table of every coalescing [`PeerPlan`](super::plan::PeerPlan) at this `bsr`
    /// (unless its tables would outgrow int32 ids): it depends on the local rank alone, so it can be prepped
    /// once before any handshake.
    ///
    /// # Errors
    /// As [`RegionTable::local_table`].
    pub fn coalesced_local_table(&self, bsr: u64) -> Result<DescTable, LayoutError> {
        let table = self.local_table(bsr)?;
        let counts: Vec<u64> = self.regions.iter().map(|r| r.num_blocks * bsr).collect();
        let starts: Vec<u64> = counts
            .iter()
            .scan(0, |acc, c| {
                let s = *acc;
                *acc += c;
                Some(s)
            })
            .collect();
        let eligible: Vec<bool> = self
            .regions
            .iter()
            .map(|r| hosts_attention(r.group, &self.groups))
            .collect();
        let chunked = with_chunk_rows(&table, &starts, &counts, &eligible).0;
        Ok(with_state_rows(&chunked, &self.ssm_streams_per_region()).map_or(chunked, |(t, _)| t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_id_resolves_to_its_units() {
        for count in [2u64, 3, 5, 64, 65, 126, 127, 128, 130] {
            let unit = StridedRow {
                addr: 0x1000,
                len: 8,
                device: 1,
                stride: 8,
                count,
            };
            let ssm = StridedRow {
                addr: 0x9000,
                len: 4,
                device: 1,
                stride: 16,
                count: 3,
            };
            let t = DescTable::new(vec![unit, ssm], count);
            let (c, starts) = with_chunk_rows(&t, &[0], &[count], &[true]);
            assert_eq!(c.rows[..2], t.rows[..]);
            assert!(c.rows.iter().all(|r| r.len <= r.stride && r.count > 0));
            let s = starts[0].as_ref().unwrap();
            for j in 1..=MAX_CHUNK_LOG2 {
                for k in 0..count {
                    if k + (1 << j) <= count {
                        let got = c.desc(s.id(k, j)).unwrap();
                        assert_eq!(got, (0x1000 + 8 * k, 8 << j), "count {count} k {k} j {j}");
                    }
                }
            }
        }
    }

    /// The chunk rows as the module doc defines them, one by one (rows of count 0 skipped).
    fn naive_chunk_rows(row: &StridedRow, next: u64) -> (Vec<StridedRow>, Vec<u64>, Vec<u64>) {
        let (mut rows, mut row_starts, mut starts, mut id) = (vec![], vec![], vec![], next);
        for j in 1..=MAX_CHUNK_LOG2 {
            for p in 0..1u64 << j {
                let count = if row.count > p { (row.count - p) / (1 << j) } else { 0 };
                starts.push(id);
                if count > 0 {
                    row_starts.push(id);
                    rows.push(StridedRow {
                        addr: row.addr + p * row.len,
                        len: row.len * (1 << j),
                        device: row.device,
                        stride: row.len * (1 << j),
                        count,
                    });
                }
                id += count;
            }
        }
        (rows, row_starts, starts)
    }

    #[test]
    fn chunk_rows_are_the_naive_ones_for_every_count() {
        for count in (2u64..300).chain([1 << 20, 100_000, 100_001]) {
            let row = StridedRow {
                addr: 0x10_0000,
                len: 576,
                device: 3,
                stride: 576,
                count,
            };
            let ssm = StridedRow {
                addr: 0x9000_0000,
                len: 4,
                device: 3,
                stride: 16,
                count: 2,
            };
            // two dense regions of the same count (one copy of the relative starts), an SSM row between them
            let t = DescTable::new(vec![row, ssm, StridedRow { addr: 0x80_0000, ..row }], 2 * count + 2);
            let (c, starts) = with_chunk_rows(&t, &[0, count + 2], &[count, count], &[true, true]);
            let (rows0, row_starts0, starts0) = naive_chunk_rows(&row, t.len());
            let next = t.len() + rows0.iter().map(|r| r.count).sum::<u64>();
            let (rows1, row_starts1, starts1) = naive_chunk_rows(&StridedRow { addr: 0x80_0000, ..row }, next);
            assert_eq!(c.rows[3..], [rows0, rows1].concat(), "count {count}");
            assert_eq!(
                c.row_starts()[3..],
                [row_starts0, row_starts1].concat(),
                "count {count}"
            );
            assert_eq!(
                c,
                DescTable::new(c.rows.clone(), t.num_fa),
                "starts and total agree with the rows"
            );
            for (s, want) in starts.iter().zip([starts0, starts1]) {
                let s = s.as_ref().unwrap();
                let got: Vec<u64> = (0..CHUNK_ROWS).map(|i| s.base + s.rel[i]).collect();
                assert_eq!(got, want, "count {count}");
            }
            let (a, b) = (starts[0].as_ref().unwrap(), starts[1].as_ref().unwrap());
            assert!(Arc::ptr_eq(&a.rel, &b.rel) && a.relative_is(&b.split_base().1));
        }
    }

    #[test]
    fn strided_or_partial_rows_are_not_dense() {
        let row = |len, stride, count| StridedRow {
            addr: 0,
            len,
            device: 0,
            stride,
            count,
        };
        let t = DescTable::new(vec![row(8, 16, 10), row(8, 8, 10), row(8, 8, 1)], 21);
        assert!(dense_row(&t, 0, 10).is_none());
        assert!(dense_row(&t, 10, 10).is_some());
        assert!(dense_row(&t, 10, 5).is_none());
        assert!(dense_row(&t, 20, 1).is_none());
        let (c, s) = with_chunk_rows(&t, &[0, 10, 20], &[10, 10, 1], &[true, true, true]);
        assert_eq!(s.iter().filter(|s| s.is_some()).count(), 1);
        assert!(c.rows.len() > 3);
    }

    #[test]
    fn chunked_bases_build_once_per_inputs_and_stay_bounded() {
        let table = |count| {
            let row = StridedRow {
                addr: 0x1000,
                len: 8,
                device: 0,
                stride: 8,
                count,
            };
            DescTable::new(vec![row], count)
        };
        let cache = ChunkedBases::default();
        let t = table(200);
        let a = cache.with_chunk_rows(&t, &[0], &[200], &[true]);
        let b = cache.with_chunk_rows(&t, &[0], &[200], &[true]);
        assert!(Arc::ptr_eq(&a, &b), "equal inputs share one build");
        let (fresh, starts) = with_chunk_rows(&t, &[0], &[200], &[true]);
        assert_eq!((&*a.0, &a.1), (&fresh, &starts), "a hit is what a fresh build gives");
        // Any input differing builds anew: another table, other counts, another mask.
        let other = cache.with_chunk_rows(&table(300), &[0], &[300], &[true]);
        assert_eq!(
            other.0.len(),
            with_chunk_rows(&table(300), &[0], &[300], &[true]).0.len()
        );
        let unmasked = cache.with_chunk_rows(&t, &[0], &[200], &[false]);
        assert_eq!(unmasked.0.rows.len(), 1);
        // Bounded: a peer choosing many sub-block counts cannot grow it past MAX_CHUNKED_BASES.
        for n in 0..3 * MAX_CHUNKED_BASES as u64 {
            cache.with_chunk_rows(&table(400 + n), &[0], &[400 + n], &[true]);
        }
        assert_eq!(cache.chunked.lock().unwrap().len(), MAX_CHUNKED_BASES);
        assert_eq!(cache.clone().chunked.lock().unwrap().len(), 0, "clones start empty");
    }
}
