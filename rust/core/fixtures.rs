//! Small hand-checked layouts, shared by unit tests, property tests and benches.
//!
//! The small MLA/KDA specs and the F.2 geometry are data in `python/hybrid_kv/fixtures.json`, read here at
//! compile time (`include_str!`) and by `hybrid_kv.fixtures` at import: one source for both languages.

use std::sync::OnceLock;

use serde::Deserialize;

use super::layout::{LayerInput, LayerMemory, MemType, RankLayout};
use super::spec::{AttentionSpec, LayerSpec, MambaKind, MlaSpec, SsmSpec};

/// The shared fixture data (`python/hybrid_kv/fixtures.json`), embedded at compile time.
const FIXTURES_JSON: &str = include_str!("../../python/hybrid_kv/fixtures.json");

/// `fixtures.json` as typed data.
#[derive(Debug, Deserialize)]
struct Fixtures {
    mla: LayerSpec,
    kda: LayerSpec,
    f2: F2,
}

/// The F.2 layout: page, block sizes and the layers sharing each tensor.
#[derive(Debug, Deserialize)]
struct F2 {
    page_bytes: u64,
    logical_block_size: u64,
    kernel_block_size: u64,
    sharers: Vec<Sharer>,
}

/// One layer sharing each F.2 tensor: name prefix, KV-cache group, and which spec it has.
#[derive(Debug, Deserialize)]
struct Sharer {
    name: String,
    group: u32,
    spec: SharerSpec,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum SharerSpec {
    Mla,
    Kda,
}

/// The parsed data; a malformed `fixtures.json` is a bug in the repository, caught by this module's tests.
fn fixtures() -> &'static Fixtures {
    static DATA: OnceLock<Fixtures> = OnceLock::new();
    DATA.get_or_init(|| {
        let data: Fixtures = serde_json::from_str(FIXTURES_JSON)
            .unwrap_or_else(|e| panic!("python/hybrid_kv/fixtures.json does not parse: {e}"));
        assert!(
            matches!(data.mla, LayerSpec::Mla(_)),
            "fixtures.json: `mla` is not an MLA spec"
        );
        assert!(
            matches!(data.kda, LayerSpec::Ssm(_)),
            "fixtures.json: `kda` is not an SSM spec"
        );
        data
    })
}

/// Bytes of one logical block of one F.2 tensor (12 tokens of 6 fp16 latents; the padded KDA page): 144.
pub fn f2_page() -> u64 {
    fixtures().f2.page_bytes
}

/// The test KDA spec: GDN, conv `(8, 3)` fp16, temporal `(1, 4, 4)` fp32, padded to `page`.
pub fn kda_spec(page: u64) -> LayerSpec {
    let mut spec = fixtures().kda.clone();
    if let LayerSpec::Ssm(SsmSpec { page_size_padded, .. }) = &mut spec {
        *page_size_padded = Some(page);
    }
    spec
}

/// The test MLA spec: one latent of 6 fp16 elements per token.
pub fn mla_spec() -> LayerSpec {
    fixtures().mla.clone()
}

/// Dense memory of one layer on device 0: `bytes` from `base`, pages back to back, the rank's block count.
pub fn dense_memory(base: u64, bytes: u64, mem_type: MemType) -> LayerMemory {
    LayerMemory {
        base,
        bytes,
        block_stride: 0,
        device: 0,
        mem_type,
        num_blocks: None,
        page_layout: None,
    }
}

