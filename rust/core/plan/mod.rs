//! Per-peer transfer planning: [`PeerPlan`] precomputes everything one local rank needs to move requests to
//! or from one peer engine; [`PeerPlan::plan`] turns one request's block ids into descriptor-id pairs.
//!
//! Design notes:
//! * **Roles.** Local is the rank that posts the transfer: decode in pull mode (READ), prefill in push mode
//!   (WRITE). The TP mapping, tables and ids are all computed from the local view, as vLLM does.
//! * **Tables.** One local base table (whole kernel blocks, or `Bsr(n)` sub-blocks when the local kernel
//!   block is cut into `n` common units), split copies of it when the local TP is smaller than the remote TP
//!   and some descriptor must be cut per remote piece, and one table per handshaked remote rank. Split tables
//!   keep the base table's flat layout, so a request's local ids are the same whichever table they index.
//!   Heads-major pages of several heads per rank cut into units are cut per (head, unit) instead (`heads.rs`):
//!   the split tables then select each remote piece's heads rather than cutting descriptors.
//! * **Ids.** Emitted region-major (every region's attention ids, then every SSM region's streams), each list
//!   in request order, so a request whose blocks ascend gives ascending, mostly consecutive ids that NIXL
//!   can merge. Ids are computed arithmetically from list windows; nothing is sorted or hashed per request.
//! * **Who writes what.** Pull reads follow vLLM's mapping (one source per head slice, every SSM shard).
//!   Push differs on purpose where vLLM would double-write or skip bytes: attention goes to *every* covered
//!   decode rank (MLA whole, GQA at the rank's head slot, so replicated decode heads are filled too), and
//!   when several prefill ranks hold the same heads for one decode rank only the first of them writes them.
//! * **Coalescing.** By default every attention region that is dense on both sides gets chunk rows appended
//!   to its tables, and a run of consecutive unit pairs becomes one id pair per power-of-two chunk (see
//!   [`super::coalesce`]); [`PeerPlan::with_coalescing`] with `false` gives the reference tables and ids.
//! * **Addresses** stay `u64` and are never dereferenced; `moves` resolves ids back to byte ranges so a plan
//!   can be checked independently of how descriptors are indexed.

mod build;
pub mod bytes;
mod checks;
mod emit;
pub mod error;
mod failed;
mod heads;
mod ids;
mod key;
pub mod mirror;
pub mod remote;
mod routes;
mod rows;
mod runs;
pub mod split;
mod stages;
pub mod trim;

#[cfg(test)]
mod coalesce_tests;
#[cfg(test)]
mod failed_tests;
#[cfg(test)]
mod mirror_tests;
#[cfg(test)]
mod stages_tests;
#[cfg(test)]
mod tests;

pub use self::checks::{REMOTE_UNITS_FACTOR, REMOTE_UNITS_FLOOR};
pub use self::error::{PlanError, Side};
pub use self::key::TableKey;
pub use self::mirror::{table_of, Mirror};
pub use self::stages::StageMap;

use std::sync::Arc;

use self::emit::{Slots, Windows};
use self::failed::BlockMap;
use self::ids::IdSpace;
use self::routes::{attention_ranks, Route};
use self::trim::{trim, GroupTrim, Window};
use super::descs::DescTable;
use super::meta::TransferMode;
use super::region::GroupKind;
use super::tp::TpMapping;
use super::units::BlockUnits;

/// One NIXL transfer: pairs of descriptor ids into a local and a remote table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankTransfer {
    /// Remote TP rank (its table is the one the remote ids index).
    pub remote_rank: u32,
    /// Local table the local ids index.
    pub local_table: TableKey,
    /// Local descriptor ids.
    pub local_ids: Vec<i32>,
    /// Remote descriptor ids (same length; pairs move equal byte counts).
    pub remote_ids: Vec<i32>,
}

/// The transfers of one request between one local rank and one peer engine.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Transfers with at least one descriptor, in remote-rank order.
    pub transfers: Vec<RankTransfer>,
    /// Every handshaked remote rank: each must be told the request is done, transferred to or not.
    pub notify_ranks: Vec<u32>,
}

