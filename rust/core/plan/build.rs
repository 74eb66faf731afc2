//! Building a [`PeerPlan`], one named step after another: check the remotes, map the TP ranks, build and
//! bound every remote table and the local base table, lay out both sides' descriptor ids, route each remote
//! rank to a local table (cutting split tables where one is needed), append the coalescing rows, and fix the
//! id slots a request is emitted into.

use std::sync::Arc;

use super::checks::{check_inside_advertised, check_remote_size, check_remotes};
use super::emit::Slots;
use super::error::{PlanError, Side};
use super::failed::BlockMap;
use super::heads::local_piece_table;
use super::ids::{shared_group_pairs, IdSpace, ID_LIMIT};
use super::key::TableKey;
use super::remote::{heads_per_rank, remote_table};
use super::routes::{attention_ranks, routes};
use super::rows::{append_rows, StateStarts};
use super::split::{split_table, Piece};
use super::PeerPlan;
use crate::core::alias::merge_alias_groups;
use crate::core::descs::DescTable;
use crate::core::meta::{AgentMeta, TransferMode};
use crate::core::region::{hosts_attention, GroupKind, RegionTable};
use crate::core::tp::TpMapping;
use crate::core::units::BlockUnits;

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
        PeerPlan::build(local, remotes, mode, coalesce, false)
    }

    /// The plan of `local` restricted to `remotes`, some of the ranks it covers (at least one): exactly the
    /// tables, routes and ids the whole plan has for those ranks, whose other routes are left out. A passive
    /// rank rebuilds its initiator's plan this way from the two payloads it knows (`mirror.rs`).
    ///
    /// # Errors
    /// As [`PeerPlan::new`]; `RemoteRanks` when a rank given is not one `local` covers.
    pub fn for_ranks(
        local: &RegionTable,
        remotes: &[AgentMeta],
        mode: TransferMode,
        coalesce: bool,
    ) -> Result<PeerPlan, PlanError> {
        PeerPlan::build(local, remotes, mode, coalesce, true)
    }

    fn build(
        local: &RegionTable,
        remotes: &[AgentMeta],
        mode: TransferMode,
        coalesce: bool,
        partial: bool,
    ) -> Result<PeerPlan, PlanError> {
        let first = check_remotes(remotes, mode)?;
        let groups = local.groups.clone();
        let mapping = map_ranks(local, remotes, first, &groups, partial)?;
        let gqa_order = groups.contains(&GroupKind::Attention).then_some(local.page_order);
        let heads = (
            heads_per_rank(mapping.total_kv_heads, local.tp_size),
            heads_per_rank(mapping.total_kv_heads, first.tp_size),
        );
        let kernels = (local.geometry.kernel_block_size, first.kernel_block_size);
        let units = BlockUnits::for_pages(kernels, gqa_order, heads, local.k_rows)?;
        check_remote_size(local, first, units, &mapping)?;
        let mut remote_tables = build_remote_tables(local, remotes, &mapping, units)?;
        let base = build_base_table(local, units, heads.0)?;
        let region_groups = attention_groups_per_region(local, &groups);
        let l_counts: Vec<u64> = local
            .regions
            .iter()
            .map(|r| r.num_blocks * units.local_pieces())
            .collect();
        let r_counts: Vec<u64> = first
            .regions
            .iter()
            .map(|r| r.num_blocks * units.remote_pieces())
            .collect();
        let (local_space, remote_space) = id_spaces(
            local,
            first,
            units,
            (base.num_fa, remote_tables[0].1.num_fa),
            (&l_counts, &r_counts),
            &region_groups,
        );
        let base_key = if units.local_pieces() == 1 {
            TableKey::Whole
        } else {
            TableKey::Bsr(units.local_pieces())
        };
        let (mut routes, pieces) = routes(local, &mapping, mode, base_key, &groups);
        // Restricted to some ranks: their routes only (split tables stay as the whole plan cuts them).
        routes.retain(|r| remote_tables.iter().any(|(rank, _)| *rank == r.remote_rank));
        let mut local_tables = with_split_tables(local, (base_key, base), &pieces, &l_counts, (units, heads.0))?;
        let (chunks, states) = if coalesce {
            // Only remote ranks some route exchanges attention with ever use chunk ids (an MLA pull reads one
            // of the ranks it handshakes with; SSM-only ranks get none).
            append_rows(
                local,
                &mut local_tables,
                &mut remote_tables,
                // per-head pieces of a unit are not consecutive units: no chunk rows
                units
                    .per_head
                    .is_none()
                    .then_some(&attention_ranks(&routes, &groups)[..]),
                &region_groups,
                (&local_space, &l_counts),
                (&remote_space, &r_counts),
            )
        } else {
            (vec![None; region_groups.len()], None)
        };
        let ssm_regions = ssm_row_regions(local, states.is_some());
        let slots = Slots::new(
            &groups,
            &region_groups,
            (&ssm_bases(states, (&local_space, &remote_space)), &ssm_regions),
            (&local_space, &remote_space),
            &chunks,
            units,
        );
        Ok(PeerPlan {
            mode,
            num_regions: local.regions.len(),
            mapping,
            units,
            local_tables,
            remote_tables,
            groups,
            local: local_space,
            remote: remote_space,
            routes,
            slots,
            blocks: BlockMap::new(local, &region_groups),
        })
    }
}

