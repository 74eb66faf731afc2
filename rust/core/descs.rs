//! NIXL descriptor tables: strided rows `(addr, len, device, stride, count)` and their flat expansion.
//!
//! A table is a list of strided rows; descriptor ids index the *flat* expansion (row 0's `count`
//! descriptors first). Local tables are region-major attention rows followed by the SSM rows
//! (per SSM region, per conv sub-projection then the temporal state, one descriptor per logical block).

use serde::{Deserialize, Serialize};

use super::error::LayoutError;
use super::region::RegionTable;

/// `count` descriptors of `len` bytes at `addr + j * stride`, all on `device`.
///
/// `repr(C)` with five `u64` fields in the order NIXL's strided rows take them, so a slice of rows is a slice
/// of `u64` (`bytemuck::Pod`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct StridedRow {
    /// First descriptor's address.
    pub addr: u64,
    /// Bytes per descriptor.
    pub len: u64,
    /// Device index.
    pub device: u64,
    /// Bytes between consecutive descriptors.
    pub stride: u64,
    /// Number of descriptors.
    pub count: u64,
}

/// A descriptor table: strided rows plus the flat index where the SSM part starts.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DescTable {
    /// The rows, in flat-index order.
    pub rows: Vec<StridedRow>,
    /// Flat count of attention descriptors (the FA/SSM boundary).
    pub num_fa: u64,
    /// Exclusive prefix sums of the row counts (flat index of each row's first descriptor).
    starts: Vec<u64>,
    total: u64,
}

impl DescTable {
    /// Make a table from rows; `num_fa` is the flat count of the attention part.
    pub fn new(rows: Vec<StridedRow>, num_fa: u64) -> DescTable {
        let mut starts = Vec::with_capacity(rows.len());
        let mut total = 0u64;
        for r in &rows {
            starts.push(total);
            total += r.count;
        }
        DescTable {
            rows,
            num_fa,
            starts,
            total,
        }
    }

    /// A table from rows whose flat `starts` (and `total`) the caller computed while making them (chunk rows:
    /// a second pass over thousands of rows was a twentieth of a coalesced peer plan's construction).
    pub(crate) fn with_starts(rows: Vec<StridedRow>, num_fa: u64, starts: Vec<u64>, total: u64) -> DescTable {
        debug_assert!(starts.len() == rows.len());
        debug_assert_eq!(DescTable::new(rows.clone(), num_fa).starts, starts);
        DescTable {
            rows,
            num_fa,
            starts,
            total,
        }
    }

    /// Number of flat descriptors.
    pub fn len(&self) -> u64 {
        self.total
    }

    /// True when the table has no descriptors.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// Flat index of each row's first descriptor.
    pub fn row_starts(&self) -> &[u64] {
        &self.starts
    }

    /// `(addr, len)` of flat descriptor `idx`, or `None` when out of range.
    pub fn desc(&self, idx: u64) -> Option<(u64, u64)> {
        if idx >= self.total {
            return None;
        }
        let row = self.starts.partition_point(|&s| s <= idx) - 1;
        let r = &self.rows[row];
        Some((r.addr + (idx - self.starts[row]) * r.stride, r.len))
    }

    /// The rows as a flat row-major `u64` buffer of shape `(rows, 5)`.
    pub fn to_strided(&self) -> Vec<u64> {
        // One copy of the rows' memory: a loop over the fields was a quarter of building a coalesced
        // DeepSeek-V3 peer's tables (7,747 rows per table).
        bytemuck::cast_slice(&self.rows).to_vec()
    }

    /// The flat expansion as a row-major `u64` buffer of shape `(len, 3)`: `(addr, len, device)`.
    pub fn to_flat(&self) -> Vec<u64> {
        let mut out = vec![0u64; (self.total as usize) * 3];
        self.write_flat(&mut out);
        out
    }

