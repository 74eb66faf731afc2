//! Byte and descriptor counts of tables and transfers, and descriptor tables read from plain rows.
//!
//! What callers used to recompute from the arrays they were handed (Python summed descriptor lengths with
//! NumPy and expanded strided rows itself): the core already knows every table, so it answers.

use super::{PeerPlan, PlanError, RankTransfer, TableKey};
use crate::core::descs::{DescTable, StridedRow};

/// Most descriptors a table read from rows may have: NIXL indexes descriptors with int32.
pub const MAX_ROW_DESCS: u64 = i32::MAX as u64;

impl DescTable {
    /// Total bytes of the flat descriptors `ids` (each id counted as often as it is named).
    ///
    /// # Errors
    /// The first id outside `[0, len)`, as `(id, len)`.
    pub fn bytes_of(&self, ids: &[i32]) -> Result<u64, (i32, u64)> {
        let mut total = 0u64;
        for &id in ids {
            let (_, len) = u64::try_from(id)
                .ok()
                .and_then(|i| self.desc(i))
                .ok_or((id, self.len()))?;
            // Saturating: a caller's list may name one descriptor any number of times.
            total = total.saturating_add(len);
        }
        Ok(total)
    }

    /// A table from row-major `u64` rows of `cols` words: `(addr, len, device)` rows (`cols == 3`, one
    /// descriptor each) or strided `(addr, len, device, stride, count)` rows (`cols == 5`). Every
    /// descriptor's bytes must lie within `u64` and the table must index with int32 ids; the table's
    /// attention/SSM boundary is unknown and set to its length.
    ///
    /// # Errors
    /// A message naming the first bad row and its value: a column count other than 3 or 5, no rows, a
    /// strided row of count 0, a descriptor whose end overflows 64 bits, or more than [`MAX_ROW_DESCS`]
    /// descriptors.
    pub fn from_rows(flat: &[u64], cols: usize) -> Result<DescTable, String> {
        if cols != 3 && cols != 5 {
            return Err(format!("descriptor rows must have 3 or 5 columns, got {cols}"));
        }
        if flat.is_empty() || flat.len() % cols != 0 {
            return Err(format!(
                "descriptor rows must be a non-empty ({cols}-column) array, got {} values",
                flat.len()
            ));
        }
        let mut rows = Vec::with_capacity(flat.len() / cols);
        let mut total = 0u64;
        for (i, r) in flat.chunks_exact(cols).enumerate() {
            let row = if cols == 3 {
                StridedRow {
                    addr: r[0],
                    len: r[1],
                    device: r[2],
                    stride: r[1],
                    count: 1,
                }
            } else {
                StridedRow {
                    addr: r[0],
                    len: r[1],
                    device: r[2],
                    stride: r[3],
                    count: r[4],
                }
            };
            if row.count == 0 {
                return Err(format!("descriptor row {i} has count 0"));
            }
            let end = (row.count - 1)
                .checked_mul(row.stride)
                .and_then(|off| off.checked_add(row.addr))
                .and_then(|last| last.checked_add(row.len));
            if end.is_none() {
                return Err(format!(
                    "descriptor row {i} (addr {}, len {}, stride {}, count {}) ends past 2^64",
                    row.addr, row.len, row.stride, row.count
                ));
            }
            total = total.saturating_add(row.count);
            if total > MAX_ROW_DESCS {
                return Err(format!(
                    "descriptor rows give {total} descriptors by row {i}, over the limit of {MAX_ROW_DESCS} (int32 ids)"
                ));
            }
            rows.push(row);
        }
        Ok(DescTable::new(rows, total))
    }
}

impl PeerPlan {
    /// Bytes moved by descriptor ids `ids` of local table `key` (a transfer moves as many bytes on each side).
    ///
    /// # Errors
    /// `BadTransfer` when there is no table `key` or an id is outside it.
    pub fn ids_bytes(&self, key: TableKey, ids: &[i32]) -> Result<u64, PlanError> {
        let table = self
            .local_table(key)
            .ok_or_else(|| PlanError::BadTransfer(format!("no local table {key}")))?;
        table.bytes_of(ids).map_err(|(id, len)| {
            PlanError::BadTransfer(format!(
                "local descriptor id {id} is out of range for table {key} of {len} descriptors"
            ))
        })
    }

    /// Bytes transfer `t` moves.
    ///
    /// # Errors
    /// As [`PeerPlan::ids_bytes`].
    pub fn transfer_bytes(&self, t: &RankTransfer) -> Result<u64, PlanError> {
        self.ids_bytes(t.local_table, &t.local_ids)
    }

    /// Descriptors (once expanded) of local table `key`, `None` when there is no such table.
    pub fn table_descriptors(&self, key: TableKey) -> Option<u64> {
        self.local_table(key).map(DescTable::len)
    }

