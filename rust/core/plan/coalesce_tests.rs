//! Coalesced chunk rows through whole deployments: fewer ids for contiguous requests, the same bytes as the
//! reference plans, single ids where nothing is contiguous, and chunk rows only for dense attention rows.

use super::tests::canonical;
use super::PeerPlan;
use crate::core::coalesce::MAX_CHUNK_LOG2;
use crate::core::descs::DescTable;
use crate::core::scenario::{Deployment, Scenario};

/// MLA + SSM tensors, pull at TP 1 -> 1 (200 blocks each side), one request of one block per group.
fn mla_ssm_pull_tp1(tensors: &[&[&str]]) -> Scenario {
    scenario(
        &["mla", "ssm"],
        tensors,
        (1, 200),
        (1, 200),
        "pull",
        ("[[7], [9]]", "[[8], [10]]"),
    )
}

/// A scenario of `tensors` tensors of the given layers (`"mla"`, `"gqa"`, `"ssm"`), groups in `kinds` order.
fn scenario(
    kinds: &[&str],
    tensors: &[&[&str]],
    p: (u32, u64),
    d: (u32, u64),
    mode: &str,
    req: (&str, &str),
) -> Scenario {
    let group = |l: &str| kinds.iter().position(|k| *k == l).unwrap();
    let groups: Vec<&str> = kinds
        .iter()
        .map(|k| match *k {
            "mla" => r#"{"kind": "mla", "head_size": 576, "dtype_bytes": 2}"#,
            "gqa" => r#"{"kind": "attention", "num_kv_heads": 4, "head_size": 2, "dtype_bytes": 2}"#,
            _ => {
                r#"{"kind": "ssm", "mamba": "mamba2", "conv_dim": 24, "conv_rows": 3, "conv_dtype_bytes": 2,
                    "temporal_shape": [8, 1, 2], "temporal_dtype_bytes": 4}"#
            }
        })
        .collect();
    let tensors: Vec<String> = tensors
        .iter()
        .enumerate()
        .map(|(i, ls)| {
            let layers: Vec<String> = ls
                .iter()
                .map(|l| format!(r#"{{"name": "layers.{i}.{l}", "group": {}}}"#, group(l)))
                .collect();
            format!(r#"{{"layers": [{}]}}"#, layers.join(", "))
        })
        .collect();
    let json = format!(
        r#"{{
  "model": {{
    "groups": [{}],
    "tensors": [{}]
  }},
  "prefill": {{"tp_size": {}, "logical_block_size": 64, "kernel_block_size": 64, "num_blocks": {}}},
  "decode": {{"tp_size": {}, "logical_block_size": 64, "kernel_block_size": 64, "num_blocks": {}}},
  "mode": "{mode}",
  "requests": [{{"id": "r", "prefill": {}, "decode": {}}}]
}}"#,
        groups.join(", "),
        tensors.join(", "),
        p.0,
        p.1,
        d.0,
        d.1,
        req.0,
        req.1
    );
    Scenario::from_json(&json).unwrap()
}

/// DeepSeek-V3-like: 61 dense MLA tensors, `blocks` logical blocks of 64 tokens, P TP 8 -> D TP 16 pull.
fn deepseek(blocks: u64, prefill: &[u64], decode: &[u64]) -> Scenario {
    let tensors: Vec<&[&str]> = vec![&["mla"]; 61];
    let mut s = scenario(&["mla"], &tensors, (8, blocks), (16, blocks), "pull", ("[[]]", "[[]]"));
    s.requests[0].prefill = vec![prefill.to_vec()];
    s.requests[0].decode = vec![decode.to_vec()];
    s
}

fn tables(p: &PeerPlan) -> impl Iterator<Item = &DescTable> {
    p.local_tables
        .iter()
        .map(|(_, t)| &**t)
        .chain(p.remote_tables.iter().map(|(_, t)| t))
}

