//! Which remote ranks a local rank exchanges each group with, and through which local table (pull follows
//! vLLM's mapping; push writes attention to every covered decode rank, once per head).

use super::key::TableKey;
use super::split::Piece;
use crate::core::meta::TransferMode;
use crate::core::region::{hosts_attention, GroupKind, RegionTable};
use crate::core::tp::TpMapping;

/// Which groups one remote rank exchanges, through which local table.
#[derive(Debug, Clone)]
pub(crate) struct Route {
    pub(crate) remote_rank: u32,
    pub(crate) table: TableKey,
    pub(crate) groups: Vec<bool>,
}

/// Routes (remote rank, local table, groups) and the split pieces they use.
pub(crate) fn routes(
    local: &RegionTable,
    m: &TpMapping,
    mode: TransferMode,
    base: TableKey,
    groups: &[GroupKind],
) -> (Vec<Route>, Vec<Piece>) {
    let has_ssm = local.has_ssm();
    let targets: Vec<u32> = match mode {
        TransferMode::Pull => m.all_source_ranks.clone(),
        TransferMode::Push => m.covered_ranks(),
    };
    let fa_splits = m.attn_ranks.len() as u64;
    let head_split = local
        .regions
        .iter()
        .any(|r| !r.is_mla && hosts_attention(r.group, groups))
        && fa_splits > 1;
    let needs_split = m.tp_ratio < 0 && (has_ssm || head_split);
    let mut pieces = Vec::new();
    let mut out = Vec::with_capacity(targets.len());
    for &rank in &targets {
        let sel: Vec<bool> = groups
            .iter()
            .enumerate()
            .map(|(g, kind)| match (mode, kind.is_attention()) {
                (TransferMode::Pull, _) => m.per_group[g].contains(&rank),
                (TransferMode::Push, true) => m.tp_ratio < 0 || m.owns_attention(),
                (TransferMode::Push, false) => m.ssm_ranks.contains(&rank),
            })
            .collect();
        let table = if needs_split {
            pieces.push(Piece {
                fa_slot: u64::from(m.attention_slot(rank)),
                fa_splits,
                ssm_index: m.ssm_ranks.iter().position(|&r| r == rank).unwrap_or(0) as u64,
                ssm_splits: if has_ssm { m.ssm_ranks.len() as u64 } else { 0 },
            });
            TableKey::Split(pieces.len() - 1)
        } else {
            base
        };
        out.push(Route {
            remote_rank: rank,
            table,
            groups: sel,
        });
    }
    (out, pieces)
}

/// Remote ranks of the routes that carry an attention group, ascending.
pub(crate) fn attention_ranks(routes: &[Route], groups: &[GroupKind]) -> Vec<u32> {
    let mut ranks: Vec<u32> = routes
        .iter()
        .filter(|r| r.groups.iter().zip(groups).any(|(&on, g)| on && g.is_attention()))
        .map(|r| r.remote_rank)
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}
