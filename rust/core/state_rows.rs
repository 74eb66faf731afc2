//! Whole-state rows: one descriptor for an SSM state whose pieces are contiguous on both sides.
//!
//! An SSM state is `[conv sub-projection 0 | 1 | 2 | temporal state | padding]` (docs/byte-layouts.md), and the tables
//! address it as one row per piece ("stream"), so that a rank can take its channel or head share of each
//! piece when the TP sizes differ. With equal TP every piece moves whole and the pieces are adjacent on both
//! sides: four descriptors (three conv pieces and the temporal state) for what is one contiguous range. For
//! such pairs a row per SSM region addressing the whole state, `(base, state bytes, page stride, states)`, is
//! appended after every other row (so no existing id moves), and a state is one id instead of one per piece.
//!
//! The base local table gets these rows whenever its own pieces are contiguous (always: they are laid out
//! that way), since it is prepped before any handshake; a remote table gets them only when its pieces are
//! contiguous too, which is what decides whether a plan uses them.

use super::descs::{DescTable, StridedRow};

/// `table` with one whole-state row appended per SSM region, and the flat id of each region's first state;
/// `None` (no row added) when some region's piece rows are not one contiguous range, or no region has two.
///
/// The SSM piece rows start at the table's `num_fa` boundary, `streams[k]` consecutive rows for the `k`-th SSM
/// region (the same number for every region of whole states; a region holding part of a state, one tensor of a
/// state split over several, has its part's).
pub fn with_state_rows(table: &DescTable, streams: &[usize]) -> Option<(DescTable, Vec<u64>)> {
    if streams.iter().all(|&n| n < 2) {
        return None; // nothing to join
    }
    let first = table.row_starts().partition_point(|&s| s < table.num_fa);
    let total = streams.iter().try_fold(0usize, |a, &n| a.checked_add(n))?;
    let mut pieces = table.rows.get(first..first.checked_add(total)?)?;
    let mut joined: Vec<StridedRow> = Vec::with_capacity(streams.len());
    for &n in streams {
        let (these, rest) = pieces.split_at(n);
        joined.push(join(these)?);
        pieces = rest;
    }
    let mut rows = Vec::with_capacity(table.rows.len() + joined.len());
    rows.extend_from_slice(&table.rows);
    let mut next = table.len();
    let mut starts = Vec::with_capacity(joined.len());
    for row in joined {
        starts.push(next);
        next = next.checked_add(row.count)?;
        rows.push(row);
    }
    Some((DescTable::new(rows, table.num_fa), starts))
}

/// One row covering `pieces` when each starts where the previous ends and all share stride and count.
fn join(pieces: &[StridedRow]) -> Option<StridedRow> {
    let first = pieces.first()?;
    let mut len = 0u64;
    for p in pieces {
        let adjacent = p.addr == first.addr.checked_add(len)?;
        if !adjacent || p.stride != first.stride || p.count != first.count || p.device != first.device {
            return None;
        }
        len = len.checked_add(p.len)?;
    }
    (len <= first.stride).then_some(StridedRow { len, ..*first })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(addr: u64, len: u64) -> StridedRow {
        StridedRow {
            addr,
            len,
            device: 0,
            stride: 100,
            count: 5,
        }
    }

    #[test]
    fn contiguous_pieces_become_one_row_per_region_after_every_other_row() {
        let attn = StridedRow {
            addr: 0x9000,
            len: 16,
            device: 0,
            stride: 16,
            count: 10,
        };
        // Two SSM regions of pieces 6 + 6 + 12 + 32 bytes.
        let t = DescTable::new(
            vec![
                attn,
                row(1000, 6),
                row(1006, 6),
                row(1012, 12),
                row(1024, 32),
                row(5000, 6),
                row(5006, 6),
                row(5012, 12),
                row(5024, 32),
            ],
            10,
        );
        let (joined, starts) = with_state_rows(&t, &[4, 4]).unwrap();
        assert_eq!(joined.rows[..9], t.rows[..]);
        assert_eq!(joined.rows[9..], [row(1000, 56), row(5000, 56)]);
        assert_eq!(starts, [50, 55]);
        assert_eq!(joined.desc(52), Some((1000 + 2 * 100, 56)));
        assert_eq!(joined.desc(55), Some((5000, 56)));
    }

    #[test]
    fn a_share_of_each_piece_is_not_joined() {
        // Half of each piece (TP 2 reading a TP 1 state): the pieces are not adjacent.
        let t = DescTable::new(vec![row(1000, 3), row(1006, 3), row(1012, 6), row(1024, 16)], 0);
        assert_eq!(with_state_rows(&t, &[4]), None);
        let t = DescTable::new(vec![row(1000, 6)], 0);
        assert_eq!(with_state_rows(&t, &[1]), None, "a single piece needs no joining");
        assert_eq!(with_state_rows(&t, &[4, 4]), None, "rows missing");
    }
}
