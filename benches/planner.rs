//! Planner throughput: region tables and local descriptor tables at DeepSeek-V3 and Kimi-Linear scale.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use hybrid_kv::core::fixtures::{deepseek_v3_like, kimi_linear_like};
use hybrid_kv::core::RegionTable;

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

criterion_group!(benches, bench_tables);
criterion_main!(benches);
