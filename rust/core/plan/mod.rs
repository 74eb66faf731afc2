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

mod emit;
pub mod error;
mod ids;
pub mod remote;
mod routes;
mod runs;
pub mod split;
pub mod trim;

#[cfg(test)]
mod coalesce_tests;
#[cfg(test)]
mod tests;

pub use self::error::{PlanError, Side};

use self::emit::{Slots, Windows};
use self::error::mismatch;
use self::ids::IdSpace;
use self::remote::{hosts_attention, remote_table};
use self::routes::{routes, Route};
use self::split::split_table;
use self::trim::{trim, GroupTrim};
use super::coalesce::{dense_row, with_chunk_rows, ChunkStarts};
use super::descs::{DescTable, StridedRow};
use super::handshake::check_well_formed;
use super::meta::{AgentMeta, TransferMode};
use super::region::{GroupKind, RegionTable};
use super::state_rows::with_state_rows;
use super::tp::{TpMapping, MAX_TP_SIZE};
use super::units::BlockUnits;

/// Which local table a transfer indexes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TableKey {
    /// The local table at the local kernel block.
    Whole,
    /// The local table with every kernel block cut into this many common units.
    Bsr(u64),
    /// The split table of the i-th remote piece.
    Split(usize),
}

impl std::fmt::Display for TableKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TableKey::Whole => f.write_str("whole"),
            TableKey::Bsr(n) => write!(f, "bsr:{n}"),
            TableKey::Split(i) => write!(f, "split:{i}"),
        }
    }
}

impl std::str::FromStr for TableKey {
    type Err = PlanError;

    /// Parse `whole`, `bsr:N` or `split:I` (the [`Display`](std::fmt::Display) form).
    fn from_str(s: &str) -> Result<TableKey, PlanError> {
        let bad = || PlanError::BadTransfer(format!("table key {s:?} is not `whole`, `bsr:N` or `split:I`"));
        match s.split_once(':') {
            None if s == "whole" => Ok(TableKey::Whole),
            Some(("bsr", n)) => n.parse().map(TableKey::Bsr).map_err(|_| bad()),
            Some(("split", i)) => i.parse().map(TableKey::Split).map_err(|_| bad()),
            _ => Err(bad()),
        }
    }
}

/// One NIXL transfer: pairs of descriptor ids into a local and a remote table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankTransfer {
    /// Remote TP rank.
    pub remote_rank: u32,
    /// Local table the local ids index.
    pub local_table: TableKey,
    /// Remote table the remote ids index (keyed by remote rank).
    pub remote_table: u32,
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
    pub local_tables: Vec<(TableKey, DescTable)>,
    /// Remote tables by remote rank, ascending.
    pub remote_tables: Vec<(u32, DescTable)>,
    groups: Vec<GroupKind>,
    local: IdSpace,
    remote: IdSpace,
    routes: Vec<Route>,
    slots: Slots,
}

const ID_LIMIT: u64 = i32::MAX as u64;

fn check_geometry(remotes: &[AgentMeta]) -> Result<(), PlanError> {
    let key = |m: &AgentMeta| {
        let regions: Vec<_> = m
            .regions
            .iter()
            .map(|r| (r.block_len, r.block_stride, r.num_blocks, r.is_mla, r.group))
            .collect();
        (
            m.engine_id.clone(),
            m.tp_size,
            m.kernel_block_size,
            m.ppl,
            m.num_logical_blocks,
            m.ssm_sizes,
            regions,
        )
    };
    let first = key(&remotes[0]);
    for m in &remotes[1..] {
        if key(m) != first {
            return Err(mismatch(
                format!("geometry of remote rank {} vs rank {}", m.tp_rank, remotes[0].tp_rank),
                first.clone(),
                key(m),
            ));
        }
    }
    Ok(())
}

/// A remote rank may address at most this many times the local rank's units (scaled by the TP ratio when the
/// remote's ranks are smaller), plus [`REMOTE_UNITS_FLOOR`]: a peer's block counts size its table, so a peer
/// claiming billions of blocks must be refused before anything is allocated for them.
pub const REMOTE_UNITS_FACTOR: u64 = 16;
/// Remote units always accepted, whatever the local pool.
pub const REMOTE_UNITS_FLOOR: u64 = 1 << 20;

