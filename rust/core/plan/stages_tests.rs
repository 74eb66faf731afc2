//! Staged plans: a request's plan cut by (region, group) into sub-plans is exactly the whole plan, each byte
//! move in exactly one sub-plan, and each sub-plan stays inside the regions (and groups) it was cut for.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::{PeerPlan, Plan, StageMap};
use crate::core::oracle_tests::{mix, scenario};
use crate::core::scenario::{Deployment, Scenario};
use crate::core::stream::{Granularity, StreamSchedule};
use crate::core::stream_tests::{hma, kimi_48b_pattern};
use crate::core::{RegionTable, TransferMode};

/// Id pairs per (remote rank, local table), sorted.
fn pairs(plans: &[&Plan]) -> BTreeMap<(u32, String), Vec<(i32, i32)>> {
    let mut out: BTreeMap<(u32, String), Vec<(i32, i32)>> = BTreeMap::new();
    for p in plans {
        for t in &p.transfers {
            let e = out.entry((t.remote_rank, t.local_table.to_string())).or_default();
            e.extend(t.local_ids.iter().copied().zip(t.remote_ids.iter().copied()));
        }
    }
    out.values_mut().for_each(|v| v.sort_unstable());
    out
}

/// Every byte move of `plans`, sorted (a multiset: a move twice stays twice).
fn moves(peer: &PeerPlan, plans: &[&Plan]) -> Vec<[u64; 3]> {
    let mut out: Vec<[u64; 3]> = plans
        .iter()
        .flat_map(|p| p.transfers.iter())
        .flat_map(|t| peer.moves(t).unwrap())
        .collect();
    out.sort_unstable();
    out
}

/// The region holding local address `addr`.
fn region_of(table: &RegionTable, addr: u64) -> usize {
    table
        .regions
        .iter()
        .position(|r| r.base <= addr && addr < r.base + r.bytes)
        .unwrap_or_else(|| panic!("address {addr:#x} is in no region"))
}

/// `whole` cut by `map` into `stages`: exactly the whole plan (ids and byte moves, each once), every stage's
/// local bytes inside regions `map` puts (some group of) in that stage.
fn check_cut(peer: &PeerPlan, table: &RegionTable, whole: &Plan, stages: &[Plan], map: &StageMap) {
    assert_eq!(stages.len(), map.num_stages());
    let all: Vec<&Plan> = stages.iter().collect();
    assert_eq!(
        pairs(&[whole]),
        pairs(&all),
        "the stages' id pairs are not the whole plan's"
    );
    let (w, s) = (moves(peer, &[whole]), moves(peer, &all));
    assert_eq!(w, s, "the stages' byte moves are not the whole plan's");
    for pair in w.windows(2) {
        assert_ne!(pair[0], pair[1], "the whole plan moves the same bytes twice");
    }
    let groups = table.groups.len();
    for (k, st) in stages.iter().enumerate() {
        assert_eq!(st.notify_ranks, whole.notify_ranks);
        for m in moves(peer, &[st]) {
            let r = region_of(table, m[0]);
            assert!(
                (0..groups).any(|g| map.of(r, g) == k),
                "stage {k} moves bytes of region {r}, which has no pair in it"
            );
        }
    }
}

/// A random stage map for `table`: per region (`by_region`) or per (region, group) pair, over 1-4 stages.
fn random_map(table: &RegionTable, seed: u64, by_region: bool) -> StageMap {
    let (regions, groups) = (table.regions.len(), table.groups.len());
    let n = 1 + (mix(seed, 1) % 4) as usize;
    let pick = |i: usize| (mix(seed, 2 + i as u64) % n as u64) as u32;
    if by_region {
        StageMap::by_region(&(0..regions).map(pick).collect::<Vec<_>>(), groups, n).unwrap()
    } else {
        StageMap::new(regions, groups, (0..regions * groups).map(pick).collect(), n).unwrap()
    }
}

