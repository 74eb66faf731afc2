//! Region-table and local-table tests: reference vectors F.1, F.2, F.7 and property tests.

use proptest::prelude::*;

use super::fixtures::{hybrid_mla_f2, kda_spec, mla_spec};
use super::layout::{LayerInput, LayerMemory, MemType, RankLayout};
use super::spec::{AttentionSpec, LayerSpec};
use super::{LayoutError, RegionTable};

const T0: u64 = 0x1000;
const T1: u64 = 0x10000;

#[test]
fn f2_dual_purpose_regions_are_mla_with_kernel_pages() {
    let t = RegionTable::build(&hybrid_mla_f2([T0, T1], 4)).unwrap();
    assert_eq!(t.geometry.ppl, 3);
    assert_eq!(t.geometry.num_kernel_blocks, 12);
    assert_eq!(t.regions.iter().map(|r| r.is_mla).collect::<Vec<_>>(), vec![true, true]);
    assert_eq!(t.regions.iter().map(|r| r.block_len).collect::<Vec<_>>(), vec![48, 48]);
    assert_eq!(t.regions.iter().map(|r| r.base).collect::<Vec<_>>(), vec![T0, T1]);
    assert_eq!(t.num_fa_descs(1), Ok(24));
    assert_eq!(t.ssm_regions, vec![0, 1]);
    assert!(t.use_mla);
    let split = t.conv_split.as_ref().unwrap();
    assert_eq!((split.conv_bytes, split.ssm_bytes), (48, 64));
}

#[test]
fn f2_local_table_rows_and_flat_descriptors() {
    let t = RegionTable::build(&hybrid_mla_f2([T0, T1], 4)).unwrap();
    let table = t.local_table(1).unwrap();
    assert_eq!(table.rows.len(), 10);
    assert_eq!(table.len(), 56);
    assert_eq!(table.num_fa, 24);
    assert_eq!(table.row_starts()[..2], [0, 12]);
    let flat = table.to_flat();
    let desc = |i: usize| (flat[3 * i], flat[3 * i + 1]);
    for k in 0..12u64 {
        assert_eq!(desc(k as usize), (T0 + 48 * k, 48));
        assert_eq!(desc(12 + k as usize), (T1 + 48 * k, 48));
    }
    let streams = [(0u64, 12u64), (12, 12), (24, 24), (48, 64)];
    for (ri, base) in [T0, T1].into_iter().enumerate() {
        for (s, (off, len)) in streams.iter().enumerate() {
            for b in 0..4u64 {
                let idx = 24 + ri * 16 + s * 4 + b as usize;
                assert_eq!(desc(idx), (base + 144 * b + off, *len), "idx {idx}");
                assert_eq!(table.desc(idx as u64), Some(desc(idx)));
            }
        }
    }
    assert_eq!(table.desc(56), None);
}

#[test]
fn block_size_ratio_splits_attention_only() {
    let t = RegionTable::build(&hybrid_mla_f2([T0, T1], 4)).unwrap();
    let table = t.local_table(2).unwrap();
    assert_eq!(table.num_fa, 48);
    assert_eq!(table.len(), 48 + 32);
    assert_eq!(table.desc(1), Some((T0 + 24, 24)));
    assert_eq!(table.desc(48), Some((T0, 12)));
    assert!(matches!(
        t.local_table(5),
        Err(LayoutError::BadBlockSizeRatio { bsr: 5, .. })
    ));
}

fn fa_layer(name: &str, group: u32, base: u64, num_blocks: u64) -> LayerInput {
    LayerInput {
        name: name.into(),
        group,
        spec: LayerSpec::FullAttention(AttentionSpec {
            num_kv_heads: 1,
            head_size: 2,
            head_size_v: None,
            dtype_bytes: 1,
            page_size_padded: Some(16),
        }),
        memory: LayerMemory {
            base,
            bytes: num_blocks * 16,
            block_stride: 16,
            device: 0,
            mem_type: MemType::Dram,
            num_blocks: Some(num_blocks),
            page_layout: None,
        },
    }
}

fn fa_layout(layers: Vec<LayerInput>) -> RankLayout {
    RankLayout {
        tp_rank: 0,
        tp_size: 1,
        logical_block_size: 4,
        kernel_block_size: 4,
        num_logical_blocks: 3,
        total_num_kv_heads: 1,
        layers,
        kv_layout: None,
    }
}

/// Reference F.7 `test_local_descriptors_follow_each_region_pool_capacity`.
#[test]
fn f7_local_descriptors_follow_each_region_capacity() {
    let t = RegionTable::build(&fa_layout(vec![fa_layer("a", 0, 100, 2), fa_layer("b", 1, 1000, 3)])).unwrap();
    let flat = t.local_table(1).unwrap().to_flat();
    let addrs: Vec<u64> = flat.chunks(3).map(|c| c[0]).collect();
    assert_eq!(addrs, vec![100, 116, 1000, 1016, 1032]);
}

