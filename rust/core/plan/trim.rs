//! Per-request block-id preparation: logical → kernel expansion and prefix-cache trimming
//! (D.5), done on list *lengths* so the planner can stream ids without materialising trimmed copies.
//!
//! Trimming pairs the decode list (the blocks decode still needs) with the prefill list (every block of the
//! prompt) group by group. It returns, for each side, the window `[start, start + len)` of the side's list
//! that is transferred. Differences from vLLM 0.33.0, on purpose: an empty decode list transfers nothing
//! (vLLM's negative slice kept the whole prefill list and then failed a count assertion), and attention
//! lists are end-aligned whenever both sides use the same *logical* block size in tokens (vLLM: the same
//! `ppl`, which is the same thing when the kernel block sizes are equal).

use super::error::PlanError;
use crate::core::region::GroupKind;

/// The part of a list that is transferred.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Window {
    /// First transferred element.
    pub start: u64,
    /// Number of transferred elements.
    pub len: u64,
}

impl Window {
    /// The whole list of `len` elements.
    pub fn all(len: u64) -> Window {
        Window { start: 0, len }
    }

    /// The window's elements of `list`.
    pub fn of<'a, T>(&self, list: &'a [T]) -> &'a [T] {
        &list[self.start as usize..(self.start + self.len) as usize]
    }
}

/// How one group's lists are paired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupTrim {
    /// Group index (for errors).
    pub group: usize,
    /// What the group holds.
    pub kind: GroupKind,
    /// Whether both sides' logical blocks hold the same number of tokens (attention lists then end-align).
    pub same_logical_tokens: bool,
    /// Largest allowed length difference of front-aligned attention lists (units per logical block of both
    /// sides together, vLLM's `ppl_d + ppl_p`).
    pub slack: u64,
}

/// Pair a decode list of `decode_len` ids with a prefill list of `prefill_len` ids (D.5).
///
/// Returns `(decode window, prefill window)`, always of equal length.
///
/// # Errors
/// `UnpairableSsm` when an SSM decode list is longer than the prefill list by two or more;
/// `UnalignedAttention` when front-aligned attention lists differ by more than `slack`.
pub fn trim(t: GroupTrim, decode_len: u64, prefill_len: u64) -> Result<(Window, Window), PlanError> {
    let (nd, np) = (decode_len, prefill_len);
    if nd == 0 || (np == 0 && t.kind == GroupKind::Ssm) {
        if nd > 1 {
            return Err(unpairable(t.group, nd, np));
        }
        return Ok((Window::default(), Window::default()));
    }
    let tail = |n: u64, keep: u64| Window {
        start: n - keep,
        len: keep,
    };
    match t.kind {
        GroupKind::Ssm => {
            if nd <= np {
                Ok((Window::all(nd), tail(np, nd)))
            } else if nd == np + 1 {
                Ok((Window::all(np), Window::all(np)))
            } else {
                Err(unpairable(t.group, nd, np))
            }
        }
        GroupKind::Attention | GroupKind::Mla => {
            if t.same_logical_tokens && nd < np {
                return Ok((Window::all(nd), tail(np, nd)));
            }
            if nd.abs_diff(np) > t.slack {
                return Err(PlanError::UnalignedAttention {
                    group: t.group,
                    decode_len: nd,
                    prefill_len: np,
                    limit: t.slack,
                });
            }
            let n = nd.min(np);
            Ok((Window::all(n), Window::all(n)))
        }
    }
}

fn unpairable(group: usize, nd: u64, np: u64) -> PlanError {
    PlanError::UnpairableSsm {
        group,
        decode_len: nd as usize,
        prefill_len: np as usize,
    }
}

