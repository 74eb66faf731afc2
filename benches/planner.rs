//! Planner throughput at DeepSeek-V3 and Kimi-Linear scale: region tables, local tables, the tables of a peer
//! (remote descriptor tables per remote rank and split local tables), and per-request planning.

use std::hint::black_box;

/// The allocator the Python binding uses (`rust/py/mod.rs`), so these times are the ones Python callers get
/// (with the `python` feature the library already installs it).
#[cfg(not(feature = "python"))]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use hybrid_kv::core::fixtures::{deepseek_v3_like, kimi_linear_like};
use hybrid_kv::core::plan::PeerPlan;
use hybrid_kv::core::scenario::{Deployment, Engine, Group, Model, Request, Scenario, Tensor, TensorLayer};
use hybrid_kv::core::{ConvLayout, DescTable, MambaKind, RegionTable, TransferMode};

fn bench_tables(c: &mut Criterion) {
    let mut g = c.benchmark_group("local_table");
    g.sample_size(10);
    let cases = [
        ("deepseek_v3_61x100k", deepseek_v3_like(61, 100_000)),
        ("kimi_linear_7x2000_tp1", kimi_linear_like(7, 32, 2_000)),
    ];
    for (name, layout) in &cases {
        let table = RegionTable::build(layout).unwrap();
        let descs = table.local_table(1).unwrap().len();
        g.throughput(Throughput::Elements(descs));
        g.bench_with_input(BenchmarkId::new("region_table_build", name), layout, |b, l| {
            b.iter(|| RegionTable::build(black_box(l)).unwrap())
        });
        g.bench_with_input(BenchmarkId::new("strided_nx5", name), &table, |b, t| {
            b.iter(|| t.local_table(black_box(1)).unwrap().to_strided())
        });
        g.bench_with_input(BenchmarkId::new("flat_nx3", name), &table, |b, t| {
            b.iter(|| t.local_table(black_box(1)).unwrap().to_flat())
        });
    }
    g.finish();
}

/// Request lengths (tokens) of the per-request planning group.
const REQUEST_TOKENS: [(&str, u64); 3] = [("4k", 4 * 1024), ("32k", 32 * 1024), ("128k", 128 * 1024)];

fn layer(name: String, group: u32) -> TensorLayer {
    TensorLayer {
        name,
        group,
        part: None,
    }
}

/// DeepSeek-V3: 61 MLA layers, 576 bf16 latents per token, kernel = logical block of 64 tokens.
fn deepseek_v3() -> Model {
    Model {
        groups: vec![Group::Mla {
            head_size: 576,
            dtype_bytes: 2,
        }],
        tensors: (0..61)
            .map(|i| Tensor {
                layers: vec![layer(format!("model.layers.{i}.self_attn"), 0)],
            })
            .collect(),
    }
}

/// Kimi-Linear: 7 MLA layers and 20 KDA layers (3 groups) pooled in 7 HMA tensors; KDA with 32 heads of 128.
fn kimi_linear() -> Model {
    let kda = Group::Ssm {
        mamba: MambaKind::Gdn,
        conv_dim: 3 * 32 * 128,
        conv_rows: 3,
        conv_dtype_bytes: 2,
        temporal_shape: vec![32, 128, 128],
        temporal_dtype_bytes: 4,
        conv_layout: ConvLayout::Ds,
    };
    let groups = vec![
        Group::Mla {
            head_size: 576,
            dtype_bytes: 2,
        },
        kda.clone(),
        kda.clone(),
        kda,
    ];
    let tensors = (0..7)
        .map(|i| {
            let mut layers = vec![layer(format!("mla.{i}"), 0)];
            layers.extend(
                (1..4u32)
                    .filter(|g| i < 6 || *g < 3)
                    .map(|g| layer(format!("kda_{g}.{i}"), g)),
            );
            Tensor { layers }
        })
        .collect();
    Model { groups, tensors }
}

/// Logical block (tokens) so one MLA page at 64-token kernel blocks holds a KDA state at `tp`.
fn kimi_logical(tp: u64) -> u64 {
    let state = (32 * 128 * 128 * 4 + 3 * 32 * 128 * 3 * 2) / tp;
    state.div_ceil(1152 * 64) * 64
}

