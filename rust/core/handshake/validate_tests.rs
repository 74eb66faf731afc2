//! Validation tests: one negative test per check, several findings at once, fingerprints.

use proptest::prelude::*;

use super::*;
use crate::core::fixtures::{dense_memory, hybrid_mla_f2, kimi_linear_like, mla_spec};
use crate::core::layout::{LayerInput, LayerMemory, MemType, RankLayout};
use crate::core::meta::{AgentMeta, EngineInfo, TransferMode};
use crate::core::region::RegionTable;
use crate::core::spec::{AttentionSpec, LayerSpec, MambaKind, SsmSpec};

fn info(engine: &str, mode: TransferMode) -> EngineInfo {
    EngineInfo {
        engine_id: engine.into(),
        agent_metadata: b"nixl".to_vec(),
        kv_layout: "HND".into(),
        attn_backend: "FLASH_ATTN".into(),
        transfer_mode: mode,
        compat_hash: "c0ffee".into(),
        prefix_caching: false,
    }
}

fn meta(layout: &RankLayout, engine: &str, mode: TransferMode) -> AgentMeta {
    AgentMeta::from_table(&RegionTable::build(layout).unwrap(), &info(engine, mode))
}

fn kda(tp: u64, page: u64) -> LayerSpec {
    LayerSpec::Ssm(SsmSpec {
        kind: MambaKind::Gdn,
        conv_shape: [8 / tp, 3],
        conv_dtype_bytes: 2,
        temporal_shape: vec![1, 4 / tp, 4],
        temporal_dtype_bytes: 4,
        page_size_padded: Some(page),
        conv_layout: Default::default(),
        part: None,
    })
}

/// The F.2 hybrid MLA layout at TP `tp` (KDA state sharded), `logical`/`kernel` tokens, `n` logical blocks.
fn hybrid(tp: u32, rank: u32, logical: u64, kernel: u64, n: u64) -> RankLayout {
    let mut l = hybrid_mla_f2(
        [
            0x1000 + u64::from(rank) * 0x100000,
            0x80000 + u64::from(rank) * 0x100000,
        ],
        n,
    );
    let page = logical * 12;
    for layer in &mut l.layers {
        layer.memory.bytes = n * page;
        if layer.spec.is_ssm() {
            layer.spec = kda(u64::from(tp), page);
        } else {
            layer.spec = mla_spec();
        }
    }
    (l.tp_size, l.tp_rank, l.logical_block_size, l.kernel_block_size) = (tp, rank, logical, kernel);
    l
}

/// A GQA model: `regions` full-attention layers, `k` KV heads in total, heads of 4 fp16 elements.
fn gqa(k: u64, tp: u32, rank: u32, kernel: u64, regions: u64) -> RankLayout {
    let heads = (k / u64::from(tp)).max(1);
    let n = 8;
    let page = 16 * heads * 16;
    let layers = (0..regions)
        .map(|i| LayerInput {
            name: format!("model.layers.{i}.attn"),
            group: 0,
            spec: LayerSpec::FullAttention(AttentionSpec {
                num_kv_heads: heads,
                head_size: 4,
                head_size_v: None,
                dtype_bytes: 2,
                page_size_padded: None,
            }),
            memory: dense_memory(0x10_0000 * (i + 1), n * page, MemType::Vram),
        })
        .collect();
    RankLayout {
        tp_size: tp,
        tp_rank: rank,
        logical_block_size: 16,
        kernel_block_size: kernel,
        num_logical_blocks: n,
        total_num_kv_heads: k,
        layers,
        kv_layout: None,
    }
}

/// A non-MLA SSM hybrid: one attention layer (2 KV heads) and one GDN layer, in separate tensors.
fn ssm_hybrid(tp: u32, rank: u32) -> RankLayout {
    let mut l = gqa(2, tp, rank, 16, 1);
    let page = 256;
    l.layers.push(LayerInput {
        name: "model.layers.1.linear_attn".into(),
        group: 1,
        spec: kda(u64::from(tp), page),
        memory: LayerMemory {
            base: 0x90_0000,
            bytes: 8 * page,
            ..l.layers[0].memory.clone()
        },
    });
    l
}

