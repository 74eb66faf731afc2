//! Hand-checked planning vectors on hand-built layouts.

use super::error::PlanError;
use super::{PeerPlan, Plan, TableKey};
use crate::core::fixtures::{dense_memory, hybrid_mla_f2, kda_spec, mla_spec};
use crate::core::layout::{LayerInput, LayerMemory, MemType, RankLayout};
use crate::core::meta::{AgentMeta, EngineInfo, TransferMode};
use crate::core::spec::{AttentionSpec, LayerSpec, MambaKind, SsmSpec};
use crate::core::RegionTable;

const T0: u64 = 0x1000;
const T1: u64 = 0x10000;

fn meta(layout: &RankLayout, mode: TransferMode) -> AgentMeta {
    let info = EngineInfo {
        engine_id: "remote".into(),
        transfer_mode: mode,
        ..EngineInfo::default()
    };
    AgentMeta::from_table(&RegionTable::build(layout).unwrap(), &info)
}

/// A KDA spec at half the reference's TP share: proj bytes (6, 6, 12), temporal 32 bytes.
fn kda_half(page: u64) -> LayerSpec {
    LayerSpec::Ssm(SsmSpec {
        kind: MambaKind::Gdn,
        conv_shape: [4, 3],
        conv_dtype_bytes: 2,
        temporal_shape: vec![1, 2, 4],
        temporal_dtype_bytes: 4,
        page_size_padded: Some(page),
        conv_layout: Default::default(),
        part: None,
    })
}

/// The F.6/F.7 remote: MLA + half-TP KDA in two tensors, logical block 8, kernel 4, 12 logical blocks.
fn f7_remote(rank: u32) -> RankLayout {
    let page = 96;
    let mut layers = Vec::new();
    for (i, base) in [0x1000_0000u64, 0x2000_0000].into_iter().enumerate() {
        for (name, group, spec) in [
            ("kda_a", 1, kda_half(page)),
            ("mla", 0, mla_spec()),
            ("kda_b", 2, kda_half(page)),
        ] {
            layers.push(LayerInput {
                name: format!("{name}.{i}"),
                group,
                spec,
                memory: dense_memory(base, 12 * page, MemType::Dram),
            });
        }
    }
    RankLayout {
        tp_rank: rank,
        tp_size: 2,
        logical_block_size: 8,
        kernel_block_size: 4,
        num_logical_blocks: 12,
        total_num_kv_heads: 1,
        layers,
        kv_layout: None,
    }
}

/// The reference peer plan: no chunk rows, one id pair per unit (the F-vectors' form).
fn reference(local: &RegionTable, remotes: &[AgentMeta], mode: TransferMode) -> Result<PeerPlan, PlanError> {
    PeerPlan::with_coalescing(local, remotes, mode, false)
}

/// Moves sorted and merged wherever consecutive on both sides: equal for any indexing of the same bytes.
pub(super) fn canonical(mut moves: Vec<[u64; 3]>) -> Vec<[u64; 3]> {
    moves.sort_unstable();
    let mut out: Vec<[u64; 3]> = Vec::with_capacity(moves.len());
    for m in moves {
        match out.last_mut() {
            Some(l) if l[0] + l[2] == m[0] && l[1] + l[2] == m[1] => l[2] += m[2],
            _ => out.push(m),
        }
    }
    out
}

/// The default (coalesced) peer plan moves exactly the reference plan's bytes for this request, in no more
/// ids; returns the coalesced plan and its peer.
fn check_coalesced(
    local: &RegionTable,
    remotes: &[AgentMeta],
    mode: TransferMode,
    ids: (&[Vec<u64>], &[Vec<u64>]),
) -> (Plan, PeerPlan) {
    let r = reference(local, remotes, mode).unwrap();
    let c = PeerPlan::new(local, remotes, mode).unwrap();
    let (pr, pc) = (r.plan(ids.0, ids.1).unwrap(), c.plan(ids.0, ids.1).unwrap());
    assert_eq!(pr.transfers.len(), pc.transfers.len());
    for (i, (tr, tc)) in pr.transfers.iter().zip(&pc.transfers).enumerate() {
        assert_eq!((tr.remote_rank, tr.local_table), (tc.remote_rank, tc.local_table));
        assert!(tc.local_ids.len() <= tr.local_ids.len());
        let (mr, mc) = (pr.moves(&r, i).unwrap(), pc.moves(&c, i).unwrap());
        let sum = |m: &[[u64; 3]]| m.iter().map(|m| m[2]).sum::<u64>();
        assert_eq!(sum(&mr), sum(&mc));
        assert_eq!(canonical(mr), canonical(mc));
    }
    (pc, c)
}