    /// Descriptors (once expanded) of remote rank `rank`'s table, `None` when it was not handshaked.
    pub fn remote_descriptors(&self, rank: u32) -> Option<u64> {
        self.remote_table(rank).map(DescTable::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::fixtures;
    use crate::core::meta::{AgentMeta, EngineInfo, TransferMode};
    use crate::core::region::RegionTable;

    #[test]
    fn from_rows_expands_in_flat_order() {
        let t = DescTable::from_rows(&[1000, 16, 0, 64, 3, 5000, 8, 1, 8, 2], 5).unwrap();
        let expect = [1000, 16, 0, 1064, 16, 0, 1128, 16, 0, 5000, 8, 1, 5008, 8, 1];
        assert_eq!(t.to_flat(), expect);
        assert_eq!(t.len(), 5);
        let flat = DescTable::from_rows(&expect, 3).unwrap();
        assert_eq!(flat.to_flat(), expect);
        assert_eq!(flat.bytes_of(&[0, 4, 4]), Ok(32));
        assert_eq!(t.bytes_of(&[0, 1, 2, 3, 4]), Ok(64));
    }

    #[test]
    fn from_rows_names_the_bad_row_and_the_limit() {
        let err = |flat: &[u64], cols| DescTable::from_rows(flat, cols).unwrap_err();
        assert_eq!(err(&[0; 4], 4), "descriptor rows must have 3 or 5 columns, got 4");
        assert!(err(&[], 5).contains("non-empty"));
        assert_eq!(err(&[0, 8, 0, 8, 1, 0, 8, 0, 8, 0], 5), "descriptor row 1 has count 0");
        assert!(err(&[u64::MAX - 8, 16, 0], 3).contains("row 0 (addr 18446744073709551607, len 16"));
        assert!(err(&[0, 1, 0, u64::MAX, 2], 5).contains("ends past 2^64"));
        let big = err(&[0, 1, 0, 1, MAX_ROW_DESCS, 0, 1, 0, 1, 1], 5);
        assert_eq!(
            big,
            format!(
                "descriptor rows give {} descriptors by row 1, over the limit of {MAX_ROW_DESCS} (int32 ids)",
                MAX_ROW_DESCS + 1
            )
        );
    }

    #[test]
    fn bytes_of_refuses_ids_outside_the_table() {
        let t = DescTable::from_rows(&[0, 256, 0, 256, 8], 5).unwrap();
        assert_eq!(t.bytes_of(&[1, 8]), Err((8, 8)));
        assert_eq!(t.bytes_of(&[-1]), Err((-1, 8)));
        assert_eq!(t.bytes_of(&[]), Ok(0));
    }

    /// Transfer bytes equal the sum of the resolved moves' lengths, for every transfer of a reference and a
    /// coalesced plan (chunk descriptors count their whole run).
    #[test]
    fn transfer_bytes_are_the_moves_lengths() {
        let cases = [
            (
                fixtures::hybrid_mla_f2([0x1000, 0x10_0000], 8),
                fixtures::hybrid_mla_f2([0x9000, 0x90_0000], 8),
            ),
            (fixtures::deepseek_v3_like(3, 64), fixtures::deepseek_v3_like(3, 64)),
        ];
        for (local, remote) in cases {
            let groups = local.layers.iter().map(|l| l.group).max().unwrap() as usize + 1;
            let ids: Vec<Vec<u64>> = (0..groups as u64).map(|g| vec![2 * g + 1, 2 * g + 2]).collect();
            let table = RegionTable::build(&local).unwrap();
            let metas = [AgentMeta::from_table(
                &RegionTable::build(&remote).unwrap(),
                &EngineInfo::default(),
            )];
            for coalesce in [false, true] {
                let peer = PeerPlan::with_coalescing(&table, &metas, TransferMode::Pull, coalesce).unwrap();
                let plan = peer.plan(&ids, &ids).unwrap();
                assert!(!plan.transfers.is_empty());
                for t in &plan.transfers {
                    let moved: u64 = peer.moves(t).unwrap().iter().map(|m| m[2]).sum();
                    assert!(moved > 0);
                    assert_eq!(peer.transfer_bytes(t), Ok(moved));
                }
                let whole = peer.table_descriptors(TableKey::Whole).unwrap();
                assert_eq!(whole, peer.local_table(TableKey::Whole).unwrap().len());
                assert_eq!(peer.table_descriptors(TableKey::Split(9)), None);
                assert_eq!(peer.remote_descriptors(0), Some(peer.remote_table(0).unwrap().len()));
                assert_eq!(peer.remote_descriptors(5), None);
                let past = i32::try_from(whole).unwrap();
                assert!(peer.ids_bytes(TableKey::Whole, &[past]).is_err());
            }
        }
    }
}
