//! Descriptor-id arithmetic of a peer plan: each side's id geometry and the unit expansion of a window of
//! logical block ids (the per-request hot path; no sorting or hashing).

use super::plan_error::{PlanError, Side};
use super::region::GroupKind;
use super::trim::Window;

/// Descriptor-id geometry of one side.
#[derive(Debug, Clone)]
pub(crate) struct IdSpace {
    /// Flat start of every region's attention descriptors.
    pub(crate) region_start: Vec<u64>,
    /// Flat start of every (SSM region, stream), in table order.
    pub(crate) ssm_start: Vec<u64>,
    /// Common units per logical attention block (`ppl * sub`).
    pub(crate) units_per_logical: u64,
    /// Tokens per logical block.
    pub(crate) logical_tokens: u64,
    /// Largest logical id + 1 of every group.
    pub(crate) group_cap: Vec<u64>,
}

impl IdSpace {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        counts: &[u64],
        num_fa: u64,
        ssm_streams: usize,
        ppl: u64,
        sub: u64,
        logical_tokens: u64,
        num_logical: u64,
        region_groups: &[Vec<usize>],
        groups: &[GroupKind],
    ) -> IdSpace {
        let mut region_start = Vec::with_capacity(counts.len());
        let mut acc = 0;
        for c in counts {
            region_start.push(acc);
            acc += c;
        }
        let ssm_start = (0..ssm_streams as u64).map(|s| num_fa + s * num_logical).collect();
        let group_cap = (0..groups.len())
            .map(|g| {
                let regions = region_groups.iter().enumerate().filter(|(_, gs)| gs.contains(&g));
                regions
                    .map(|(r, _)| counts[r] / (ppl * sub))
                    .fold(num_logical, u64::min)
            })
            .collect();
        IdSpace {
            region_start,
            ssm_start,
            units_per_logical: ppl * sub,
            logical_tokens,
            group_cap,
        }
    }

    pub(crate) fn check(&self, side: Side, ids: &[Vec<u64>]) -> Result<(), PlanError> {
        if ids.len() != self.group_cap.len() {
            return Err(PlanError::GroupCount {
                side,
                got: ids.len(),
                expected: self.group_cap.len(),
            });
        }
        for (g, (list, &cap)) in ids.iter().zip(&self.group_cap).enumerate() {
            if let Some(&id) = list.iter().find(|&&id| id >= cap) {
                return Err(PlanError::BlockOutOfRange {
                    side,
                    group: g,
                    id,
                    limit: cap,
                    unit: "logical",
                });
            }
        }
        Ok(())
    }
}

/// Unit ids of the window `w` of the unit expansion of logical `ids` (`u` units per logical block).
pub(crate) fn window_units(ids: &[u64], u: u64, w: Window) -> Vec<u64> {
    let mut out = Vec::with_capacity(w.len as usize);
    let (mut i, end) = (w.start, w.start + w.len);
    while i < end {
        let (b, j0) = (i / u, i % u);
        let j1 = u.min(j0 + (end - i));
        let base = ids[b as usize] * u;
        out.extend(base + j0..base + j1);
        i += j1 - j0;
    }
    out
}
