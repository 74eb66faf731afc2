//! Validating a whole deployment: every local rank against each remote rank it handshakes with (C.2).

use serde::Serialize;

use super::error::Finding;
use super::validate::{findings, Expected};
use crate::core::meta::AgentMeta;
use crate::core::tp::handshake_target_ranks;

/// The verdict for one (local rank, remote rank) pair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PairVerdict {
    /// Local TP rank (decode in pull mode, prefill in push mode).
    pub local_rank: u32,
    /// Remote TP rank.
    pub remote_rank: u32,
    /// Every failed check (empty when compatible).
    pub findings: Vec<Finding>,
}

impl PairVerdict {
    /// Whether the pair passed every check.
    pub fn compatible(&self) -> bool {
        self.findings.is_empty()
    }
}

/// Validate every local rank against the remote ranks it exchanges with. `remote` is indexed by TP rank;
/// all its ranks must advertise one engine id, TP size and block count (rank 0's are expected of the rest).
/// Targets are [`handshake_target_ranks`]; when the TP sizes do not divide (or a local rank is outside its TP
/// size), the local rank is paired with remote rank 0 so the reason is reported.
pub fn check_pairs(local: &[AgentMeta], remote: &[AgentMeta]) -> Vec<PairVerdict> {
    let Some(first) = remote.first() else { return Vec::new() };
    let expected = Expected {
        engine_id: Some(first.engine_id.clone()),
        tp_size: Some(remote.len() as u32),
        num_blocks: Some(first.num_blocks),
    };
    let mut out = Vec::new();
    for l in local {
        // Sizes that do not divide (or a rank outside its TP size) pair with remote rank 0, whose checks say why.
        let targets = handshake_target_ranks(l.tp_rank, l.tp_size, remote.len() as u32).unwrap_or_else(|_| vec![0]);
        for t in targets {
            let Some(r) = remote.get(t as usize) else { continue };
            out.push(PairVerdict {
                local_rank: l.tp_rank,
                remote_rank: t,
                findings: findings(l, r, &expected),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::fixtures::kimi_linear_like;
    use crate::core::meta::{EngineInfo, TransferMode};
    use crate::core::region::RegionTable;

    fn engine(tp: u32, heads_total: u64, id: &str) -> Vec<AgentMeta> {
        let info = EngineInfo {
            engine_id: id.into(),
            transfer_mode: TransferMode::Pull,
            ..EngineInfo::default()
        };
        (0..tp)
            .map(|rank| {
                let mut l = kimi_linear_like(2, heads_total / u64::from(tp), 8);
                (l.tp_size, l.tp_rank) = (tp, rank);
                AgentMeta::from_table(&RegionTable::build(&l).unwrap(), &info)
            })
            .collect()
    }

    #[test]
    fn every_pair_is_checked() {
        let d = engine(2, 32, "decode");
        let p = engine(4, 32, "prefill");
        let v = check_pairs(&d, &p);
        let pairs: Vec<(u32, u32)> = v.iter().map(|p| (p.local_rank, p.remote_rank)).collect();
        assert_eq!(pairs, [(0, 0), (0, 1), (1, 2), (1, 3)]);
        assert!(v.iter().all(PairVerdict::compatible), "{v:?}");
        let mut bad = p.clone();
        bad[3].engine_id = "stray".into();
        let v = check_pairs(&d, &bad);
        assert!(!v[3].compatible() && v[..3].iter().all(PairVerdict::compatible));
        let v = check_pairs(&d, &engine(3, 48, "prefill"));
        assert_eq!(v.len(), 2);
        assert!(v[0].findings.iter().any(|f| f.check == "tp_divisibility"));
        // A local rank outside its TP size is paired with remote rank 0 and reported, not dropped.
        let mut stray = d.clone();
        stray[1].tp_rank = 5;
        let v = check_pairs(&stray, &p);
        assert_eq!((v[2].local_rank, v[2].remote_rank), (5, 0));
        assert!(v[2].findings.iter().any(|f| f.check == "local.tp_rank"), "{v:?}");
    }
}