fn pairs(local: &[i32], remote: &[i32]) -> Vec<(i32, i32)> {
    let mut p: Vec<(i32, i32)> = local.iter().copied().zip(remote.iter().copied()).collect();
    p.sort_unstable();
    p
}

/// F.7 `test_hetero_ppl_multi_read_writes_stay_within_request_blocks`, with the derived ids.
#[test]
fn f7_hetero_ppl_multi_read() {
    let local = RegionTable::build(&hybrid_mla_f2([T0, T1], 8)).unwrap();
    let remotes = [
        meta(&f7_remote(0), TransferMode::Pull),
        meta(&f7_remote(1), TransferMode::Pull),
    ];
    let peer = reference(&local, &remotes, TransferMode::Pull).unwrap();
    assert_eq!(peer.mapping.attn_ranks, vec![0]);
    assert_eq!(peer.mapping.per_group, vec![vec![0], vec![0, 1], vec![0, 1]]);
    // Split tables: FA whole, SSM halved at p * len / 2.
    for p in 0..2u64 {
        let t = peer.local_table(TableKey::Split(p as usize)).unwrap();
        assert_eq!(t.desc(1), Some((T0 + 48, 48)));
        let streams = [(0, 12), (12, 12), (24, 24), (48, 64)];
        for (s, (off, len)) in streams.iter().enumerate() {
            assert_eq!(
                t.desc(48 + s as u64 * 8 + 3),
                Some((T0 + 144 * 3 + off + p * len / 2, len / 2))
            );
        }
    }
    let rt = peer.remote_table(0).unwrap();
    assert_eq!(rt.desc(48 + 12 * 3 + 2), Some((0x1000_0000 + 96 * 2 + 24, 32)));
    assert_eq!(rt.desc(48 + 12 * 2 + 2), Some((0x1000_0000 + 96 * 2 + 12, 12)));

    let plan = peer
        .plan(&[vec![2, 5], vec![1], vec![7]], &[vec![1, 4], vec![5], vec![2]])
        .unwrap();
    assert_eq!(plan.transfers.len(), 2);
    let (t0, t1) = (&plan.transfers[0], &plan.transfers[1]);
    assert_eq!(
        (t0.remote_rank, t0.local_table, t1.remote_rank, t1.local_table),
        (0, TableKey::Split(0), 1, TableKey::Split(1))
    );
    let ssm_l: Vec<i32> = (0..8).map(|s| 49 + 8 * s).chain((0..8).map(|s| 55 + 8 * s)).collect();
    let ssm_r: Vec<i32> = (0..8).map(|s| 53 + 12 * s).chain((0..8).map(|s| 50 + 12 * s)).collect();
    let mut want_l = vec![6, 7, 8, 15, 30, 31, 32, 39];
    let mut want_r = vec![2, 3, 8, 9, 26, 27, 32, 33];
    want_l.extend(&ssm_l);
    want_r.extend(&ssm_r);
    assert_eq!(pairs(&t0.local_ids, &t0.remote_ids), pairs(&want_l, &want_r));
    assert_eq!(pairs(&t1.local_ids, &t1.remote_ids), pairs(&ssm_l, &ssm_r));
    assert_eq!(t0.local_ids[..4], [6, 7, 8, 15], "region-major, request order");
    // Every local byte written lies inside the request's own unified pages (logical blocks 2, 5, 1, 7).
    for i in 0..2 {
        for [la, _, len] in plan.moves(&peer, i).unwrap() {
            let (base, off) = if la >= T1 { (T1, la - T1) } else { (T0, la - T0) };
            let block = off / 144;
            assert!(
                [1, 2, 5, 7].contains(&block) && (off + len - 1) / 144 == block,
                "{base:#x}+{off}"
            );
        }
    }
    let ids: (&[Vec<u64>], &[Vec<u64>]) = (&[vec![2, 5], vec![1], vec![7]], &[vec![1, 4], vec![5], vec![2]]);
    let (c, _) = check_coalesced(&local, &remotes, TransferMode::Pull, ids);
    assert!(
        c.transfers[0].local_ids.len() < t0.local_ids.len(),
        "MLA runs 6-7 and 30-31 coalesce"
    );
}

