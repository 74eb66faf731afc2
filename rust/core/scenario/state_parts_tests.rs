//! Scenarios with SSM states split over several tensors (`part`, `conv_layout`) in slot pools of their own
//! (`state_slots`): written as a scenario, SGLang-shaped pools build the very layouts that
//! `state_split_tests` moves byte-exact between every TP pair (addresses aside), and plan; a misplaced or
//! out-of-range value is refused naming its field.

use super::{build_engines, Deployment, Scenario, ScenarioError};
use crate::core::layout::LayerInput;
use crate::core::spec::{ConvLayout, LayerSpec, SsmSpec};
use crate::core::state_split_tests::{layout, Store, PAGES, SLOTS, STORES};

/// The scenario of `store`'s pools (the byte model's: GDN Q|K|V conv channels 4|4|8 over 3 rows, 2 temporal
/// heads of [4, 2] f32, 2 KV heads of 4 elements on 4-token pages), prefill TP `p_tp`, decode TP `d_tp`, one
/// request moving pages [4, 1] and state slot `slot` into pages [2, 5] and slot 8.
fn scenario(store: Store, (p_tp, d_tp): (u32, u32), slot: u64) -> String {
    let conv_layout = match store {
        Store::OneConv(ConvLayout::Sd) | Store::ThreeConv(ConvLayout::Sd) => "sd",
        _ => "ds",
    };
    // one tensor per layer of the byte model's layout, with its name and part
    let tensors: Vec<String> = layout(store, 1, 0)
        .layers
        .iter()
        .map(|l| {
            let part = match &l.spec {
                LayerSpec::Ssm(SsmSpec { part: Some(p), .. }) => {
                    format!(", \"part\": {}", serde_json::to_string(p).unwrap())
                }
                _ => String::new(),
            };
            format!(
                r#"{{"layers": [{{"name": "{}", "group": {}{part}}}]}}"#,
                l.name, l.group
            )
        })
        .collect();
    let engine = |tp: u32| {
        format!(
            r#"{{"tp_size": {tp}, "logical_block_size": 4, "kernel_block_size": 4, "num_blocks": {PAGES}, "state_slots": {SLOTS}}}"#
        )
    };
    format!(
        r#"{{
  "model": {{
    "groups": [
      {{"kind": "attention", "num_kv_heads": 2, "head_size": 4, "dtype_bytes": 2}},
      {{"kind": "ssm", "mamba": "gdn", "conv_dim": 16, "conv_rows": 3, "conv_dtype_bytes": 2,
        "temporal_shape": [2, 4, 2], "temporal_dtype_bytes": 4, "conv_layout": "{conv_layout}"}}
    ],
    "tensors": [{}]
  }},
  "prefill": {}, "decode": {},
  "requests": [{{"id": "r", "prefill": [[4, 1], [{slot}]], "decode": [[2, 5], [8]]}}]
}}"#,
        tensors.join(", "),
        engine(p_tp),
        engine(d_tp)
    )
}

/// What the planner reads of a layer, addresses aside: name, group, spec (an SSM page padded to exactly its
/// part's bytes is the unpadded page), bytes and own block count.
fn essence(l: &LayerInput) -> (String, u32, LayerSpec, u64, Option<u64>) {
    let mut spec = l.spec.clone();
    if let LayerSpec::Ssm(s) = &mut spec {
        if s.page_size_padded == s.state_bytes(&l.name).ok() {
            s.page_size_padded = None;
        }
    }
    (l.name.clone(), l.group, spec, l.memory.bytes, l.memory.num_blocks)
}