fn checks(local: &AgentMeta, remote: &AgentMeta) -> Vec<String> {
    findings(local, remote, &Expected::default())
        .into_iter()
        .map(|f| f.check)
        .collect()
}

fn f6_pair() -> (AgentMeta, AgentMeta) {
    let local = meta(&hybrid(1, 0, 12, 4, 8), "local-engine", TransferMode::Pull);
    let remote = meta(&hybrid(2, 0, 8, 4, 12), "remote-engine", TransferMode::Pull);
    (local, remote)
}

#[test]
fn f6_unmodified_remote_is_compatible() {
    let (local, remote) = f6_pair();
    assert_eq!(local.regions.iter().map(|r| r.block_len).collect::<Vec<_>>(), [48, 48]);
    assert_eq!((remote.ssm_sizes, remote.ppl, remote.num_blocks), ((24, 32), 2, 24));
    assert_eq!(validate(&local, &remote), Ok(()));
    assert_eq!(fingerprint(&local), fingerprint(&remote));
}

#[test]
fn f6_mismatched_mla_kernel_page_is_rejected_with_both_values() {
    let (local, mut remote) = f6_pair();
    for r in &mut remote.regions {
        r.block_len = 24;
    }
    let err = validate(&local, &remote).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("hybrid_mla_block_len: local [48, 48], remote [24, 24]"),
        "{msg}"
    );
    // The reference's remote also keeps its 24 + 32-byte KDA state in what are now 24 x 2-byte pages: a push
    // plan would write past every page, so hybrid-kv reports that too (vLLM does not check it).
    assert_eq!(
        checks(&local, &remote),
        ["remote.ssm_state_size", "hybrid_mla_block_len"],
        "{msg}"
    );
    assert_ne!(fingerprint(&local), fingerprint(&remote));
    // With prefix caching on, vLLM stops at check 7; here all are reported.
    let mut local = local;
    local.prefix_caching = true;
    assert_eq!(
        checks(&local, &remote),
        [
            "remote.ssm_state_size",
            "prefix_caching_hetero_ppl",
            "hybrid_mla_block_len"
        ]
    );
}

#[test]
fn kimi_linear_hetero_tp_is_compatible_and_fingerprints_agree() {
    let mut d = kimi_linear_like(3, 32, 16);
    let mut p = kimi_linear_like(3, 4, 16);
    (p.tp_size, p.tp_rank) = (8, 3);
    d.tp_size = 1;
    let (d, p) = (
        meta(&d, "decode", TransferMode::Pull),
        meta(&p, "prefill", TransferMode::Pull),
    );
    assert_ne!(d.ppl, p.ppl);
    assert_eq!(validate(&d, &p), Ok(()));
    assert_eq!(fingerprint(&d), fingerprint(&p));
}

#[test]
fn identity_checks() {
    let (local, remote) = f6_pair();
    let mut r = remote.clone();
    r.version = 9;
    assert_eq!(checks(&local, &r), ["version"]);
    r = remote.clone();
    r.compat_hash = "beef".into();
    assert_eq!(checks(&local, &r), ["compat_hash"]);
    r = remote.clone();
    r.engine_id = local.engine_id.clone();
    assert_eq!(checks(&local, &r), ["engine_id"]);
    let want = Expected {
        engine_id: Some("other".into()),
        tp_size: Some(4),
        num_blocks: Some(7),
    };
    let f: Vec<String> = findings(&local, &remote, &want)
        .into_iter()
        .map(|f| f.to_string())
        .collect();
    assert_eq!(f.len(), 3, "{f:?}");
    assert!(
        f[0].starts_with("engine_id: local expected \"other\", remote \"remote-engine\""),
        "{f:?}"
    );
    assert!(f[1].starts_with("num_blocks: local expected 7"), "{f:?}");
    assert!(f[2].starts_with("tp_size: local expected 4, remote 2"), "{f:?}");
    r = remote.clone();
    r.transfer_mode = TransferMode::Push;
    assert_eq!(checks(&local, &r), ["transfer_mode"]);
    r = remote.clone();
    r.attn_backend = "FLASHINFER".into();
    assert_eq!(checks(&local, &r), ["attn_backend"]);
}

