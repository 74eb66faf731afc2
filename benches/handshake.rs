//! Handshake throughput: encode, decode (hostile-input checks included) and validate one peer's metadata,
//! for DeepSeek-V3 (61 MLA regions) and Kimi-Linear (7 MLA+KDA HMA regions) with P_TP > D_TP and D_TP > P_TP.
//! Throughput is handshakes per second (one metadata blob, or one local/remote pair, per element).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use hybrid_kv::core::fixtures::{deepseek_v3_like, kimi_linear_like};
use hybrid_kv::core::handshake::{decode, encode, findings, validate, Expected};
use hybrid_kv::core::{AgentMeta, EngineInfo, RankLayout, RegionTable, TransferMode};

fn info(engine: &str) -> EngineInfo {
    EngineInfo {
        engine_id: engine.into(),
        agent_metadata: vec![0x5a; 2048], // NIXL agent blobs are a few KiB
        kv_layout: "HND".into(),
        attn_backend: "FLASHMLA".into(),
        transfer_mode: TransferMode::Pull,
        compat_hash: "c0ffee".into(),
        prefix_caching: false,
    }
}

fn at_tp(mut l: RankLayout, tp: u32, rank: u32) -> RankLayout {
    (l.tp_size, l.tp_rank) = (tp, rank);
    l
}

/// DeepSeek-V3 at TP `tp`: MLA is replicated, so every rank has the same 61 regions.
fn deepseek(tp: u32, blocks: u64) -> RankLayout {
    at_tp(deepseek_v3_like(61, blocks), tp, 0)
}

/// Kimi-Linear at TP `tp`: KDA heads sharded (32 / tp per rank), logical block sized to the sharded state.
fn kimi(tp: u32, logical_blocks: u64) -> RankLayout {
    at_tp(kimi_linear_like(7, 32 / u64::from(tp), logical_blocks), tp, 0)
}

fn meta(layout: &RankLayout, engine: &str) -> AgentMeta {
    AgentMeta::from_table(&RegionTable::build(layout).unwrap(), &info(engine))
}

/// (name, decode-side (local, pulling) meta, prefill-side (remote) meta).
fn cases() -> Vec<(&'static str, AgentMeta, AgentMeta)> {
    vec![
        (
            "deepseek_v3_p8_d16",
            meta(&deepseek(16, 100_000), "d"),
            meta(&deepseek(8, 100_000), "p"),
        ),
        (
            "deepseek_v3_p16_d8",
            meta(&deepseek(8, 100_000), "d"),
            meta(&deepseek(16, 100_000), "p"),
        ),
        (
            "kimi_linear_p1_d4",
            meta(&kimi(4, 8_000), "d"),
            meta(&kimi(1, 2_000), "p"),
        ),
        (
            "kimi_linear_p4_d1",
            meta(&kimi(1, 2_000), "d"),
            meta(&kimi(4, 8_000), "p"),
        ),
    ]
}

fn bench_handshake(c: &mut Criterion) {
    let mut g = c.benchmark_group("handshake");
    g.throughput(Throughput::Elements(1));
    for (name, local, remote) in cases() {
        let bytes = encode(&remote).unwrap();
        assert_eq!(decode(&bytes).unwrap(), remote, "{name}: decode(encode(m)) != m");
        let verdict = findings(&local, &remote, &Expected::default());
        // Both outcomes are timed as they are; the bench prints which one it measures.
        eprintln!(
            "{name}: {} bytes, {} findings{}",
            bytes.len(),
            verdict.len(),
            verdict.first().map(|f| format!(" (first: {f:?})")).unwrap_or_default()
        );
        g.bench_with_input(BenchmarkId::new("encode", name), &remote, |b, m| {
            b.iter(|| encode(black_box(m)).unwrap())
        });
        g.bench_with_input(BenchmarkId::new("decode", name), &bytes, |b, bytes| {
            b.iter(|| decode(black_box(bytes)).unwrap())
        });
        g.bench_with_input(BenchmarkId::new("validate", name), &(local, remote), |b, (l, r)| {
            b.iter(|| validate(black_box(l), black_box(r)).is_ok())
        });
    }
    g.finish();
}

criterion_group!(benches, bench_handshake);
criterion_main!(benches);
