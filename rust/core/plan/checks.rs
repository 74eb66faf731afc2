//! What a [`PeerPlan`](super::PeerPlan) refuses from its remotes: it trusts nothing it is handed (JSON, a
//! scenario, bytes never validated), so it runs the structure checks itself, requires every remote rank to
//! describe the same engine, bounds the tables a peer's block counts would size, and refuses any remote row
//! that would leave the regions that rank advertised.

use super::error::{mismatch, PlanError};
use super::ids::ID_LIMIT;
use crate::core::descs::{DescTable, StridedRow};
use crate::core::handshake::check_well_formed;
use crate::core::meta::{AgentMeta, TransferMode};
use crate::core::region::RegionTable;
use crate::core::tp::{TpMapping, MAX_TP_SIZE};
use crate::core::units::BlockUnits;

/// The first of `remotes` once they are checked: at least one, each well-formed, at most [`MAX_TP_SIZE`] of
/// them, all of one geometry, and in transfer mode `mode`.
pub(super) fn check_remotes(remotes: &[AgentMeta], mode: TransferMode) -> Result<&AgentMeta, PlanError> {
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
    Ok(first)
}

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
pub(super) fn check_remote_size(
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
    let local_units = total(local.regions.iter().map(|r| r.num_blocks), units.local_pieces());
    let remote_units = total(remote.regions.iter().map(|r| r.num_blocks), units.remote_pieces());
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

/// The last line of defence: every descriptor of `table` must lie inside one region `remote` advertised.
/// Rows are affine, so a row's first and last descriptors bound it.
pub(super) fn check_inside_advertised(rank: u32, table: &DescTable, remote: &AgentMeta) -> Result<(), PlanError> {
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