    /// Write the flat expansion into `out`, row-major `(len, 3)`: `(addr, len, device)`.
    ///
    /// Lets a caller fill a buffer it allocated itself (e.g. a numpy array, which numpy backs with huge
    /// pages: faulting in a fresh 146 MB `Vec` page by page costs 3-4x the writes themselves).
    /// Tables of [`PARALLEL_FLAT_MIN`] descriptors or more are written by up to [`MAX_FLAT_THREADS`]
    /// threads, one contiguous slice each: the first touch of fresh memory (the kernel zeroing it) is the
    /// bottleneck and it scales with cores.
    ///
    /// # Panics
    /// When `out.len() != 3 * self.len()`.
    pub fn write_flat(&self, out: &mut [u64]) {
        assert_eq!(
            out.len() as u64,
            self.total * 3,
            "flat buffer must hold 3 words per descriptor"
        );
        let threads = if self.total < PARALLEL_FLAT_MIN {
            1
        } else {
            std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_FLAT_THREADS))
        };
        if threads <= 1 {
            self.write_flat_from(0, out);
            return;
        }
        let per = self.total.div_ceil(threads as u64);
        std::thread::scope(|s| {
            for (i, chunk) in out.chunks_mut(per as usize * 3).enumerate() {
                s.spawn(move || self.write_flat_from(i as u64 * per, chunk));
            }
        });
    }

    /// Write flat descriptors `first .. first + out.len() / 3` into `out`.
    fn write_flat_from(&self, first: u64, out: &mut [u64]) {
        let mut row = self.starts.partition_point(|&s| s <= first).saturating_sub(1);
        let mut idx = first;
        let mut rest = out;
        while !rest.is_empty() {
            let r = &self.rows[row];
            let skip = idx - self.starts[row];
            let n = ((r.count - skip) as usize).min(rest.len() / 3);
            let (head, tail) = rest.split_at_mut(n * 3);
            rest = tail;
            // In range: every row was checked against its region when the region table was built.
            let mut addr = r.addr.wrapping_add(skip.wrapping_mul(r.stride));
            for d in head.chunks_exact_mut(3) {
                d[0] = addr;
                d[1] = r.len;
                d[2] = r.device;
                addr = addr.wrapping_add(r.stride);
            }
            idx += n as u64;
            row += 1;
        }
    }
}

/// Flat tables at least this long (24 MiB as `(N, 3)` u64) are written by several threads.
pub const PARALLEL_FLAT_MIN: u64 = 1 << 20;
/// Most threads [`DescTable::write_flat`] uses.
pub const MAX_FLAT_THREADS: usize = 4;

impl RegionTable {
    /// Check a block-size ratio: `BadBlockSizeRatio` when `bsr` is 0 or does not divide every region's kernel page.
    ///
    /// # Errors
    /// That error, naming the first region whose page `bsr` does not divide.
    pub fn check_bsr(&self, bsr: u64) -> Result<(), LayoutError> {
        if bsr == 0 {
            return Err(LayoutError::BadBlockSizeRatio {
                bsr,
                detail: "ratio is zero".into(),
            });
        }
        match self.regions.iter().find(|r| r.block_len % bsr != 0) {
            Some(r) => Err(LayoutError::BadBlockSizeRatio {
                bsr,
                detail: format!("region {} has kernel page {}", r.name, r.block_len),
            }),
            None => Ok(()),
        }
    }

    /// The local descriptor table at block-size ratio `bsr` (1 for the rank's own granularity).
    ///
    /// With `bsr > 1` every kernel block becomes `bsr` sub-blocks of `block_len / bsr` (for a peer with
    /// smaller kernel blocks); SSM descriptors are unaffected.
    ///
    /// # Errors
    /// `BadBlockSizeRatio` when `bsr` is 0 or does not divide a region's kernel page.
    pub fn local_table(&self, bsr: u64) -> Result<DescTable, LayoutError> {
        self.check_bsr(bsr)?;
        let dev = u64::from(self.device);
        let mut rows = Vec::with_capacity(self.regions.len() + self.ssm_regions.len() * 4);
        for r in &self.regions {
            let sub = r.block_len / bsr;
            if bsr == 1 || r.block_stride == r.block_len {
                let stride = r.block_stride / bsr;
                rows.push(StridedRow {
                    addr: r.base,
                    len: sub,
                    device: dev,
                    stride,
                    count: r.num_blocks * bsr,
                });
            } else {
                for k in 0..r.num_blocks {
                    let addr = r.base + k * r.block_stride;
                    rows.push(StridedRow {
                        addr,
                        len: sub,
                        device: dev,
                        stride: sub,
                        count: bsr,
                    });
                }
            }
        }
        let num_fa = self.num_fa_descs(bsr)?;
        rows.extend(self.ssm_rows(dev));
        Ok(DescTable::new(rows, num_fa))
    }

