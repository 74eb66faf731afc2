//! A serializable report of a planned scenario: every request, every local rank, every transfer with its
//! descriptor ids and resolved byte moves (what `hybrid-kv plan SCENARIO --json` prints).

use serde::Serialize;

use super::{Deployment, ScenarioError};
use crate::core::meta::TransferMode;

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Transfer mode.
    pub mode: TransferMode,
    /// Which side posts the transfers ("decode" in pull mode, "prefill" in push mode).
    pub local_side: &'static str,
    /// Prefill and decode TP sizes.
    pub tp: (u32, u32),
    /// Per request, per local rank.
    pub requests: Vec<RequestReport>,
}

/// One request.
#[derive(Debug, Clone, Serialize)]
pub struct RequestReport {
    /// Request id.
    pub id: String,
    /// One entry per local rank.
    pub ranks: Vec<RankReport>,
}

/// One local rank's part of a request.
#[derive(Debug, Clone, Serialize)]
pub struct RankReport {
    /// Local rank.
    pub local_rank: u32,
    /// Remote ranks to notify.
    pub notify_ranks: Vec<u32>,
    /// Transfers.
    pub transfers: Vec<TransferReport>,
}

/// One transfer.
#[derive(Debug, Clone, Serialize)]
pub struct TransferReport {
    /// Remote rank.
    pub remote_rank: u32,
    /// Local table key (`whole`, `bsr:N`, `split:I`).
    pub local_table: String,
    /// Local descriptor ids.
    pub local_ids: Vec<i32>,
    /// Remote descriptor ids.
    pub remote_ids: Vec<i32>,
    /// Bytes moved.
    pub bytes: u64,
    /// `[local_addr, remote_addr, len]` per descriptor pair (empty unless requested).
    pub moves: Vec<[u64; 3]>,
}

/// Plan every request of `dep` and describe the result; `with_moves` resolves every pair into bytes.
///
/// # Errors
/// `Plan` naming the request and rank when a request cannot be planned or resolved.
pub fn report(dep: &Deployment, with_moves: bool) -> Result<Report, ScenarioError> {
    let s = &dep.scenario;
    let mut requests: Vec<RequestReport> = Vec::with_capacity(s.requests.len());
    for rp in dep.plan_all()? {
        let peer = &dep.peers[rp.local_rank as usize];
        let mut transfers = Vec::with_capacity(rp.plan.transfers.len());
        for t in &rp.plan.transfers {
            let moves = peer.moves(t).map_err(|e| ScenarioError::Plan {
                context: format!("request {} on local rank {}", rp.request, rp.local_rank),
                source: e,
            })?;
            transfers.push(TransferReport {
                remote_rank: t.remote_rank,
                local_table: t.local_table.to_string(),
                local_ids: t.local_ids.clone(),
                remote_ids: t.remote_ids.clone(),
                bytes: moves.iter().map(|m| m[2]).sum(),
                moves: if with_moves { moves } else { Vec::new() },
            });
        }
        let rank = RankReport {
            local_rank: rp.local_rank,
            notify_ranks: rp.plan.notify_ranks,
            transfers,
        };
        match requests.last_mut() {
            Some(r) if r.id == rp.request => r.ranks.push(rank),
            _ => requests.push(RequestReport {
                id: rp.request,
                ranks: vec![rank],
            }),
        }
    }
    Ok(Report {
        mode: s.mode,
        local_side: match s.mode {
            TransferMode::Pull => "decode",
            TransferMode::Push => "prefill",
        },
        tp: (s.prefill.tp_size, s.decode.tp_size),
        requests,
    })
}
