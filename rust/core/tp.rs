//! Heterogeneous-TP mapping: the TP ratio of two engines and which remote ranks a local rank exchanges each
//! KV-cache group with (without decode context parallelism). Kernel block sizes are related through their
//! common unit instead (`units.rs`).
//!
//! "Source" follows vLLM's read-oriented naming: in pull mode the sources are the prefill ranks a decode
//! rank reads from; in push mode the same mapping, computed from the prefill rank's view, names the decode
//! ranks it writes to.

use super::plan::{PlanError, Side};
use super::region::GroupKind;

/// The TP mapping of one local rank against one remote engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpMapping {
    /// Local TP rank.
    pub tp_rank: u32,
    /// Local TP size.
    pub tp_size: u32,
    /// Remote TP size.
    pub remote_tp: u32,
    /// Signed TP ratio from the local view.
    pub tp_ratio: i64,
    /// Total KV heads used for head arithmetic (1 for MLA).
    pub total_kv_heads: u64,
    /// Model-level MLA (attention replicated on every rank).
    pub is_mla: bool,
    /// Remote ranks holding the attention heads this rank needs, one per distinct head slice (GQA dedup).
    pub attn_ranks: Vec<u32>,
    /// Remote ranks whose SSM shards overlap this rank's shard (empty without SSM groups).
    pub ssm_ranks: Vec<u32>,
    /// Source ranks of every group, in group order; a rank's position is its piece index.
    pub per_group: Vec<Vec<u32>>,
    /// Sorted union of all source ranks.
    pub all_source_ranks: Vec<u32>,
    /// `(head, slot)`: the attention slot of every distinct head among `attn_ranks`.
    slot_of_head: Vec<(u64, u32)>,
    /// Head-slice index inside a larger remote block (local TP > remote TP, non-MLA).
    pub rank_offset_factor: u64,
    /// Local ranks that read each source (`max(1, tp_ratio)`).
    pub local_consumers: u64,
}

/// Largest TP size accepted from anyone (a scenario file, a peer's metadata, a caller): TP mappings allocate
/// per rank, so a size must be bounded before it sizes anything. Deployments today use at most a few hundred.
pub const MAX_TP_SIZE: u32 = 1024;

/// TP ratio from the local side's view: `local/remote` (>= 1) when the local TP is at least the remote TP,
/// `-(remote/local)` otherwise. In pull mode local is decode; in push mode local is prefill.
///
/// # Errors
/// A message naming both sizes when either is zero or over [`MAX_TP_SIZE`], or the larger does not divide by
/// the smaller.
pub fn tp_ratio(local_tp: u32, remote_tp: u32) -> Result<i64, String> {
    if local_tp == 0 || remote_tp == 0 {
        return Err(format!(
            "TP sizes must be positive (local {local_tp}, remote {remote_tp})"
        ));
    }
    if local_tp > MAX_TP_SIZE || remote_tp > MAX_TP_SIZE {
        return Err(format!(
            "TP sizes must be at most {MAX_TP_SIZE} (local {local_tp}, remote {remote_tp})"
        ));
    }
    if local_tp >= remote_tp {
        if local_tp % remote_tp != 0 {
            return Err(format!(
                "local TP {local_tp} is not a multiple of remote TP {remote_tp}"
            ));
        }
        Ok(i64::from(local_tp / remote_tp))
    } else {
        if remote_tp % local_tp != 0 {
            return Err(format!(
                "remote TP {remote_tp} is not a multiple of local TP {local_tp}"
            ));
        }
        Ok(-i64::from(remote_tp / local_tp))
    }
}

/// Remote ranks a local rank must handshake with: one rank when the local TP is at least the
/// remote TP, otherwise the `|ratio|` remote ranks covering this rank's shard.
///
/// # Errors
/// `TpRatio` when the sizes do not divide, `RankOutOfRange` for a bad rank.
pub fn handshake_target_ranks(tp_rank: u32, tp_size: u32, remote_tp: u32) -> Result<Vec<u32>, PlanError> {
    let ratio = checked_ratio(tp_rank, tp_size, remote_tp)?;
    Ok(if ratio > 0 {
        vec![tp_rank / ratio as u32]
    } else {
        let abs = ratio.unsigned_abs() as u32;
        (tp_rank * abs..(tp_rank + 1) * abs).collect()
    })
}

/// The signed TP ratio of a local rank: `TpRatio` when the sizes do not divide, then `RankOutOfRange` when
/// `tp_rank` is not below `tp_size`.
fn checked_ratio(tp_rank: u32, tp_size: u32, remote_tp: u32) -> Result<i64, PlanError> {
    for (side, tp) in [(Side::Local, tp_size), (Side::Remote, remote_tp)] {
        if tp > MAX_TP_SIZE {
            return Err(PlanError::OverLimit {
                what: format!("{side} TP size"),
                value: u64::from(tp),
                limit: u64::from(MAX_TP_SIZE),
            });
        }
    }
    let ratio = tp_ratio(tp_size, remote_tp).map_err(|_| PlanError::TpRatio {
        local_tp: tp_size,
        remote_tp,
    })?;
    if tp_rank >= tp_size {
        return Err(PlanError::RankOutOfRange {
            side: Side::Local,
            rank: tp_rank,
            tp_size,
        });
    }
    Ok(ratio)
}

