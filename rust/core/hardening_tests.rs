//! Regression tests for hostile or broken peers: each reproduces one attack on the decoder, the
//! validator or `PeerPlan`, and checks it is refused with an error naming the value and the limit, before
//! anything is allocated for it.

use super::adversary::{cases, Case};
use super::fixtures::deepseek_v3_like;
use super::handshake::{decode, encode, findings, Expected, HandshakeError};
use super::layout::RankLayout;
use super::meta::{AgentMeta, EngineInfo, TransferMode};
use super::plan::PeerPlan;
use super::plan::{PlanError, Side};
use super::region::RegionTable;
use super::tp::{handshake_target_ranks, TpMapping, MAX_TP_SIZE};

/// Kimi-shaped hybrid, decode TP 1 pulling from prefill TP 2 (valid as built).
fn kimi() -> Case {
    cases().remove(0)
}

fn checks(local: &AgentMeta, remote: &AgentMeta) -> Vec<String> {
    findings(local, remote, &Expected::default())
        .into_iter()
        .map(|f| f.check)
        .collect()
}

/// Every remote rank tells the same lie.
fn lie(case: &Case, f: impl Fn(&mut AgentMeta)) -> Vec<AgentMeta> {
    let mut remotes = case.remotes.clone();
    remotes.iter_mut().for_each(f);
    remotes
}

#[test]
fn a_tp_size_of_u32_max_is_refused_without_allocating() {
    // Before: 4 x tp_size bytes for the target list (abort at 2^32 - 1).
    let err = handshake_target_ranks(0, 1, u32::MAX).unwrap_err();
    assert_eq!(
        err,
        PlanError::OverLimit {
            what: "remote TP size".into(),
            value: u64::from(u32::MAX),
            limit: u64::from(MAX_TP_SIZE)
        }
    );
    assert!(err.to_string().contains("4294967295, over the limit of 1024"), "{err}");
    assert!(TpMapping::compute(0, 1, 1 << 28, 1, true, &[]).is_err());
    let case = kimi();
    let remote = lie(&case, |m| m.tp_size = u32::MAX).remove(0);
    assert!(checks(&case.local_meta(), &remote).contains(&"remote.tp_size".to_string()));
    let bytes = encode(&remote).unwrap();
    match decode(&bytes) {
        Err(HandshakeError::Invalid(f)) => assert!(f.iter().any(|f| f.check == "tp_size"), "{f:?}"),
        other => panic!("decoded {other:?}"),
    }
    let err = PeerPlan::new(&case.local, &lie(&case, |m| m.tp_size = u32::MAX), case.mode).unwrap_err();
    assert!(matches!(err, PlanError::MalformedRemote { .. }), "{err}");
}

#[test]
fn billions_of_remote_blocks_are_refused_before_any_row_is_built() {
    // The padded DeepSeek case: remote kernel blocks twice the local ones and stride != block_len, so the
    // remote table has one row per remote block. Before: a loop per claimed block until allocation aborted.
    let case = cases().remove(3);
    assert_eq!(case.name, "deepseek kernel 64 <- padded kernel 128");
    let built = PeerPlan::new(&case.local, &case.remotes, case.mode).unwrap();
    assert!(built.remote_tables[0].1.rows.len() >= 32, "rows per block");
    for blocks in [1u64 << 33, 1 << 30] {
        let remotes = lie(&case, |m| {
            m.num_logical_blocks = blocks;
            m.num_blocks = blocks;
            m.regions.iter_mut().for_each(|r| r.num_blocks = blocks);
            m.regions
                .iter_mut()
                .enumerate()
                .for_each(|(i, r)| r.base = (i as u64) << 58);
        });
        let err = PeerPlan::new(&case.local, &remotes, case.mode).unwrap_err();
        let text = err.to_string();
        match blocks {
            b if b > i32::MAX as u64 => assert!(text.contains("num_blocks"), "{text}"),
            _ => assert!(
                matches!(err, PlanError::OverLimit { .. }) && text.contains("kernel units advertised by remote rank 0"),
                "{text}"
            ),
        }
    }
}

