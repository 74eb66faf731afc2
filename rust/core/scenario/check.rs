//! Checking a scenario's deployment pair by pair (what `hybrid-kv check SCENARIO.json` prints).
//!
//! Every rank of both engines is built (layout, region table, handshake metadata), every local rank is
//! validated against each remote rank it handshakes with ([`check_pairs`]), and every local
//! rank whose pairs all pass then builds its peer plan and plans the scenario's requests; a planning error
//! becomes a finding of each of that rank's pairs. Nothing stops at the first problem.

use serde::Serialize;

use super::ranks::{link_peer, rank_costs, RankCost};
use super::{build_engines, Scenario, ScenarioError};
use crate::core::handshake::{check_pairs, Finding};
use crate::core::meta::{AgentMeta, TransferMode};
use crate::core::plan::PlanError;
use crate::core::plan::{PeerPlan, Plan};
use crate::core::region::RegionTable;

/// Whether a rank pair can exchange KV caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Every handshake check passed and every request planned.
    Compatible,
    /// At least one finding.
    Incompatible,
}

/// One (local rank, remote rank) pair of the deployment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PairCheck {
    /// Prefill TP rank of the pair.
    pub prefill_rank: u32,
    /// Decode TP rank of the pair.
    pub decode_rank: u32,
    /// Local rank (decode in pull mode, prefill in push mode).
    pub local_rank: u32,
    /// Remote rank.
    pub remote_rank: u32,
    /// The verdict.
    pub verdict: Verdict,
    /// Every failed handshake check, then any planning error of the local rank (empty when compatible).
    pub findings: Vec<Finding>,
}

/// Totals over the whole deployment.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CheckSummary {
    /// Every pair is compatible.
    pub compatible: bool,
    /// Pairs checked.
    pub pairs: usize,
    /// Compatible pairs.
    pub compatible_pairs: usize,
    /// Incompatible pairs.
    pub incompatible_pairs: usize,
    /// Local ranks that built their peer plan.
    pub planned_ranks: usize,
    /// Requests in the scenario.
    pub requests: usize,
    /// (request, local rank) plans that succeeded.
    pub plans: usize,
    /// Transfers of those plans.
    pub transfers: usize,
    /// Bytes those transfers move.
    pub bytes: u64,
}

/// The report of a whole deployment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckReport {
    /// The scenario's description.
    pub name: Option<String>,
    /// Transfer mode.
    pub mode: TransferMode,
    /// Which side posts the transfers ("decode" in pull mode, "prefill" in push mode).
    pub local_side: &'static str,
    /// Prefill and decode TP sizes.
    pub tp: (u32, u32),
    /// Every pair, local-rank-major (empty when an engine cannot be built).
    pub pairs: Vec<PairCheck>,
    /// Totals.
    pub summary: CheckSummary,
    /// The verdict, at the top of the report as in `check --preset` (`summary.compatible`).
    pub compatible: bool,
    /// Why the deployment is incompatible, one line each, as in `check --preset`: every finding prefixed with
    /// its rank pair, or why an engine cannot be built.
    pub reasons: Vec<String>,
    /// Every rank of both engines and what the requests cost it, prefill first (only when asked for, see
    /// [`check_scenario_with`]; left out of the JSON when empty).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankCost>,
}

/// Check every rank pair of the deployment `s` describes. An engine that cannot be built at its TP size (heads,
/// conv channels or a layout that do not split) makes the deployment incompatible, with that reason and no
/// pairs, as `check --preset` reports it.
///
/// # Errors
/// `Json`, `Invalid` or `OverLimit` for a scenario the format forbids.
pub fn check_scenario(s: &Scenario) -> Result<CheckReport, ScenarioError> {
    check_scenario_with(s, true, false)
}