/// The TP mapping of the local rank against the remotes' engine, once the remotes given are exactly the ranks
/// it covers (the handshake targets), or with `partial` some of them, each once.
fn map_ranks(
    local: &RegionTable,
    remotes: &[AgentMeta],
    first: &AgentMeta,
    groups: &[GroupKind],
    partial: bool,
) -> Result<TpMapping, PlanError> {
    let mapping = TpMapping::compute(
        local.tp_rank,
        local.tp_size,
        first.tp_size,
        local.total_num_kv_heads,
        local.use_mla,
        groups,
    )?;
    let mut given: Vec<u32> = remotes.iter().map(|m| m.tp_rank).collect();
    given.sort_unstable();
    let covered = mapping.covered_ranks();
    let fits = if partial {
        given.windows(2).all(|w| w[0] < w[1]) && given.iter().all(|r| covered.contains(r))
    } else {
        given == covered
    };
    if !fits {
        return Err(PlanError::RemoteRanks {
            given,
            needed: mapping.covered_ranks(),
        });
    }
    Ok(mapping)
}

/// One table per remote rank, ascending by rank, each within int32 ids and inside the regions its rank
/// advertised (checked before chunk rows are appended: each chunk row lies inside the dense row it is cut
/// from).
fn build_remote_tables(
    local: &RegionTable,
    remotes: &[AgentMeta],
    mapping: &TpMapping,
    units: BlockUnits,
) -> Result<Vec<(u32, DescTable)>, PlanError> {
    let mut remote_tables = Vec::with_capacity(remotes.len());
    for m in remotes {
        let t = remote_table(local, m, mapping, units)?;
        check_id_range(&t, Side::Remote)?;
        remote_tables.push((m.tp_rank, t));
    }
    remote_tables.sort_by_key(|(r, _)| *r);
    for ((rank, table), m) in remote_tables.iter().zip(sorted_by_rank(remotes)) {
        check_inside_advertised(*rank, table, m)?;
    }
    Ok(remote_tables)
}

/// `remotes` in ascending rank order (the order of `PeerPlan::remote_tables`).
fn sorted_by_rank(remotes: &[AgentMeta]) -> Vec<&AgentMeta> {
    let mut v: Vec<&AgentMeta> = remotes.iter().collect();
    v.sort_by_key(|m| m.tp_rank);
    v
}

/// The local base table in common units (per-head pieces: those of the first remote slot's heads, all of the
/// rank's heads unless it holds more than the remote ranks), within int32 ids.
fn build_base_table(local: &RegionTable, units: BlockUnits, heads: u64) -> Result<DescTable, PlanError> {
    let base = if units.per_head.is_some() {
        local_piece_table(local, units, heads, 0)?
    } else {
        local.local_table(units.local_sub)?
    };
    check_id_range(&base, Side::Local)?;
    Ok(base)
}

/// Refuse a table whose descriptor ids would not fit int32.
fn check_id_range(table: &DescTable, side: Side) -> Result<(), PlanError> {
    if table.len() > ID_LIMIT {
        return Err(PlanError::TableTooLarge {
            side,
            len: table.len(),
            limit: ID_LIMIT,
        });
    }
    Ok(())
}

/// Per local region, the attention groups whose pages it holds (every attention group when the region is
/// shared by all of them).
fn attention_groups_per_region(local: &RegionTable, groups: &[GroupKind]) -> Vec<Vec<usize>> {
    local
        .regions
        .iter()
        .map(|r| {
            (0..groups.len())
                .filter(|&g| groups[g].is_attention() && (r.group.is_none() || r.group == Some(g as u32)))
                .collect()
        })
        .collect()
}

