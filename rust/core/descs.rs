//! NIXL descriptor tables: strided rows `(addr, len, device, stride, count)` and their flat expansion.
//!
//! A table is a list of strided rows; descriptor ids index the *flat* expansion (row 0's `count`
//! descriptors first). Local tables are region-major attention rows followed by the SSM rows
//! (per SSM region, per conv sub-projection then the temporal state, one descriptor per logical block).

use serde::{Deserialize, Serialize};

use super::error::LayoutError;
use super::region::RegionTable;

/// `count` descriptors of `len` bytes at `addr + j * stride`, all on `device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
        self.rows
            .iter()
            .flat_map(|r| [r.addr, r.len, r.device, r.stride, r.count])
            .collect()
    }

    /// The flat expansion as a row-major `u64` buffer of shape `(len, 3)`: `(addr, len, device)`.
    pub fn to_flat(&self) -> Vec<u64> {
        let mut out = vec![0u64; (self.total as usize) * 3];
        let mut chunks = out.chunks_exact_mut(3);
        for r in &self.rows {
            let mut addr = r.addr;
            for chunk in chunks.by_ref().take(r.count as usize) {
                chunk[0] = addr;
                chunk[1] = r.len;
                chunk[2] = r.device;
                addr = addr.wrapping_add(r.stride); // in range: checked when the region table was built
            }
        }
        out
    }
}

impl RegionTable {
    /// The local descriptor table at block-size ratio `bsr` (1 for the rank's own granularity).
    ///
    /// With `bsr > 1` every kernel block becomes `bsr` sub-blocks of `block_len / bsr` (for a peer with
    /// smaller kernel blocks); SSM descriptors are unaffected.
    ///
    /// # Errors
    /// `BadBlockSizeRatio` when `bsr` is 0 or does not divide a region's kernel page.
    pub fn local_table(&self, bsr: u64) -> Result<DescTable, LayoutError> {
        if bsr == 0 {
            return Err(LayoutError::BadBlockSizeRatio {
                bsr,
                detail: "ratio is zero".into(),
            });
        }
        let dev = u64::from(self.device);
        let mut rows = Vec::with_capacity(self.regions.len() + self.ssm_regions.len() * 4);
        for r in &self.regions {
            if r.block_len % bsr != 0 {
                return Err(LayoutError::BadBlockSizeRatio {
                    bsr,
                    detail: format!("region {} has kernel page {}", r.name, r.block_len),
                });
            }
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
        let num_fa = self.num_fa_descs(bsr);
        rows.extend(self.ssm_rows(dev));
        Ok(DescTable::new(rows, num_fa))
    }

    /// SSM rows of the local table: per SSM region, per sub-stream, one descriptor per logical block.
    fn ssm_rows(&self, dev: u64) -> Vec<StridedRow> {
        let Some(split) = &self.conv_split else {
            return Vec::new();
        };
        let geo = &self.geometry;
        let mut rows = Vec::new();
        for &i in &self.ssm_regions {
            let r = &self.regions[i];
            for (off, len) in split.streams() {
                rows.push(StridedRow {
                    addr: r.base + off,
                    len,
                    device: dev,
                    stride: r.block_stride * geo.ppl,
                    count: geo.num_logical_blocks,
                });
            }
        }
        rows
    }
}
