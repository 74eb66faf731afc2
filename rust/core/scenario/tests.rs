//! Scenario parsing, building and the example scenarios shipped in `tests/data/scenarios`.

use super::report::report;
use super::{Deployment, Scenario, ScenarioError};
use crate::core::plan::PlanError;
use crate::core::plan::TableKey;

const F2: &str = include_str!("../../../tests/data/scenarios/hybrid_mla_f2.json");
const KIMI_PUSH: &str = include_str!("../../../tests/data/scenarios/kimi_tiny_8p2d_push.json");
const GQA_PULL: &str = include_str!("../../../tests/data/scenarios/gqa_ssm_2p4d_pull.json");

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
    // Coalesced (the default): MLA units 3, 4, 5 are an odd run, so they keep their plain ids (one descriptor
    // once NIXL merges them, as in the reference); each KDA state (equal TP) is one whole-state id instead of
    // four pieces. The same bytes.
    let dep_c = Deployment::build(&Scenario::from_json(F2).unwrap()).unwrap();
    let c = &dep_c.plan_all().unwrap()[0].plan.transfers[0];
    assert_eq!((&c.local_ids[..6], c.local_ids.len()), (&want[..6], 6 + 2 * 2));
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
    let unp = F2.replace("\"decode\": [[1], [2], [3]]", "\"decode\": [[1], [0, 2, 3], []]");
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
fn heads_major_pages_with_different_kernel_blocks_are_planned_per_head() {
    let s = GQA_PULL.replace(
        "\"decode\": {\"tp_size\": 4, \"logical_block_size\": 16, \"kernel_block_size\": 16",
        "\"decode\": {\"tp_size\": 1, \"logical_block_size\": 16, \"kernel_block_size\": 8",
    );
    let dep = Deployment::build(&Scenario::from_json(&s).unwrap()).unwrap();
    let plans = dep.plan_all().unwrap();
    assert!(plans.iter().any(|p| !p.plan.transfers.is_empty()));
    assert!(
        dep.peers.iter().all(|p| p.units.per_head.is_some()),
        "{:?}",
        dep.peers[0].units
    );
}

/// F2 with `edit` applied to its JSON value.
fn f2_edited(edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let mut v: serde_json::Value = serde_json::from_str(F2).unwrap();
    edit(&mut v);
    v.to_string()
}

/// The error `Scenario::from_json` gives for `text`, as one line.
fn parse_error(text: &str) -> String {
    let err = Scenario::from_json(text).unwrap_err().to_string();
    assert!(!err.contains('\n'), "{err}");
    err
}

fn assert_names(err: &str, needles: &[&str]) {
    for n in needles {
        assert!(err.contains(n), "{n:?} not in {err:?}");
    }
}

#[test]
fn engine_counts_over_their_bounds_are_refused_when_parsed_naming_field_value_and_limit() {
    let cases: [(&str, &str, u64, &str); 6] = [
        ("prefill", "tp_size", u64::from(u32::MAX), "1024"),
        ("decode", "tp_size", 1025, "1024"),
        ("decode", "num_blocks", 1 << 40, "2147483647"),
        ("prefill", "num_blocks", u64::MAX, "2147483647"),
        ("prefill", "logical_block_size", 1 << 21, "1048576"),
        ("decode", "kernel_block_size", 1 << 40, "1048576"),
    ];
    for (side, field, value, limit) in cases {
        let text = f2_edited(|v| v[side][field] = value.into());
        let err = parse_error(&text);
        assert_names(&err, &[&format!("{side}.{field}"), &value.to_string(), limit]);
    }
}

#[test]
fn zero_sizes_name_their_field() {
    let cases: [(&str, usize, &str); 6] = [
        ("prefill", 0, "tp_size"),
        ("decode", 0, "num_blocks"),
        ("decode", 0, "kernel_block_size"),
        ("model", 0, "dtype_bytes"),
        ("model", 0, "head_size"),
        ("model", 1, "conv_rows"),
    ];
    for (part, group, field) in cases {
        let text = f2_edited(|v| match part {
            "model" => v["model"]["groups"][group][field] = 0.into(),
            side => v[side][field] = 0.into(),
        });
        let err = parse_error(&text);
        let name = if part == "model" {
            format!("model.groups[{group}].{field}")
        } else {
            format!("{part}.{field}")
        };
        assert_names(&err, &[&name, "must be positive, got 0"]);
    }
    let text = f2_edited(|v| v["model"]["groups"][1]["temporal_shape"] = serde_json::json!([1, 0, 4]));
    assert_names(&parse_error(&text), &["model.groups[1].temporal_shape[1]", "got 0"]);
}

#[test]
fn attention_head_size_v_of_zero_is_a_k_or_v_alone_tensor() {
    let text = GQA_PULL.replace("\"head_size\": 2,", "\"head_size\": 2, \"head_size_v\": 0,");
    assert_ne!(
        text, GQA_PULL,
        "the GQA example has an attention group with head_size 2"
    );
    let s: Scenario = serde_json::from_str(&text).unwrap();
    assert!(Deployment::build(&s).is_ok());
}