/// F.2's example request, planned against an identical peer: MLA ids [3,4,5,15,16,17], KDA per stream.
#[test]
fn f2_example_descriptor_ids() {
    let local = RegionTable::build(&hybrid_mla_f2([T0, T1], 4)).unwrap();
    let remote = meta(&hybrid_mla_f2([0x9000, 0x90000], 4), TransferMode::Pull);
    let remotes = [remote];
    let peer = reference(&local, &remotes, TransferMode::Pull).unwrap();
    let plan = peer
        .plan(&[vec![1], vec![2], vec![3]], &[vec![1], vec![2], vec![3]])
        .unwrap();
    let t = &plan.transfers[0];
    assert_eq!(t.local_table, TableKey::Whole);
    let mut want: Vec<i32> = vec![3, 4, 5, 15, 16, 17];
    for s in 0..8 {
        want.extend([24 + 4 * s + 2, 24 + 4 * s + 3]);
    }
    assert_eq!(t.local_ids, want);
    assert_eq!(t.remote_ids, want);
    // Coalesced: each MLA run 3, 4, 5 has odd length, so it keeps its plain ids (NIXL merges them into one
    // descriptor either way). Equal TP: each KDA state is one whole-state id (48 + 64 bytes) instead of its
    // four pieces. A two-block request makes each MLA run 6 units: three 2-unit chunk ids.
    let ids: (&[Vec<u64>], &[Vec<u64>]) = (&[vec![1], vec![2], vec![3]], &[vec![1], vec![2], vec![3]]);
    let (c, peer) = check_coalesced(&local, &remotes, TransferMode::Pull, ids);
    let t = &c.transfers[0];
    assert_eq!((&t.local_ids[..6], t.local_ids.len()), (&want[..6], 6 + 2 * 2));
    let whole = peer.local_table(TableKey::Whole).unwrap();
    for &id in &t.local_ids[6..] {
        assert_eq!(whole.desc(id as u64).map(|(_, len)| len), Some(48 + 64));
    }
    let ids: (&[Vec<u64>], &[Vec<u64>]) = (&[vec![1, 2], vec![3], vec![0]], &[vec![1, 2], vec![3], vec![0]]);
    let (c, peer) = check_coalesced(&local, &remotes, TransferMode::Pull, ids);
    let t = &c.transfers[0];
    assert!(
        t.local_ids[..6].iter().all(|&i| i >= 56),
        "chunk ids follow the SSM rows: {:?}",
        t.local_ids
    );
    let whole = peer.local_table(TableKey::Whole).unwrap();
    assert_eq!(whole.desc(t.local_ids[0] as u64), Some((T0 + 3 * 48, 96)));
    assert_eq!(whole.desc(t.local_ids[2] as u64), Some((T0 + 7 * 48, 96)));
    assert_eq!(t.local_ids, t.remote_ids);
}

fn mla_ssm(
    tp: u32,
    rank: u32,
    kda: LayerSpec,
    logical: u64,
    kernel: u64,
    num_logical: u64,
    mla_only: bool,
) -> RankLayout {
    let page = logical * 12;
    let mut layers = Vec::new();
    for (i, base) in [0x10_0000u64, 0x20_0000].into_iter().enumerate() {
        let memory = dense_memory(base, num_logical * page, MemType::Dram);
        layers.push(LayerInput {
            name: format!("mla.{i}"),
            group: 0,
            spec: mla_spec(),
            memory: memory.clone(),
        });
        if !mla_only {
            let spec = match &kda {
                LayerSpec::Ssm(s) => LayerSpec::Ssm(SsmSpec {
                    page_size_padded: Some(page),
                    ..s.clone()
                }),
                other => other.clone(),
            };
            layers.push(LayerInput {
                name: format!("kda.{i}"),
                group: 1,
                spec,
                memory,
            });
        }
    }
    RankLayout {
        tp_rank: rank,
        tp_size: tp,
        logical_block_size: logical,
        kernel_block_size: kernel,
        num_logical_blocks: num_logical,
        total_num_kv_heads: 1,
        layers,
        kv_layout: None,
    }
}