/// Refuse a remote whose block counts would size tables far beyond the local ones (or past int32 ids).
fn check_remote_size(
    local: &RegionTable,
    remote: &AgentMeta,
    units: BlockUnits,
    mapping: &TpMapping,
) -> Result<(), PlanError> {
    fn total(mut blocks: impl Iterator<Item = u64>, sub: u64) -> u64 {
        blocks
            .try_fold(0u64, |acc, n| acc.checked_add(n.checked_mul(sub)?))
            .unwrap_or(u64::MAX)
    }
    let local_units = total(local.regions.iter().map(|r| r.num_blocks), units.local_sub);
    let remote_units = total(remote.regions.iter().map(|r| r.num_blocks), units.remote_sub);
    let spread = if mapping.tp_ratio < 0 {
        mapping.tp_ratio.unsigned_abs()
    } else {
        1
    };
    let limit = local_units
        .saturating_mul(REMOTE_UNITS_FACTOR)
        .saturating_mul(spread)
        .saturating_add(REMOTE_UNITS_FLOOR)
        .min(ID_LIMIT);
    if remote_units > limit {
        return Err(PlanError::OverLimit {
            what: format!(
                "kernel units advertised by remote rank {} (local rank has {local_units})",
                remote.tp_rank
            ),
            value: remote_units,
            limit,
        });
    }
    Ok(())
}

