//! Descriptor-id arithmetic of a peer plan: each side's id geometry and the unit expansion of a window of
//! logical block ids (the per-request hot path; no sorting or hashing).

use super::error::{PlanError, Side};
use super::trim::Window;
use crate::core::region::GroupKind;

/// Largest descriptor id a table may have: NIXL takes ids as int32.
pub(crate) const ID_LIMIT: u64 = i32::MAX as u64;

/// Descriptor-id geometry of one side.
#[derive(Debug, Clone)]
pub(crate) struct IdSpace {
    /// Flat start of every region's attention descriptors.
    pub(crate) region_start: Vec<u64>,
    /// Kernel blocks of every region (what per-head piece ids are laid out by).
    pub(crate) region_blocks: Vec<u64>,
    /// Flat start of every (SSM region, stream), in table order.
    pub(crate) ssm_start: Vec<u64>,
    /// Common units per logical attention block (`ppl * sub`; each unit is `per_unit` descriptors, one per head
    /// when cut per head).
    pub(crate) units_per_logical: u64,
    /// Tokens per logical block.
    pub(crate) logical_tokens: u64,
    /// Largest logical id + 1 of every group (an SSM group's: the fewest states of its rows).
    pub(crate) group_cap: Vec<u64>,
    /// What each group's cap counts (`PlanError::BlockOutOfRange`'s unit).
    pub(crate) group_unit: Vec<&'static str>,
    /// Pairs of groups `(g, h)`, `g < h`, whose ids address a common region (see [`shared_group_pairs`]):
    /// one id in both would move (or write) the same bytes twice.
    pub(crate) shared: Vec<(usize, usize)>,
}

impl IdSpace {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        counts: &[u64],
        num_fa: u64,
        ssm_rows: &[u64],
        ppl: u64,
        (sub, per_unit): (u64, u64),
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
        // each SSM row's states: the logical blocks, or a state tensor's own slots (bounded when it was built)
        let ssm_start = ssm_rows
            .iter()
            .scan(num_fa, |acc, &n| {
                let s = *acc;
                *acc = acc.saturating_add(n);
                Some(s)
            })
            .collect();
        let ssm_cap = ssm_rows.iter().copied().min();
        let group_cap = (0..groups.len())
            .map(|g| {
                if groups[g] == GroupKind::Ssm {
                    return ssm_cap.unwrap_or(num_logical);
                }
                let regions = region_groups.iter().enumerate().filter(|(_, gs)| gs.contains(&g));
                regions
                    .map(|(r, _)| counts[r] / (ppl * sub * per_unit))
                    .fold(num_logical, u64::min)
            })
            .collect();
        let group_unit = groups
            .iter()
            .map(|&k| match (k, ssm_cap) {
                (GroupKind::Ssm, Some(cap)) if cap != num_logical => "state slots",
                _ => "logical blocks",
            })
            .collect();
        let region_blocks = counts.iter().map(|c| c / (sub * per_unit)).collect();
        IdSpace {
            region_start,
            region_blocks,
            ssm_start,
            units_per_logical: ppl * sub,
            logical_tokens,
            group_cap,
            group_unit,
            shared: Vec::new(),
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
                    unit: self.group_unit[g],
                });
            }
            if let Some(id) = first_duplicate(list) {
                return Err(PlanError::DuplicateBlock { side, group: g, id });
            }
        }
        for &(g, h) in &self.shared {
            if let Some(id) = first_common(&ids[g], &ids[h]) {
                return Err(PlanError::SharedBlock {
                    side,
                    id,
                    groups: (g, h),
                });
            }
        }
        Ok(())
    }
}