/// Everything one local rank needs to plan requests against one peer engine.
#[derive(Debug, Clone)]
pub struct PeerPlan {
    /// Transfer mode (pull: local is decode; push: local is prefill).
    pub mode: TransferMode,
    /// TP mapping of the local rank.
    pub mapping: TpMapping,
    /// Common unit of the two kernel block sizes.
    pub units: BlockUnits,
    /// Local tables by key: the base table first, then the split tables.
    pub local_tables: Vec<(TableKey, Arc<DescTable>)>,
    /// Remote tables by remote rank, ascending.
    pub remote_tables: Vec<(u32, DescTable)>,
    groups: Vec<GroupKind>,
    num_regions: usize,
    local: IdSpace,
    remote: IdSpace,
    routes: Vec<Route>,
    slots: Slots,
    blocks: BlockMap,
}

impl PeerPlan {
    /// Remote ranks this local rank exchanges attention pages with (the others carry SSM state only).
    pub fn attention_ranks(&self) -> Vec<u32> {
        attention_ranks(&self.routes, &self.groups)
    }

    /// Whether some region's runs are coalesced into chunk descriptors (its tables have chunk rows).
    pub fn coalesced(&self) -> bool {
        self.slots.coalesced()
    }

    /// The local table of `key`.
    pub fn local_table(&self, key: TableKey) -> Option<&DescTable> {
        self.local_tables.iter().find(|(k, _)| *k == key).map(|(_, t)| &**t)
    }

    /// The table of remote rank `rank`.
    pub fn remote_table(&self, rank: u32) -> Option<&DescTable> {
        self.remote_tables.iter().find(|(r, _)| *r == rank).map(|(_, t)| t)
    }

    /// Plan one request from each side's *logical* block ids per group (in group order).
    ///
    /// Each side's attention ids are expanded with its own kernel blocks per logical block and cut into the
    /// common unit; then decode and prefill lists are paired (prefix-cache trimming, `trim.rs`).
    ///
    /// # Errors
    /// `GroupCount` for a wrong number of groups, `BlockOutOfRange` for an id outside its side's pool (naming
    /// the id and the limit), `UnpairableSsm` / `UnalignedAttention` for lists that cannot be paired.
    pub fn plan(&self, local_ids: &[Vec<u64>], remote_ids: &[Vec<u64>]) -> Result<Plan, PlanError> {
        let mut out = Plan::default();
        self.plan_into(local_ids, remote_ids, &mut out)?;
        Ok(out)
    }

    /// [`PeerPlan::plan`] into `out`, reusing its id buffers: a caller planning request after request
    /// avoids allocating (and page-faulting) fresh id arrays every time.
    ///
    /// # Errors
    /// As [`PeerPlan::plan`]; `out` is then left empty.
    pub fn plan_into(&self, local_ids: &[Vec<u64>], remote_ids: &[Vec<u64>], out: &mut Plan) -> Result<(), PlanError> {
        let mut spare = std::mem::take(&mut out.transfers);
        out.notify_ranks.clear();
        let (lw, rw) = self.windows(local_ids, remote_ids)?;
        let (lu, ru) = (self.local.units_per_logical, self.remote.units_per_logical);
        let windows = Windows {
            local: (local_ids, &lw, lu),
            remote: (remote_ids, &rw, ru),
        };
        let group_ids = self.slots.request(&self.groups, &windows);
        let mut done: Vec<(&[bool], usize)> = Vec::new();
        let mut transfers: Vec<RankTransfer> = Vec::with_capacity(self.routes.len());
        for route in &self.routes {
            let mut t = spare.pop().unwrap_or(RankTransfer {
                remote_rank: 0,
                local_table: TableKey::Whole,
                local_ids: Vec::new(),
                remote_ids: Vec::new(),
            });
            t.local_ids.clear();
            t.remote_ids.clear();
            match done.iter().find(|(m, _)| *m == route.groups.as_slice()) {
                Some(&(_, i)) => {
                    t.local_ids.extend_from_slice(&transfers[i].local_ids);
                    t.remote_ids.extend_from_slice(&transfers[i].remote_ids);
                }
                None => self
                    .slots
                    .emit(&route.groups, &group_ids, &mut t.local_ids, &mut t.remote_ids),
            }
            if t.local_ids.is_empty() {
                spare.push(t);
                continue;
            }
            done.push((&route.groups, transfers.len()));
            t.remote_rank = route.remote_rank;
            t.local_table = route.table;
            transfers.push(t);
        }
        out.transfers = transfers;
        out.notify_ranks.extend(self.remote_tables.iter().map(|(r, _)| *r));
        Ok(())
    }

