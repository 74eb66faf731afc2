//! Staged plans: one request's plan cut into sub-plans by (region, group), for pushing a request's KV while
//! its prefill still runs.
//!
//! Every id slot of a plan is one (region, group) pair: the pages (or states) of one layer in one tensor
//! (HMA puts layer *i* of every group in tensor *i*). A [`StageMap`] assigns each pair a stage;
//! [`PeerPlan::plan_staged`] emits the request once and writes each slot's ids to its stage, so the stages use
//! the whole plan's tables and ids (nothing extra to prep), and their union is exactly the whole plan: each id
//! pair of every transfer in exactly one stage. A map that gives all pairs of a region one stage is a
//! per-region cut (`StageMap::by_region`).

use super::emit::Windows;
use super::error::PlanError;
use super::{PeerPlan, Plan, RankTransfer};

/// The stage of every (region, group) pair of a local region table, for [`PeerPlan::plan_staged`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageMap {
    regions: usize,
    groups: usize,
    stages: usize,
    /// Region-major: `of[region * groups + group]`.
    of: Vec<u32>,
}

impl StageMap {
    /// A map from the stage of each (region, group) pair, region-major (`of[region * groups + group]`), each
    /// below `stages`.
    ///
    /// # Errors
    /// `BadStages` when `of` does not have `regions * groups` entries or names a stage `>= stages`.
    pub fn new(regions: usize, groups: usize, of: Vec<u32>, stages: usize) -> Result<StageMap, PlanError> {
        let want = regions
            .checked_mul(groups)
            .ok_or_else(|| PlanError::BadStages(format!("{regions} regions x {groups} groups overflows")))?;
        if of.len() != want {
            return Err(PlanError::BadStages(format!(
                "{} entries for {regions} regions x {groups} groups",
                of.len()
            )));
        }
        if let Some(&s) = of.iter().find(|&&s| s as usize >= stages) {
            return Err(PlanError::BadStages(format!(
                "stage {s} named, but there are {stages} stages"
            )));
        }
        Ok(StageMap {
            regions,
            groups,
            stages,
            of,
        })
    }

    /// A per-region map: every group's pair in region `r` is in stage `region_stage[r]`.
    ///
    /// # Errors
    /// As [`StageMap::new`].
    pub fn by_region(region_stage: &[u32], groups: usize, stages: usize) -> Result<StageMap, PlanError> {
        let of = region_stage
            .iter()
            .flat_map(|&s| std::iter::repeat_n(s, groups))
            .collect();
        StageMap::new(region_stage.len(), groups, of, stages)
    }

    /// Number of stages.
    pub fn num_stages(&self) -> usize {
        self.stages
    }

    /// The stage of region `region`'s pages of group `group`.
    pub(crate) fn of(&self, region: usize, group: usize) -> usize {
        self.of[region * self.groups + group] as usize
    }
}

impl PeerPlan {
    /// Plan one request (as [`PeerPlan::plan`]) cut into `stages.num_stages()` sub-plans by (region, group):
    /// stage `k` holds the id pairs of every slot `stages` puts in `k`, in the whole plan's order, with the
    /// same tables and ids. Stages with nothing to move have no transfers; every stage's `notify_ranks` is the
    /// whole plan's.
    ///
    /// # Errors
    /// As [`PeerPlan::plan`]; `BadStages` when `stages` was not made for this plan's local regions and groups.
    pub fn plan_staged(
        &self,
        local_ids: &[Vec<u64>],
        remote_ids: &[Vec<u64>],
        stages: &StageMap,
    ) -> Result<Vec<Plan>, PlanError> {
        if (stages.regions, stages.groups) != (self.num_regions, self.groups.len()) {
            return Err(PlanError::BadStages(format!(
                "made for {} regions x {} groups; this plan's local table has {} x {}",
                stages.regions,
                stages.groups,
                self.num_regions,
                self.groups.len()
            )));
        }
        let (lw, rw) = self.windows(local_ids, remote_ids)?;
        let windows = Windows {
            local: (local_ids, &lw, self.local.units_per_logical),
            remote: (remote_ids, &rw, self.remote.units_per_logical),
        };
        let group_ids = self.slots.request(&self.groups, &windows);
        let n = stages.num_stages();
        let mut out: Vec<Plan> = (0..n)
            .map(|_| Plan {
                transfers: Vec::new(),
                notify_ranks: self.remote_tables.iter().map(|(r, _)| *r).collect(),
            })
            .collect();
        let mut bufs: Vec<(Vec<i32>, Vec<i32>)> = vec![(Vec::new(), Vec::new()); n];
        for route in &self.routes {
            bufs.iter_mut().for_each(|(l, r)| {
                l.clear();
                r.clear();
            });
            self.slots.emit_staged(&route.groups, &group_ids, stages, &mut bufs);
            for (plan, (l, r)) in out.iter_mut().zip(&bufs) {
                if l.is_empty() {
                    continue;
                }
                plan.transfers.push(RankTransfer {
                    remote_rank: route.remote_rank,
                    local_table: route.table,
                    local_ids: l.clone(),
                    remote_ids: r.clone(),
                });
            }
        }
        Ok(out)
    }
}