/// F.3 `test_push_write_hybrid_mla_replicates_attention`: P TP 1 writes into D TP 2, attention to both ranks
/// through the split tables, SSM to both ranks.
#[test]
fn f3_push_hybrid_mla_replicates_attention() {
    let p = RegionTable::build(&mla_ssm(1, 0, kda_spec(0), 12, 4, 16, false)).unwrap();
    let d: Vec<AgentMeta> = (0..2)
        .map(|r| meta(&mla_ssm(2, r, kda_half(0), 8, 4, 32, false), TransferMode::Push))
        .collect();
    let peer = PeerPlan::new(&p, &d, TransferMode::Push).unwrap();
    let plan = peer.plan(&[vec![1, 2], vec![5]], &[vec![7, 8], vec![3]]).unwrap();
    assert_eq!(plan.transfers.len(), 2);
    for (i, t) in plan.transfers.iter().enumerate() {
        assert_eq!((t.remote_rank, t.local_table), (i as u32, TableKey::Split(i)));
        assert_eq!(
            (&t.local_ids, &t.remote_ids),
            (&plan.transfers[0].local_ids, &plan.transfers[0].remote_ids)
        );
    }
    assert!(
        plan.transfers[0].local_ids.len() > 2 * 4,
        "attention (2 regions x 4 units) plus SSM"
    );
}

/// F.4: pure-MLA push from P TP 1 writes every D rank through the whole table.
#[test]
fn f4_pure_mla_push_writes_every_d_rank() {
    let p = RegionTable::build(&mla_ssm(1, 0, mla_spec(), 16, 16, 300, true)).unwrap();
    let d: Vec<AgentMeta> = (0..2)
        .map(|r| meta(&mla_ssm(2, r, mla_spec(), 16, 16, 300, true), TransferMode::Push))
        .collect();
    let peer = reference(&p, &d, TransferMode::Push).unwrap();
    let plan = peer.plan(&[vec![100, 101]], &[vec![200, 201]]).unwrap();
    let got: Vec<(u32, TableKey)> = plan.transfers.iter().map(|t| (t.remote_rank, t.local_table)).collect();
    assert_eq!(got, vec![(0, TableKey::Whole), (1, TableKey::Whole)]);
    assert_eq!(plan.transfers[0].local_ids, vec![100, 101, 400, 401]);
    assert_eq!(plan.transfers[0].remote_ids, vec![200, 201, 500, 501]);
    let ids: (&[Vec<u64>], &[Vec<u64>]) = (&[vec![100, 101]], &[vec![200, 201]]);
    let (c, _) = check_coalesced(&p, &d, TransferMode::Push, ids);
    assert!(
        c.transfers.iter().all(|t| t.local_ids.len() == 2),
        "one 2-unit chunk per region"
    );
}

/// One KV head of two one-byte elements: 16-byte kernel pages of 4 tokens.
fn small_fa_spec() -> LayerSpec {
    LayerSpec::FullAttention(AttentionSpec {
        num_kv_heads: 1,
        head_size: 2,
        head_size_v: None,
        dtype_bytes: 1,
        page_size_padded: None,
    })
}

fn one_region_fa(rank_blocks: u64) -> RankLayout {
    let spec = small_fa_spec();
    let memory = dense_memory(0x4000, rank_blocks * 16, MemType::Dram);
    RankLayout {
        tp_rank: 0,
        tp_size: 1,
        logical_block_size: 4,
        kernel_block_size: 4,
        num_logical_blocks: rank_blocks,
        total_num_kv_heads: 1,
        layers: vec![LayerInput {
            name: "attn.0".into(),
            group: 0,
            spec,
            memory,
        }],
        kv_layout: None,
    }
}