/// Every rank's coalesced plan moves exactly the reference plan's bytes; returns local rank 0's (coalesced,
/// reference) id pair counts.
fn compare(s: &Scenario) -> (usize, usize) {
    let (c, r) = (Deployment::build(s).unwrap(), Deployment::build_with(s, false).unwrap());
    let (pc, pr) = (c.plan_all().unwrap(), r.plan_all().unwrap());
    let (mut nc, mut nr) = (0, 0);
    for (a, b) in pc.iter().zip(&pr) {
        let (peer_c, peer_r) = (&c.peers[a.local_rank as usize], &r.peers[b.local_rank as usize]);
        assert_eq!(a.plan.transfers.len(), b.plan.transfers.len());
        for (i, (tc, tr)) in a.plan.transfers.iter().zip(&b.plan.transfers).enumerate() {
            assert_eq!((tc.remote_rank, tc.local_table), (tr.remote_rank, tr.local_table));
            assert_eq!(tc.local_ids.len(), tc.remote_ids.len());
            let (mc, mr) = (a.plan.moves(peer_c, i).unwrap(), b.plan.moves(peer_r, i).unwrap());
            let sum = |m: &[[u64; 3]]| m.iter().map(|m| m[2]).sum::<u64>();
            assert_eq!(sum(&mc), sum(&mr));
            // Same union of local and of remote byte ranges, paired the same way.
            assert_eq!(canonical(mc), canonical(mr));
            if a.local_rank == 0 {
                nc += tc.local_ids.len();
                nr += tr.local_ids.len();
            }
        }
    }
    for (peer_c, peer_r) in c.peers.iter().zip(&r.peers) {
        check_tables(peer_c, peer_r);
    }
    (nc, nr)
}

/// Coalesced tables are the reference tables plus chunk rows, each a run of `2^j` units (`1 <= j <= J`) of a
/// dense attention row of the reference table, then whole-state rows, each joining one SSM region's piece
/// rows; every row has `len <= stride`.
fn check_tables(c: &PeerPlan, r: &PeerPlan) {
    for (tc, tr) in tables(c).zip(tables(r)) {
        assert!(tc.rows.iter().all(|x| x.len <= x.stride), "{:?}", tc.rows);
        assert_eq!((&tc.rows[..tr.rows.len()], tc.num_fa), (&tr.rows[..], tr.num_fa));
        let attention: Vec<_> = tr
            .rows
            .iter()
            .zip(tr.row_starts())
            .filter(|(_, &s)| s < tr.num_fa)
            .map(|(u, _)| *u)
            .collect();
        let pieces: Vec<_> = tr
            .rows
            .iter()
            .zip(tr.row_starts())
            .filter(|(_, &s)| s >= tr.num_fa)
            .map(|(p, _)| *p)
            .collect();
        for x in &tc.rows[tr.rows.len()..] {
            if let Some(first) = pieces.iter().position(|p| p.addr == x.addr && p.len < x.len) {
                // A whole-state row: the region's pieces from `first` on, adjacent, summing to its length.
                let mut end = x.addr;
                for p in &pieces[first..] {
                    if p.addr != end || end >= x.addr + x.len {
                        break;
                    }
                    assert_eq!((p.stride, p.count, p.device), (x.stride, x.count, x.device));
                    end += p.len;
                }
                assert_eq!(end, x.addr + x.len, "state row {x:?} is not its pieces joined");
                continue;
            }
            let unit = attention.iter().find(|u| {
                u.len == u.stride && x.addr >= u.addr && x.addr + x.stride * x.count <= u.addr + u.len * u.count
            });
            let u = unit.unwrap_or_else(|| panic!("chunk row {x:?} lies in no dense attention row"));
            let k = x.len / u.len;
            assert!(
                x.len == x.stride
                    && x.len % u.len == 0
                    && k.is_power_of_two()
                    && (2..=1 << MAX_CHUNK_LOG2).contains(&k)
            );
            assert_eq!((x.addr - u.addr) % u.len, 0);
        }
    }
}

#[test]
fn deepseek_v3_128k_contiguous_request_is_a_few_chunks() {
    let s = deepseek(4096, &(100..2148).collect::<Vec<_>>(), &(107..2155).collect::<Vec<_>>());
    let (nc, nr) = compare(&s);
    assert_eq!(nr, 61 * 2048);
    assert!(nc <= 61 * 2048usize.div_ceil(1 << MAX_CHUNK_LOG2) + 61, "{nc} id pairs");
    let dep = Deployment::build(&s).unwrap();
    assert!(dep.peers[0].coalesced());
    assert_eq!(dep.peers[0].local_tables[0].1.rows.len(), 61 * 127);
}