/// Reference F.1/F.2: two dual-purpose HMA tensors (`T0`, `T1`) shared by `mla.i`, `kda_a.i`, `kda_b.i`;
/// logical block 12 tokens, kernel block 4 (ppl 3), `num_blocks` logical blocks of 144 bytes.
/// Layers are listed KDA-first, as the vLLM test registers them.
pub fn hybrid_mla_f2(bases: [u64; 2], num_blocks: u64) -> RankLayout {
    let f2 = &fixtures().f2;
    let page = f2.page_bytes;
    let mut layers = Vec::new();
    for (i, &base) in bases.iter().enumerate() {
        for sharer in &f2.sharers {
            let spec = match sharer.spec {
                SharerSpec::Mla => mla_spec(),
                SharerSpec::Kda => kda_spec(page),
            };
            layers.push(LayerInput {
                name: format!("{}.{i}", sharer.name),
                group: sharer.group,
                spec,
                memory: dense_memory(base, num_blocks * page, MemType::Dram),
            });
        }
    }
    RankLayout {
        tp_rank: 0,
        tp_size: 1,
        logical_block_size: f2.logical_block_size,
        kernel_block_size: f2.kernel_block_size,
        num_logical_blocks: num_blocks,
        total_num_kv_heads: 1,
        layers,
        kv_layout: None,
    }
}

/// DeepSeek-V3-sized layout: `regions` MLA layers (bf16 latents of 576, kernel block 64 tokens), each its
/// own tensor of `num_blocks` kernel blocks, at synthetic addresses.
pub fn deepseek_v3_like(regions: u32, num_blocks: u64) -> RankLayout {
    let page = 64 * 576 * 2;
    let layers = (0..regions)
        .map(|i| LayerInput {
            name: format!("model.layers.{i}.self_attn"),
            group: 0,
            spec: LayerSpec::Mla(MlaSpec {
                head_size: 576,
                dtype_bytes: 2,
                page_size_padded: None,
            }),
            memory: dense_memory(
                0x7f00_0000_0000 + u64::from(i) * (num_blocks * page + (1 << 20)),
                num_blocks * page,
                MemType::Vram,
            ),
        })
        .collect();
    RankLayout {
        tp_rank: 0,
        tp_size: 1,
        logical_block_size: 64,
        kernel_block_size: 64,
        num_logical_blocks: num_blocks,
        total_num_kv_heads: 1,
        layers,
        kv_layout: None,
    }
}

/// GQA layout of heads-major pages: `regions` tensors of one attention layer each, 8 KV heads of 8 bf16 K and V
/// elements shared by `tp` ranks (rank `rank`), logical blocks of 32 tokens in kernel blocks of `kernel` tokens.
pub fn gqa_heads_major(regions: u32, tp: u32, rank: u32, kernel: u64, num_logical_blocks: u64) -> RankLayout {
    let heads = 8 / u64::from(tp);
    let page = 32 * heads * 2 * 8 * 2;
    let layers = (0..regions)
        .map(|i| LayerInput {
            name: format!("model.layers.{i}.self_attn"),
            group: 0,
            spec: LayerSpec::FullAttention(AttentionSpec {
                num_kv_heads: heads,
                head_size: 8,
                head_size_v: None,
                dtype_bytes: 2,
                page_size_padded: None,
            }),
            memory: dense_memory(
                0x6000_0000_0000 + (u64::from(rank) << 36) + u64::from(i) * (num_logical_blocks * page + (1 << 20)),
                num_logical_blocks * page,
                MemType::Vram,
            ),
        })
        .collect();
    RankLayout {
        tp_rank: rank,
        tp_size: tp,
        logical_block_size: 32,
        kernel_block_size: kernel,
        num_logical_blocks,
        total_num_kv_heads: 8,
        layers,
        kv_layout: None,
    }
}