#[test]
fn tp_checks() {
    let local = meta(&gqa(8, 2, 0, 16, 2), "d", TransferMode::Pull);
    let mut remote = meta(&gqa(8, 4, 3, 16, 2), "p", TransferMode::Pull);
    assert_eq!(checks(&local, &remote), ["tp_peer"]);
    remote.tp_size = 3;
    remote.tp_rank = 0;
    assert!(checks(&local, &remote).contains(&"tp_divisibility".to_string()));
    let ok = meta(&gqa(8, 4, 1, 16, 2), "p", TransferMode::Pull);
    assert_eq!(validate(&local, &ok), Ok(()));
}

#[test]
fn region_checks() {
    let (local, remote) = f6_pair();
    let mut r = remote.clone();
    r.regions.pop();
    r.ssm_regions.pop();
    assert_eq!(checks(&local, &r), ["region_count", "region_names", "ssm_regions"]);
    r = remote.clone();
    r.regions[1].name = "kda_a.7".into();
    assert_eq!(checks(&local, &r), ["region_names"]);
    r = remote.clone();
    r.regions[0].is_mla = false;
    assert_eq!(checks(&local, &r), ["region_mla_flags"]);
    r = remote.clone();
    r.regions[0].group = Some(1);
    assert_eq!(checks(&local, &r), ["region_groups"]);
    r = remote.clone();
    r.ssm_regions.reverse();
    assert_eq!(checks(&local, &r), ["ssm_regions"]);
    r = remote.clone();
    r.groups.swap(1, 0);
    assert_eq!(checks(&local, &r), ["group_kinds"]);
    r = remote.clone();
    r.regions[1].num_blocks = 8;
    assert_eq!(checks(&local, &r), ["region_num_blocks"]);
}

#[test]
fn layout_and_head_checks() {
    let local = meta(&gqa(8, 2, 0, 16, 2), "d", TransferMode::Pull);
    let mut remote = meta(&gqa(8, 4, 1, 16, 2), "p", TransferMode::Pull);
    remote.kv_layout = "NHD".into();
    assert_eq!(checks(&local, &remote), ["kv_layout", "head_contiguity"]);
    // token-major pages on both sides are split per token (vLLM's LBNHC names the same order)
    let mut l2 = local.clone();
    l2.kv_layout = "LBNHC".into();
    assert!(checks(&l2, &remote).is_empty(), "{:?}", checks(&l2, &remote));
    // a name outside the vocabulary is malformed, on either side
    l2.kv_layout = "XYZ".into();
    assert_eq!(checks(&l2, &remote), ["local.kv_layout"]);
    // P_TP 4 > D_TP 1 while P replicates 2 KV heads.
    let d = meta(&gqa(2, 1, 0, 16, 1), "d", TransferMode::Pull);
    let p = meta(&gqa(2, 4, 0, 16, 1), "p", TransferMode::Pull);
    assert!(
        checks(&d, &p).contains(&"gqa_replication".to_string()),
        "{:?}",
        checks(&d, &p)
    );
    // Push: local is P.
    let p = meta(&gqa(2, 4, 0, 16, 1), "p", TransferMode::Push);
    let d = meta(&gqa(2, 1, 0, 16, 1), "d", TransferMode::Push);
    assert!(checks(&p, &d).contains(&"gqa_replication".to_string()));
}