/// Expand logical block ids to kernel ids (vLLM's `_logical_to_kernel_block_ids`): every attention id `b`
/// becomes `b*ppl .. b*ppl + ppl - 1`; SSM ids pass through.
pub fn logical_to_kernel(ids: &[Vec<u64>], groups: &[GroupKind], ppl: u64) -> Vec<Vec<u64>> {
    ids.iter()
        .zip(groups)
        .map(|(list, kind)| {
            if kind.is_attention() {
                list.iter().flat_map(|&b| b * ppl..(b + 1) * ppl).collect()
            } else {
                list.clone()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use GroupKind::{Attention as A, Ssm as S};

    fn r(a: u64, b: u64) -> Vec<u64> {
        (a..=b).collect()
    }

    /// Reference F.9 `_logical_to_kernel_block_ids` vectors.
    #[test]
    fn f9_logical_to_kernel() {
        assert_eq!(
            logical_to_kernel(&[vec![0, 1, 2], vec![3, 4]], &[A, A], 2),
            vec![r(0, 5), r(6, 9)]
        );
        // Each side expands with its own ppl (remote-ratio variants).
        assert_eq!(
            logical_to_kernel(&[vec![0], vec![10]], &[A, S], 10),
            vec![r(0, 9), vec![10]]
        );
        assert_eq!(
            logical_to_kernel(&[vec![0, 1], vec![10]], &[A, S], 6),
            vec![r(0, 11), vec![10]]
        );
        assert_eq!(
            logical_to_kernel(&[vec![0, 1, 2], vec![5]], &[A, S], 1),
            vec![vec![0, 1, 2], vec![5]]
        );
        assert_eq!(logical_to_kernel(&[vec![0, 1]], &[A], 4), vec![r(0, 7)]);
        assert_eq!(
            logical_to_kernel(&[vec![0, 1], vec![2, 3]], &[A, A], 3),
            vec![r(0, 5), r(6, 11)]
        );
        assert_eq!(
            logical_to_kernel(&[vec![5, 6], vec![2]], &[A, S], 34),
            vec![r(170, 237), vec![2]]
        );
    }

    type Lists = Vec<Vec<u64>>;

    /// Apply D.5 to kernel lists: `(decode, prefill)` per group after trimming.
    fn apply(
        groups: &[GroupKind],
        ppl_d: u64,
        ppl_p: u64,
        d: &[Vec<u64>],
        p: &[Vec<u64>],
    ) -> Result<(Lists, Lists), PlanError> {
        let (mut od, mut op) = (Vec::new(), Vec::new());
        for (g, kind) in groups.iter().enumerate() {
            let t = GroupTrim {
                group: g,
                kind: *kind,
                same_logical_tokens: ppl_d == ppl_p,
                slack: ppl_d + ppl_p,
            };
            let (wd, wp) = trim(t, d[g].len() as u64, p[g].len() as u64)?;
            od.push(wd.of(&d[g]).to_vec());
            op.push(wp.of(&p[g]).to_vec());
        }
        Ok((od, op))
    }

    /// Reference F.9 `_apply_prefix_caching` table (groups FA, Mamba).
    #[test]
    fn f9_prefix_caching() {
        let g = [A, S];
        let (d, p) = apply(&g, 6, 10, &[r(0, 11), vec![42]], &[r(0, 9), vec![42]]).unwrap();
        assert_eq!((d, p), (vec![r(0, 9), vec![42]], vec![r(0, 9), vec![42]]));
        let (d, p) = apply(&g, 10, 6, &[r(0, 9), vec![42]], &[r(0, 11), vec![42]]).unwrap();
        assert_eq!((d, p), (vec![r(0, 9), vec![42]], vec![r(0, 9), vec![42]]));
        let (_, p) = apply(&g, 10, 10, &[r(0, 9), vec![42]], &[r(0, 9), r(40, 43)]).unwrap();
        assert_eq!(p, vec![r(0, 9), vec![43]]);
        let (_, p) = apply(&g, 10, 10, &[r(6, 9), vec![42]], &[r(0, 9), vec![42]]).unwrap();
        assert_eq!(p, vec![r(6, 9), vec![42]]);
        let (d, p) = apply(&g, 10, 10, &[r(6, 9), vec![99]], &[r(0, 9), vec![10, 20, 99]]).unwrap();
        assert_eq!((d, p), (vec![r(6, 9), vec![99]], vec![r(6, 9), vec![99]]));
        let (_, p) = apply(&[S], 10, 10, &[vec![5, 6]], &[vec![1, 2, 3]]).unwrap();
        assert_eq!(p, vec![vec![2, 3]]);
        let (d, _) = apply(&[S], 10, 10, &[vec![4, 5, 6]], &[vec![8, 9]]).unwrap();
        assert_eq!(d, vec![vec![4, 5]]);
        let err = apply(&[S], 10, 10, &[vec![4, 5, 6, 7]], &[vec![8, 9]]).unwrap_err();
        assert_eq!(
            err,
            PlanError::UnpairableSsm {
                group: 0,
                decode_len: 4,
                prefill_len: 2
            }
        );
        assert!(err.to_string().contains("unpairable SSM state slots"));
    }

    /// F.5: push end-trim and pass-through; and the empty decode list transfers nothing.
    #[test]
    fn end_trim_and_empty_decode() {
        let (d, p) = apply(&[A], 1, 1, &[vec![500, 501]], &[r(10, 14)]).unwrap();
        assert_eq!((d, p), (vec![vec![500, 501]], vec![vec![13, 14]]));
        let (_, p) = apply(&[A], 1, 1, &[vec![500, 501, 502]], &[r(10, 12)]).unwrap();
        assert_eq!(p, vec![r(10, 12)]);
        let (d, p) = apply(&[A, S], 2, 2, &[vec![], vec![]], &[r(0, 5), vec![3]]).unwrap();
        assert_eq!((d, p), (vec![vec![], vec![]], vec![vec![], vec![]]));
        let err = apply(&[A], 2, 3, &[r(0, 20)], &[r(0, 3)]).unwrap_err().to_string();
        assert!(
            err.contains("decode lists 21 units and prefill 4") && err.contains("at most 5"),
            "{err}"
        );
    }
}