/// Kimi-Linear-shaped hybrid layout: `regions` HMA tensors, each shared by one MLA layer (576 bf16 latents)
/// and three KDA layers (GDN state of `heads` heads of 128x128 fp32, conv Q|K|V of `heads*128` channels);
/// kernel block 64, logical block sized so the MLA page covers the KDA state.
pub fn kimi_linear_like(regions: u32, heads: u64, num_logical_blocks: u64) -> RankLayout {
    let state = heads * 128 * 128 * 4 + 3 * heads * 128 * 3 * 2;
    let per_token = 576 * 2;
    let kernel = 64;
    let logical = state.div_ceil(per_token * kernel) * kernel;
    let page = logical * per_token;
    let mut layers = Vec::new();
    for i in 0..regions {
        let base = 0x7f00_0000_0000 + u64::from(i) * (num_logical_blocks * page + (1 << 20));
        let memory = dense_memory(base, num_logical_blocks * page, MemType::Vram);
        let kda = LayerSpec::Ssm(SsmSpec {
            kind: MambaKind::Gdn,
            conv_shape: [3 * heads * 128, 3],
            conv_dtype_bytes: 2,
            temporal_shape: vec![heads, 128, 128],
            temporal_dtype_bytes: 4,
            page_size_padded: Some(page),
            conv_layout: Default::default(),
            part: None,
        });
        let mla = LayerSpec::Mla(MlaSpec {
            head_size: 576,
            dtype_bytes: 2,
            page_size_padded: None,
        });
        layers.push(LayerInput {
            name: format!("mla.{i}"),
            group: 0,
            spec: mla,
            memory: memory.clone(),
        });
        for g in 1..4u32 {
            let name = format!("kda_{g}.{i}");
            layers.push(LayerInput {
                name,
                group: g,
                spec: kda.clone(),
                memory: memory.clone(),
            });
        }
    }
    RankLayout {
        tp_rank: 0,
        tp_size: 1,
        logical_block_size: logical,
        kernel_block_size: kernel,
        num_logical_blocks,
        total_num_kv_heads: 1,
        layers,
        kv_layout: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::region::RegionTable;

    /// The data file holds the hand-checked vectors the tests were written against.
    #[test]
    fn fixture_data_is_the_hand_checked_f2_vectors() {
        assert_eq!(
            mla_spec(),
            LayerSpec::Mla(MlaSpec {
                head_size: 6,
                dtype_bytes: 2,
                page_size_padded: None,
            })
        );
        assert_eq!(
            kda_spec(160),
            LayerSpec::Ssm(SsmSpec {
                kind: MambaKind::Gdn,
                conv_shape: [8, 3],
                conv_dtype_bytes: 2,
                temporal_shape: vec![1, 4, 4],
                temporal_dtype_bytes: 4,
                page_size_padded: Some(160),
                conv_layout: Default::default(),
                part: None,
            })
        );
        assert_eq!(f2_page(), 144);
        let layout = hybrid_mla_f2([0x1000, 0x9000], 4);
        let names: Vec<(&str, u32)> = layout.layers.iter().map(|l| (l.name.as_str(), l.group)).collect();
        assert_eq!(
            names,
            [
                ("kda_a.0", 1),
                ("mla.0", 0),
                ("kda_b.0", 2),
                ("kda_a.1", 1),
                ("mla.1", 0),
                ("kda_b.1", 2)
            ]
        );
        assert_eq!((layout.logical_block_size, layout.kernel_block_size), (12, 4));
        assert!(layout.layers.iter().all(|l| l.memory.bytes == 4 * 144));
    }

    /// The F.2 page is the MLA page of one logical block, and it holds the KDA state.
    #[test]
    fn f2_page_is_the_mla_page_and_holds_the_kda_state() {
        let f2 = &fixtures().f2;
        let LayerSpec::Mla(mla) = mla_spec() else {
            panic!("mla_spec is not MLA")
        };
        assert_eq!(f2.page_bytes, f2.logical_block_size * mla.head_size * mla.dtype_bytes);
        assert_eq!(f2.logical_block_size % f2.kernel_block_size, 0);
        let LayerSpec::Ssm(kda) = kda_spec(f2.page_bytes) else {
            panic!("kda_spec is not SSM")
        };
        let state = kda.conv_shape.iter().product::<u64>() * kda.conv_dtype_bytes
            + kda.temporal_shape.iter().product::<u64>() * kda.temporal_dtype_bytes;
        assert!(state <= f2.page_bytes, "KDA state {state} > page {}", f2.page_bytes);
        assert!(RegionTable::build(&hybrid_mla_f2([0x1000, 0x9000], 4)).is_ok());
    }
}