#[test]
fn model_and_request_counts_over_their_bounds_are_refused() {
    // More groups than MAX_GROUPS.
    let text = f2_edited(|v| {
        let g = v["model"]["groups"][0].clone();
        v["model"]["groups"] = serde_json::Value::Array(vec![g; 257]);
    });
    assert_names(&parse_error(&text), &["model.groups", "257", "256"]);
    // More layers than MAX_LAYERS (one tensor each).
    let text = f2_edited(|v| {
        let t: Vec<serde_json::Value> = (0..4097)
            .map(|i| serde_json::json!({"layers": [{"name": format!("mla.{i}"), "group": 0}]}))
            .collect();
        v["model"]["tensors"] = t.into();
    });
    assert_names(&parse_error(&text), &["model.tensors", "4097", "4096"]);
    // TP x layers over MAX_RANK_LAYERS: 1024 ranks of 6 layers each is fine, 1024 x 65 is not.
    let text = f2_edited(|v| {
        let t: Vec<serde_json::Value> = (0..65)
            .map(|i| serde_json::json!({"layers": [{"name": format!("mla.{i}"), "group": 0}]}))
            .collect();
        v["model"]["tensors"] = t.into();
        v["decode"]["tp_size"] = 1024.into();
    });
    assert_names(&parse_error(&text), &["decode.tp_size", "1024", "65", "66560", "65536"]);
    // A layer name longer than MAX_NAME_CHARS.
    let text = f2_edited(|v| v["model"]["tensors"][1]["layers"][2]["name"] = "x".repeat(257).into());
    assert_names(&parse_error(&text), &["model.tensors[1].layers[2].name", "257", "256"]);
    // Temporal shapes of more than MAX_TEMPORAL_DIMS dims.
    let text =
        f2_edited(|v| v["model"]["groups"][2]["temporal_shape"] = serde_json::json!([1, 4, 4, 1, 1, 1, 1, 1, 1]));
    assert_names(&parse_error(&text), &["model.groups[2].temporal_shape", "9", "8"]);
    // More requests than MAX_REQUESTS.
    let text = f2_edited(|v| {
        let r = v["requests"][0].clone();
        v["requests"] = serde_json::Value::Array(vec![r; 65537]);
    });
    assert_names(&parse_error(&text), &["requests", "65537", "65536"]);
    // Requests x local ranks over MAX_RANK_PLANS (pull: decode ranks plan; push: prefill ranks).
    let many = |mode: &'static str| {
        f2_edited(|v| {
            let r = v["requests"][0].clone();
            v["requests"] = serde_json::Value::Array(vec![r; 129]);
            v["decode"]["tp_size"] = 512.into();
            v["mode"] = mode.into();
        })
    };
    assert_names(
        &parse_error(&many("pull")),
        &["requests x decode.tp_size (129 x 512)", "66048", "65536"],
    );
    assert!(
        Scenario::from_json(&many("push")).is_ok(),
        "push: one prefill rank plans"
    );
    // Block ids of all requests x local ranks over MAX_PLANNED_IDS: 2^19 + 2 ids a side on 16 decode ranks.
    let text = f2_edited(|v| {
        let big = serde_json::Value::Array((0..(1u64 << 19)).map(Into::into).collect());
        v["requests"][0]["prefill"] = serde_json::json!([big.clone(), [2], [3]]);
        v["requests"][0]["decode"] = serde_json::json!([big, [2], [3]]);
        v["decode"]["tp_size"] = 16.into();
    });
    assert_names(
        &parse_error(&text),
        &[
            "block ids of all requests x decode.tp_size (1048580 x 16)",
            "16777280",
            "16777216",
        ],
    );
    // More ids in one request than MAX_IDS_PER_REQUEST (2^20 + 1 in group 0, and the 2 of groups 1 and 2).
    let text = f2_edited(|v| {
        v["requests"][0]["prefill"][0] = serde_json::Value::Array(vec![0.into(); (1 << 20) + 1]);
    });
    assert_names(&parse_error(&text), &["requests[0].prefill", "1048579", "1048576"]);
    // More id lists in one request than MAX_GROUPS.
    let text = f2_edited(|v| {
        v["requests"][0]["decode"] = serde_json::Value::Array(vec![serde_json::json!([]); 300]);
    });
    assert_names(&parse_error(&text), &["requests[0].decode", "300", "256"]);
    // A request id longer than MAX_NAME_CHARS.
    let text = f2_edited(|v| v["requests"][0]["id"] = "r".repeat(1000).into());
    assert_names(&parse_error(&text), &["requests[0].id", "1000", "256"]);
}

#[test]
fn counts_at_their_bounds_are_accepted() {
    // TP 1024 on an MLA-only model of 64 layers: 65536 rank-layers, the largest accepted.
    let text = f2_edited(|v| {
        v["model"]["groups"] = serde_json::json!([v["model"]["groups"][0].clone()]);
        let t: Vec<serde_json::Value> = (0..64)
            .map(|i| serde_json::json!({"layers": [{"name": format!("mla.{i}"), "group": 0}]}))
            .collect();
        v["model"]["tensors"] = t.into();
        v["prefill"]["tp_size"] = 1024.into();
        v["prefill"]["num_blocks"] = i32::MAX.into();
        v["requests"] = serde_json::json!([]);
    });
    let s = Scenario::from_json(&text).unwrap();
    let (prefill, decode) = super::build_engines(&s).unwrap();
    assert_eq!((prefill.len(), decode.len()), (1024, 1));
}

#[test]
fn bounds_are_checked_on_scenarios_built_in_rust_too() {
    let mut s = Scenario::from_json(F2).unwrap();
    s.decode.tp_size = u32::MAX;
    let err = Deployment::build(&s).unwrap_err().to_string();
    assert_names(&err, &["decode.tp_size", "4294967295", "1024"]);
}
