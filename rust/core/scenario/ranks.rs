//! What each rank of a checked deployment holds and what the scenario's requests cost it (the per-rank table of
//! `hybrid-kv check --preset`): regions and local rows of every rank, and for every posting rank its peer
//! plan's tables and the descriptors, bytes and transfers of its requests.

use serde::Serialize;

use super::RankState;
use crate::core::plan::{PeerPlan, Plan, PlanError};

/// Rows and descriptors (once expanded) of one local table of a peer plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TableSize {
    /// Table key (`whole`, `bsr:N`, `split:I`).
    pub key: String,
    /// Strided rows, as prepped.
    pub rows: usize,
    /// Descriptors once expanded.
    pub descriptors: u64,
}

/// One rank of a deployment and its costs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankCost {
    /// "prefill" or "decode".
    pub role: &'static str,
    /// TP rank.
    pub rank: u32,
    /// Regions of its region table.
    pub regions: usize,
    /// Strided rows of its local table (at its own kernel block, without chunk rows).
    pub local_rows: usize,
    /// Descriptors of that table once expanded.
    pub local_descriptors: u64,
    /// Whether it posts the transfers (decode in pull mode, prefill in push mode).
    pub posts: bool,
    /// The ranks it exchanges data with: a posting rank's handshake targets; for the other side, the posting
    /// ranks whose planned requests transfer to it. Ascending.
    pub peers: Vec<u32>,
    /// A posting rank's local tables (base table first), empty until its peer plan is built.
    pub tables: Vec<TableSize>,
    /// Descriptors of each handshaked remote rank's table, by remote rank.
    pub remote_descriptors: Vec<(u32, u64)>,
    /// Local descriptors of its planned requests' transfers.
    pub request_descriptors: u64,
    /// Bytes those transfers move.
    pub request_bytes: u64,
    /// Transfers of its planned requests.
    pub request_transfers: usize,
}

impl RankCost {
    /// The facts of one built rank that need no peer: regions and its own local table.
    pub fn of_rank(role: &'static str, state: &RankState, posts: bool) -> RankCost {
        let (local_rows, local_descriptors) = state.table.local_table(1).map_or((0, 0), |t| (t.rows.len(), t.len()));
        RankCost {
            role,
            rank: state.table.tp_rank,
            regions: state.table.regions.len(),
            local_rows,
            local_descriptors,
            posts,
            peers: Vec::new(),
            tables: Vec::new(),
            remote_descriptors: Vec::new(),
            request_descriptors: 0,
            request_bytes: 0,
            request_transfers: 0,
        }
    }

    /// Record a posting rank's peer plan: its local tables and each remote rank's table size.
    pub fn add_peer_plan(&mut self, peer: &PeerPlan) {
        self.tables = peer
            .local_tables
            .iter()
            .map(|(k, t)| TableSize {
                key: k.to_string(),
                rows: t.rows.len(),
                descriptors: t.len(),
            })
            .collect();
        self.remote_descriptors = peer.remote_tables.iter().map(|(r, t)| (*r, t.len())).collect();
    }

    /// Add one planned request's transfers; returns the bytes they move.
    ///
    /// # Errors
    /// `BadTransfer` when a transfer names a table or id its peer plan does not have.
    pub fn add_plan(&mut self, peer: &PeerPlan, plan: &Plan) -> Result<u64, PlanError> {
        let mut bytes = 0u64;
        for t in &plan.transfers {
            bytes = bytes.saturating_add(peer.transfer_bytes(t)?);
        }
        self.request_transfers += plan.transfers.len();
        self.request_descriptors += plan.transfers.iter().map(|t| t.local_ids.len() as u64).sum::<u64>();
        self.request_bytes = self.request_bytes.saturating_add(bytes);
        Ok(bytes)
    }
}

/// The costs of every rank of both engines, prefill ranks first, before any peer plan.
pub fn rank_costs(prefill: &[RankState], decode: &[RankState], prefill_posts: bool) -> Vec<RankCost> {
    let prefill = prefill.iter().map(|r| RankCost::of_rank("prefill", r, prefill_posts));
    prefill
        .chain(decode.iter().map(|r| RankCost::of_rank("decode", r, !prefill_posts)))
        .collect()
}