fn engine(tp: u32, logical: u64, num_blocks: u64) -> Engine {
    Engine {
        tp_size: tp,
        logical_block_size: logical,
        kernel_block_size: 64,
        num_blocks,
        kv_layout: None,
        state_slots: None,
    }
}

/// One request of `tokens` tokens on every group; the engines' ids are disjoint ascending runs.
fn scenario(model: Model, p: Engine, d: Engine, mode: TransferMode, tokens: u64) -> Scenario {
    let ids = |e: &Engine, start: u64| -> Vec<Vec<u64>> {
        model
            .groups
            .iter()
            .enumerate()
            .map(|(g, grp)| match grp {
                Group::Ssm { .. } => vec![start + 10 * g as u64],
                _ => (start + 100..start + 100 + tokens.div_ceil(e.logical_block_size)).collect(),
            })
            .collect()
    };
    let req = Request {
        id: "r".into(),
        prefill: ids(&p, 0),
        decode: ids(&d, 7),
    };
    Scenario {
        name: None,
        model,
        prefill: p,
        decode: d,
        mode,
        requests: vec![req],
    }
}

/// DeepSeek-V3 from prefill TP `p` to decode TP `d`: `blocks` blocks of 64 tokens on every rank.
fn deepseek_v3_scenario(p: u32, d: u32, mode: TransferMode, tokens: u64, blocks: u64) -> Scenario {
    scenario(
        deepseek_v3(),
        engine(p, 64, blocks),
        engine(d, 64, blocks),
        mode,
        tokens,
    )
}

/// Kimi-Linear from prefill TP `p` to decode TP `d`: logical blocks sized by [`kimi_logical`], 256 per TP rank.
fn kimi_linear_scenario(p: u32, d: u32, mode: TransferMode, tokens: u64) -> Scenario {
    let engine_at = |tp: u32| engine(tp, kimi_logical(u64::from(tp)), 256 * u64::from(tp));
    scenario(kimi_linear(), engine_at(p), engine_at(d), mode, tokens)
}

/// Rank 0 of the posting side, its region table and the metadata of the peer ranks it handshakes with.
fn peer_inputs(s: &Scenario) -> (RegionTable, Vec<hybrid_kv::core::AgentMeta>) {
    let dep = Deployment::build(s).unwrap();
    let (local, remote) = match s.mode {
        TransferMode::Pull => (&dep.decode, &dep.prefill),
        TransferMode::Push => (&dep.prefill, &dep.decode),
    };
    let metas = dep.peers[0]
        .remote_tables
        .iter()
        .map(|(r, _)| remote[*r as usize].meta.clone())
        .collect();
    (local[0].table.clone(), metas)
}

/// Every table of a peer plan: local (base and split) tables, then one remote table per remote rank.
fn peer_tables(p: &PeerPlan) -> impl Iterator<Item = &DescTable> {
    p.local_tables
        .iter()
        .map(|(_, t)| &**t)
        .chain(p.remote_tables.iter().map(|(_, t)| t))
}

