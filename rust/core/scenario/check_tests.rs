//! `check_scenario`: every rank pair of a deployment, compatible or with all of its findings.

use super::check::{check_scenario, check_scenario_json, CheckReport, Verdict};
use super::{Scenario, ScenarioError};

const F2: &str = include_str!("../../../tests/data/scenarios/hybrid_mla_f2.json");
const KIMI_PUSH: &str = include_str!("../../../tests/data/scenarios/kimi_tiny_8p2d_push.json");
const GQA_PULL: &str = include_str!("../../../tests/data/scenarios/gqa_ssm_2p4d_pull.json");

fn check(text: &str) -> CheckReport {
    check_scenario(&Scenario::from_json(text).unwrap()).unwrap()
}

fn kimi_pull() -> String {
    KIMI_PUSH.replace("\"mode\": \"push\"", "\"mode\": \"pull\"")
}

/// `(check, local, remote)` of every finding of every pair.
fn findings(r: &CheckReport) -> Vec<Vec<(String, String, String)>> {
    r.pairs
        .iter()
        .map(|p| {
            p.findings
                .iter()
                .map(|f| (f.check.clone(), f.local.clone(), f.remote.clone()))
                .collect()
        })
        .collect()
}

fn one(check: &str, local: &str, remote: &str) -> Vec<(String, String, String)> {
    vec![(check.into(), local.into(), remote.into())]
}

#[test]
fn example_scenarios_are_compatible_pair_by_pair() {
    for (text, pairs, locals) in [(F2.to_string(), 1, 1), (GQA_PULL.into(), 4, 4), (kimi_pull(), 8, 2)] {
        let r = check(&text);
        assert!(r.summary.compatible, "{r:?}");
        assert_eq!((r.summary.pairs, r.summary.compatible_pairs), (pairs, pairs));
        assert_eq!(r.summary.planned_ranks, locals);
        assert_eq!(r.summary.plans, locals * r.summary.requests);
        assert!(r.summary.transfers > 0 && r.summary.bytes > 0);
        assert!(r
            .pairs
            .iter()
            .all(|p| p.verdict == Verdict::Compatible && p.findings.is_empty()));
    }
    // Pull 2P -> 4D: decode rank d reads prefill rank d / 2.
    let r = check(GQA_PULL);
    let pd: Vec<(u32, u32, u32, u32)> = r
        .pairs
        .iter()
        .map(|p| (p.prefill_rank, p.decode_rank, p.local_rank, p.remote_rank))
        .collect();
    assert_eq!(pd, [(0, 0, 0, 0), (0, 1, 1, 0), (1, 2, 2, 1), (1, 3, 3, 1)]);
    let json = serde_json::to_string(&r).unwrap();
    assert!(json.contains("\"verdict\":\"compatible\"") && json.contains("\"local_side\":\"decode\""));
}

#[test]
fn push_with_a_smaller_local_kernel_block_passes_the_handshake_and_plans() {
    // Both the handshake and the planner cut 8- and 16-token kernel blocks into 8-token units, in push too.
    let r = check(KIMI_PUSH);
    assert_eq!(r.local_side, "prefill");
    let pd: Vec<(u32, u32)> = r.pairs.iter().map(|p| (p.prefill_rank, p.decode_rank)).collect();
    assert_eq!(pd, (0..8).map(|p| (p, p / 4)).collect::<Vec<_>>());
    assert!(findings(&r).iter().all(Vec::is_empty), "{r:?}");
    assert_eq!((r.summary.incompatible_pairs, r.summary.planned_ranks), (0, 8));
}

#[test]
fn tp_sizes_that_do_not_divide_are_reported_on_every_pair() {
    // 12 temporal heads and 12/12/24 conv channels split over 6 and over 4 ranks, but 6 and 4 do not divide.
    let s = kimi_pull()
        .replace("\"temporal_shape\": [8, 2, 2]", "\"temporal_shape\": [12, 2, 2]")
        .replace("\"prefill\": {\"tp_size\": 8", "\"prefill\": {\"tp_size\": 6")
        .replace("\"decode\": {\"tp_size\": 2", "\"decode\": {\"tp_size\": 4");
    let r = check(&s);
    assert_eq!(findings(&r), vec![one("tp_divisibility", "4", "6"); 4]);
    assert!(r
        .pairs
        .iter()
        .all(|p| p.verdict == Verdict::Incompatible && p.remote_rank == 0));
    assert!(!r.summary.compatible && r.summary.planned_ranks == 0 && r.summary.plans == 0);
}