/// Remote ranks of the routes that carry an attention group, ascending.
fn attention_ranks(routes: &[Route], groups: &[GroupKind]) -> Vec<u32> {
    let mut ranks: Vec<u32> = routes
        .iter()
        .filter(|r| r.groups.iter().zip(groups).any(|(&on, g)| on && g.is_attention()))
        .map(|r| r.remote_rank)
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

/// `remotes` in ascending rank order (the order of `PeerPlan::remote_tables`).
fn sorted_by_rank(remotes: &[AgentMeta]) -> Vec<&AgentMeta> {
    let mut v: Vec<&AgentMeta> = remotes.iter().collect();
    v.sort_by_key(|m| m.tp_rank);
    v
}

/// The last line of defence: every descriptor of `table` must lie inside one region `remote` advertised.
/// Rows are affine, so a row's first and last descriptors bound it.
fn check_inside_advertised(rank: u32, table: &DescTable, remote: &AgentMeta) -> Result<(), PlanError> {
    // Extents sorted by base; well-formed regions do not overlap, so the one that can hold an address is the
    // last starting at or below it (a binary search: tables have thousands of chunk rows).
    let mut extents: Vec<(u64, u64)> = remote.regions.iter().filter_map(|r| Some((r.base, r.end()?))).collect();
    extents.sort_unstable();
    // The region holding the row's first byte must also hold its last descriptor's last byte: a row that
    // starts in one region and ends in another would address the gap between them.
    let holds = |row: &StridedRow| -> Option<bool> {
        let i = extents.partition_point(|&(b, _)| b <= row.addr).checked_sub(1)?;
        let last = (row.count - 1).checked_mul(row.stride)?.checked_add(row.addr)?;
        Some(last.checked_add(row.len)? <= extents[i].1 && row.addr.checked_add(row.len)? <= extents[i].1)
    };
    for row in &table.rows {
        if row.count == 0 {
            continue;
        }
        if holds(row) != Some(true) {
            return Err(PlanError::OutsideAdvertised {
                rank,
                addr: row.addr,
                len: row.len,
                stride: row.stride,
                count: row.count,
            });
        }
    }
    Ok(())
}

impl PeerPlan {
    /// Precompute the mapping and tables of `local` against `remotes`: the handshake metadata of every remote
    /// rank this local rank talks to (the handshake targets), all of one peer engine.
    ///
    /// # Errors
    /// A [`PlanError`] naming both sides' values: TP sizes that do not divide, remote ranks that are not the
    /// handshake targets, mismatched modes, regions, groups, pages or SSM state sizes, unsupported
    /// combinations, or tables too large for int32 descriptor ids.
    pub fn new(local: &RegionTable, remotes: &[AgentMeta], mode: TransferMode) -> Result<PeerPlan, PlanError> {
        PeerPlan::with_coalescing(local, remotes, mode, true)
    }

    /// [`PeerPlan::new`], choosing whether runs of consecutive units are coalesced into chunk descriptors.
    ///
    /// With `coalesce` false the tables have no chunk rows and every plan has one id pair per unit (the
    /// reference vectors; what NIXL < 1.5 users expanding tables to `(N, 3)` want). With `true` (the
    /// default of [`PeerPlan::new`]) coalescing is still skipped when the chunk rows would push a table past
    /// the int32 id range.
    ///
    /// # Errors
    /// As [`PeerPlan::new`].
    pub fn with_coalescing(
        local: &RegionTable,
        remotes: &[AgentMeta],
        mode: TransferMode,
        coalesce: bool,
    ) -> Result<PeerPlan, PlanError> {
        let Some(first) = remotes.first() else {
            return Err(PlanError::RemoteRanks {
                given: Vec::new(),
                needed: vec![],
            });
        };
        for m in remotes {
            let problems = check_well_formed(m);
            if !problems.is_empty() {
                let findings: Vec<String> = problems.iter().map(ToString::to_string).collect();
                return Err(PlanError::MalformedRemote {
                    rank: m.tp_rank,
                    findings: findings.join("; "),
                });
            }
        }
        if remotes.len() > MAX_TP_SIZE as usize {
            return Err(PlanError::OverLimit {
                what: "remote ranks given".into(),
                value: remotes.len() as u64,
                limit: u64::from(MAX_TP_SIZE),
            });
        }
        check_geometry(remotes)?;
        if first.transfer_mode != mode {
            return Err(mismatch("transfer mode", mode, first.transfer_mode));
        }
        let groups = local.groups.clone();
        let mapping = TpMapping::compute(
            local.tp_rank,
            local.tp_size,
            first.tp_size,
            local.total_num_kv_heads,
            local.use_mla,
            &groups,
        )?;
        let mut given: Vec<u32> = remotes.iter().map(|m| m.tp_rank).collect();
        given.sort_unstable();
        if given != mapping.covered_ranks() {
            return Err(PlanError::RemoteRanks {
                given,
                needed: mapping.covered_ranks(),
            });
        }
        let units = BlockUnits::new(local.geometry.kernel_block_size, first.kernel_block_size)?;
        check_remote_size(local, first, units, &mapping)?;
        let mut remote_tables = Vec::with_capacity(remotes.len());
        for m in remotes {
            let t = remote_table(local, m, &mapping, units)?;
            if t.len() > ID_LIMIT {
                return Err(PlanError::TableTooLarge {
                    side: Side::Remote,
                    len: t.len(),
                    limit: ID_LIMIT,
                });
            }
            remote_tables.push((m.tp_rank, t));
        }
        remote_tables.sort_by_key(|(r, _)| *r);
        // Checked before chunk rows are appended: each chunk row lies inside the dense row it is cut from.
        for ((rank, table), m) in remote_tables.iter().zip(sorted_by_rank(remotes)) {
            check_inside_advertised(*rank, table, m)?;
        }
        let base = local.local_table(units.local_sub)?;
        if base.len() > ID_LIMIT {
            return Err(PlanError::TableTooLarge {
                side: Side::Local,
                len: base.len(),
                limit: ID_LIMIT,
            });
        }
        let region_groups: Vec<Vec<usize>> = local
            .regions
            .iter()
            .map(|r| {
                (0..groups.len())
                    .filter(|&g| groups[g].is_attention() && (r.group.is_none() || r.group == Some(g as u32)))
                    .collect()
            })
            .collect();
        let ssm_streams = local.conv_split.as_ref().map_or(0, |s| s.num_streams()) * local.ssm_regions.len();
        let l_counts: Vec<u64> = local.regions.iter().map(|r| r.num_blocks * units.local_sub).collect();
        let r_counts: Vec<u64> = first.regions.iter().map(|r| r.num_blocks * units.remote_sub).collect();
        let geo = &local.geometry;
        let local_space = IdSpace::new(
            &l_counts,
            base.num_fa,
            ssm_streams,
            geo.ppl,
            units.local_sub,
            geo.logical_block_size,
            geo.num_logical_blocks,
            &region_groups,
            &groups,
        );
        let remote_space = IdSpace::new(
            &r_counts,
            remote_tables[0].1.num_fa,
            ssm_streams,
            first.ppl,
            units.remote_sub,
            first.logical_block_size,
            first.num_logical_blocks,
            &region_groups,
            &groups,
        );
        let base_key = if units.local_sub == 1 {
            TableKey::Whole
        } else {
            TableKey::Bsr(units.local_sub)
        };
        let (routes, pieces) = routes(local, &mapping, mode, base_key, &groups);
        let replicated: Vec<bool> = local
            .regions
            .iter()
            .map(|r| r.is_mla || !hosts_attention(r.group, &groups))
            .collect();
        let mut local_tables = Vec::with_capacity(1 + pieces.len());
        for (i, piece) in pieces.iter().enumerate() {
            local_tables.push((TableKey::Split(i), split_table(&base, &replicated, &l_counts, *piece)?));
        }
        local_tables.insert(0, (base_key, base));
        let chunks = if coalesce {
            // Only remote ranks some route exchanges attention with ever use chunk ids (an MLA pull reads one
            // of the ranks it handshakes with; SSM-only ranks get none).
            add_chunk_rows(
                &mut local_tables,
                &mut remote_tables,
                &attention_ranks(&routes, &groups),
                &region_groups,
                (&local_space, &l_counts),
                (&remote_space, &r_counts),
            )
        } else {
            vec![None; region_groups.len()]
        };
        let streams = local.conv_split.as_ref().map_or(0, |s| s.num_streams());
        let states = if coalesce {
            add_state_rows(&mut local_tables, &mut remote_tables, local.ssm_regions.len(), streams)
        } else {
            None
        };
        // SSM slots: one per whole state where both sides have state rows, else one per piece.
        let ssm_bases: Vec<(u64, u64)> = match &states {
            Some((l, r)) => l.iter().copied().zip(r.iter().copied()).collect(),
            None => local_space
                .ssm_start
                .iter()
                .copied()
                .zip(remote_space.ssm_start.iter().copied())
                .collect(),
        };
        let slots = Slots::new(
            &groups,
            &region_groups,
            &ssm_bases,
            (&local_space, &remote_space),
            &chunks,
        );
        Ok(PeerPlan {
            mode,
            mapping,
            units,
            local_tables,
            remote_tables,
            groups,
            local: local_space,
            remote: remote_space,
            routes,
            slots,
        })
    }

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
        self.local_tables.iter().find(|(k, _)| *k == key).map(|(_, t)| t)
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
                remote_table: 0,
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
            t.remote_table = route.remote_rank;
            transfers.push(t);
        }
        out.transfers = transfers;
        out.notify_ranks.extend(self.remote_tables.iter().map(|(r, _)| *r));
        Ok(())
    }

    /// Resolve a transfer into byte moves `[local_addr, remote_addr, len]`, one per descriptor pair.
    ///
    /// # Errors
    /// `BadTransfer` when a table or id does not exist or a pair's lengths differ.
    pub fn moves(&self, t: &RankTransfer) -> Result<Vec<[u64; 3]>, PlanError> {
        self.resolve(t.local_table, t.remote_table, &t.local_ids, &t.remote_ids)
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

/// Append chunk rows: to the base local table for every attention region dense in it (so the base table
/// depends on the local rank alone and can be prepped before any handshake, see
/// [`RegionTable::coalesced_local_table`]), to the split tables for the attention regions dense in all of
/// them (MLA, kept whole), and to the remote tables for the regions dense there and in the local tables the
/// routes use. Returns the per-region chunk starts of the regions coalesced on both sides (none at all when a
/// table would outgrow int32 ids; every table is then left as it was).
fn add_chunk_rows(
    local_tables: &mut [(TableKey, DescTable)],
    remote_tables: &mut [(u32, DescTable)],
    attention_ranks: &[u32],
    region_groups: &[Vec<usize>],
    (l_space, l_counts): (&IdSpace, &[u64]),
    (r_space, r_counts): (&IdSpace, &[u64]),
) -> Vec<Option<(ChunkStarts, ChunkStarts)>> {
    let none = || vec![None; region_groups.len()];
    let dense = |tables: &[&DescTable], starts: &[u64], counts: &[u64]| -> Vec<bool> {
        (0..region_groups.len())
            .map(|r| {
                !region_groups[r].is_empty() && tables.iter().all(|t| dense_row(t, starts[r], counts[r]).is_some())
            })
            .collect()
    };
    let locals: Vec<&DescTable> = local_tables.iter().map(|(_, t)| t).collect();
    let base_mask = dense(&locals[..1], &l_space.region_start, l_counts);
    // Every route uses a split table when there are any, else the base table.
    let used_mask = if locals.len() > 1 {
        dense(&locals[1..], &l_space.region_start, l_counts)
    } else {
        base_mask.clone()
    };
    let remotes: Vec<&DescTable> = remote_tables.iter().map(|(_, t)| t).collect();
    let remote_mask: Vec<bool> = dense(&remotes, &r_space.region_start, r_counts)
        .iter()
        .zip(&used_mask)
        .map(|(&r, &l)| r && l)
        .collect();
    let local: Vec<_> = local_tables
        .iter()
        .enumerate()
        .map(|(i, (_, t))| {
            let mask = if i == 0 { &base_mask } else { &used_mask };
            with_chunk_rows(t, &l_space.region_start, l_counts, mask)
        })
        .collect();
    let remote: Vec<Option<_>> = remote_tables
        .iter()
        .map(|(rank, t)| {
            attention_ranks
                .contains(rank)
                .then(|| with_chunk_rows(t, &r_space.region_start, r_counts, &remote_mask))
        })
        .collect();
    let Some((_, remote_starts)) = remote.iter().flatten().next() else {
        // No route exchanges attention, so no chunk id is ever planned; the base table still gets its chunk
        // rows, since it depends on the local rank alone (prepped before any handshake).
        if let Some((base, _)) = local.into_iter().next().filter(|(t, _)| t.len() <= ID_LIMIT) {
            local_tables[0].1 = base;
        }
        return none();
    };
    if local
        .iter()
        .chain(remote.iter().flatten())
        .any(|(t, _)| t.len() > ID_LIMIT)
    {
        return none();
    }
    // Chunk starts depend only on the region counts and the mask, so all split (all remote) tables agree.
    let used = if local.len() > 1 { &local[1].1 } else { &local[0].1 };
    let chunks = used
        .iter()
        .zip(remote_starts)
        .zip(&remote_mask)
        .map(|((l, r), &m)| if m { l.clone().zip(r.clone()) } else { None })
        .collect();
    for ((_, t), (c, _)) in local_tables.iter_mut().zip(local) {
        *t = c;
    }
    for ((_, t), c) in remote_tables.iter_mut().zip(remote) {
        if let Some((c, _)) = c {
            *t = c;
        }
    }
    chunks
}

/// Append whole-state rows (`state_rows.rs`) to the base local table (always, as
/// [`RegionTable::coalesced_local_table`] does) and, when the routes use the base table for SSM state (no split
/// tables) and every remote table's pieces are contiguous too (equal TP), to the remote tables. Returns the
/// flat id of each SSM region's first state on both sides when plans use them.
fn add_state_rows(
    local_tables: &mut [(TableKey, DescTable)],
    remote_tables: &mut [(u32, DescTable)],
    regions: usize,
    streams: usize,
) -> Option<(Vec<u64>, Vec<u64>)> {
    let (base, local_starts) = with_state_rows(&local_tables[0].1, regions, streams)?;
    if base.len() > ID_LIMIT {
        return None;
    }
    local_tables[0].1 = base;
    if local_tables.len() > 1 {
        return None; // SSM state moves through split tables, in shares
    }
    let remote: Vec<(DescTable, Vec<u64>)> = remote_tables
        .iter()
        .map(|(_, t)| with_state_rows(t, regions, streams).filter(|(t, _)| t.len() <= ID_LIMIT))
        .collect::<Option<_>>()?;
    let remote_starts = remote.first()?.1.clone();
    if remote.iter().any(|(_, s)| *s != remote_starts) {
        return None;
    }
    for ((_, t), (joined, _)) in remote_tables.iter_mut().zip(remote) {
        *t = joined;
    }
    Some((local_starts, remote_starts))
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