#[test]
fn block_size_and_block_len_checks() {
    // 4 KV heads per rank: heads-major pages are cut per (head, unit), so 8- and 16-token blocks pair up.
    let local = meta(&gqa(8, 2, 0, 8, 2), "d", TransferMode::Pull);
    let remote = meta(&gqa(8, 2, 0, 16, 2), "p", TransferMode::Pull);
    assert_eq!(validate(&local, &remote), Ok(()));
    assert_eq!(validate(&remote, &local), Ok(()));
    // One KV head per rank (8 heads, TP 8): pages are token-contiguous, so 8- and 16-token blocks pair up.
    let local = meta(&gqa(8, 8, 0, 8, 2), "d", TransferMode::Pull);
    let remote = meta(&gqa(8, 8, 0, 16, 2), "p", TransferMode::Pull);
    assert_eq!(validate(&local, &remote), Ok(()));
    assert_eq!(validate(&remote, &local), Ok(()));
    let mut bad = local.clone();
    bad.regions[1].block_len += 16;
    bad.regions[1].block_stride += 16;
    let f = findings(&remote, &bad, &Expected::default());
    assert_eq!(f.len(), 1, "{f:?}");
    let text = f[0].to_string();
    assert!(
        text.starts_with("attention_block_len: local [") && text.contains("expected remote ["),
        "{text}"
    );
}

#[test]
fn hybrid_mla_kernel_blocks_pair_in_common_units_in_both_modes() {
    // Local kernel 4, remote kernel 8: neither needs to divide the other's page layout; 4-token units.
    for mode in [TransferMode::Pull, TransferMode::Push] {
        let local = meta(&hybrid(1, 0, 12, 4, 8), "d", mode);
        let remote = meta(&hybrid(2, 1, 8, 8, 12), "p", mode);
        assert_eq!(validate(&local, &remote), Ok(()), "{mode:?}");
        assert_eq!(validate(&remote, &local), Ok(()), "{mode:?}");
        let mut bad = remote.clone();
        for r in &mut bad.regions {
            r.block_len /= 2;
            r.block_stride = r.block_len;
        }
        // Halved pages no longer hold the KDA state either.
        assert_eq!(
            checks(&local, &bad),
            ["remote.ssm_state_size", "hybrid_mla_block_len"],
            "{mode:?}"
        );
    }
}

#[test]
fn ssm_state_sizes_must_scale_with_tp() {
    let local = meta(&ssm_hybrid(1, 0), "d", TransferMode::Pull);
    let remote = meta(&ssm_hybrid(2, 1), "p", TransferMode::Pull);
    assert_eq!(validate(&local, &remote), Ok(()));
    let mut bad = remote.clone();
    bad.ssm_sizes.1 = 64; // not halved
    let f = findings(&local, &bad, &Expected::default());
    assert_eq!(f.len(), 1);
    assert_eq!(
        f[0].to_string(),
        "ssm_temporal_bytes: local 64 at tp 1, remote 64 at tp 2 (expected remote 32 (local x local tp / remote tp))"
    );
    bad = remote.clone();
    bad.conv_proj_bytes = vec![6, 18, 0];
    assert_eq!(checks(&local, &bad), ["conv_proj_bytes[1]", "conv_proj_bytes[2]"]);
    bad.conv_proj_bytes = vec![24];
    assert_eq!(checks(&local, &bad), ["conv_proj_count"]);
}

#[test]
fn prefix_caching_with_hetero_ppl_for_ssm() {
    let (mut local, remote) = f6_pair();
    local.prefix_caching = true;
    let f = findings(&local, &remote, &Expected::default());
    assert_eq!(f.len(), 1);
    assert_eq!(f[0].check, "prefix_caching_hetero_ppl");
    assert!(f[0].to_string().contains(
        "local logical block 12 tokens, prefix caching true, remote logical block 8 tokens, prefix caching false"
    ));
}

#[test]
fn malformed_remote_is_reported_not_compared() {
    let (local, mut remote) = f6_pair();
    remote.tp_rank = 5;
    remote.regions[0].block_stride = 1;
    let f = checks(&local, &remote);
    assert_eq!(f, ["remote.tp_rank", "remote.regions[0]"]);
}