#[test]
fn metadata_that_was_never_validated_is_checked_by_peer_plan() {
    let case = kimi();
    for (what, f) in [
        (
            "ppl",
            Box::new(|m: &mut AgentMeta| m.ppl = 0) as Box<dyn Fn(&mut AgentMeta)>,
        ),
        (
            "base",
            Box::new(|m: &mut AgentMeta| m.regions[1].base = u64::MAX - 4096),
        ),
        ("tp_rank", Box::new(|m: &mut AgentMeta| m.tp_rank = 7)),
    ] {
        let err = PeerPlan::new(&case.local, &lie(&case, f), case.mode).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, PlanError::MalformedRemote { .. }), "{what}: {text}");
        assert!(text.contains(what), "{what}: {text}");
    }
}

#[test]
fn an_ssm_state_larger_than_its_page_is_refused_at_the_handshake() {
    let case = kimi();
    let remote = lie(&case, |m| m.ssm_sizes.1 = m.regions[0].block_len * m.ppl).remove(0);
    let local = case.local_meta();
    let found = checks(&local, &remote);
    assert!(found.contains(&"remote.ssm_state_size".to_string()), "{found:?}");
    let text = findings(&local, &remote, &Expected::default())
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    assert!(text.contains("must fit its logical page"), "{text}");
    // The decoder lets it through, so that the validation can list it beside every other finding.
    assert!(decode(&encode(&remote).unwrap()).is_ok());
    let remotes = lie(&case, |m| m.ssm_sizes.1 = m.regions[0].block_len * m.ppl);
    assert!(PeerPlan::new(&case.local, &remotes, case.mode).is_err());
}

#[test]
fn overlapping_or_relocated_region_bases_are_refused_at_the_handshake() {
    let case = kimi();
    let local = case.local_meta();
    for shift in [0u64, 4096] {
        let remote = lie(&case, |m| m.regions[1].base = m.regions[0].base + shift).remove(0);
        let found = checks(&local, &remote);
        assert!(
            found.contains(&"remote.region_overlap".to_string()),
            "{shift}: {found:?}"
        );
        let remotes = lie(&case, |m| m.regions[1].base = m.regions[0].base + shift);
        assert!(PeerPlan::new(&case.local, &remotes, case.mode).is_err());
    }
    // Every finding is listed at once: an overlap beside a compat mismatch.
    let mut remote = lie(&case, |m| m.regions[1].base = m.regions[0].base).remove(0);
    remote.compat_hash = "beef".into();
    let found = checks(&local, &remote);
    assert!(found.contains(&"remote.region_overlap".to_string()) && found.contains(&"compat_hash".to_string()));
}

#[test]
fn a_region_smaller_than_its_ssm_states_is_refused_by_peer_plan() {
    // Found by the fuzzer: one region advertising fewer kernel blocks than the SSM states it holds made the
    // SSM rows run past it.
    let case = kimi();
    let remotes = lie(&case, |m| m.regions[0].num_blocks = 2);
    let err = PeerPlan::new(&case.local, &remotes, case.mode).unwrap_err();
    assert!(matches!(err, PlanError::OutsideAdvertised { .. }), "{err}");
    assert!(err.to_string().contains("outside the regions it advertised"), "{err}");
}

#[test]
fn duplicate_block_ids_are_refused_naming_the_id() {
    let case = kimi();
    let peer = PeerPlan::new(&case.local, &case.remotes, case.mode).unwrap();
    let ok_local = vec![vec![1, 2], vec![3], vec![4], vec![5]];
    let ok_remote = vec![vec![3, 4, 5, 6], vec![7], vec![8], vec![9]];
    assert!(peer.plan(&ok_local, &ok_remote).is_ok());
    let mut local = ok_local.clone();
    local[0] = vec![2, 1, 2];
    assert_eq!(
        peer.plan(&local, &ok_remote).unwrap_err(),
        PlanError::DuplicateBlock {
            side: Side::Local,
            group: 0,
            id: 2
        }
    );
    let mut remote = ok_remote.clone();
    remote[2] = vec![8, 8];
    let err = peer.plan(&ok_local, &remote).unwrap_err();
    assert_eq!(
        err.to_string(),
        "remote block id 8 is listed twice in group 2: a request names each block once"
    );
}