#[test]
fn bad_layouts_name_the_value_and_limit() {
    let mut l = fa_layout(vec![fa_layer("a", 0, 100, 2), fa_layer("b", 0, 120, 3)]);
    let err = RegionTable::build(&l).unwrap_err();
    assert!(matches!(err, LayoutError::Overlap { .. }), "{err}");
    assert!(err.to_string().contains("overlaps"), "{err}");

    l = fa_layout(vec![fa_layer("a", 0, 100, 2)]);
    l.layers[0].memory.bytes = 20;
    let err = RegionTable::build(&l).unwrap_err().to_string();
    assert!(err.contains("too small") && err.contains("needs 32"), "{err}");

    l = fa_layout(vec![fa_layer("a", 0, u64::MAX - 8, 2)]);
    let err = RegionTable::build(&l).unwrap_err();
    assert!(matches!(err, LayoutError::AddressOverflow { .. }), "{err}");

    l = fa_layout(vec![fa_layer("a", 0, 100, 2)]);
    l.kernel_block_size = 3;
    assert_eq!(
        RegionTable::build(&l).unwrap_err(),
        LayoutError::KernelBlockNotDividing { kernel: 3, logical: 4 }
    );

    l = fa_layout(vec![fa_layer("a", 0, 100, 2), fa_layer("b", 0, 1000, 2)]);
    l.layers[1].memory.mem_type = MemType::Vram;
    assert!(matches!(
        RegionTable::build(&l).unwrap_err(),
        LayoutError::MixedMemory { .. }
    ));

    l = fa_layout(vec![fa_layer("a", 0, 100, 2)]);
    l.layers[0].memory.bytes = 0;
    assert!(RegionTable::build(&l).is_err());

    let mut h = hybrid_mla_f2([T0, T1], 4);
    h.layers[0].spec = kda_spec(100); // smaller than the 112-byte state
    assert!(matches!(
        RegionTable::build(&h).unwrap_err(),
        LayoutError::StateLargerThanPage { .. }
    ));

    let mut h = hybrid_mla_f2([T0, T1], 4);
    h.layers[0].spec = kda_spec(288); // sharer disagrees on the kernel page
    h.layers[0].memory.bytes = 4 * 288;
    assert!(matches!(
        RegionTable::build(&h).unwrap_err(),
        LayoutError::SharedPageMismatch { .. }
    ));
}

#[test]
fn mla_first_or_kda_first_gives_the_same_table() {
    let kda_first = hybrid_mla_f2([T0, T1], 4);
    let mut mla_first = kda_first.clone();
    mla_first.layers.retain(|l| matches!(l.spec, LayerSpec::Mla(_)));
    mla_first
        .layers
        .extend(kda_first.layers.iter().filter(|l| l.spec != mla_spec()).cloned());
    let a = RegionTable::build(&kda_first).unwrap();
    let b = RegionTable::build(&mla_first).unwrap();
    assert_eq!(a, b);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any registration order gives the same regions, flags and tables.
    #[test]
    fn registration_order_does_not_matter(seed in any::<u64>(), nb in 1u64..9) {
        let layout = hybrid_mla_f2([T0, T1], nb);
        let mut shuffled = layout.clone();
        let mut s = seed;
        for i in (1..shuffled.layers.len()).rev() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            shuffled.layers.swap(i, (s >> 33) as usize % (i + 1));
        }
        let a = RegionTable::build(&layout).unwrap();
        let b = RegionTable::build(&shuffled).unwrap();
        prop_assert_eq!(&a, &b);
        prop_assert_eq!(a.local_table(1).unwrap(), b.local_table(1).unwrap());
    }

    /// Every descriptor lies inside one registered region, and no two descriptors of a table overlap.
    #[test]
    fn descriptors_inside_regions_and_disjoint(nb in 1u64..9, gap in 0u64..4096, bsr in prop::sample::select(vec![1u64, 2, 3, 4])) {
        let layout = hybrid_mla_f2([T0, T0 + nb * 144 + gap], nb);
        let t = RegionTable::build(&layout).unwrap();
        let table = t.local_table(bsr).unwrap();
        let flat = table.to_flat();
        let reg = t.registration();
        let mut spans: Vec<(u64, u64)> = flat.chunks(3).map(|c| (c[0], c[0] + c[1])).collect();
        for &(s, e) in &spans {
            prop_assert!(reg.iter().any(|r| s >= r[0] && e <= r[0] + r[1]), "[{}, {}) outside regions", s, e);
        }
        // The FA part and the SSM part each tile memory without overlap (they alias each other by design).
        let fa = table.num_fa as usize;
        let (fa_part, ssm_part) = spans.split_at_mut(fa);
        for part in [fa_part, ssm_part] {
            part.sort();
            for w in part.windows(2) {
                prop_assert!(w[0].1 <= w[1].0, "{:?} overlaps {:?}", w[0], w[1]);
            }
        }
    }
}