#[test]
fn peer_plans_of_one_rank_share_its_chunked_base_table() {
    let s = deepseek(256, &[1, 2, 3], &[4, 5, 6]);
    let dep = Deployment::build(&s).unwrap();
    let local = &dep.decode[0].table;
    let ranks: Vec<u32> = dep.peers[0].remote_tables.iter().map(|(r, _)| *r).collect();
    let remotes: Vec<_> = ranks.iter().map(|&r| dep.prefill[r as usize].meta.clone()).collect();
    let a = PeerPlan::new(local, &remotes, crate::core::meta::TransferMode::Pull).unwrap();
    let b = PeerPlan::new(local, &remotes, crate::core::meta::TransferMode::Pull).unwrap();
    assert!(
        std::sync::Arc::ptr_eq(&a.local_tables[0].1, &b.local_tables[0].1),
        "built once per rank"
    );
    assert_eq!(*a.local_tables[0].1, local.coalesced_local_table(1).unwrap());
    // A fresh rank (no cache) plans exactly the same tables.
    let fresh = PeerPlan::new(&local.clone(), &remotes, crate::core::meta::TransferMode::Pull).unwrap();
    assert!(!std::sync::Arc::ptr_eq(&a.local_tables[0].1, &fresh.local_tables[0].1));
    assert!(tables(&a).eq(tables(&fresh)));
}

#[test]
fn hybrid_plans_of_one_rank_share_their_base_table_with_state_rows() {
    // MLA + SSM at equal TP: the base table gets chunk rows and whole-state rows; every plan of the rank holds
    // that one table (its rows copied out and prepped once), equal to coalesced_local_table.
    let tensors: &[&[&str]] = &[&["mla", "ssm"], &["mla", "ssm"]];
    let s = mla_ssm_pull_tp1(tensors);
    let dep = Deployment::build(&s).unwrap();
    let local = &dep.decode[0].table;
    let remotes = vec![dep.prefill[0].meta.clone()];
    let pull = crate::core::meta::TransferMode::Pull;
    let a = PeerPlan::new(local, &remotes, pull).unwrap();
    let b = PeerPlan::new(local, &remotes, pull).unwrap();
    let base = &a.local_tables[0].1;
    assert!(
        std::sync::Arc::ptr_eq(base, &b.local_tables[0].1),
        "built once per rank"
    );
    assert_eq!(**base, local.coalesced_local_table(1).unwrap());
    assert!(
        base.rows.len() > local.local_table(1).unwrap().rows.len() + 2,
        "chunk and state rows"
    );
    let fresh = PeerPlan::new(&local.clone(), &remotes, pull).unwrap();
    assert!(!std::sync::Arc::ptr_eq(base, &fresh.local_tables[0].1));
    assert!(tables(&a).eq(tables(&fresh)));
    let ids = (vec![vec![7], vec![9]], vec![vec![8], vec![10]]);
    assert_eq!(a.plan(&ids.0, &ids.1).unwrap(), fresh.plan(&ids.0, &ids.1).unwrap());
}