/// Check that `heads` KV heads can be shared by `tp` ranks as docs/byte-layouts.md says (equal shares or equal replicas).
fn check_heads(heads: u64, tp: u32, side: Side) -> Result<(), PlanError> {
    let tp64 = u64::from(tp);
    if heads == 0 || (tp64 <= heads && heads % tp64 != 0) || (tp64 > heads && tp64 % heads != 0) {
        return Err(PlanError::NotSupported(format!(
            "{side} TP {tp} with {heads} KV heads: heads must split evenly across ranks or ranks evenly across heads"
        )));
    }
    Ok(())
}

impl TpMapping {
    /// Compute the mapping (vLLM's `compute_tp_mapping` for DCP = 1).
    ///
    /// `total_kv_heads` is ignored for MLA (treated as 1). `groups` gives every group's kind, in order.
    ///
    /// # Errors
    /// `TpRatio` when the TP sizes do not divide, `RankOutOfRange`, or `NotSupported` when the heads do not
    /// share evenly across either side's ranks.
    pub fn compute(
        tp_rank: u32,
        tp_size: u32,
        remote_tp: u32,
        total_kv_heads: u64,
        is_mla: bool,
        groups: &[GroupKind],
    ) -> Result<TpMapping, PlanError> {
        let ratio = checked_ratio(tp_rank, tp_size, remote_tp)?;
        let k = if is_mla { 1 } else { total_kv_heads };
        if !is_mla {
            check_heads(k, tp_size, Side::Local)?;
            check_heads(k, remote_tp, Side::Remote)?;
        }
        let (rank, tp, rtp) = (u64::from(tp_rank), u64::from(tp_size), u64::from(remote_tp));
        let head = |r: u32| u64::from(r) * k / rtp;
        let abs = rtp / tp; // remote ranks per local rank when the remote TP is larger

        let attn: Vec<u32> = if is_mla || tp >= rtp {
            vec![(rank * rtp / tp) as u32]
        } else {
            let start = tp_rank * abs as u32;
            let mut seen = Vec::new();
            let mut ranks = Vec::new();
            for r in start..start + abs as u32 {
                if !seen.contains(&head(r)) {
                    seen.push(head(r));
                    ranks.push(r);
                }
            }
            ranks
        };
        let has_ssm = groups.contains(&GroupKind::Ssm);
        let ssm: Vec<u32> = match (has_ssm, tp < rtp) {
            (false, _) => Vec::new(),
            (true, true) => (tp_rank * abs as u32..(tp_rank + 1) * abs as u32).collect(),
            (true, false) => attn.clone(),
        };
        let mut all: Vec<u32> = attn.iter().chain(&ssm).copied().collect();
        all.sort_unstable();
        all.dedup();
        let per_group = groups
            .iter()
            .map(|g| {
                if *g == GroupKind::Ssm {
                    ssm.clone()
                } else {
                    attn.clone()
                }
            })
            .collect();
        let slot_of_head = attn.iter().enumerate().map(|(i, &r)| (head(r), i as u32)).collect();
        let rank_offset_factor = if is_mla || tp <= rtp {
            0
        } else if tp > k {
            let local_head = rank * k / tp;
            local_head - head(attn[0])
        } else {
            rank % (tp / rtp)
        };
        Ok(TpMapping {
            tp_rank,
            tp_size,
            remote_tp,
            tp_ratio: ratio,
            total_kv_heads: k,
            is_mla,
            attn_ranks: attn,
            ssm_ranks: ssm,
            per_group,
            all_source_ranks: all,
            slot_of_head,
            rank_offset_factor,
            local_consumers: ratio.max(1) as u64,
        })
    }

    /// Attention slot of remote rank `r`: the index of its head slice among `attn_ranks` (0 when none).
    pub fn attention_slot(&self, r: u32) -> u32 {
        let h = u64::from(r) * self.total_kv_heads / u64::from(self.remote_tp);
        self.slot_of_head
            .iter()
            .find(|(head, _)| *head == h)
            .map_or(0, |(_, s)| *s)
    }

    /// Remote ranks whose shards overlap this rank's (the handshake targets).
    pub fn covered_ranks(&self) -> Vec<u32> {
        if self.tp_ratio > 0 {
            vec![self.tp_rank / self.tp_ratio as u32]
        } else {
            let abs = self.tp_ratio.unsigned_abs() as u32;
            (self.tp_rank * abs..(self.tp_rank + 1) * abs).collect()
        }
    }