/// Both sides' descriptor-id geometry: `num_fa` and the per-region unit `counts` of the local base table and
/// of the remote tables (all remote ranks share one geometry).
fn id_spaces(
    local: &RegionTable,
    first: &AgentMeta,
    units: BlockUnits,
    (l_num_fa, r_num_fa): (u64, u64),
    (l_counts, r_counts): (&[u64], &[u64]),
    region_groups: &[Vec<usize>],
) -> (IdSpace, IdSpace) {
    let groups = &local.groups;
    let geo = &local.geometry;
    // the remote's rows mirror the local ones (`remote_table`), each with the states of its remote region
    let r_rows: Vec<u64> = local
        .ssm_regions
        .iter()
        .zip(local.ssm_streams_per_region())
        .flat_map(|(&i, n)| {
            let states = first
                .regions
                .get(i)
                .and_then(|r| r.states)
                .unwrap_or(first.num_logical_blocks);
            std::iter::repeat_n(states, n)
        })
        .collect();
    let local_space = IdSpace::new(
        l_counts,
        l_num_fa,
        &local.ssm_row_counts(),
        geo.ppl,
        (units.local_sub, units.per_unit()),
        geo.logical_block_size,
        geo.num_logical_blocks,
        region_groups,
        groups,
    );
    let remote_space = IdSpace::new(
        r_counts,
        r_num_fa,
        &r_rows,
        first.ppl,
        (units.remote_sub, units.per_unit()),
        first.logical_block_size,
        first.num_logical_blocks,
        region_groups,
        groups,
    );
    // Both sides' region `r` take the same groups' ids (slots pair them), so they share the same pairs.
    // aliases of one tensor count as one region: a block id in two of their groups is refused
    let bases: Vec<u64> = local.regions.iter().map(|r| r.base).collect();
    let shared = shared_group_pairs(groups, &merge_alias_groups(&bases, region_groups), &local.ssm_regions);
    (
        IdSpace {
            shared: shared.clone(),
            ..local_space
        },
        IdSpace { shared, ..remote_space },
    )
}

/// The local tables by key: the base table first, then one split table per piece the routes use. Regions kept
/// whole in every piece (MLA, or holding no attention) are marked replicated. Per-head pieces are cut from the
/// piece table of the piece's heads (`heads` per local rank), whose attention rows are kept whole.
fn with_split_tables(
    local: &RegionTable,
    (base_key, base): (TableKey, DescTable),
    pieces: &[Piece],
    l_counts: &[u64],
    (units, heads): (BlockUnits, u64),
) -> Result<Vec<(TableKey, Arc<DescTable>)>, PlanError> {
    let replicated: Vec<bool> = local
        .regions
        .iter()
        .map(|r| r.is_mla || !hosts_attention(r.group, &local.groups) || units.per_head.is_some())
        .collect();
    let mut local_tables = Vec::with_capacity(1 + pieces.len());
    for (i, piece) in pieces.iter().enumerate() {
        let split = if units.per_head.is_some() {
            let heads_table = local_piece_table(local, units, heads, piece.fa_slot)?;
            split_table(&heads_table, &replicated, l_counts, *piece)?
        } else {
            split_table(&base, &replicated, l_counts, *piece)?
        };
        local_tables.push((TableKey::Split(i), Arc::new(split)));
    }
    local_tables.insert(0, (base_key, Arc::new(base)));
    Ok(local_tables)
}

/// The SSM region of every SSM slot base: one per region with whole-state rows, else one per piece row.
fn ssm_row_regions(local: &RegionTable, whole: bool) -> Vec<usize> {
    if whole {
        return local.ssm_regions.clone();
    }
    local
        .ssm_regions
        .iter()
        .zip(local.ssm_streams_per_region())
        .flat_map(|(&i, n)| std::iter::repeat_n(i, n))
        .collect()
}

/// SSM slot bases `(local, remote)`: one per whole state where both sides have state rows, else one per piece.
fn ssm_bases(states: Option<StateStarts>, (l_space, r_space): (&IdSpace, &IdSpace)) -> Vec<(u64, u64)> {
    match states {
        Some((l, r)) => l.into_iter().zip(r).collect(),
        None => l_space
            .ssm_start
            .iter()
            .copied()
            .zip(r_space.ssm_start.iter().copied())
            .collect(),
    }
}