    /// SSM rows of the local table: per SSM region, per sub-stream of the state (or state part) it holds, one
    /// descriptor per state.
    pub(crate) fn ssm_rows(&self, dev: u64) -> Vec<StridedRow> {
        let Some(split) = &self.conv_split else {
            return Vec::new();
        };
        let geo = &self.geometry;
        let mut rows = Vec::new();
        for &i in &self.ssm_regions {
            let r = &self.regions[i];
            for (off, len) in split.part_streams(r.state_part.as_ref()) {
                rows.push(StridedRow {
                    addr: r.base + off,
                    len,
                    device: dev,
                    stride: r.block_stride * geo.ppl,
                    count: r.states.unwrap_or(geo.num_logical_blocks),
                });
            }
        }
        rows
    }

    /// Sub-stream rows of every SSM region, in `ssm_regions` order (the same for every region of whole states).
    pub fn ssm_streams_per_region(&self) -> Vec<usize> {
        let Some(split) = &self.conv_split else {
            return Vec::new();
        };
        self.ssm_regions
            .iter()
            .map(|&i| split.part_streams(self.regions[i].state_part.as_ref()).len())
            .collect()
    }

    /// States of every SSM sub-stream row, in table order (the rank's logical blocks, or a state tensor's own
    /// slot count).
    pub fn ssm_row_counts(&self) -> Vec<u64> {
        let logical = self.geometry.num_logical_blocks;
        self.ssm_regions
            .iter()
            .zip(self.ssm_streams_per_region())
            .flat_map(|(&i, n)| std::iter::repeat_n(self.regions[i].states.unwrap_or(logical), n))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> DescTable {
        let rows = (0..7u64)
            .map(|i| StridedRow {
                addr: 0x1000 * (i + 1),
                len: 8 + i,
                device: i % 2,
                stride: 16 + i,
                count: 3 + 5 * i,
            })
            .collect();
        DescTable::new(rows, 0)
    }

    #[test]
    fn flat_slices_from_any_start_match_desc() {
        let t = table();
        let want: Vec<u64> = (0..t.len())
            .flat_map(|i| {
                let (a, l) = t.desc(i).unwrap();
                let row = t.row_starts().partition_point(|&s| s <= i) - 1;
                [a, l, t.rows[row].device]
            })
            .collect();
        assert_eq!(t.to_flat(), want);
        for first in 0..t.len() {
            for n in 0..=(t.len() - first).min(12) {
                let mut out = vec![0; n as usize * 3];
                t.write_flat_from(first, &mut out);
                assert_eq!(
                    out,
                    want[first as usize * 3..(first + n) as usize * 3],
                    "first {first} n {n}"
                );
            }
        }
    }

    #[test]
    fn threaded_flat_matches_serial() {
        let rows = vec![
            StridedRow {
                addr: 0,
                len: 4,
                device: 0,
                stride: 4,
                count: PARALLEL_FLAT_MIN / 3 + 1,
            },
            StridedRow {
                addr: 1 << 40,
                len: 8,
                device: 1,
                stride: 64,
                count: PARALLEL_FLAT_MIN,
            },
        ];
        let t = DescTable::new(rows, 0);
        let mut serial = vec![0; t.len() as usize * 3];
        t.write_flat_from(0, &mut serial);
        assert_eq!(t.to_flat(), serial);
    }

    #[test]
    fn empty_table_is_empty_flat() {
        assert!(DescTable::new(Vec::new(), 0).to_flat().is_empty());
    }
}