    /// Whether this local rank is the one that sends its attention bytes when several local ranks hold the
    /// same heads for one remote rank (push with local TP > remote TP): the first rank of each head among the
    /// local ranks that share a remote rank. Always true otherwise.
    ///
    /// Without this, every replica would write the same destination bytes (MLA latents, replicated heads).
    pub fn owns_attention(&self) -> bool {
        if self.tp_ratio <= 1 {
            return true;
        }
        let ratio = self.tp_ratio as u32;
        if self.tp_rank % ratio == 0 {
            return true;
        }
        if self.is_mla {
            return false;
        }
        let tp = u64::from(self.tp_size);
        let head = |r: u32| u64::from(r) * self.total_kv_heads / tp;
        tp <= self.total_kv_heads || head(self.tp_rank - 1) != head(self.tp_rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use GroupKind::{Attention as A, Mla as M, Ssm as S};

    fn map(rank: u32, tp: u32, remote: u32, k: u64, mla: bool, groups: &[GroupKind]) -> TpMapping {
        TpMapping::compute(rank, tp, remote, k, mla, groups).unwrap()
    }

    #[test]
    fn sign_convention() {
        assert_eq!(tp_ratio(4, 2), Ok(2));
        assert_eq!(tp_ratio(2, 8), Ok(-4));
        assert_eq!(tp_ratio(3, 3), Ok(1));
        assert!(tp_ratio(3, 2).unwrap_err().contains("local TP 3"));
        assert!(tp_ratio(2, 3).is_err());
        assert!(tp_ratio(0, 3).is_err());
    }

    /// Reference F.10 source-rank vectors (K = 8, full attention).
    #[test]
    fn f10_source_ranks() {
        assert_eq!(map(1, 2, 2, 8, false, &[A]).all_source_ranks, vec![1]);
        assert_eq!(map(2, 4, 2, 8, false, &[A]).all_source_ranks, vec![1]);
        assert_eq!(map(0, 1, 2, 8, false, &[A]).all_source_ranks, vec![0, 1]);
    }

    /// Reference F.10 derived hybrid vectors.
    #[test]
    fn f10_hybrid_mappings() {
        let m = map(0, 1, 2, 1, true, &[M, S, S]);
        assert_eq!(m.attn_ranks, vec![0]);
        assert_eq!(m.ssm_ranks, vec![0, 1]);
        assert_eq!(m.all_source_ranks, vec![0, 1]);
        assert_eq!(m.per_group, vec![vec![0], vec![0, 1], vec![0, 1]]);
        assert_eq!(
            (m.attention_slot(0), m.attention_slot(1), m.rank_offset_factor),
            (0, 0, 0)
        );
        assert_eq!(m.tp_ratio, -2);

        let kimi = map(0, 1, 8, 1, true, &[M, S]);
        assert_eq!(kimi.attn_ranks, vec![0]);
        assert_eq!(kimi.ssm_ranks, (0..8).collect::<Vec<_>>());

        let gqa = map(0, 1, 4, 2, false, &[A, S]);
        assert_eq!(gqa.attn_ranks, vec![0, 2]);
        assert_eq!(gqa.ssm_ranks, vec![0, 1, 2, 3]);
        let slots: Vec<u32> = (0..4).map(|r| gqa.attention_slot(r)).collect();
        assert_eq!(slots, vec![0, 0, 1, 1]);

        let d4p2 = map(3, 4, 2, 8, false, &[A]);
        assert_eq!(d4p2.attn_ranks, vec![1]);
        assert_eq!(d4p2.rank_offset_factor, 1);
        assert_eq!(d4p2.local_consumers, 2);
    }

    #[test]
    fn replicated_heads_offset_and_mla_spread() {
        // Local TP 8 over K = 2 heads reading remote TP 1: local rank 5 holds head 1, at offset 1.
        assert_eq!(map(5, 8, 1, 2, false, &[A]).rank_offset_factor, 1);
        // MLA spreads local ranks over the replicas.
        assert_eq!(map(3, 4, 2, 1, true, &[M]).attn_ranks, vec![1]);
        assert_eq!(map(1, 2, 4, 1, true, &[M]).attn_ranks, vec![2]);
    }

    #[test]
    fn handshake_targets_and_owners() {
        assert_eq!(handshake_target_ranks(1, 2, 8).unwrap(), vec![4, 5, 6, 7]);
        assert_eq!(handshake_target_ranks(3, 4, 2).unwrap(), vec![1]);
        assert!(matches!(
            handshake_target_ranks(0, 3, 2),
            Err(PlanError::TpRatio {
                local_tp: 3,
                remote_tp: 2
            })
        ));
        assert!(matches!(
            handshake_target_ranks(4, 4, 2),
            Err(PlanError::RankOutOfRange { rank: 4, .. })
        ));
        let owners: Vec<bool> = (0..4).map(|r| map(r, 4, 1, 1, true, &[M]).owns_attention()).collect();
        assert_eq!(owners, vec![true, false, false, false]);
        // K = 2 over 4 local ranks to 1 remote: ranks 0 and 2 hold distinct heads.
        let owners: Vec<bool> = (0..4).map(|r| map(r, 4, 1, 2, false, &[A]).owns_attention()).collect();
        assert_eq!(owners, vec![true, false, true, false]);
        assert!(map(1, 2, 4, 1, true, &[M]).owns_attention());
    }

    #[test]
    fn uneven_heads_are_rejected_with_both_values() {
        let err = TpMapping::compute(0, 4, 2, 6, false, &[A]).unwrap_err().to_string();
        assert!(err.contains("TP 4") && err.contains("6 KV heads"), "{err}");
    }
}