fn check_scenario(s: &Scenario, seed: u64) {
    let dep = Deployment::build(s).unwrap();
    let locals = match s.mode {
        TransferMode::Pull => &dep.decode,
        TransferMode::Push => &dep.prefill,
    };
    for req in &s.requests {
        let (l, r) = match s.mode {
            TransferMode::Pull => (&req.decode, &req.prefill),
            TransferMode::Push => (&req.prefill, &req.decode),
        };
        for (peer, rank) in dep.peers.iter().zip(locals) {
            let whole = peer.plan(l, r).unwrap();
            for by_region in [true, false] {
                let map = random_map(&rank.table, mix(seed, u64::from(rank.table.tp_rank)), by_region);
                let stages = peer.plan_staged(l, r, &map).unwrap();
                check_cut(peer, &rank.table, &whole, &stages, &map);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() })]

    /// Random deployments of every family (both modes, any TP pair, coalesced tables, prefix hits): the
    /// sub-plans of a random partition of the regions, and of the (region, group) pairs, are the whole plan.
    #[test]
    fn stages_of_any_partition_are_exactly_the_whole_plan(s in scenario(), seed in any::<u64>()) {
        check_scenario(&s, seed);
    }
}

/// Logical block holding local address `addr` of `table` (pages and states alike: one logical page each).
fn logical_block(table: &RegionTable, addr: u64) -> u64 {
    let r = &table.regions[region_of(table, addr)];
    (addr - r.base) / (r.block_stride * table.geometry.ppl)
}

#[test]
fn a_layer_stage_moves_only_its_own_group_s_blocks() {
    // Kimi-Linear-48B's layer pattern at small sizes, push to an identical decode: each stage of the layer
    // schedule moves, in each region, only blocks of the groups whose layer in that tensor is final.
    let layout = hma(&kimi_48b_pattern(), 7);
    let table = RegionTable::build(&layout).unwrap();
    let info = crate::core::EngineInfo {
        engine_id: "decode".into(),
        transfer_mode: TransferMode::Push,
        ..crate::core::EngineInfo::default()
    };
    let remote = crate::core::AgentMeta::from_table(&table, &info);
    let peer = PeerPlan::new(&table, &[remote], TransferMode::Push).unwrap();
    let sched = StreamSchedule::new(&table, None, Granularity::Layer).unwrap();
    // 4 groups, disjoint block ids (3 attention blocks, one state per SSM group).
    let local: Vec<Vec<u64>> = vec![vec![0, 1, 2], vec![3], vec![4], vec![5]];
    let remote_ids: Vec<Vec<u64>> = vec![vec![4, 5, 6], vec![0], vec![1], vec![2]];
    let whole = peer.plan(&local, &remote_ids).unwrap();
    let stages = peer.plan_staged(&local, &remote_ids, &sched.map).unwrap();
    check_cut(&peer, &table, &whole, &stages, &sched.map);
    // Pairs no layer writes (tensor 6 of the 6-layer KDA group 3) are final from the start, in stage 0.
    let written: Vec<(u32, u32)> = sched.stages.iter().flat_map(|s| s.units.iter().copied()).collect();
    for (k, (st, info)) in stages.iter().zip(&sched.stages).enumerate() {
        let mut seen = 0;
        for m in moves(&peer, &[st]) {
            let (r, b) = (region_of(&table, m[0]) as u32, logical_block(&table, m[0]));
            let g = local.iter().position(|ids| ids.contains(&b)).unwrap() as u32;
            let unwritten_first = k == 0 && !written.contains(&(r, g));
            assert!(
                info.units.contains(&(r, g)) || unwritten_first,
                "stage {k} moved block {b} of group {g} in region {r}"
            );
            seen += 1;
        }
        assert!(seen > 0, "stage {k} moves nothing");
    }
    // Seven stages (one per MLA hook), none at the end of the forward.
    assert_eq!(stages.len(), 7);
    assert!(sched.stages.iter().all(|s| s.hook.is_some()));
}

#[test]
fn a_stage_map_for_another_table_is_refused() {
    let table = RegionTable::build(&hma("SA", 1)).unwrap();
    let info = crate::core::EngineInfo {
        transfer_mode: TransferMode::Push,
        ..crate::core::EngineInfo::default()
    };
    let remote = crate::core::AgentMeta::from_table(&table, &info);
    let peer = PeerPlan::new(&table, &[remote], TransferMode::Push).unwrap();
    let wrong = StageMap::by_region(&[0, 0, 0], table.groups.len(), 1).unwrap();
    let err = peer
        .plan_staged(&[vec![0], vec![1]], &[vec![0], vec![1]], &wrong)
        .unwrap_err();
    assert!(err.to_string().contains("stage map: made for 3 regions"), "{err}");
    assert!(StageMap::new(1, 2, vec![0, 2], 2).is_err(), "a stage past the count");
    assert!(StageMap::new(1, 2, vec![0], 2).is_err(), "too few entries");
}
