//! Per-head pieces: heads-major pages of several heads per rank cut into units smaller than a kernel block.
//!
//! A heads-major kernel page is `[heads, tokens, cell]`: a unit of `u` tokens is one byte range per head, not one
//! range. So both sides' kernel blocks are cut into `(head, unit)` pieces of `u * cell` bytes, the heads being
//! those one rank pair exchanges (`hp`, the smaller side's heads per rank). Piece `(k, h, j)` of kernel block
//! `k < n`, head `h < hp` and unit `j < sub` lies at `k * stride + (first + h) * head_bytes + j * piece` of the
//! region, where `first` is the first head the pair exchanges on that side, and has id `(h * sub + j) * n + k`:
//! so a region's pieces are `hp * sub` strided rows of `n` descriptors each, whatever `n`, `first` or the page
//! padding (ordered by kernel block first, a head slice of a page would need one row per kernel block: 1.2
//! million rows for 48 layers of 8,192 blocks). The side with more heads per rank selects its `hp` heads by
//! `first`: the remote table of a rank reading a slice of a larger remote page starts at its slice, and the split
//! local table of each remote piece at that piece's heads, so a request's ids are the same for every route.
//!
//! Nothing is coalesced: two units of one head are contiguous on both sides only inside one kernel block on
//! each, which happens only when neither kernel block divides the other (and then for runs shorter than either
//! block); with one dividing the other every piece is a whole head of the smaller block, and its neighbour in
//! token order lies in the next kernel block, past the other heads.

use super::error::{exact_div, PlanError};
use crate::core::descs::{DescTable, StridedRow};
use crate::core::region::{hosts_attention, RegionTable};
use crate::core::units::BlockUnits;

/// One region's pages as the piece rows see them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pages<'a> {
    pub(super) name: &'a str,
    pub(super) base: u64,
    pub(super) block_len: u64,
    pub(super) block_stride: u64,
    pub(super) num_blocks: u64,
    pub(super) device: u64,
}

impl Pages<'_> {
    /// The row of `len` bytes at `offset` in every kernel block of the region.
    ///
    /// # Errors
    /// `AddressOverflow` when the row's first address wraps.
    fn row(&self, offset: u64, len: u64) -> Result<StridedRow, PlanError> {
        let addr = self
            .base
            .checked_add(offset)
            .ok_or_else(|| PlanError::AddressOverflow {
                what: format!("region {}", self.name),
                addr: self.base,
                len: offset,
            })?;
        Ok(StridedRow {
            addr,
            len,
            device: self.device,
            stride: self.block_stride,
            count: self.num_blocks,
        })
    }
}

/// The rows of a region's pieces: heads `[first, first + hp)` of every kernel block of `heads` heads, each cut
/// into `sub` units, in id order (one row per head, part and unit, one descriptor per kernel block). A head's
/// unit is one part, or for `HKTV` pages (`k_rows` > 0: K stored `[k_rows, tokens]`, then V `[tokens, k_rows]`)
/// `k_rows` K runs and one V run: part `q` of unit `j` lies at `q * k_row + j * k_row / sub` for `q < k_rows`, at
/// `half + j * half / sub` for the V run, `half` being the head's K (and V) bytes and `k_row` one K element's.
///
/// # Errors
/// `Indivisible` when a page does not split into heads, parts and units evenly, `Mismatch` when the heads asked
/// for are not on the page, `AddressOverflow` when a piece's address wraps.
pub(super) fn piece_rows(
    p: Pages<'_>,
    heads: u64,
    (first, hp): (u64, u64),
    sub: u64,
    k_rows: u64,
) -> Result<Vec<StridedRow>, PlanError> {
    let head_bytes = exact_div(
        || format!("kernel page of region {} per head", p.name),
        p.block_len,
        heads,
    )?;
    // (offset in the head's page of unit 0, bytes between units, bytes) of each part
    let parts: Vec<(u64, u64, u64)> = if k_rows == 0 {
        let piece = exact_div(|| format!("head page of region {} per unit", p.name), head_bytes, sub)?;
        vec![(0, piece, piece)]
    } else {
        let half = exact_div(
            || format!("HKTV head page of region {} into K and V", p.name),
            head_bytes,
            2,
        )?;
        let k_row = exact_div(|| format!("HKTV K of region {} per K row", p.name), half, k_rows)?;
        let k_piece = exact_div(|| format!("HKTV K row of region {} per unit", p.name), k_row, sub)?;
        let v_piece = exact_div(|| format!("HKTV V of region {} per unit", p.name), half, sub)?;
        (0..k_rows)
            .map(|q| (q * k_row, k_piece, k_piece))
            .chain([(half, v_piece, v_piece)])
            .collect()
    };
    if first.checked_add(hp).is_none_or(|end| end > heads) {
        return Err(PlanError::Mismatch {
            what: format!(
                "heads exchanged of region {} (first, count) against its heads per rank",
                p.name
            ),
            local: format!("({first}, {hp})"),
            remote: heads.to_string(),
        });
    }
    let parts = &parts;
    (first..first + hp)
        .flat_map(|h| parts.iter().flat_map(move |&part| (0..sub).map(move |j| (h, part, j))))
        // inside the page: (h, part, j) < (heads, parts, sub), so the offset is below `block_len`
        .map(|(h, (offset, step, len), j)| p.row(h * head_bytes + offset + j * step, len))
        .collect()
}

