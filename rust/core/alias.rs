//! Aliases: attention layers of different page lengths viewing one tensor (DeepSeek-V4-style caches, e.g. an
//! indexer cache aliasing a sliding-window cache with a shorter page). Regions are keyed by (base, page length,
//! stride): each alias is a region of its own, planned with its own page, and aliases of one base count as one
//! tensor wherever memory is concerned (registration, overlap, the groups whose ids address it). Aliases must
//! step by the same stride, so that block `b` of every alias lies in the tensor's page `b`; a region that
//! overlaps another without sharing its base (a partial overlap) is refused.

use super::error::LayoutError;
use super::region::Region;

/// Index of the first region of every region's base (itself when it aliases nothing earlier).
pub fn alias_roots(bases: &[u64]) -> Vec<usize> {
    bases
        .iter()
        .map(|b| bases.iter().position(|x| x == b).unwrap_or(0))
        .collect()
}

/// `(base, end, first index)` of every distinct base, ascending, each end the furthest of its aliases.
pub fn tensor_extents(extents: impl Iterator<Item = (u64, u64)>) -> Vec<(u64, u64, usize)> {
    let mut out: Vec<(u64, u64, usize)> = Vec::new();
    for (i, (base, end)) in extents.enumerate() {
        match out.iter_mut().find(|(b, ..)| *b == base) {
            Some(t) => t.1 = t.1.max(end),
            None => out.push((base, end, i)),
        }
    }
    out.sort_unstable();
    out
}

/// Every region's groups merged over its aliases, so that a block id in two groups addressing one tensor
/// through different aliases is refused like one in two groups sharing a region.
pub fn merge_alias_groups(bases: &[u64], region_groups: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let roots = alias_roots(bases);
    let mut merged: Vec<Vec<usize>> = region_groups.to_vec();
    for (i, &root) in roots.iter().enumerate() {
        if root != i {
            let extra = region_groups[i].clone();
            merged[root].extend(extra);
        }
    }
    for (i, &root) in roots.iter().enumerate() {
        if root != i {
            merged[i] = merged[root].clone();
        }
    }
    for g in &mut merged {
        g.sort_unstable();
        g.dedup();
    }
    merged
}

/// Whether a layer stepping by `block_stride` over `num_blocks` may alias region `r` at the same base: same stride and block count.
pub(crate) fn can_alias(r: &Region, (block_stride, num_blocks): (u64, u64)) -> bool {
    (r.block_stride, r.num_blocks) == (block_stride, num_blocks)
}

/// Aliases hold attention pages only: an SSM state at a base another page length also maps is refused.
pub(crate) fn check_aliases(regions: &[Region], owner: &[&str]) -> Result<(), LayoutError> {
    for (i, r) in regions.iter().enumerate() {
        if let Some(j) = (0..i).find(|&j| regions[j].base == r.base) {
            let a = &regions[j];
            if a.has_ssm || r.has_ssm {
                return Err(LayoutError::SharedPageMismatch {
                    a: owner[j].to_string(),
                    b: owner[i].to_string(),
                    base: r.base,
                    a_len: a.block_len,
                    b_len: r.block_len,
                    a_stride: a.block_stride,
                    b_stride: r.block_stride,
                });
            }
        }
    }
    Ok(())
}

/// Distinct tensors (aliases of one base merged) must not overlap: a partial overlap is refused.
pub(crate) fn check_no_overlap(regions: &[Region]) -> Result<(), LayoutError> {
    // ends were checked to fit the address space when the layers were read
    let tensors = tensor_extents(regions.iter().map(|r| (r.base, r.base + r.bytes)));
    for pair in tensors.windows(2) {
        let ((a_start, a_end, a), (b_start, b_end, b)) = (pair[0], pair[1]);
        if a_end > b_start {
            return Err(LayoutError::Overlap {
                a: regions[a].name.clone(),
                a_start,
                a_end,
                b: regions[b].name.clone(),
                b_start,
                b_end,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases_count_as_one_tensor() {
        assert_eq!(alias_roots(&[10, 20, 10]), vec![0, 1, 0]);
        assert_eq!(
            tensor_extents([(10, 50), (20, 30), (10, 90)].into_iter()),
            vec![(10, 90, 0), (20, 30, 1)]
        );
        assert_eq!(
            merge_alias_groups(&[10, 20, 10], &[vec![0], vec![1], vec![2]]),
            vec![vec![0, 2], vec![1], vec![0, 2]]
        );
    }
}