#[test]
fn fragmented_requests_fall_back_to_single_ids() {
    let even: Vec<u64> = (0..64).map(|i| 2 * i).collect();
    let run: Vec<u64> = (300..364).collect();
    // Neither side consecutive, or only one side consecutive: one id per unit, exactly the reference ids.
    for (p, d) in [(&even, &even), (&even, &run), (&run, &even)] {
        let s = deepseek(512, p, d);
        let (c, r) = (
            Deployment::build(&s).unwrap(),
            Deployment::build_with(&s, false).unwrap(),
        );
        assert!(c.peers[0].coalesced());
        assert_eq!(c.plan_all().unwrap()[0].plan, r.plan_all().unwrap()[0].plan);
        compare(&s);
    }
    // Mixed: a run of 4 both sides then a gap: one 4-unit chunk and a single per region.
    let s = deepseek(512, &[10, 11, 12, 13, 20], &[40, 41, 42, 43, 46]);
    let (nc, nr) = compare(&s);
    assert_eq!((nc, nr), (61 * 2, 61 * 5));
    // A run of odd length (5) stays five plain ids, which NIXL merges into one descriptor as it does the
    // reference's: chunks of 4 + 1 would post two.
    let s = deepseek(512, &[10, 11, 12, 13, 14, 20], &[40, 41, 42, 43, 44, 46]);
    let (nc, nr) = compare(&s);
    assert_eq!((nc, nr), (61 * 6, 61 * 6));
    // Mostly fragmented (one adjacent pair in eight units saves less than a quarter of the ids): the plain id
    // path, exactly the reference ids.
    let s = deepseek(
        512,
        &[10, 11, 20, 30, 40, 50, 60, 70],
        &[40, 41, 50, 60, 70, 80, 90, 99],
    );
    let (c, r) = (
        Deployment::build(&s).unwrap(),
        Deployment::build_with(&s, false).unwrap(),
    );
    assert_eq!(c.plan_all().unwrap()[0].plan, r.plan_all().unwrap()[0].plan);
}

#[test]
fn no_chunk_rows_for_head_sharded_or_ssm_rows() {
    let req = ("[[1, 2, 3, 4], [7]]", "[[5, 6, 7, 8], [9]]");
    // Dense attention tensors and separate SSM tensors. GQA: push P1 -> D2 cuts heads (split tables), pull
    // D2 <- P1 reads head slices, P2 -> D1 pull splits; equal TP keeps GQA whole. MLA (with SSM, so P < D
    // gives split tables too) stays whole, replicated, everywhere.
    for attn in ["gqa", "mla"] {
        let tensors: &[&[&str]] = &[&[attn], &["ssm"], &[attn], &["ssm"]];
        for (p, d, mode) in [
            (1, 2, "push"),
            (1, 2, "pull"),
            (2, 1, "pull"),
            (2, 1, "push"),
            (2, 2, "pull"),
        ] {
            let s = scenario(&[attn, "ssm"], tensors, (p, 200), (d, 200), mode, req);
            let (c, r) = (
                Deployment::build(&s).unwrap(),
                Deployment::build_with(&s, false).unwrap(),
            );
            let whole = attn == "mla" || p == d;
            let locals = if mode == "pull" { &c.decode } else { &c.prefill };
            for (i, (pc, pr)) in c.peers.iter().zip(&r.peers).enumerate() {
                let attention = pc.attention_ranks();
                assert_eq!(
                    pc.coalesced(),
                    whole && !attention.is_empty(),
                    "{attn} P{p} D{d} {mode}"
                );
                // The base table depends on the local rank alone: chunk rows for both dense attention regions, a
                // whole-state row for both SSM regions.
                let base = &*pc.local_tables[0].1;
                assert_eq!(base, &locals[i].table.coalesced_local_table(1).unwrap());
                assert_eq!(base.rows.len() - pr.local_tables[0].1.rows.len(), 2 * 126 + 2);
                // Split tables: 126 chunk rows per attention region when it is kept whole, else none.
                let splits = pc.local_tables.iter().zip(&pr.local_tables).skip(1);
                for ((_, tc), (_, tr)) in splits {
                    let added = tc.rows.len() - tr.rows.len();
                    let want = if whole && !attention.is_empty() { 2 * 126 } else { 0 };
                    assert_eq!(added, want, "{attn} P{p} D{d} {mode}");
                }
                // Remote tables: the same, for the ranks attention is exchanged with (SSM-only ranks get none),
                // and with equal TP a whole-state row for both SSM regions.
                for ((rank, tc), (_, tr)) in pc.remote_tables.iter().zip(&pr.remote_tables) {
                    let added = tc.rows.len() - tr.rows.len();
                    let chunks = if whole && attention.contains(rank) { 2 * 126 } else { 0 };
                    let want = chunks + if p == d { 2 } else { 0 };
                    assert_eq!(added, want, "{attn} P{p} D{d} {mode} remote rank {rank}");
                }
            }
            let (nc, nr) = compare(&s);
            assert_eq!(nc < nr, whole);
        }
    }
}