#[test]
fn split_state_scenarios_build_the_byte_models_layouts_and_plan() {
    for store in STORES.into_iter().filter(|s| *s != Store::Fused) {
        for tps in [(1, 2), (2, 1), (2, 2)] {
            let s = Scenario::from_json(&scenario(store, tps, 7)).unwrap_or_else(|e| panic!("{store:?}: {e}"));
            let (prefill, decode) = build_engines(&s).unwrap_or_else(|e| panic!("{store:?} {tps:?}: {e}"));
            for (tp, ranks) in [(tps.0, &prefill), (tps.1, &decode)] {
                for (r, rank) in ranks.iter().enumerate() {
                    let want = layout(store, u64::from(tp), r as u64);
                    let got: Vec<_> = rank.layout.layers.iter().map(essence).collect();
                    let want: Vec<_> = want.layers.iter().map(essence).collect();
                    assert_eq!(got, want, "{store:?} TP {tp} rank {r}");
                }
            }
            let plans = Deployment::build(&s).and_then(|d| d.plan_all());
            let plans = plans.unwrap_or_else(|e| panic!("{store:?} {tps:?}: {e}"));
            assert!(plans.iter().all(|p| !p.plan.transfers.is_empty()));
        }
    }
}

#[test]
fn a_state_slot_at_the_scenarios_slot_count_is_refused_and_a_page_id_past_it_is_not_a_slot() {
    let store = Store::ThreeConv(ConvLayout::Sd);
    let s = Scenario::from_json(&scenario(store, (2, 1), SLOTS)).unwrap();
    let err = Deployment::build(&s)
        .and_then(|d| d.plan_all())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("{SLOTS}")) && err.contains("state slots"),
        "{err}"
    );
    // slots past the page pool's size are slots, not pages
    const { assert!(SLOTS > PAGES) };
    let s = Scenario::from_json(&scenario(store, (2, 1), SLOTS - 1)).unwrap();
    Deployment::build(&s).and_then(|d| d.plan_all()).unwrap();
}

#[test]
fn misplaced_or_out_of_range_split_state_fields_are_refused_naming_them() {
    let good = scenario(Store::OneConv(ConvLayout::Ds), (2, 1), 7);
    let refused = |text: String| {
        Scenario::from_json(&text)
            .and_then(|s| Deployment::build(&s))
            .unwrap_err()
    };
    // a part on an attention layer
    let err = refused(good.replace(
        r#""name": "model.layers.0.attn", "group": 0"#,
        r#""name": "model.layers.0.attn", "group": 0, "part": "temporal""#,
    ));
    assert!(
        matches!(&err, ScenarioError::Invalid(m) if m.contains("model.layers.0.attn") && m.contains("part")),
        "{err}"
    );
    // slot counts: zero, over the id limit
    let err = refused(good.replacen(&format!(r#""state_slots": {SLOTS}"#), r#""state_slots": 0"#, 1));
    assert!(
        err.to_string().contains("prefill.state_slots must be positive"),
        "{err}"
    );
    let err = refused(good.replacen(&format!(r#""state_slots": {SLOTS}"#), r#""state_slots": 2147483648"#, 1));
    assert!(
        matches!(&err, ScenarioError::OverLimit { field, value: 2147483648, .. } if field == "prefill.state_slots"),
        "{err}"
    );
    // an unknown part, an unknown conv layout
    for (from, to) in [
        (r#""temporal""#, r#""tempral""#),
        (r#""conv_layout": "ds""#, r#""conv_layout": "dss""#),
    ] {
        assert!(good.contains(from));
        let err = refused(good.replacen(from, to, 1));
        assert!(
            matches!(&err, ScenarioError::Json(m) if m.contains(to.trim_matches('"').rsplit('"').next().unwrap())),
            "{err}"
        );
    }
    // an incomplete split (a conv part without the temporal one) is refused by the layout's whole-state rule
    let t = good
        .find(r#", {"layers": [{"name": "model.layers.1.linear.temporal""#)
        .unwrap();
    let end = good[t + 2..].find("]}").unwrap() + t + 4;
    let err = refused(format!("{}{}", &good[..t], &good[end..]));
    assert!(matches!(&err, ScenarioError::Layout { .. }), "{err}");
}