#[test]
fn several_mismatches_are_all_reported() {
    let (local, mut remote) = f6_pair();
    remote.engine_id = "local-engine".into();
    remote.attn_backend = "TRITON_MLA".into();
    remote.compat_hash = "0".into();
    for r in &mut remote.regions {
        r.block_len = 24;
    }
    remote.ssm_sizes = (24, 30);
    let err = validate(&local, &remote).unwrap_err();
    let msg = err.to_string();
    let lines: Vec<&str> = msg.lines().collect();
    assert!(lines[0].contains("6 handshake check(s) failed"), "{msg}");
    for check in [
        "remote.ssm_state_size",
        "compat_hash",
        "engine_id",
        "hybrid_mla_block_len",
        "ssm_temporal_bytes",
        "attn_backend",
    ] {
        assert!(
            lines.iter().any(|l| l.trim_start().starts_with(check)),
            "{check} missing from {msg}"
        );
    }
}

proptest! {
    /// A remote whose TP-invariant geometry differs is never accepted.
    #[test]
    fn fingerprint_difference_implies_a_finding(region in 0usize..2, what in 0u8..6, v in 1u64..200) {
        let (local, mut remote) = f6_pair();
        match what {
            0 => remote.regions[region].block_len = v,
            1 => remote.regions[region].is_mla = v % 2 == 0,
            2 => remote.ssm_sizes.0 = v,
            3 => remote.conv_proj_bytes[region] = v,
            4 => remote.total_num_kv_heads = v,
            _ => remote.regions[region].name = format!("x.{v}"),
        }
        if fingerprint(&local) != fingerprint(&remote) {
            prop_assert!(validate(&local, &remote).is_err());
        }
    }
}

#[test]
fn compat_hash_covers_the_wire_format_version_not_the_package_version() {
    use crate::core::handshake::{compat_hash, compat_hash_for, ModelFactors};
    use crate::core::meta::META_VERSION;
    let f = ModelFactors::default();
    // Pinned: every release speaking this wire format (a rolling upgrade of patch versions) computes exactly
    // this; only a META_VERSION bump may change it (tests/test_compat_hash.py recomputes it from its definition).
    assert_eq!(
        compat_hash(&f),
        "b112e127cca17d5c5ae90539cbd3f0ccd1d331492ba746221afb12286cb7f1a5"
    );
    assert_eq!(compat_hash(&f), compat_hash_for(META_VERSION, &f));
    assert_ne!(compat_hash(&f), compat_hash_for(META_VERSION + 1, &f));
}

#[test]
fn compat_hash_covers_the_connector_wire_version_and_refuses_unknown_factors() {
    use crate::core::handshake::{compat_hash, ModelFactors};
    let f = ModelFactors::default();
    let with = |connector: &str| ModelFactors {
        connector: connector.into(),
        ..f.clone()
    };
    // No connector: the pinned hash of the plain factors (above) is unchanged.
    assert_eq!(compat_hash(&with("")), compat_hash(&f));
    assert_ne!(compat_hash(&with("hybrid-kv-vllm/1")), compat_hash(&f));
    assert_ne!(
        compat_hash(&with("hybrid-kv-vllm/1")),
        compat_hash(&with("hybrid-kv-vllm/2"))
    );
    let json = serde_json::to_value(&f).unwrap();
    let mut extra = json.clone();
    extra["vllm_version"] = "0.33.0".into();
    let err = serde_json::from_value::<ModelFactors>(extra).unwrap_err().to_string();
    assert!(err.contains("unknown field `vllm_version`"), "{err}");
    let mut connector = json;
    connector["connector"] = "hybrid-kv-vllm/1".into();
    assert_eq!(
        serde_json::from_value::<ModelFactors>(connector).unwrap(),
        with("hybrid-kv-vllm/1")
    );
}