/// Record that posting rank `local` (of role `local_role`) transfers to `remote` in a planned request: it
/// becomes one of `remote`'s peers.
pub fn link_peer(costs: &mut [RankCost], local_role: &str, local: u32, remote: u32) {
    if let Some(c) = costs.iter_mut().find(|c| c.role != local_role && c.rank == remote) {
        if let Err(at) = c.peers.binary_search(&local) {
            c.peers.insert(at, local);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::core::scenario::check::check_scenario_with;
    use crate::core::scenario::report::report;
    use crate::core::scenario::{Deployment, Scenario};

    const KIMI_PUSH: &str = include_str!("../../../tests/data/scenarios/kimi_tiny_8p2d_push.json");
    const GQA_PULL: &str = include_str!("../../../tests/data/scenarios/gqa_ssm_2p4d_pull.json");

    /// Every rank is listed; a posting rank's request costs are those of `plan`'s report (transfers, local ids,
    /// resolved bytes), its peers its handshake targets, and the other side's peers the posting ranks that
    /// transfer to it.
    #[test]
    fn rank_costs_match_the_plan_report() {
        for (text, coalesce) in [(KIMI_PUSH, true), (KIMI_PUSH, false), (GQA_PULL, true)] {
            let s = Scenario::from_json(text).unwrap();
            let r = check_scenario_with(&s, coalesce, true).unwrap();
            assert!(r.compatible, "{r:?}");
            assert_eq!(r.ranks.len(), (s.prefill.tp_size + s.decode.tp_size) as usize);
            let plans = report(&Deployment::build_with(&s, coalesce).unwrap(), false).unwrap();
            let posting: Vec<_> = r.ranks.iter().filter(|c| c.posts).collect();
            assert!(posting.iter().all(|c| c.role == r.local_side && !c.tables.is_empty()));
            for c in &posting {
                let transfers: Vec<_> = plans
                    .requests
                    .iter()
                    .flat_map(|q| q.ranks.iter().filter(|k| k.local_rank == c.rank))
                    .flat_map(|k| k.transfers.iter())
                    .collect();
                assert_eq!(c.request_transfers, transfers.len());
                assert_eq!(c.request_bytes, transfers.iter().map(|t| t.bytes).sum::<u64>());
                assert!(c.request_bytes > 0);
                let descs: usize = transfers.iter().map(|t| t.local_ids.len()).sum();
                assert_eq!(c.request_descriptors, descs as u64);
                let pairs: Vec<u32> = r
                    .pairs
                    .iter()
                    .filter(|p| p.local_rank == c.rank)
                    .map(|p| p.remote_rank)
                    .collect();
                assert_eq!(c.peers, pairs);
                assert_eq!(c.remote_descriptors.iter().map(|(k, _)| *k).collect::<Vec<_>>(), pairs);
                assert!(c.tables.iter().all(|t| t.descriptors >= t.rows as u64 && t.rows > 0));
            }
            for c in r.ranks.iter().filter(|c| !c.posts) {
                assert!(c.tables.is_empty() && c.request_transfers == 0);
                let want: Vec<u32> = posting
                    .iter()
                    .filter(|p| {
                        plans.requests.iter().any(|q| {
                            q.ranks
                                .iter()
                                .any(|k| k.local_rank == p.rank && k.transfers.iter().any(|t| t.remote_rank == c.rank))
                        })
                    })
                    .map(|p| p.rank)
                    .collect();
                assert!(!want.is_empty());
                assert_eq!(c.peers, want);
            }
            assert!(r
                .ranks
                .iter()
                .all(|c| c.regions > 0 && c.local_descriptors >= c.local_rows as u64));
            let plain = serde_json::to_value(check_scenario_with(&s, coalesce, false).unwrap()).unwrap();
            assert!(plain.get("ranks").is_none(), "ranks are left out unless asked for");
        }
    }
}
