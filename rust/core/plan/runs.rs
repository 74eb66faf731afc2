//! Chunk runs of one group's paired unit windows, found on the *logical* block ids: a logical block is
//! `u` consecutive units, so runs are walked one block (not one unit) at a time and the unit expansion of a
//! coalesced group is never materialised.

use super::trim::Window;
use crate::core::coalesce::MAX_CHUNK_LOG2;

/// `2^j` units starting at local unit `l` and remote unit `r` (`j == 0`: one unit, a plain id).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) l: u64,
    pub(crate) r: u64,
    pub(crate) j: u32,
}

/// Position in the window `w` of the unit expansion of logical `ids` (`u` units per logical block).
#[derive(Debug, Clone, Copy)]
pub(crate) struct UnitCursor<'a> {
    ids: &'a [u64],
    u: u64,
    block: usize,
    offset: u64,
    left: u64,
}

impl<'a> UnitCursor<'a> {
    /// Cursor at the first unit of window `w` of `ids` expanded to `u` units per id.
    pub(crate) fn new(ids: &'a [u64], u: u64, w: Window) -> UnitCursor<'a> {
        UnitCursor {
            ids,
            u,
            block: (w.start / u) as usize,
            offset: w.start % u,
            left: w.len,
        }
    }

    /// The current unit and how many consecutive units follow it inside its logical block and the window.
    fn span(&self) -> (u64, u64) {
        (
            self.ids[self.block] * self.u + self.offset,
            (self.u - self.offset).min(self.left),
        )
    }

    fn advance(&mut self, n: u64) {
        self.offset += n;
        self.left -= n;
        if self.offset == self.u {
            (self.block, self.offset) = (self.block + 1, 0);
        }
    }
}

/// Append to `out` the chunks of two equally long unit windows: every maximal run of units consecutive on
/// both sides is cut into equal chunks of the largest power of two dividing its length (see [`cut`]), so a
/// lone unit, or any run of odd length, is `j == 0` runs (plain ids).
///
/// Stops early, returning `false`, once `out` holds more than `limit` runs (the caller then plans the group
/// one id per unit, and a fragmented request is not walked to its end for nothing).
pub(crate) fn chunk_runs(mut l: UnitCursor<'_>, mut r: UnitCursor<'_>, limit: usize, out: &mut Vec<Run>) -> bool {
    let mut left = l.left.min(r.left);
    if l.u == r.u && l.offset == r.offset {
        return aligned_runs(l, r, left, limit, out);
    }
    // The maximal run being grown: (local start, remote start, units).
    let mut open: Option<(u64, u64, u64)> = None;
    while left > 0 {
        let ((lu, ln), (ru, rn)) = (l.span(), r.span());
        let take = ln.min(rn).min(left);
        open = match open {
            Some((l0, r0, n)) if l0 + n == lu && r0 + n == ru => Some((l0, r0, n + take)),
            other => {
                if let Some(run) = other {
                    if !cut(run, limit, out) {
                        return false;
                    }
                }
                Some((lu, ru, take))
            }
        };
        l.advance(take);
        r.advance(take);
        left -= take;
    }
    open.is_none_or(|run| cut(run, limit, out))
}

/// [`chunk_runs`] when the two windows' logical blocks pair one to one (same units per block, same offset
/// into the first block): a run continues exactly while both sides' next logical ids are consecutive, so
/// it is found by one tight scan of the id lists.
fn aligned_runs(l: UnitCursor<'_>, r: UnitCursor<'_>, left: u64, limit: usize, out: &mut Vec<Run>) -> bool {
    if left == 0 {
        return true;
    }
    let (u, first) = (l.u, l.offset);
    let blocks = (first + left).div_ceil(u) as usize;
    let (ls, rs) = (&l.ids[l.block..l.block + blocks], &r.ids[r.block..r.block + blocks]);
    let mut i = 0;
    while i < blocks {
        let mut k = i + 1;
        while k < blocks && ls[k] == ls[k - 1] + 1 && rs[k] == rs[k - 1] + 1 {
            k += 1;
        }
        // Window units of blocks i..k, as offsets into block i.
        let (b0, b1) = (i as u64 * u, k as u64 * u);
        let (start, end) = (b0.max(first), b1.min(first + left));
        if !cut(
            (ls[i] * u + start - b0, rs[i] * u + start - b0, end - start),
            limit,
            out,
        ) {
            return false;
        }
        i = k;
    }
    true
}

/// Cut one maximal run of `n` units into `n / 2^j` equal chunks of `2^j` units, `j` the largest with `2^j`
/// dividing `n` (at most [`MAX_CHUNK_LOG2`]); `false` once `out` would hold more than `limit` runs.
///
/// Equal chunks of one run are consecutive ids of one chunk row on both sides, which NIXL merges back into one
/// descriptor, exactly as it merges the run's plain unit ids: a coalesced plan never posts more descriptors
/// than the reference plan after NIXL's merge, only fewer ids. (Cutting largest-first, a run of 7 units was
/// three ids in three rows: three descriptors where the reference posts one.)
fn cut((l, r, n): (u64, u64, u64), limit: usize, out: &mut Vec<Run>) -> bool {
    let j = n.trailing_zeros().min(MAX_CHUNK_LOG2);
    let count = n >> j;
    if (out.len() as u64).saturating_add(count) > limit as u64 {
        return false;
    }
    out.extend((0..count).map(|i| Run {
        l: l + (i << j),
        r: r + (i << j),
        j,
    }));
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::plan::ids::window_units;
    use proptest::prelude::*;

    /// The definition, over the materialised unit lists: every maximal run of units consecutive on both sides,
    /// cut into equal chunks of the largest power of two (at most 2^MAX_CHUNK_LOG2) dividing its length.
    fn unit_level(l: &[u64], r: &[u64]) -> Vec<Run> {
        let n = l.len().min(r.len());
        let (mut out, mut i) = (Vec::new(), 0);
        while i < n {
            let (l0, r0) = (l[i], r[i]);
            let mut m = 1;
            while i + m < n && l[i + m] == l0 + m as u64 && r[i + m] == r0 + m as u64 {
                m += 1;
            }
            let j = m.trailing_zeros().min(MAX_CHUNK_LOG2);
            for c in 0..(m >> j) as u64 {
                out.push(Run {
                    l: l0 + (c << j),
                    r: r0 + (c << j),
                    j,
                });
            }
            i += m;
        }
        out
    }

    fn ids_strategy() -> impl Strategy<Value = Vec<u64>> {
        // Mostly consecutive ids with jumps, so long runs and breaks both occur.
        prop::collection::vec((0u64..3, 0u64..40), 1..60).prop_map(|steps| {
            let mut cur = 100;
            steps
                .into_iter()
                .map(|(kind, jump)| {
                    cur = if kind == 0 { cur + 2 + jump } else { cur + 1 };
                    cur
                })
                .collect()
        })
    }

    /// `chunk_runs` over the two windows equals [`unit_level`] over their materialised units.
    fn assert_definition(
        (lids, lu, lw): (&[u64], u64, Window),
        (rids, ru, rw): (&[u64], u64, Window),
    ) -> Result<(), TestCaseError> {
        let mut got = Vec::new();
        prop_assert!(chunk_runs(
            UnitCursor::new(lids, lu, lw),
            UnitCursor::new(rids, ru, rw),
            usize::MAX,
            &mut got
        ));
        prop_assert_eq!(
            got,
            unit_level(&window_units(lids, lu, lw), &window_units(rids, ru, rw))
        );
        Ok(())
    }

    proptest! {
        #[test]
        fn logical_runs_equal_the_unit_level_definition(
            lids in ids_strategy(),
            rids in ids_strategy(),
            lu in 1u64..9,
            ru in 1u64..9,
            start in 0u64..20,
            len in 0u64..400,
        ) {
            let total = (lids.len() as u64 * lu).min(rids.len() as u64 * ru);
            let start = start.min(total);
            let len = len.min(total - start);
            // Equal-length windows at different offsets on the two sides, as trimming produces.
            let lw = Window { start: lids.len() as u64 * lu - start - len, len };
            let rw = Window { start, len };
            assert_definition((&lids, lu, lw), (&rids, ru, rw))?;
        }
    }

    proptest! {
        #[test]
        fn aligned_runs_equal_the_unit_level_definition(
            lids in ids_strategy(),
            rids in ids_strategy(),
            u in 1u64..9,
            l_block in 0u64..60,
            r_block in 0u64..60,
            offset in 0u64..8,
            len in 0u64..400,
        ) {
            // Same units per block and the same offset into the first block on both sides.
            let offset = offset % u;
            let (nl, nr) = (lids.len() as u64, rids.len() as u64);
            let lw = Window { start: (l_block % nl) * u + offset, len: 0 };
            let rw = Window { start: (r_block % nr) * u + offset, len: 0 };
            let len = len.min(nl * u - lw.start).min(nr * u - rw.start);
            let (lw, rw) = (Window { len, ..lw }, Window { len, ..rw });
            assert_definition((&lids, u, lw), (&rids, u, rw))?;
        }
    }

    proptest! {
        #[test]
        fn the_run_limit_stops_exactly_when_there_are_more_runs(
            lids in ids_strategy(),
            rids in ids_strategy(),
            lu in 1u64..5,
            ru in 1u64..5,
            limit in 0usize..40,
        ) {
            // Same or different units per block: the aligned and the general walk.
            let w = Window { start: 0, len: (lids.len() as u64 * lu).min(rids.len() as u64 * ru) };
            let (l, r) = (UnitCursor::new(&lids, lu, w), UnitCursor::new(&rids, ru, w));
            let mut all = Vec::new();
            chunk_runs(l, r, usize::MAX, &mut all);
            let mut got = Vec::new();
            let complete = chunk_runs(l, r, limit, &mut got);
            prop_assert_eq!(complete, all.len() <= limit);
            if complete {
                prop_assert_eq!(got, all);
            }
        }
    }

    #[test]
    fn a_long_contiguous_run_is_cut_into_equal_chunks_of_one_row() {
        let ids: Vec<u64> = (0..20).collect();
        let cut_of = |units: u64| {
            let mut got = Vec::new();
            let w = Window { start: 0, len: units };
            assert!(chunk_runs(
                UnitCursor::new(&ids, 8, w),
                UnitCursor::new(&ids, 8, w),
                usize::MAX,
                &mut got
            ));
            got
        };
        // 160 units = 5 x 32: five consecutive ids of the 32-unit row (one descriptor once NIXL merges them).
        let got = cut_of(160);
        assert_eq!(got.iter().map(|r| r.j).collect::<Vec<_>>(), [5; 5]);
        assert_eq!((got[4].l, got[4].r), (128, 128));
        // 128 units: two 64-unit chunks; 7 units: seven plain ids (the reference's one merged descriptor).
        assert_eq!(cut_of(128).iter().map(|r| r.j).collect::<Vec<_>>(), [6, 6]);
        assert_eq!(cut_of(7).iter().map(|r| r.j).collect::<Vec<_>>(), [0; 7]);
    }
}
