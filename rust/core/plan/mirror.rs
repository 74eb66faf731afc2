//! The passive rank's copy of its initiator's plan: which of its own bytes each move of a request touches.
//!
//! A transfer digest is compared across the two sides of the same byte moves (`(initiator range, peer range,
//! len)`, in move order). The initiator has its [`PeerPlan`]; the passive rank (the prefill in pull mode, the
//! decode in push mode) rebuilds the very same plan from the two handshake payloads it knows, the initiator's
//! and its own: the initiator's region table is rebuilt from its metadata ([`table_of`]) and planned against
//! this rank alone ([`PeerPlan::for_ranks`]), which gives the whole plan's tables, routes and ids for this
//! rank. Same code, same inputs: the same moves in the same order, whatever the TP sizes, block sizes and
//! layouts.
//!
//! The initiator's payload is untrusted: it is checked well formed, its block counts are bounded against this
//! rank's before any table is sized, and the plan runs every check [`PeerPlan::new`] runs on a remote.

use super::checks::{REMOTE_UNITS_FACTOR, REMOTE_UNITS_FLOOR};
use super::error::PlanError;
use super::ids::ID_LIMIT;
use super::{PeerPlan, Plan};
use crate::core::coalesce::ChunkedBases;
use crate::core::handshake::check_well_formed;
use crate::core::meta::AgentMeta;
use crate::core::region::{BlockGeometry, Region, RegionTable};

/// The region table an [`AgentMeta`] describes, as the rank that sent it built it (regions, groups, geometry,
/// SSM state layout); the registered bytes of a region are its extent, and the conv channel counts (which
/// only the scenario checks read) are not known.
///
/// # Errors
/// `MalformedRemote` (every finding) when the metadata is not well formed.
pub fn table_of(meta: &AgentMeta) -> Result<RegionTable, PlanError> {
    let problems = check_well_formed(meta);
    if !problems.is_empty() {
        let findings: Vec<String> = problems.iter().map(ToString::to_string).collect();
        return Err(PlanError::MalformedRemote {
            rank: meta.tp_rank,
            findings: findings.join("; "),
        });
    }
    let regions = meta
        .regions
        .iter()
        .enumerate()
        .map(|(i, r)| Region {
            name: r.name.clone(),
            base: r.base,
            // well formed: every region has blocks and an extent that does not wrap
            bytes: r.end().map_or(0, |end| end - r.base),
            block_len: r.block_len,
            block_stride: r.block_stride,
            num_blocks: r.num_blocks,
            is_mla: r.is_mla,
            group: r.group,
            has_ssm: meta.ssm_regions.contains(&(i as u32)),
            state_part: r.state_part.clone(),
            states: r.states,
        })
        .collect();
    let conv_split = (!meta.ssm_regions.is_empty()).then(|| meta.conv_split());
    Ok(RegionTable {
        regions,
        ssm_regions: meta.ssm_regions.iter().map(|&i| i as usize).collect(),
        groups: meta.groups.clone(),
        geometry: BlockGeometry {
            logical_block_size: meta.logical_block_size,
            kernel_block_size: meta.kernel_block_size,
            ppl: meta.ppl,
            num_logical_blocks: meta.num_logical_blocks,
            num_kernel_blocks: meta.num_blocks,
        },
        conv_split,
        use_mla: meta.use_mla,
        total_num_kv_heads: meta.total_num_kv_heads,
        page_order: meta.page_order().unwrap_or_default(),
        k_rows: meta.k_rows,
        tp_rank: meta.tp_rank,
        tp_size: meta.tp_size,
        device: meta.device_id,
        mem_type: meta.mem_type,
        chunked_bases: ChunkedBases::default(),
        layers: Vec::new(), // layer names never travel in a payload; a mirror plans, it does not stream
    })
}

/// Kernel blocks over every region of `meta` (saturating).
fn units(meta: &AgentMeta) -> u64 {
    meta.regions
        .iter()
        .fold(0u64, |acc, r| acc.saturating_add(r.num_blocks))
}

/// How many ranks of the smaller TP one rank of the larger spans (the TP ratio's magnitude, at least 1).
fn spread(a: u32, b: u32) -> u64 {
    let (lo, hi) = (a.min(b).max(1), a.max(b).max(1));
    u64::from(hi / lo)
}

/// One passive rank's copy of one initiator rank's plan, restricted to the passive rank.
#[derive(Debug, Clone)]
pub struct Mirror {
    plan: PeerPlan,
    /// The passive (own) rank.
    pub rank: u32,
    /// The initiator's rank.
    pub initiator_rank: u32,
}

impl Mirror {
    /// Rebuild the plan of the rank that sent `initiator` against this rank (`own`, this rank's own metadata),
    /// in the initiator's transfer mode, coalescing as the initiator does (`coalesce` must be its setting).
    ///
    /// # Errors
    /// `MalformedRemote` for metadata that is not well formed; `OverLimit` when the initiator advertises more
    /// than [`REMOTE_UNITS_FACTOR`] times this rank's blocks (plus [`REMOTE_UNITS_FLOOR`]); `RemoteRanks` when
    /// the initiator does not exchange data with this rank; any error [`PeerPlan::new`] gives.
    pub fn new(own: &AgentMeta, initiator: &AgentMeta, coalesce: bool) -> Result<Mirror, PlanError> {
        let limit = units(own)
            .saturating_mul(REMOTE_UNITS_FACTOR)
            .saturating_mul(spread(own.tp_size, initiator.tp_size))
            .saturating_add(REMOTE_UNITS_FLOOR)
            .min(ID_LIMIT);
        if units(initiator) > limit {
            return Err(PlanError::OverLimit {
                what: format!(
                    "kernel blocks advertised by initiator rank {} (this rank has {})",
                    initiator.tp_rank,
                    units(own)
                ),
                value: units(initiator),
                limit,
            });
        }
        let table = table_of(initiator)?;
        let plan = PeerPlan::for_ranks(&table, std::slice::from_ref(own), initiator.transfer_mode, coalesce)?;
        Ok(Mirror {
            plan,
            rank: own.tp_rank,
            initiator_rank: initiator.tp_rank,
        })
    }

    /// The byte moves `[initiator_addr, own_addr, len]` of one request between the initiator and this rank,
    /// in the initiator's move order (its transfers to this rank, in plan order, each in id order): what the
    /// initiator's `Plan::moves` gives for those transfers.
    ///
    /// `initiator_ids` and `own_ids` are each side's logical block ids per group.
    ///
    /// # Errors
    /// As [`PeerPlan::plan`].
    pub fn moves(&self, initiator_ids: &[Vec<u64>], own_ids: &[Vec<u64>]) -> Result<Vec<[u64; 3]>, PlanError> {
        let mut plan = Plan::default();
        self.plan.plan_into(initiator_ids, own_ids, &mut plan)?;
        let mut out = Vec::new();
        for t in &plan.transfers {
            out.extend(self.plan.moves(t)?);
        }
        Ok(out)
    }
}
