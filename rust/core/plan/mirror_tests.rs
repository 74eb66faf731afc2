//! A passive rank's mirror of its initiator's plan gives exactly the initiator's moves with it, in order, for
//! every rank pair of the example deployments, in both modes, coalesced or not.

use super::mirror::{table_of, Mirror};
use super::{PeerPlan, PlanError};
use crate::core::meta::TransferMode;
use crate::core::scenario::{Deployment, Scenario};
use crate::core::tp::handshake_target_ranks;

const SCENARIOS: [&str; 3] = [
    include_str!("../../../tests/data/scenarios/hybrid_mla_f2.json"),
    include_str!("../../../tests/data/scenarios/kimi_tiny_8p2d_push.json"),
    include_str!("../../../tests/data/scenarios/gqa_ssm_2p4d_pull.json"),
];

fn deployments() -> Vec<(String, Deployment)> {
    let mut out = Vec::new();
    // The GQA scenario again with decode kernel blocks of 8 tokens against 16, at decode TP 4 and 1: heads-major
    // pages cut per (head, unit), under a head split both ways.
    let variants = SCENARIOS
        .iter()
        .enumerate()
        .map(|(i, text)| (i, *text, None))
        .chain([(2, SCENARIOS[2], Some(4)), (2, SCENARIOS[2], Some(1))]);
    for (i, text, per_head) in variants {
        for mode in [TransferMode::Pull, TransferMode::Push] {
            for coalesce in [true, false] {
                let mut s = Scenario::from_json(text).unwrap();
                s.mode = mode;
                if let Some(tp) = per_head {
                    (s.decode.tp_size, s.decode.kernel_block_size) = (tp, 8);
                }
                let dep = Deployment::build_with(&s, coalesce).unwrap();
                assert_eq!(dep.peers.iter().all(|p| p.units.per_head.is_some()), per_head.is_some());
                out.push((format!("scenario {i} {per_head:?} {mode:?} coalesce={coalesce}"), dep));
            }
        }
    }
    out
}

#[test]
fn mirrors_give_the_initiators_moves_for_every_rank_pair() {
    let mut pairs = 0;
    for (name, dep) in deployments() {
        let (initiators, passives) = match dep.scenario.mode {
            TransferMode::Pull => (&dep.decode, &dep.prefill),
            TransferMode::Push => (&dep.prefill, &dep.decode),
        };
        let coalesce = dep.peers.iter().any(PeerPlan::coalesced);
        for (init, peer) in initiators.iter().zip(&dep.peers) {
            let targets =
                handshake_target_ranks(init.table.tp_rank, init.table.tp_size, passives.len() as u32).unwrap();
            for &t in &targets {
                let own = &passives[t as usize];
                let mirror = Mirror::new(&own.meta, &init.meta, coalesce).unwrap();
                assert_eq!((mirror.rank, mirror.initiator_rank), (t, init.table.tp_rank));
                for req in &dep.scenario.requests {
                    let (init_ids, own_ids) = match dep.scenario.mode {
                        TransferMode::Pull => (&req.decode, &req.prefill),
                        TransferMode::Push => (&req.prefill, &req.decode),
                    };
                    let plan = peer.plan(init_ids, own_ids).unwrap();
                    let want: Vec<[u64; 3]> = plan
                        .transfers
                        .iter()
                        .filter(|x| x.remote_rank == t)
                        .flat_map(|x| peer.moves(x).unwrap())
                        .collect();
                    let got = mirror.moves(init_ids, own_ids).unwrap();
                    assert_eq!(got, want, "{name}: request {} rank pair {t}", req.id);
                    pairs += 1;
                }
            }
        }
    }
    assert!(pairs > 50, "{pairs} rank pairs checked");
}

#[test]
fn a_rebuilt_table_plans_as_the_original() {
    for (name, dep) in deployments() {
        for rank in dep.prefill.iter().chain(&dep.decode) {
            let t = table_of(&rank.meta).unwrap();
            assert_eq!(t.regions.len(), rank.table.regions.len(), "{name}");
            for (a, b) in t.regions.iter().zip(&rank.table.regions) {
                assert_eq!(
                    (
                        &a.name,
                        a.base,
                        a.block_len,
                        a.block_stride,
                        a.num_blocks,
                        a.is_mla,
                        a.group,
                        a.has_ssm
                    ),
                    (
                        &b.name,
                        b.base,
                        b.block_len,
                        b.block_stride,
                        b.num_blocks,
                        b.is_mla,
                        b.group,
                        b.has_ssm
                    ),
                    "{name}"
                );
            }
            assert_eq!(t.geometry, rank.table.geometry, "{name}");
            assert_eq!(t.ssm_regions, rank.table.ssm_regions, "{name}");
            let (a, b) = (t.conv_split.as_ref(), rank.table.conv_split.as_ref());
            assert_eq!(
                a.map(|s| (&s.proj_bytes, s.conv_bytes, s.ssm_bytes)),
                b.map(|s| (&s.proj_bytes, s.conv_bytes, s.ssm_bytes))
            );
            assert_eq!(t.local_table(1).unwrap(), rank.table.local_table(1).unwrap(), "{name}");
        }
    }
}

#[test]
fn a_mirror_refuses_what_the_initiator_cannot_send() {
    let dep = &deployments()[0].1; // F2, pull: decode ranks initiate
    let (init, own) = (&dep.decode[0].meta, &dep.prefill[0].meta);
    // an initiator in the other mode, or one claiming far more blocks than this rank has
    let mut other = init.clone();
    other.transfer_mode = TransferMode::Push;
    assert!(Mirror::new(own, &other, true).is_err());
    let mut huge = init.clone();
    for r in &mut huge.regions {
        r.num_blocks = 1 << 40;
    }
    huge.num_blocks = 1 << 40;
    assert!(matches!(
        Mirror::new(own, &huge, true),
        Err(PlanError::OverLimit { .. })
    ));
    let mut bad = init.clone();
    bad.tp_rank = bad.tp_size;
    assert!(matches!(
        Mirror::new(own, &bad, true),
        Err(PlanError::MalformedRemote { .. })
    ));
    // ids of a request are checked as the initiator's plan checks them
    let mirror = Mirror::new(own, init, true).unwrap();
    let n = init.num_logical_blocks;
    let ids: Vec<Vec<u64>> = init.groups.iter().map(|_| vec![n]).collect();
    assert!(matches!(
        mirror.moves(&ids, &ids),
        Err(PlanError::BlockOutOfRange { .. })
    ));
}

#[test]
fn a_rank_the_initiator_does_not_cover_is_refused() {
    let mut s = Scenario::from_json(SCENARIOS[2]).unwrap(); // GQA + SSM, P TP 2 -> D TP 4
    s.mode = TransferMode::Pull;
    let dep = Deployment::build(&s).unwrap();
    // decode rank 0 (of 4) reads from prefill rank 0 (of 2) only
    assert_eq!(handshake_target_ranks(0, 4, 2).unwrap(), vec![0]);
    let err = Mirror::new(&dep.prefill[1].meta, &dep.decode[0].meta, true).unwrap_err();
    assert!(matches!(err, PlanError::RemoteRanks { .. }), "{err}");
}