    /// Check both sides' ids and pair their lists: the transferred window of every group on each side
    /// (prefix-cache trimming, `trim.rs`).
    fn windows(
        &self,
        local_ids: &[Vec<u64>],
        remote_ids: &[Vec<u64>],
    ) -> Result<(Vec<Window>, Vec<Window>), PlanError> {
        self.local.check(Side::Local, local_ids)?;
        self.remote.check(Side::Remote, remote_ids)?;
        let (lu, ru) = (self.local.units_per_logical, self.remote.units_per_logical);
        let same = self.local.logical_tokens == self.remote.logical_tokens;
        let mut lw = Vec::with_capacity(self.groups.len());
        let mut rw = Vec::with_capacity(self.groups.len());
        for (g, &kind) in self.groups.iter().enumerate() {
            let (lm, rm) = if kind.is_attention() { (lu, ru) } else { (1, 1) };
            let (nl, nr) = (local_ids[g].len() as u64 * lm, remote_ids[g].len() as u64 * rm);
            let t = GroupTrim {
                group: g,
                kind,
                same_logical_tokens: same,
                slack: lu + ru,
            };
            let (l, r) = match self.mode {
                TransferMode::Pull => trim(t, nl, nr)?,
                TransferMode::Push => {
                    let (d, p) = trim(t, nr, nl)?;
                    (p, d)
                }
            };
            lw.push(l);
            rw.push(r);
        }
        Ok((lw, rw))
    }

    /// Resolve a transfer into byte moves `[local_addr, remote_addr, len]`, one per descriptor pair.
    ///
    /// # Errors
    /// `BadTransfer` when a table or id does not exist or a pair's lengths differ.
    pub fn moves(&self, t: &RankTransfer) -> Result<Vec<[u64; 3]>, PlanError> {
        self.resolve(t.local_table, t.remote_rank, &t.local_ids, &t.remote_ids)
    }

    /// Resolve descriptor-id pairs of local table `key` and remote rank `remote_rank` into byte moves
    /// `[local_addr, remote_addr, len]`.
    ///
    /// # Errors
    /// `BadTransfer` when a table or id does not exist, the lists differ in length, or a pair's lengths differ.
    pub fn resolve(
        &self,
        key: TableKey,
        remote_rank: u32,
        local_ids: &[i32],
        remote_ids: &[i32],
    ) -> Result<Vec<[u64; 3]>, PlanError> {
        let lt = self
            .local_table(key)
            .ok_or_else(|| PlanError::BadTransfer(format!("no local table {key:?}")))?;
        let rt = self
            .remote_table(remote_rank)
            .ok_or_else(|| PlanError::BadTransfer(format!("no remote table for rank {remote_rank}")))?;
        if local_ids.len() != remote_ids.len() {
            return Err(PlanError::BadTransfer(format!(
                "{} local ids but {} remote ids",
                local_ids.len(),
                remote_ids.len()
            )));
        }
        let desc = |table: &DescTable, id: i32, side: Side| {
            u64::try_from(id).ok().and_then(|i| table.desc(i)).ok_or_else(|| {
                PlanError::BadTransfer(format!(
                    "{side} descriptor id {id} is out of range for a table of {}",
                    table.len()
                ))
            })
        };
        let mut out = Vec::with_capacity(local_ids.len());
        for (&l, &r) in local_ids.iter().zip(remote_ids) {
            let ((la, ll), (ra, rl)) = (desc(lt, l, Side::Local)?, desc(rt, r, Side::Remote)?);
            if ll != rl {
                return Err(PlanError::BadTransfer(format!(
                    "local descriptor {l} has {ll} bytes but remote descriptor {r} has {rl}"
                )));
            }
            out.push([la, ra, ll]);
        }
        Ok(out)
    }
}

impl Plan {
    /// Byte moves of transfer `i`, resolved through `peer`'s tables (see [`PeerPlan::moves`]).
    ///
    /// # Errors
    /// `BadTransfer` when `i` is out of range or the transfer does not resolve.
    pub fn moves(&self, peer: &PeerPlan, i: usize) -> Result<Vec<[u64; 3]>, PlanError> {
        let t = self.transfers.get(i).ok_or_else(|| {
            PlanError::BadTransfer(format!(
                "transfer {i} is out of range for a plan of {} transfers",
                self.transfers.len()
            ))
        })?;
        peer.moves(t)
    }
}
