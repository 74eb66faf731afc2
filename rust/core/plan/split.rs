//! Split local tables: one copy of the local table per remote piece, pointing at the part of each local
//! descriptor that piece fills or provides.
//!
//! Used when the local TP is smaller than the remote TP: each remote rank holds a slice of the local rank's
//! heads and SSM shards. MLA (replicated) attention rows are kept whole; head-sharded attention rows are cut
//! into `fa_splits` slices and the piece takes slice `slot`; SSM rows are cut into `ssm_splits` chunks and the
//! piece takes chunk `ssm_index`. Row counts and strides are kept, so descriptor ids are the same in every
//! split table as in the table it was cut from.

use super::error::{exact_div, PlanError};
use crate::core::descs::{DescTable, StridedRow};

/// Which part of every descriptor one remote piece covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Attention head slot of the piece.
    pub fa_slot: u64,
    /// Number of head slices of a local attention unit (1: keep whole).
    pub fa_splits: u64,
    /// Index of the piece among the SSM sources.
    pub ssm_index: u64,
    /// Number of SSM chunks (0 or 1: keep whole).
    pub ssm_splits: u64,
}

/// Cut `table` for one piece.
///
/// `replicated[r]` says whether region `r` is kept whole (MLA); `region_counts[r]` is the number of flat
/// attention descriptors region `r` owns (in order, summing to `table.num_fa`).
///
/// # Errors
/// `Indivisible` when a descriptor length does not split evenly, `BadTransfer` when the region counts do
/// not add up to the table's attention part.
pub fn split_table(
    table: &DescTable,
    replicated: &[bool],
    region_counts: &[u64],
    piece: Piece,
) -> Result<DescTable, PlanError> {
    if region_counts.iter().sum::<u64>() != table.num_fa || replicated.len() != region_counts.len() {
        return Err(PlanError::BadTransfer(format!(
            "region descriptor counts {region_counts:?} do not add up to the {} attention descriptors",
            table.num_fa
        )));
    }
    let mut region_end = Vec::with_capacity(region_counts.len());
    let mut acc = 0;
    for c in region_counts {
        acc += c;
        region_end.push(acc);
    }
    let mut rows = Vec::with_capacity(table.rows.len());
    for (row, &start) in table.rows.iter().zip(table.row_starts()) {
        let (index, splits) = if start < table.num_fa {
            let region = region_end.partition_point(|&e| e <= start);
            if replicated[region] {
                (0, 1)
            } else {
                (piece.fa_slot, piece.fa_splits)
            }
        } else {
            (piece.ssm_index, piece.ssm_splits)
        };
        if splits <= 1 {
            rows.push(*row);
            continue;
        }
        let chunk = exact_div(|| format!("descriptor length at flat index {start}"), row.len, splits)?;
        rows.push(StridedRow {
            addr: row.addr + index * chunk,
            len: chunk,
            ..*row
        });
    }
    Ok(DescTable::new(rows, table.num_fa))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(descs: &[(u64, u64)], num_fa: u64) -> DescTable {
        let rows = descs
            .iter()
            .map(|&(addr, len)| StridedRow {
                addr,
                len,
                device: 0,
                stride: len,
                count: 1,
            })
            .collect();
        DescTable::new(rows, num_fa)
    }

    fn descs(t: &DescTable) -> Vec<(u64, u64)> {
        (0..t.len()).map(|i| t.desc(i).unwrap()).collect()
    }

    /// F.10 `test_build_src_split_handles`: local TP 1 reading remote TP 2 or 4 over 8 attention descriptors.
    #[test]
    fn f10_build_src_split_handles() {
        let src: Vec<(u64, u64)> = (0..8).map(|i| (0x2000 + 1024 * i, 1024)).collect();
        for remote_tp in [2u64, 4] {
            for p in 0..remote_tp {
                let piece = Piece {
                    fa_slot: p,
                    fa_splits: remote_tp,
                    ssm_index: p,
                    ssm_splits: 0,
                };
                let t = split_table(&table(&src, 8), &[false], &[8], piece).unwrap();
                let got = descs(&t);
                assert_eq!(got.len(), 8);
                assert!(got.iter().all(|&(_, len)| len == 1024 / remote_tp));
                assert_eq!(got[3].0, 0x2000 + 3 * 1024 + p * 1024 / remote_tp);
            }
        }
    }

    /// F.10 FA+SSM: attention readers (0,), SSM readers (0, 1): attention whole, SSM halved.
    #[test]
    fn f10_fa_whole_ssm_halved() {
        let src = table(&[(1000, 200), (2000, 200), (3000, 400)], 2);
        let want = [
            vec![(1000, 200), (2000, 200), (3000, 200)],
            vec![(1000, 200), (2000, 200), (3200, 200)],
        ];
        for (p, want) in want.iter().enumerate() {
            let piece = Piece {
                fa_slot: 0,
                fa_splits: 1,
                ssm_index: p as u64,
                ssm_splits: 2,
            };
            assert_eq!(
                &descs(&split_table(&src, &[false, false], &[1, 1], piece).unwrap()),
                want
            );
        }
    }

    /// F.10 hetero block size (bsr 2): the attention sub-blocks pass through, SSM is halved.
    #[test]
    fn f10_hetero_block_size_passthrough() {
        let src = table(&[(1000, 100), (1100, 100), (2000, 100), (2100, 100), (3000, 400)], 4);
        for p in 0..2u64 {
            let piece = Piece {
                fa_slot: 0,
                fa_splits: 1,
                ssm_index: p,
                ssm_splits: 2,
            };
            let got = descs(&split_table(&src, &[true, true], &[2, 2], piece).unwrap());
            assert_eq!(got[..4], [(1000, 100), (1100, 100), (2000, 100), (2100, 100)]);
            assert_eq!(got[4], (3000 + 200 * p, 200));
        }
    }

    #[test]
    fn uneven_split_names_the_length() {
        let err = split_table(
            &table(&[(0, 10)], 1),
            &[false],
            &[1],
            Piece {
                fa_slot: 0,
                fa_splits: 3,
                ssm_index: 0,
                ssm_splits: 0,
            },
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("10 is not divisible by 3"), "{err}");
    }
}
