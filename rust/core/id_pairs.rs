//! Checking a transfer's descriptor ids against the two tables they index, before NIXL sees them.
//!
//! A table is seen through the end of each row in flat descriptor ids (the running sum of the row counts)
//! and each row's descriptor length: an id is valid when it is below the last end, and a pair of ids may
//! move bytes only when both descriptors have the same length. Ids come from anyone who calls the transport,
//! so they are checked in full; the first bad one is reported by its position.

/// One table's shape as the check needs it: `ends[r]` is one past row `r`'s last flat id (non-decreasing),
/// `lens[r]` the length of each of its descriptors.
#[derive(Debug, Clone, Copy)]
pub struct TableView<'a> {
    /// Exclusive end of each row in flat descriptor ids.
    pub ends: &'a [u64],
    /// Bytes per descriptor of each row.
    pub lens: &'a [u64],
}

impl TableView<'_> {
    /// Number of descriptors (flat ids `0..size`).
    pub fn size(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
    }
}

/// The first thing wrong with a transfer's ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadIds {
    /// `ends` and `lens` of a table differ in length.
    Shape,
    /// The local id at this position is negative or not below the local table's size.
    LocalOutOfRange(usize),
    /// The remote id at this position is negative or not below the remote table's size.
    RemoteOutOfRange(usize),
    /// The local and remote id arrays differ in length.
    Count,
    /// The descriptors of the pair at this position differ in length.
    LengthMismatch(usize),
}

/// A walk over one table's rows that remembers the last row it found: ids of one transfer come in ascending
/// runs, so most lookups are one comparison.
struct RowFinder<'a> {
    view: TableView<'a>,
    row: usize,
}

impl<'a> RowFinder<'a> {
    fn new(view: TableView<'a>) -> Self {
        RowFinder { view, row: 0 }
    }

    /// Length of descriptor `id` (`id` must be below the table's size).
    fn len_of(&mut self, id: u64) -> u64 {
        let ends = self.view.ends;
        let start = if self.row == 0 { 0 } else { ends[self.row - 1] };
        if !(start <= id && id < ends[self.row]) {
            self.row = ends.partition_point(|&e| e <= id);
        }
        self.view.lens[self.row]
    }
}

/// The first problem with `local_ids` (and, when `remote` is given, `remote_ids` and the pairs), if any.
///
/// Every local id is checked against `local`'s size; with `remote`, every remote id against its size, the
/// two arrays must have the same length, and each pair's descriptors the same length. Range errors are
/// reported before pairing errors, local before remote, each at its first position.
pub fn first_bad_ids(
    local: TableView<'_>,
    local_ids: &[i32],
    remote: Option<TableView<'_>>,
    remote_ids: &[i32],
) -> Option<BadIds> {
    if local.ends.len() != local.lens.len() || remote.is_some_and(|r| r.ends.len() != r.lens.len()) {
        return Some(BadIds::Shape);
    }
    let out_of = |ids: &[i32], size: u64| ids.iter().position(|&i| i < 0 || i as u64 >= size);
    if let Some(k) = out_of(local_ids, local.size()) {
        return Some(BadIds::LocalOutOfRange(k));
    }
    let remote = remote?;
    if let Some(k) = out_of(remote_ids, remote.size()) {
        return Some(BadIds::RemoteOutOfRange(k));
    }
    if local_ids.len() != remote_ids.len() {
        return Some(BadIds::Count);
    }
    let (mut l, mut r) = (RowFinder::new(local), RowFinder::new(remote));
    local_ids
        .iter()
        .zip(remote_ids)
        .position(|(&a, &b)| l.len_of(a as u64) != r.len_of(b as u64))
        .map(BadIds::LengthMismatch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn view<'a>(ends: &'a [u64], lens: &'a [u64]) -> TableView<'a> {
        TableView { ends, lens }
    }

    #[test]
    fn finds_each_kind_of_problem_at_its_first_position() {
        let (le, ll) = ([3u64, 5, 9], [10u64, 20, 10]); // ids 0-2: 10 B, 3-4: 20 B, 5-8: 10 B
        let (re, rl) = ([4u64, 6], [10u64, 20]); // ids 0-3: 10 B, 4-5: 20 B
        let (l, r) = (view(&le, &ll), view(&re, &rl));
        assert_eq!(first_bad_ids(l, &[0, 3, 8], None, &[]), None);
        assert_eq!(
            first_bad_ids(l, &[0, 9, -1], None, &[]),
            Some(BadIds::LocalOutOfRange(1))
        );
        assert_eq!(first_bad_ids(l, &[-1], None, &[]), Some(BadIds::LocalOutOfRange(0)));
        assert_eq!(first_bad_ids(l, &[0, 3], Some(r), &[0, 4]), None);
        assert_eq!(
            first_bad_ids(l, &[0, 3], Some(r), &[0, 6]),
            Some(BadIds::RemoteOutOfRange(1))
        );
        assert_eq!(first_bad_ids(l, &[0, 3], Some(r), &[0]), Some(BadIds::Count));
        assert_eq!(
            first_bad_ids(l, &[5, 4, 3], Some(r), &[1, 5, 0]),
            Some(BadIds::LengthMismatch(2))
        );
        assert_eq!(first_bad_ids(view(&le, &rl), &[0], None, &[]), Some(BadIds::Shape));
        assert_eq!(
            first_bad_ids(view(&[], &[]), &[0], None, &[]),
            Some(BadIds::LocalOutOfRange(0))
        );
    }

    /// The naive answer: each id's row by a linear scan.
    fn reference(l: TableView<'_>, lids: &[i32], r: TableView<'_>, rids: &[i32]) -> Option<BadIds> {
        let row_len = |v: TableView<'_>, id: i32| v.ends.iter().position(|&e| (id as u64) < e).map(|k| v.lens[k]);
        if let Some(k) = lids.iter().position(|&i| i < 0 || row_len(l, i).is_none()) {
            return Some(BadIds::LocalOutOfRange(k));
        }
        if let Some(k) = rids.iter().position(|&i| i < 0 || row_len(r, i).is_none()) {
            return Some(BadIds::RemoteOutOfRange(k));
        }
        if lids.len() != rids.len() {
            return Some(BadIds::Count);
        }
        (0..lids.len())
            .find(|&k| row_len(l, lids[k]) != row_len(r, rids[k]))
            .map(BadIds::LengthMismatch)
    }

    fn table() -> impl Strategy<Value = (Vec<u64>, Vec<u64>)> {
        prop::collection::vec((0u64..4, 1u64..4), 1..6).prop_map(|rows| {
            let mut end = 0;
            rows.iter()
                .map(|&(count, len)| {
                    end += count;
                    (end, len)
                })
                .unzip()
        })
    }

    proptest! {
        #[test]
        fn agrees_with_a_linear_scan(
            (le, ll) in table(),
            (re, rl) in table(),
            pairs in prop::collection::vec((-1i32..14, -1i32..14), 0..12),
            drop_one in any::<bool>(),
        ) {
            let lids: Vec<i32> = pairs.iter().map(|p| p.0).collect();
            let mut rids: Vec<i32> = pairs.iter().map(|p| p.1).collect();
            if drop_one {
                rids.pop();
            }
            let (l, r) = (view(&le, &ll), view(&re, &rl));
            prop_assert_eq!(first_bad_ids(l, &lids, Some(r), &rids), reference(l, &lids, r, &rids));
        }
    }
}
