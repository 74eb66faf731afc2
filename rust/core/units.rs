//! The common token unit of two kernel block sizes (in both directions).
//!
//! vLLM addresses the local side in `bsr = local/remote` sub-blocks when the local kernel block is larger,
//! and (hybrid MLA pull only) rewrites the remote metadata into `gcd` sub-blocks when neither divides the
//! other. hybrid-kv always does the second: both sides are cut into units of `gcd(local, remote)` tokens, so
//! a larger kernel block on either side works, in pull and in push. A unit of a token-major page (and of a page
//! of one head, or MLA latents) is one byte range; a unit of a heads-major page of several heads per rank is one
//! byte range per head (`[H, N, C]`: a head's tokens are contiguous, a token's heads are not), so such units
//! are cut per head ([`BlockUnits::per_head`]). SSM states are never cut.

use super::kv_layout::PageOrder;
use super::plan::PlanError;

/// Largest number of units one kernel block may be cut into (vLLM gives up above 128 as well).
pub const MAX_UNITS_PER_BLOCK: u64 = 128;

/// How two kernel block sizes are cut into a common unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockUnits {
    /// Tokens per unit (`gcd` of the two kernel block sizes).
    pub unit_tokens: u64,
    /// Units per local kernel block (vLLM's `block_size_ratio` when the remote block divides the local one).
    pub local_sub: u64,
    /// Units per remote kernel block (vLLM's C.6 split factor).
    pub remote_sub: u64,
    /// Heads-major pages of several heads per rank (on either side) cut into units smaller than a kernel block:
    /// the heads a rank pair exchanges per unit (the smaller side's heads per rank), every unit then being one
    /// descriptor per head. `None`: a unit is one descriptor (a token range, or a whole page).
    pub per_head: Option<u64>,
    /// Descriptors per head and unit when cut per head: 1, or for `HKTV` pages the K rows (one run each) and the
    /// V run.
    pub parts: u64,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl BlockUnits {
    /// Cut `local_kernel` and `remote_kernel` tokens into their greatest common unit.
    ///
    /// # Errors
    /// `Mismatch` when a size is zero or a block would be cut into more than [`MAX_UNITS_PER_BLOCK`] units.
    pub fn new(local_kernel: u64, remote_kernel: u64) -> Result<BlockUnits, PlanError> {
        let bad = || PlanError::Mismatch {
            what: format!(
                "kernel block size (tokens; at most {MAX_UNITS_PER_BLOCK} common units per block are supported)"
            ),
            local: local_kernel.to_string(),
            remote: remote_kernel.to_string(),
        };
        if local_kernel == 0 || remote_kernel == 0 {
            return Err(bad());
        }
        let unit = gcd(local_kernel, remote_kernel);
        let units = BlockUnits {
            unit_tokens: unit,
            local_sub: local_kernel / unit,
            remote_sub: remote_kernel / unit,
            per_head: None,
            parts: 1,
        };
        if units.local_sub.max(units.remote_sub) > MAX_UNITS_PER_BLOCK {
            return Err(bad());
        }
        Ok(units)
    }

    /// Units of one token each: how token-major pages are cut when heads are split between TP sizes, since a
    /// head range of a token-major page is contiguous only inside one token.
    ///
    /// # Errors
    /// `Mismatch` when a size is zero or a kernel block has more than [`MAX_UNITS_PER_BLOCK`] tokens.
    pub fn per_token(local_kernel: u64, remote_kernel: u64) -> Result<BlockUnits, PlanError> {
        if local_kernel.max(remote_kernel) > MAX_UNITS_PER_BLOCK || local_kernel == 0 || remote_kernel == 0 {
            return Err(PlanError::Mismatch {
                what: format!(
                    "kernel block size (tokens; token-major pages split between TP sizes are cut per token, \
                     at most {MAX_UNITS_PER_BLOCK} tokens per block)"
                ),
                local: local_kernel.to_string(),
                remote: remote_kernel.to_string(),
            });
        }
        Ok(BlockUnits {
            unit_tokens: 1,
            local_sub: local_kernel,
            remote_sub: remote_kernel,
            per_head: None,
            parts: 1,
        })
    }

    /// The units a pair of ranks is planned in: per token when token-major attention pages are split between
    /// TP sizes (`heads` per rank differ), else the common unit of the two kernel blocks, cut per head when
    /// heads-major pages of several heads per rank are cut at all.
    ///
    /// `gqa_order` is the page order of the model's (non-MLA) attention pages, `None` without any; `k_rows` the
    /// K elements per head of `HKTV` pages, whose units are always cut per head (even one head: its K is not one
    /// range).
    ///
    /// # Errors
    /// As [`BlockUnits::new`] and [`BlockUnits::per_token`]; `Mismatch` for `HKTV` pages cut with no K rows.
    pub fn for_pages(
        (local_kernel, remote_kernel): (u64, u64),
        gqa_order: Option<PageOrder>,
        (local_heads, remote_heads): (u64, u64),
        k_rows: u64,
    ) -> Result<BlockUnits, PlanError> {
        match gqa_order {
            Some(PageOrder::HeadsMajorKTransposed) => {
                let units = BlockUnits::new(local_kernel, remote_kernel)?;
                if units.is_identity() {
                    return Ok(units);
                }
                if k_rows == 0 {
                    return Err(PlanError::Mismatch {
                        what: "K rows of HKTV pages cut into token units".into(),
                        local: k_rows.to_string(),
                        remote: "at least 1".into(),
                    });
                }
                Ok(BlockUnits {
                    per_head: Some(local_heads.min(remote_heads)),
                    parts: k_rows.saturating_add(1),
                    ..units
                })
            }
            Some(PageOrder::TokenMajor) if local_heads != remote_heads => {
                BlockUnits::per_token(local_kernel, remote_kernel)
            }
            Some(PageOrder::HeadsMajor) if local_heads > 1 || remote_heads > 1 => {
                let units = BlockUnits::new(local_kernel, remote_kernel)?;
                Ok(BlockUnits {
                    per_head: (!units.is_identity()).then_some(local_heads.min(remote_heads)),
                    ..units
                })
            }
            _ => BlockUnits::new(local_kernel, remote_kernel),
        }
    }

    /// True when both sides use their whole kernel blocks.
    pub fn is_identity(&self) -> bool {
        self.local_sub == 1 && self.remote_sub == 1
    }

    /// Descriptors per unit: the heads exchanged times each head's parts when cut per head, else 1.
    pub fn per_unit(&self) -> u64 {
        self.per_head.map_or(1, |hp| hp.saturating_mul(self.parts))
    }

    /// Descriptors per local kernel block: its units, times the descriptors of each.
    pub fn local_pieces(&self) -> u64 {
        self.local_sub.saturating_mul(self.per_unit())
    }

    /// Descriptors per remote kernel block (as [`BlockUnits::local_pieces`]).
    pub fn remote_pieces(&self) -> u64 {
        self.remote_sub.saturating_mul(self.per_unit())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_of_both_directions() {
        assert_eq!(
            BlockUnits::new(16, 4).unwrap(),
            BlockUnits {
                unit_tokens: 4,
                local_sub: 4,
                remote_sub: 1,
                per_head: None,
                parts: 1
            }
        );
        assert_eq!(
            BlockUnits::new(4, 16).unwrap(),
            BlockUnits {
                unit_tokens: 4,
                local_sub: 1,
                remote_sub: 4,
                per_head: None,
                parts: 1
            }
        );
        assert_eq!(
            BlockUnits::new(12, 8).unwrap(),
            BlockUnits {
                unit_tokens: 4,
                local_sub: 3,
                remote_sub: 2,
                per_head: None,
                parts: 1
            }
        );
        assert!(BlockUnits::new(64, 64).unwrap().is_identity());
        let err = BlockUnits::new(257, 256).unwrap_err().to_string();
        assert!(err.contains("local 257") && err.contains("remote 256"), "{err}");
    }

    /// `HKTV` pages: whole pages stay whole; cut pages are cut per head (one head too) into K rows + 1 parts.
    #[test]
    fn k_transposed_units_are_cut_per_head_into_parts() {
        let hktv = Some(PageOrder::HeadsMajorKTransposed);
        let whole = BlockUnits::for_pages((64, 64), hktv, (2, 1), 64).unwrap();
        assert_eq!((whole.per_head, whole.per_unit()), (None, 1));
        let cut = BlockUnits::for_pages((128, 64), hktv, (1, 1), 64).unwrap();
        assert_eq!(
            (cut.local_sub, cut.per_head, cut.parts, cut.per_unit()),
            (2, Some(1), 65, 65)
        );
        assert_eq!((cut.local_pieces(), cut.remote_pieces()), (130, 65));
        let cut = BlockUnits::for_pages((64, 128), hktv, (2, 4), 8).unwrap();
        assert_eq!((cut.per_head, cut.per_unit(), cut.remote_pieces()), (Some(2), 18, 36));
        let err = BlockUnits::for_pages((64, 128), hktv, (2, 2), 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("K rows"), "{err}");
        let hnd = BlockUnits::for_pages((128, 64), Some(PageOrder::HeadsMajor), (1, 1), 0).unwrap();
        assert_eq!((hnd.per_head, hnd.per_unit()), (None, 1));
    }
}
