//! Scenario parsing, building and the example scenarios shipped in `tests/data/scenarios`.

use super::plan::TableKey;
use super::plan_error::PlanError;
use super::scenario::{Deployment, Scenario, ScenarioError};
use super::scenario_report::report;

const F2: &str = include_str!("../../tests/data/scenarios/hybrid_mla_f2.json");
const KIMI_PUSH: &str = include_str!("../../tests/data/scenarios/kimi_tiny_8p2d_push.json");
const GQA_PULL: &str = include_str!("../../tests/data/scenarios/gqa_ssm_2p4d_pull.json");

#[test]
fn f2_scenario_gives_the_reference_ids() {
    let dep = Deployment::build_with(&Scenario::from_json(F2).unwrap(), false).unwrap();
    let plans = dep.plan_all().unwrap();
    let t = &plans[0].plan.transfers[0];
    let mut want: Vec<i32> = vec![3, 4, 5, 15, 16, 17];
    for s in 0..8 {
        want.extend([24 + 4 * s + 2, 24 + 4 * s + 3]);
    }
    assert_eq!((t.local_table, &t.local_ids), (TableKey::Whole, &want));
    assert_eq!(
        dep.decode[0]
            .table
            .regions
            .iter()
            .map(|r| r.block_len)
            .collect::<Vec<_>>(),
        vec![48, 48]
    );
    // Coalesced (the default): MLA units 3, 4, 5 become a 2-unit chunk and unit 5, the same bytes.
    let dep_c = Deployment::build(&Scenario::from_json(F2).unwrap()).unwrap();
    let c = &dep_c.plan_all().unwrap()[0].plan.transfers[0];
    assert_eq!(c.local_ids.len(), want.len() - 2);
    assert_eq!((c.local_ids[1], c.local_ids[3], &c.local_ids[4..]), (5, 17, &want[6..]));
    let bytes = |dep: &Deployment, t| dep.peers[0].moves(t).unwrap().iter().map(|m| m[2]).sum::<u64>();
    assert_eq!(bytes(&dep_c, c), bytes(&dep, t));
}

#[test]
fn example_scenarios_plan_and_report() {
    for text in [F2, KIMI_PUSH, GQA_PULL] {
        let dep = Deployment::build(&Scenario::from_json(text).unwrap()).unwrap();
        let r = report(&dep, true).unwrap();
        assert!(r
            .requests
            .iter()
            .all(|q| q.ranks.iter().any(|k| !k.transfers.is_empty())));
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains("\"moves\":[["), "{json}");
    }
}

#[test]
fn unknown_fields_and_bad_values_are_reported() {
    let err = Scenario::from_json(&F2.replace("\"mode\"", "\"modes\""))
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown field `modes`"), "{err}");
    let err = Scenario::from_json(&F2.replace("\"kind\": \"mla\"", "\"kind\": \"mlx\""))
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown variant `mlx`"), "{err}");
    // The decode page (4 tokens of MLA = 48 bytes) cannot hold the 112-byte KDA state.
    let small = F2.replace(
        "\"decode\": {\"tp_size\": 1, \"logical_block_size\": 12",
        "\"decode\": {\"tp_size\": 1, \"logical_block_size\": 4",
    );
    let err = Deployment::build(&Scenario::from_json(&small).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("SSM state of 112 bytes does not fit the attention page of 48 bytes"),
        "{err}"
    );
    // Conv channels that do not split over TP 3.
    let tp3 = F2.replace("\"prefill\": {\"tp_size\": 1", "\"prefill\": {\"tp_size\": 3");
    let err = Deployment::build(&Scenario::from_json(&tp3).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("must all divide by prefill TP 3"), "{err}");
    // Unpairable SSM slots name both list lengths.
    let unp = F2.replace("\"decode\": [[1], [2], [3]]", "\"decode\": [[1], [0, 2, 3], [3]]");
    let err = Deployment::build(&Scenario::from_json(&unp).unwrap())
        .unwrap()
        .plan_all()
        .unwrap_err();
    assert!(matches!(
        err,
        ScenarioError::Plan {
            source: PlanError::UnpairableSsm {
                decode_len: 3,
                prefill_len: 1,
                ..
            },
            ..
        }
    ));
}

#[test]
fn heads_major_pages_with_different_kernel_blocks_are_refused_with_both_values() {
    let s = GQA_PULL.replace(
        "\"decode\": {\"tp_size\": 4, \"logical_block_size\": 16, \"kernel_block_size\": 16",
        "\"decode\": {\"tp_size\": 1, \"logical_block_size\": 16, \"kernel_block_size\": 8",
    );
    let err = Deployment::build(&Scenario::from_json(&s).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("not supported") && err.contains("local 8 / remote 16"),
        "{err}"
    );
}