/// The rows of a region no piece addresses (it holds no attention): its pages cut into `count` descriptors, so
/// that every region has as many descriptors per kernel block (the last `block_len % count` bytes of a page in
/// none of them).
///
/// # Errors
/// `Indivisible` when a page is shorter than `count` bytes.
pub(super) fn filler_rows(p: Pages<'_>, count: u64) -> Result<Vec<StridedRow>, PlanError> {
    let len = p.block_len / count.max(1);
    if len == 0 {
        return Err(PlanError::Indivisible {
            what: format!("kernel page of region {} per descriptor", p.name),
            value: p.block_len,
            by: count,
        });
    }
    // j * len < block_len: inside the page
    (0..count).map(|j| p.row(j * len, len)).collect()
}

/// The local table cut into per-head pieces for the heads of remote slot `slot` (slot 0 holds heads `[0, hp)`):
/// every attention region's pieces, every other region's pages cut into as many equal descriptors (never
/// addressed, so that every region has the same descriptor count per kernel block), then the SSM rows.
///
/// # Errors
/// As [`piece_rows`].
pub(super) fn local_piece_table(
    local: &RegionTable,
    units: BlockUnits,
    heads: u64,
    slot: u64,
) -> Result<DescTable, PlanError> {
    let hp = units.per_head.unwrap_or(1);
    let dev = u64::from(local.device);
    let mut rows = Vec::with_capacity(local.regions.len());
    let mut num_fa = 0u64;
    for r in &local.regions {
        let pages = Pages {
            name: &r.name,
            base: r.base,
            block_len: r.block_len,
            block_stride: r.block_stride,
            num_blocks: r.num_blocks,
            device: dev,
        };
        let first = slot.saturating_mul(hp);
        rows.extend(if hosts_attention(r.group, &local.groups) {
            piece_rows(pages, heads, (first, hp), units.local_sub, k_rows_of(r.is_mla, units)?)?
        } else {
            filler_rows(pages, units.local_pieces())?
        });
        num_fa += r.num_blocks * units.local_pieces();
    }
    rows.extend(local.ssm_rows(dev));
    Ok(DescTable::new(rows, num_fa))
}

/// The K rows a region's heads are cut into: `HKTV` pages' (`units.parts - 1`), 0 for one part per head.
///
/// # Errors
/// `NotSupported` for an MLA region on a rank whose pages are cut into K rows (one latent per token, no heads).
pub(super) fn k_rows_of(is_mla: bool, units: BlockUnits) -> Result<u64, PlanError> {
    match units.parts.saturating_sub(1) {
        0 => Ok(0),
        _ if is_mla => Err(PlanError::NotSupported(
            "MLA regions beside HKTV attention pages cut into token units".into(),
        )),
        k_rows => Ok(k_rows),
    }
}