#[test]
fn one_block_id_in_two_groups_sharing_tensors_is_refused_naming_both_groups() {
    // Before this was refused: Kimi's MLA group and its KDA groups share every HMA tensor, so block 1 in groups 1,
    // 2 and 3 was planned as three overlapping destination ranges (pull and push alike).
    for case in cases().into_iter().take(2) {
        let dest = if case.mode == TransferMode::Pull {
            Side::Local
        } else {
            Side::Remote
        };
        let peer = PeerPlan::new(&case.local, &case.remotes, case.mode).unwrap();
        let (local, remote) = (
            vec![vec![1, 2], vec![3], vec![4], vec![5]],
            vec![vec![3, 4, 5, 6], vec![7], vec![8], vec![9]],
        );
        assert!(peer.plan(&local, &remote).is_ok());
        let mut l = local.clone();
        (l[1], l[2], l[3]) = (vec![1], vec![1], vec![1]);
        let mut r = remote.clone();
        r[3] = vec![4]; // an SSM state in the attention group's block 4
        let (bad_l, bad_r) = if dest == Side::Local {
            (&l, &remote)
        } else {
            (&local, &r)
        };
        let err = peer.plan(bad_l, bad_r).unwrap_err();
        let want = if dest == Side::Local {
            PlanError::SharedBlock {
                side: Side::Local,
                id: 1,
                groups: (0, 1),
            }
        } else {
            PlanError::SharedBlock {
                side: Side::Remote,
                id: 4,
                groups: (0, 3),
            }
        };
        assert_eq!(err, want, "{}", case.name);
        // The source side is refused too: a request naming one block in two groups is malformed either way.
        let (src_l, src_r) = if dest == Side::Local {
            (&local, &r)
        } else {
            (&l, &remote)
        };
        assert!(matches!(
            peer.plan(src_l, src_r).unwrap_err(),
            PlanError::SharedBlock { .. }
        ));
    }
    let peer = {
        let case = kimi();
        PeerPlan::new(&case.local, &case.remotes, case.mode).unwrap()
    };
    let err = peer
        .plan(
            &[vec![1, 2], vec![3], vec![3], vec![5]],
            &[vec![3, 4, 5, 6], vec![7], vec![8], vec![9]],
        )
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "local block id 3 is listed in groups 1 and 2, which share KV-cache tensors: a request names each block once"
    );
}

#[test]
fn groups_on_disjoint_tensors_may_reuse_an_id() {
    // Two MLA groups, each on its own tensors (no region shared): block 0 of each group is different memory,
    // so one id in both moves disjoint bytes and is planned.
    let two_groups = |mut l: RankLayout| {
        l.layers[1].group = 1;
        l
    };
    let local = RegionTable::build(&two_groups(deepseek_v3_like(2, 64))).unwrap();
    let remote = two_groups(deepseek_v3_like(2, 64));
    let mut remote_table = RegionTable::build(&remote).unwrap();
    for r in &mut remote_table.regions {
        r.base += 1 << 40;
    }
    let info = EngineInfo {
        engine_id: "peer".into(),
        agent_metadata: Vec::new(),
        kv_layout: "HND".into(),
        attn_backend: "test".into(),
        transfer_mode: TransferMode::Pull,
        compat_hash: String::new(),
        prefix_caching: false,
    };
    let meta = AgentMeta::from_table(&remote_table, &info);
    let peer = PeerPlan::new(&local, &[meta], TransferMode::Pull).unwrap();
    let plan = peer.plan(&[vec![0, 1], vec![0, 1]], &[vec![5, 6], vec![5, 6]]).unwrap();
    let mut dest: Vec<[u64; 2]> = (0..plan.transfers.len())
        .flat_map(|i| plan.moves(&peer, i).unwrap())
        .map(|[l, _, n]| [l, l + n])
        .collect();
    dest.sort_unstable();
    assert_eq!(dest.len(), 2, "{dest:?}");
    assert!(dest.windows(2).all(|w| w[0][1] <= w[1][0]), "{dest:?}");
}

/// Destination byte ranges `[start, end)` of a plan, per destination memory (pull: the local rank's; push: each
/// remote rank's), sorted.
fn destinations(peer: &PeerPlan, plan: &super::plan::Plan, mode: TransferMode) -> Vec<(u32, u64, u64)> {
    let mut out: Vec<(u32, u64, u64)> = Vec::new();
    for (i, t) in plan.transfers.iter().enumerate() {
        for [l, r, n] in plan.moves(peer, i).unwrap() {
            out.push(match mode {
                TransferMode::Pull => (u32::MAX, l, l + n),
                TransferMode::Push => (t.remote_rank, r, r + n),
            });
        }
    }
    out.sort_unstable();
    out
}