/// Descriptors NIXL posts for `ids` after its merge: a pair continues the previous one when both its ids are
/// the next index in the same dense row (`len == stride`) of their table (`make_prepped_xfer`).
fn nixl_merged(local: &DescTable, remote: &DescTable, local_ids: &[i32], remote_ids: &[i32]) -> usize {
    let dense_row = |t: &DescTable, id: i32| {
        let i = t.row_starts().partition_point(|&s| s <= id as u64) - 1;
        (t.rows[i].len == t.rows[i].stride).then_some(i)
    };
    let mut posted = 0;
    let mut prev: Option<(i32, i32, usize, usize)> = None;
    for (&l, &r) in local_ids.iter().zip(remote_ids) {
        let rows = dense_row(local, l).zip(dense_row(remote, r));
        let merges = matches!((prev, rows), (Some((pl, pr, a, b)), Some((c, d))) if l == pl + 1 && r == pr + 1 && a == c && b == d);
        if !merges {
            posted += 1;
        }
        prev = rows.map(|(a, b)| (l, r, a, b));
    }
    posted
}

/// Every transfer of every posting rank: descriptors NIXL posts after merging, coalesced and reference.
fn merged_counts(s: &Scenario) -> (usize, usize) {
    let (c, r) = (Deployment::build(s).unwrap(), Deployment::build_with(s, false).unwrap());
    let (pc, pr) = (c.plan_all().unwrap(), r.plan_all().unwrap());
    let count = |dep: &Deployment, plans: &[crate::core::scenario::RankPlan]| -> usize {
        plans
            .iter()
            .flat_map(|p| p.plan.transfers.iter().map(move |t| (p.local_rank, t)))
            .map(|(rank, t)| {
                let peer = &dep.peers[rank as usize];
                let (lt, rt) = (
                    peer.local_table(t.local_table).unwrap(),
                    peer.remote_table(t.remote_rank).unwrap(),
                );
                nixl_merged(lt, rt, &t.local_ids, &t.remote_ids)
            })
            .sum()
    };
    (count(&c, &pc), count(&r, &pr))
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
    /// Coalescing never makes NIXL post more descriptors than the reference ids do after NIXL's own merge,
    /// for MLA, GQA and SSM groups, equal and different TP, pull and push, contiguous and fragmented requests.
    #[test]
    fn coalesced_plans_never_post_more_descriptors_than_the_merged_reference(
        attn in proptest::sample::select(vec!["mla", "gqa"]),
        tp in proptest::sample::select(vec![(1u32, 1u32), (2, 1), (1, 2), (2, 2)]),
        push in proptest::bool::ANY,
        runs in proptest::collection::vec((1u64..9, 0u64..3), 1..6),
    ) {
        // Runs of consecutive blocks separated by gaps of 0-2 blocks, the same on both sides but shifted.
        let mut ids = Vec::new();
        let mut next = 3;
        for (len, gap) in runs {
            ids.extend(next..next + len);
            next += len + gap;
        }
        let shifted: Vec<u64> = ids.iter().map(|b| b + 5).collect();
        let req = (format!("[{ids:?}, [{}]]", ids[0]), format!("[{shifted:?}, [{}]]", shifted[0]));
        let tensors: &[&[&str]] = &[&[attn], &["ssm"], &[attn], &["ssm"]];
        let mode = if push { "push" } else { "pull" };
        let s = scenario(&[attn, "ssm"], tensors, (tp.0, 200), (tp.1, 200), mode, (&req.0, &req.1));
        let (coalesced, reference) = merged_counts(&s);
        proptest::prop_assert!(coalesced <= reference, "{coalesced} > {reference} for {req:?} {tp:?} {mode}");
    }
}

#[test]
fn equal_tp_ssm_states_post_one_descriptor_each() {
    // MLA + SSM, TP 1 -> 1: one block per request and group: 2 regions x (1 MLA run + 1 state) = 4 after the
    // merge, against 2 x (1 + 4 pieces) = 10 for the reference.
    let tensors: &[&[&str]] = &[&["mla"], &["ssm"], &["mla"], &["ssm"]];
    let s = mla_ssm_pull_tp1(tensors);
    assert_eq!(merged_counts(&s), (4, 10));
}