/// A request's piece ids of one side relative to a region of `blocks` kernel blocks: head by head, each head's
/// units (`sub` per kernel block, in request order) as `(h * sub + j) * blocks + k`.
pub(super) fn piece_ids(units: &[u64], sub: u64, hp: u64, blocks: u64) -> Vec<u64> {
    let mut out = Vec::with_capacity(units.len() * hp as usize);
    let first = out.len();
    out.extend(units.iter().map(|&u| (u % sub) * blocks + u / sub));
    // head h adds h * sub rows of `blocks` ids to head 0's ids
    for h in 1..hp {
        let shift = h * sub * blocks;
        out.extend_from_within(first..first + units.len());
        let n = out.len();
        out[n - units.len()..].iter_mut().for_each(|id| *id += shift);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(rows: &[StridedRow]) -> Vec<(u64, u64)> {
        let t = DescTable::new(rows.to_vec(), 0);
        (0..t.len()).map(|i| t.desc(i).unwrap()).collect()
    }

    /// Pieces `(k, h, j)` of a `[4 heads, 4 tokens, 2 bytes]` page at strides 32 and 40: the id `(h * sub + j) *
    /// 3 + k` of each resolves to the address of the formula.
    #[test]
    fn piece_rows_follow_the_formula() {
        let pages = |stride| Pages {
            name: "l",
            base: 1000,
            block_len: 32,
            block_stride: stride,
            num_blocks: 3,
            device: 0,
        };
        for stride in [32u64, 40] {
            for (first, hp) in [(0u64, 4u64), (2, 2), (1, 1)] {
                for sub in [1u64, 2, 4] {
                    let got = flat(&piece_rows(pages(stride), 4, (first, hp), sub, 0).unwrap());
                    let piece = 8 / sub;
                    assert_eq!(got.len() as u64, 3 * hp * sub);
                    for (k, h, j) in (0..3).flat_map(|k| (0..hp).flat_map(move |h| (0..sub).map(move |j| (k, h, j)))) {
                        let id = ((h * sub + j) * 3 + k) as usize;
                        let want = (1000 + k * stride + (first + h) * 8 + j * piece, piece);
                        assert_eq!(
                            got[id], want,
                            "stride {stride} first {first} hp {hp} sub {sub} ({k}, {h}, {j})"
                        );
                    }
                }
            }
        }
        let err = piece_rows(pages(32), 4, (3, 2), 1, 0).unwrap_err().to_string();
        assert!(err.contains("(3, 2)") && err.contains("remote 4"), "{err}");
        let err = piece_rows(pages(32), 3, (0, 1), 1, 0).unwrap_err().to_string();
        assert!(err.contains("32") && err.contains('3'), "{err}");
    }

    /// `HKTV` pieces of a `[2 heads, (K [3 rows, 4 tokens], V [4 tokens, 3]), 1 byte]` page: part `q` of unit
    /// `j` of head `h` in kernel block `k` has the row `((h * 4 + q) * sub + j)` and holds exactly the bytes of
    /// those tokens' K element `q` (or their V).
    #[test]
    fn k_transposed_pieces_hold_their_tokens() {
        let (tokens, rows, heads) = (4u64, 3u64, 2u64);
        let head_bytes = 2 * tokens * rows;
        let pages = Pages {
            name: "l",
            base: 0,
            block_len: heads * head_bytes,
            block_stride: heads * head_bytes + 8,
            num_blocks: 2,
            device: 0,
        };
        // the byte at `addr` of the page model: (block, head, K element or V, token, V element)
        let cell = |addr: u64| {
            let (k, off) = (addr / pages.block_stride, addr % pages.block_stride);
            let (h, off) = (off / head_bytes, off % head_bytes);
            if off < tokens * rows {
                (k, h, Some(off / tokens), off % tokens, 0)
            } else {
                let off = off - tokens * rows;
                (k, h, None, off / rows, off % rows)
            }
        };
        for sub in [1u64, 2, 4] {
            let u = tokens / sub;
            let got = flat(&piece_rows(pages, heads, (1, 1), sub, rows).unwrap());
            assert_eq!(got.len() as u64, 2 * (rows + 1) * sub);
            for (i, &(addr, len)) in got.iter().enumerate() {
                let (row, k) = (i as u64 / 2, i as u64 % 2);
                let (q, j) = (row / sub, row % sub);
                let want_len = if q < rows { u } else { u * rows };
                assert_eq!(len, want_len, "sub {sub} piece {i}");
                for b in addr..addr + len {
                    let (bk, bh, bq, t, _) = cell(b);
                    assert_eq!((bk, bh), (k, 1), "sub {sub} piece {i} byte {b}");
                    assert_eq!(bq, (q < rows).then_some(q), "sub {sub} piece {i} byte {b}");
                    assert_eq!(t / u, j, "sub {sub} piece {i} byte {b}: token {t}");
                }
            }
        }
        let err = piece_rows(
            Pages {
                block_len: 2 * 25,
                ..pages
            },
            2,
            (0, 1),
            1,
            3,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("HKTV"), "{err}");
    }

    #[test]
    fn piece_ids_go_head_by_head() {
        // Units 4, 5 (kernel block 2) and 1 (block 0), 2 units per block, 2 heads, a region of 3 blocks: ids
        // (h * 2 + j) * 3 + k.
        assert_eq!(piece_ids(&[4, 5, 1], 2, 2, 3), [2, 5, 3, 8, 11, 9]);
        assert_eq!(piece_ids(&[7, 3], 1, 3, 10), [7, 3, 17, 13, 27, 23]);
    }
}