/// `PeerPlan::new`: the TP mapping, one remote descriptor table per remote rank, and the split local tables
/// (P_TP > D_TP), at DeepSeek-V3 scale (61 regions x 100,000 kernel blocks) and Kimi-Linear scale.
fn bench_peer_tables(c: &mut Criterion) {
    let mut g = c.benchmark_group("peer_tables");
    g.sample_size(10);
    let cases = [
        (
            "deepseek_v3_100k_pull_p8_d16",
            deepseek_v3_scenario(8, 16, TransferMode::Pull, 4096, 100_000),
        ),
        (
            "deepseek_v3_100k_pull_p16_d8",
            deepseek_v3_scenario(16, 8, TransferMode::Pull, 4096, 100_000),
        ),
        (
            "kimi_linear_pull_p8_d1",
            kimi_linear_scenario(8, 1, TransferMode::Pull, 4096),
        ),
        (
            "kimi_linear_pull_p1_d8",
            kimi_linear_scenario(1, 8, TransferMode::Pull, 4096),
        ),
        (
            "kimi_linear_push_p1_d8",
            kimi_linear_scenario(1, 8, TransferMode::Push, 4096),
        ),
    ];
    for (name, s) in &cases {
        let (table, metas) = peer_inputs(s);
        let peer = PeerPlan::new(&table, &metas, s.mode).unwrap();
        let descs: u64 = peer_tables(&peer).map(|t| t.len()).sum();
        g.throughput(Throughput::Elements(descs));
        // Strided rows, ready for NIXL's Nx5 prep.
        g.bench_function(BenchmarkId::new("peer_plan_new", name), |b| {
            b.iter(|| PeerPlan::new(black_box(&table), black_box(&metas), s.mode).unwrap())
        });
        // The same tables without chunk rows (`coalesce=False`): what coalescing costs at construction.
        g.bench_function(BenchmarkId::new("peer_plan_reference", name), |b| {
            b.iter(|| PeerPlan::with_coalescing(black_box(&table), black_box(&metas), s.mode, false).unwrap())
        });
        // The reference tables (no chunk rows: what a NIXL < 1.5 user builds) expanded to Nx3, the form NIXL
        // < 1.5 takes.
        g.bench_function(BenchmarkId::new("peer_tables_nx3", name), |b| {
            b.iter(|| {
                let peer = PeerPlan::with_coalescing(black_box(&table), black_box(&metas), s.mode, false).unwrap();
                peer_tables(&peer).map(|t| t.to_flat().len()).sum::<usize>()
            })
        });
    }
    g.finish();
}

fn bench_plan_request(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan_request");
    g.sample_size(20);
    for (len, tokens) in REQUEST_TOKENS {
        let cases = [
            (
                "deepseek_v3_pull_p8_d16",
                deepseek_v3_scenario(8, 16, TransferMode::Pull, tokens, 4096),
            ),
            (
                "deepseek_v3_pull_p16_d8",
                deepseek_v3_scenario(16, 8, TransferMode::Pull, tokens, 4096),
            ),
            (
                "deepseek_v3_push_p8_d16",
                deepseek_v3_scenario(8, 16, TransferMode::Push, tokens, 4096),
            ),
            (
                "kimi_linear_pull_p1_d2",
                kimi_linear_scenario(1, 2, TransferMode::Pull, tokens),
            ),
            // Equal TP: every KDA state is one whole-state id (state_rows.rs).
            (
                "kimi_linear_pull_p1_d1",
                kimi_linear_scenario(1, 1, TransferMode::Pull, tokens),
            ),
            (
                "kimi_linear_pull_p8_d1",
                kimi_linear_scenario(8, 1, TransferMode::Pull, tokens),
            ),
            (
                "kimi_linear_push_p1_d8",
                kimi_linear_scenario(1, 8, TransferMode::Push, tokens),
            ),
        ];
        for (name, s) in &cases {
            let dep = Deployment::build(s).unwrap();
            let peer = &dep.peers[0];
            let req = &s.requests[0];
            let (local, remote) = match s.mode {
                TransferMode::Pull => (&req.decode, &req.prefill),
                TransferMode::Push => (&req.prefill, &req.decode),
            };
            let plan = peer.plan(local, remote).unwrap();
            let ids: usize = plan.transfers.iter().map(|t| t.local_ids.len()).sum();
            g.throughput(Throughput::Elements(ids as u64));
            let id = format!("{name}_{len}");
            // Fresh id arrays every request (what the Python binding does: the arrays are handed to numpy).
            g.bench_function(BenchmarkId::new("plan", &id), |b| {
                b.iter(|| peer.plan(black_box(local), black_box(remote)).unwrap())
            });
            // Reused id buffers (a Rust caller planning request after request).
            let mut out = plan.clone();
            g.bench_function(BenchmarkId::new("plan_into", &id), |b| {
                b.iter(|| peer.plan_into(black_box(local), black_box(remote), &mut out).unwrap())
            });
            // The reference plan (`coalesce=False`: one id per unit and per SSM piece), for comparison.
            let reference = Deployment::build_with(s, false).unwrap();
            let peer_ref = &reference.peers[0];
            g.bench_function(BenchmarkId::new("plan_reference", &id), |b| {
                b.iter(|| peer_ref.plan(black_box(local), black_box(remote)).unwrap())
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench_tables, bench_peer_tables, bench_plan_request);
criterion_main!(benches);