/// Pairs of groups `(g, h)`, `g < h`, whose ids address a common region, as the planner emits them: an
/// attention group addresses the regions `region_groups` lists it in, an SSM group every SSM region. HMA
/// pools layer *i* of every group into one tensor, so block `b` of two groups sharing it is the same page;
/// groups on disjoint tensors may reuse ids (their bytes differ).
pub(crate) fn shared_group_pairs(
    groups: &[GroupKind],
    region_groups: &[Vec<usize>],
    ssm_regions: &[usize],
) -> Vec<(usize, usize)> {
    let ssm: Vec<usize> = (0..groups.len()).filter(|&g| groups[g] == GroupKind::Ssm).collect();
    let mut pairs = Vec::new();
    for (r, attn) in region_groups.iter().enumerate() {
        let mut sharers: Vec<usize> = attn.clone();
        if ssm_regions.contains(&r) {
            sharers.extend(&ssm);
        }
        sharers.sort_unstable();
        sharers.dedup();
        for (i, &g) in sharers.iter().enumerate() {
            pairs.extend(sharers[i + 1..].iter().map(|&h| (g, h)));
        }
    }
    pairs.sort_unstable();
    pairs.dedup();
    pairs
}

/// The smallest id in both `a` and `b`, if any. Ascending lists (the common case) are checked by binary
/// searches of the longer one, after an O(1) test of their id ranges; others on sorted copies.
pub(crate) fn first_common(a: &[u64], b: &[u64]) -> Option<u64> {
    if a.is_empty() || b.is_empty() {
        return None;
    }
    let ascending = |l: &[u64]| l.windows(2).all(|w| w[0] < w[1]);
    let (short, long) = if a.len() <= b.len() { (a, b) } else { (b, a) };
    if ascending(short) && ascending(long) {
        if short[short.len() - 1] < long[0] || long[long.len() - 1] < short[0] {
            return None;
        }
        return short.iter().copied().find(|x| long.binary_search(x).is_ok());
    }
    let mut long = long.to_vec();
    long.sort_unstable();
    let mut short = short.to_vec();
    short.sort_unstable();
    short.into_iter().find(|x| long.binary_search(x).is_ok())
}

/// The smallest id listed more than once, if any. Strictly ascending lists (the common case) take one pass;
/// others are checked on a sorted copy.
pub(crate) fn first_duplicate(ids: &[u64]) -> Option<u64> {
    if ids.windows(2).all(|w| w[0] < w[1]) {
        return None;
    }
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    sorted.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
}

/// Unit ids of the window `w` of the unit expansion of logical `ids` (`u` units per logical block).
///
/// One division for the window's first unit, none per unit (a `div` per unit was most of a long request's
/// planning time).
pub(crate) fn window_units(ids: &[u64], u: u64, w: Window) -> Vec<u64> {
    if u == 1 {
        return ids[w.start as usize..(w.start + w.len) as usize].to_vec();
    }
    let mut out = Vec::with_capacity(w.len as usize);
    let (mut b, mut j0, mut left) = ((w.start / u) as usize, w.start % u, w.len);
    while left > 0 {
        let take = (u - j0).min(left);
        let base = ids[b] * u + j0;
        out.extend(base..base + take);
        (b, j0, left) = (b + 1, 0, left - take);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicates_are_found_in_any_order() {
        assert_eq!(first_duplicate(&[]), None);
        assert_eq!(first_duplicate(&[3]), None);
        assert_eq!(first_duplicate(&[1, 2, 5]), None);
        assert_eq!(first_duplicate(&[5, 2, 1]), None);
        assert_eq!(first_duplicate(&[1, 2, 2, 3]), Some(2));
        assert_eq!(first_duplicate(&[9, 4, 7, 4, 9]), Some(4));
    }

    #[test]
    fn window_units_match_the_expansion() {
        let ids = [7u64, 2, 9, 4];
        for u in 1..5u64 {
            let all: Vec<u64> = ids.iter().flat_map(|&b| b * u..(b + 1) * u).collect();
            for start in 0..=all.len() as u64 {
                for len in 0..=all.len() as u64 - start {
                    let w = Window { start, len };
                    assert_eq!(window_units(&ids, u, w), all[start as usize..(start + len) as usize]);
                }
            }
        }
    }
}