/// [`check_scenario`], choosing whether peer plans coalesce runs into chunk descriptors (`false`: the
/// reference plans) and whether the report lists every rank's costs (`ranks`).
///
/// # Errors
/// As [`check_scenario`].
pub fn check_scenario_with(s: &Scenario, coalesce: bool, with_ranks: bool) -> Result<CheckReport, ScenarioError> {
    let (prefill, decode) = match build_engines(s) {
        Ok(engines) => engines,
        Err(e @ (ScenarioError::Deployment(_) | ScenarioError::Layout { .. })) => {
            return Ok(CheckReport::unbuildable(s, e.to_string()))
        }
        Err(e) => return Err(e),
    };
    let (local, remote) = match s.mode {
        TransferMode::Pull => (&decode, &prefill),
        TransferMode::Push => (&prefill, &decode),
    };
    let local_metas: Vec<AgentMeta> = local.iter().map(|r| r.meta.clone()).collect();
    let remote_metas: Vec<AgentMeta> = remote.iter().map(|r| r.meta.clone()).collect();
    let mut pairs: Vec<PairCheck> = check_pairs(&local_metas, &remote_metas)
        .into_iter()
        .map(|v| {
            let (prefill_rank, decode_rank) = match s.mode {
                TransferMode::Pull => (v.remote_rank, v.local_rank),
                TransferMode::Push => (v.local_rank, v.remote_rank),
            };
            PairCheck {
                prefill_rank,
                decode_rank,
                local_rank: v.local_rank,
                remote_rank: v.remote_rank,
                verdict: Verdict::Compatible,
                findings: v.findings,
            }
        })
        .collect();
    let mut summary = CheckSummary {
        requests: s.requests.len(),
        ..CheckSummary::default()
    };
    let mut costs = if with_ranks {
        rank_costs(&prefill, &decode, s.mode == TransferMode::Push)
    } else {
        Vec::new() // nothing below is computed for a rank without an entry
    };
    let local_side = local_side_of(s.mode);
    for l in local {
        let rank = l.table.tp_rank;
        let mine: Vec<usize> = (0..pairs.len()).filter(|&i| pairs[i].local_rank == rank).collect();
        let cost = costs.iter().position(|c| c.role == local_side && c.rank == rank);
        if let Some(c) = cost {
            costs[c].peers = mine.iter().map(|&i| pairs[i].remote_rank).collect();
            costs[c].peers.sort_unstable();
        }
        if mine.is_empty() || mine.iter().any(|&i| !pairs[i].findings.is_empty()) {
            continue; // an incompatible handshake is not planned: its findings already say why
        }
        let metas: Vec<AgentMeta> = mine
            .iter()
            .map(|&i| remote_metas[pairs[i].remote_rank as usize].clone())
            .collect();
        let who = match s.mode {
            TransferMode::Pull => ("decode", "prefill"),
            TransferMode::Push => ("prefill", "decode"),
        };
        let ranks: Vec<u32> = metas.iter().map(|m| m.tp_rank).collect();
        let who = (format!("{} rank {rank}", who.0), format!("{} ranks {ranks:?}", who.1));
        let own = cost.map(|c| &mut costs[c]);
        let (found, touched) = plan_rank(s, &l.table, &metas, &who, &mut summary, coalesce, own);
        for remote in touched {
            link_peer(&mut costs, local_side, rank, remote);
        }
        for &i in &mine {
            pairs[i].findings.extend(found.iter().cloned());
        }
    }
    for p in &mut pairs {
        if !p.findings.is_empty() {
            p.verdict = Verdict::Incompatible;
        }
    }
    summary.pairs = pairs.len();
    summary.compatible_pairs = pairs.iter().filter(|p| p.verdict == Verdict::Compatible).count();
    summary.incompatible_pairs = summary.pairs - summary.compatible_pairs;
    summary.compatible = summary.pairs > 0 && summary.incompatible_pairs == 0;
    let reasons = pairs
        .iter()
        .flat_map(|p| {
            p.findings
                .iter()
                .map(move |f| format!("prefill rank {} / decode rank {}: {f}", p.prefill_rank, p.decode_rank))
        })
        .collect();
    Ok(CheckReport {
        name: s.name.clone(),
        mode: s.mode,
        local_side,
        tp: (s.prefill.tp_size, s.decode.tp_size),
        compatible: summary.compatible,
        pairs,
        summary,
        reasons,
        ranks: costs,
    })
}

fn local_side_of(mode: TransferMode) -> &'static str {
    match mode {
        TransferMode::Pull => "decode",
        TransferMode::Push => "prefill",
    }
}