/// F.5 push prefix-cache end-trim, and out-of-range ids naming the id and the limit.
#[test]
fn f5_push_prefix_end_trim() {
    let p = RegionTable::build(&one_region_fa(10_000)).unwrap();
    let d = meta(&one_region_fa(10_000), TransferMode::Push);
    let d = [d];
    let peer = reference(&p, &d, TransferMode::Push).unwrap();
    let plan = peer.plan(&[(10..15).collect()], &[vec![500, 501]]).unwrap();
    assert_eq!(
        (
            plan.transfers[0].local_ids.clone(),
            plan.transfers[0].remote_ids.clone()
        ),
        (vec![13, 14], vec![500, 501])
    );
    let plan = peer.plan(&[vec![10, 11, 12]], &[vec![500, 501, 502]]).unwrap();
    assert_eq!(plan.transfers[0].local_ids, vec![10, 11, 12]);
    let err = peer.plan(&[vec![10_000]], &[vec![1]]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "local block id 10000 of group 0 is out of range: the pool has 10000 logical blocks"
    );
    assert!(matches!(
        peer.plan(&[], &[vec![1]]),
        Err(PlanError::GroupCount {
            got: 0,
            expected: 1,
            ..
        })
    ));
    let empty = peer.plan(&[vec![3]], &[vec![]]).unwrap();
    assert!(empty.transfers.is_empty() && empty.notify_ranks == vec![0]);
    let (c, _) = check_coalesced(&p, &d, TransferMode::Push, (&[(10..15).collect()], &[vec![500, 501]]));
    assert_eq!(c.transfers[0].local_ids.len(), 1, "13, 14 -> 500, 501 is one chunk");
    let (c, _) = check_coalesced(
        &p,
        &d,
        TransferMode::Push,
        (&[vec![10, 11, 12]], &[vec![500, 501, 502]]),
    );
    // An odd run: three plain ids (one descriptor once NIXL merges them, as the reference's).
    assert_eq!(c.transfers[0].local_ids.len(), 3);
}

/// F.8 descriptor-id vectors through a plan: per-region group routing and per-region capacities.
#[test]
fn f8_region_group_mapping_and_capacity() {
    let fa = |name: &str, group: u32, base: u64, nb: u64| LayerInput {
        name: name.into(),
        group,
        spec: small_fa_spec(),
        memory: LayerMemory {
            num_blocks: Some(nb),
            ..dense_memory(base, nb * 16, MemType::Dram)
        },
    };
    let layout = |layers| RankLayout {
        tp_rank: 0,
        tp_size: 1,
        logical_block_size: 4,
        kernel_block_size: 4,
        num_logical_blocks: 10,
        total_num_kv_heads: 1,
        layers,
        kv_layout: None,
    };
    let three = layout(vec![
        fa("a", 0, 0x1000, 10),
        fa("b", 0, 0x2000, 10),
        fa("c", 1, 0x3000, 10),
    ]);
    let (three_t, three_m) = (RegionTable::build(&three).unwrap(), [meta(&three, TransferMode::Pull)]);
    let peer = reference(&three_t, &three_m, TransferMode::Pull).unwrap();
    let plan = peer.plan(&[vec![1, 2], vec![7]], &[vec![1, 2], vec![7]]).unwrap();
    assert_eq!(plan.transfers[0].local_ids, vec![1, 2, 11, 12, 27]);
    let ids: (&[Vec<u64>], &[Vec<u64>]) = (&[vec![1, 2], vec![7]], &[vec![1, 2], vec![7]]);
    let (c, _) = check_coalesced(&three_t, &three_m, TransferMode::Pull, ids);
    assert_eq!(c.transfers[0].local_ids.len(), 3, "two 2-unit chunks and unit 27");
    let cap = layout(vec![fa("a", 0, 0x1000, 5), fa("b", 1, 0x2000, 10)]);
    let peer = PeerPlan::new(
        &RegionTable::build(&cap).unwrap(),
        &[meta(&cap, TransferMode::Pull)],
        TransferMode::Pull,
    )
    .unwrap();
    assert_eq!(
        peer.plan(&[vec![4], vec![8]], &[vec![4], vec![8]]).unwrap().transfers[0].remote_ids,
        vec![4, 13]
    );
    let err = peer
        .plan(&[vec![5], vec![8]], &[vec![4], vec![8]])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("block id 5 of group 0") && err.contains("has 5 logical blocks"),
        "{err}"
    );
}