mod shared_ids {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

        /// Requests whose ids are drawn from a tiny pool, so one id often lands in several groups: whatever is
        /// planned never writes a destination byte twice, and an id shared by two groups sharing tensors is
        /// refused as `SharedBlock` (every fixture case, pull and push, coalesced or not).
        #[test]
        fn no_plan_writes_a_destination_byte_twice(
            case in 0usize..4,
            coalesce in any::<bool>(),
            local in prop::collection::vec(prop::collection::vec(0u64..6, 0..4), 4),
            remote in prop::collection::vec(prop::collection::vec(0u64..6, 0..4), 4),
        ) {
            let case = cases().swap_remove(case);
            let peer = PeerPlan::with_coalescing(&case.local, &case.remotes, case.mode, coalesce).unwrap();
            let n = case.local.groups.len();
            let (mut local, mut remote) = (local, remote);
            local.truncate(n);
            remote.truncate(n);
            match peer.plan(&local, &remote) {
                Ok(plan) => {
                    let dest = destinations(&peer, &plan, case.mode);
                    for w in dest.windows(2) {
                        prop_assert!(w[0].0 != w[1].0 || w[0].2 <= w[1].1, "{}: {w:?} overlap", case.name);
                    }
                }
                Err(PlanError::SharedBlock { side, id, groups: (g, h) }) => {
                    let ids = if side == Side::Local { &local } else { &remote };
                    prop_assert!(g < h && ids[g].contains(&id) && ids[h].contains(&id));
                }
                Err(_) => {}
            }
        }
    }
}

#[test]
fn a_heads_major_page_a_few_bytes_longer_than_its_cells_is_refused() {
    // Found by the fuzz campaign: a push into heads-major pages cut per (head, unit) against a remote whose page
    // claims 8 bytes more than its 16 tokens x 8 heads of 32-byte cells. Its pieces were 513 bytes against the
    // local 512 (a plan whose pairs differ in length); now the page is refused, naming both sides' bytes.
    let case = cases()
        .into_iter()
        .find(|c| c.name.starts_with("gqa heads-major kernel 32"))
        .unwrap();
    let remotes = lie(&case, |m| {
        m.regions[1].block_len += 8;
        m.regions[1].block_stride = 1 << 20; // far apart, so that the regions stay apart
    });
    let err = PeerPlan::new(&case.local, &remotes, case.mode).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("kernel page of region") && text.contains("local 4096") && text.contains("remote 4104"),
        "{text}"
    );
}

#[test]
fn hktv_k_rows_a_peer_lies_about_are_refused() {
    // A peer of HKTV pages sizes every head's parts by its K rows: too many would make millions of rows per
    // region, a different count would cut the pages at other bytes. Both are refused before any row is built.
    let case = cases().into_iter().find(|c| c.name.starts_with("gqa HKTV")).unwrap();
    assert_eq!(case.local.k_rows, 8);
    let huge = lie(&case, |m| m.k_rows = 1 << 40);
    match decode(&encode(&huge[0]).unwrap()) {
        Err(HandshakeError::Invalid(f)) => assert!(
            f.iter()
                .any(|f| f.check == "k_rows" && f.to_string().contains("1099511627776")),
            "{f:?}"
        ),
        other => panic!("decoded {other:?}"),
    }
    assert!(PeerPlan::new(&case.local, &huge, case.mode).is_err());
    let other = lie(&case, |m| m.k_rows = 4);
    assert!(checks(&case.local_meta(), &other[0]).contains(&"k_rows".to_string()));
    let err = PeerPlan::new(&case.local, &other, case.mode).unwrap_err().to_string();
    assert!(
        err.contains("K rows of HKTV pages") && err.contains("local 8") && err.contains("remote 4"),
        "{err}"
    );
    // HKTV without K rows, or K rows on another layout, is malformed
    for m in [lie(&case, |m| m.k_rows = 0), lie(&case, |m| m.kv_layout = "HND".into())] {
        assert!(matches!(
            decode(&encode(&m[0]).unwrap()),
            Err(HandshakeError::Invalid(_))
        ));
    }
}