impl CheckReport {
    /// The report of a deployment one of whose engines cannot be built: incompatible, for `reason`.
    fn unbuildable(s: &Scenario, reason: String) -> CheckReport {
        CheckReport {
            name: s.name.clone(),
            mode: s.mode,
            local_side: local_side_of(s.mode),
            tp: (s.prefill.tp_size, s.decode.tp_size),
            pairs: Vec::new(),
            summary: CheckSummary {
                requests: s.requests.len(),
                ..CheckSummary::default()
            },
            compatible: false,
            reasons: vec![reason],
            ranks: Vec::new(),
        }
    }
}

/// Parse `text` as a scenario and check it.
///
/// # Errors
/// `Json` for a malformed scenario, otherwise as [`check_scenario`].
pub fn check_scenario_json(text: &str) -> Result<CheckReport, ScenarioError> {
    check_scenario(&Scenario::from_json(text)?)
}

/// Local and remote names of a pair (the values of a planning error that carries none of its own).
type Who = (String, String);

/// Build one local rank's peer plan and plan (and resolve) every request on it; each failure is a finding.
/// Returns the findings and the remote ranks its planned requests transfer to; `cost` gets its tables and
/// its requests' costs.
fn plan_rank(
    s: &Scenario,
    table: &RegionTable,
    metas: &[AgentMeta],
    who: &Who,
    summary: &mut CheckSummary,
    coalesce: bool,
    mut cost: Option<&mut RankCost>,
) -> (Vec<Finding>, Vec<u32>) {
    let peer = match PeerPlan::with_coalescing(table, metas, s.mode, coalesce) {
        Ok(p) => p,
        Err(e) => return (vec![plan_finding("peer_plan", None, &e, s.mode, who)], Vec::new()),
    };
    summary.planned_ranks += 1;
    if let Some(c) = cost.as_deref_mut() {
        c.add_peer_plan(&peer);
    }
    let mut touched: Vec<u32> = Vec::new();
    let mut out = Vec::new();
    let mut plan = Plan::default();
    for req in &s.requests {
        let (l, r) = match s.mode {
            TransferMode::Pull => (&req.decode, &req.prefill),
            TransferMode::Push => (&req.prefill, &req.decode),
        };
        let resolved = peer.plan_into(l, r, &mut plan).and_then(|()| {
            plan.transfers.iter().try_fold(
                0u64,
                |acc, t| Ok(acc + peer.moves(t)?.iter().map(|m| m[2]).sum::<u64>()),
            )
        });
        let resolved = resolved.and_then(|bytes| {
            if let Some(c) = cost.as_deref_mut() {
                c.add_plan(&peer, &plan)?;
            }
            Ok(bytes)
        });
        match resolved {
            Ok(bytes) => {
                touched.extend(plan.transfers.iter().map(|t| t.remote_rank));
                summary.plans += 1;
                summary.transfers += plan.transfers.len();
                summary.bytes += bytes;
            }
            Err(e) => out.push(plan_finding("plan_request", Some(&req.id), &e, s.mode, who)),
        }
    }
    (out, touched)
}

/// A planning error as a finding: errors that carry both sides' values put them in `local` and `remote`,
/// others name the ranks (`who`) and leave the values to the detail.
fn plan_finding(check: &str, request: Option<&str>, e: &PlanError, mode: TransferMode, who: &Who) -> Finding {
    // (decode value, prefill value) in local/remote order.
    let by_side = |d: String, p: String| match mode {
        TransferMode::Pull => (d, p),
        TransferMode::Push => (p, d),
    };
    let (local, remote) = match e {
        PlanError::TpRatio { local_tp, remote_tp } => (format!("tp {local_tp}"), format!("tp {remote_tp}")),
        PlanError::Mismatch { what, local, remote } => (format!("{what} {local}"), format!("{what} {remote}")),
        PlanError::RemoteRanks { given, needed } => (format!("needs ranks {needed:?}"), format!("ranks {given:?}")),
        PlanError::UnpairableSsm {
            decode_len,
            prefill_len,
            ..
        } => by_side(format!("{decode_len} states"), format!("{prefill_len} states")),
        PlanError::UnalignedAttention {
            decode_len,
            prefill_len,
            ..
        } => by_side(format!("{decode_len} units"), format!("{prefill_len} units")),
        _ => who.clone(),
    };
    let detail = match request {
        Some(id) => format!("request {id}: {e}"),
        None => e.to_string(),
    };
    Finding::new(check, local, remote, detail)
}