#[test]
fn hybrid_mla_block_len_mismatch_is_reported_with_every_finding_of_each_pair() {
    // An SSM-only tensor pages at the per-rank state (208 bytes at decode TP 2, 52 at prefill TP 8), which
    // the MLA tensors' block-size ratio of 2 does not scale.
    let extra = kimi_pull()
        .replace(
            "{\"name\": \"kda.1\", \"group\": 1}]}",
            "{\"name\": \"kda.1\", \"group\": 1}]},\n      {\"layers\": [{\"name\": \"kda.2\", \"group\": 1}]}",
        )
        .replace(
            "\"decode\": {\"tp_size\": 2, \"logical_block_size\": 32",
            "\"decode\": {\"tp_size\": 2, \"logical_block_size\": 16",
        );
    let r = check(&extra);
    let want = one("hybrid_mla_block_len", "[256, 256, 208]", "[128, 128, 52]");
    assert_eq!(findings(&r), vec![want.clone(); 8]);
    assert!(
        r.pairs[0].findings[0].detail.contains("equal kernel-page bytes per"),
        "{r:?}"
    );
    // With prefill TP 3 the sizes no longer divide either: both findings on every pair, nothing dropped.
    let both = extra
        .replace("\"temporal_shape\": [8, 2, 2]", "\"temporal_shape\": [12, 2, 2]")
        .replace(
            "\"prefill\": {\"tp_size\": 8, \"logical_block_size\": 8",
            "\"prefill\": {\"tp_size\": 3, \"logical_block_size\": 16",
        );
    let r = check(&both);
    let want = vec![
        ("tp_divisibility".to_string(), "2".to_string(), "3".to_string()),
        (
            "hybrid_mla_block_len".into(),
            "[256, 256, 240]".into(),
            "[128, 128, 80]".into(),
        ),
    ];
    assert_eq!(findings(&r), vec![want; 2]);
}

#[test]
fn heads_major_pages_with_different_kernel_blocks_pass_the_handshake() {
    // Decode kernel blocks of 32 tokens against 16, two heads per prefill rank: heads-major pages are cut per
    // (head, 16-token unit), so every pair validates and plans.
    let s = GQA_PULL.replace(
        "\"decode\": {\"tp_size\": 4, \"logical_block_size\": 16, \"kernel_block_size\": 16",
        "\"decode\": {\"tp_size\": 4, \"logical_block_size\": 32, \"kernel_block_size\": 32",
    );
    let r = check(&s);
    assert_eq!(r.summary.incompatible_pairs, 0, "{:?}", r.pairs);
    assert!(r.pairs.iter().all(|p| p.findings.is_empty()), "{:?}", r.pairs);
}

#[test]
fn a_request_that_cannot_be_planned_names_both_lengths() {
    let s = F2.replace("\"decode\": [[1], [2], [3]]", "\"decode\": [[1], [0, 2, 3], []]");
    let r = check(&s);
    assert_eq!(findings(&r), vec![one("plan_request", "3 states", "1 states")]);
    assert!(r.pairs[0].findings[0]
        .detail
        .starts_with("request req-0: unpairable SSM state slots"));
    assert_eq!((r.summary.planned_ranks, r.summary.plans), (1, 0));
    assert!(!r.compatible && r.reasons.len() == 1, "{:?}", r.reasons);
    assert!(
        r.reasons[0].starts_with("prefill rank 0 / decode rank 0: plan_request: local 3 states, remote 1 states"),
        "{}",
        r.reasons[0]
    );
}

#[test]
fn malformed_scenarios_are_errors_and_unbuildable_engines_are_incompatible() {
    assert!(matches!(
        check_scenario_json("{\"model\": 1}"),
        Err(ScenarioError::Json(_))
    ));
    // A TP size the model does not split over is a deployment that fails, reported like `check --preset`
    // reports it (verdict and reasons at the top, exit 1 in the CLI), not a malformed file.
    let tp3 = F2.replace("\"prefill\": {\"tp_size\": 1", "\"prefill\": {\"tp_size\": 3");
    let r = check_scenario_json(&tp3).unwrap();
    assert!(!r.compatible && !r.summary.compatible && r.pairs.is_empty(), "{r:?}");
    assert_eq!(r.reasons.len(), 1);
    assert!(
        r.reasons[0].contains("must all divide by prefill TP 3"),
        "{:?}",
        r.reasons
    );
    // A compatible one has the verdict at the top too, and no reasons; an incompatible pair's findings are
    // its reasons, prefixed with the pair.
    let ok = check_scenario_json(F2).unwrap();
    assert!(ok.compatible && ok.reasons.is_empty());
}
