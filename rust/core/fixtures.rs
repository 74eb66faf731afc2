//! Small hand-checked layouts, shared by unit tests, property tests and benches.

use super::layout::{LayerInput, LayerMemory, MemType, RankLayout};
use super::spec::{LayerSpec, MambaKind, MlaSpec, SsmSpec};

/// The test KDA spec: GDN, conv `(8, 3)` fp16, temporal `(1, 4, 4)` fp32, padded to `page`.
pub fn kda_spec(page: u64) -> LayerSpec {
    LayerSpec::Ssm(SsmSpec {
        kind: MambaKind::Gdn,
        conv_shape: [8, 3],
        conv_dtype_bytes: 2,
        temporal_shape: vec![1, 4, 4],
        temporal_dtype_bytes: 4,
        page_size_padded: Some(page),
    })
}

/// The test MLA spec: one latent of 6 fp16 elements per token.
pub fn mla_spec() -> LayerSpec {
    LayerSpec::Mla(MlaSpec {
        head_size: 6,
        dtype_bytes: 2,
        page_size_padded: None,
    })
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
    }
}

/// Reference F.1/F.2: two dual-purpose HMA tensors (`T0`, `T1`) shared by `mla.i`, `kda_a.i`, `kda_b.i`;
/// logical block 12 tokens, kernel block 4 (ppl 3), `num_blocks` logical blocks of 144 bytes.
/// Layers are listed KDA-first, as the vLLM test registers them.
pub fn hybrid_mla_f2(bases: [u64; 2], num_blocks: u64) -> RankLayout {
    let page = 144;
    let mut layers = Vec::new();
    for (i, &base) in bases.iter().enumerate() {
        for (name, group, spec) in [
            ("kda_a", 1, kda_spec(page)),
            ("mla", 0, mla_spec()),
            ("kda_b", 2, kda_spec(page)),
        ] {
            layers.push(LayerInput {
                name: format!("{name}.{i}"),
                group,
                spec,
                memory: dense_memory(base, num_blocks * page, MemType::Dram),
            });
        }
    }
    RankLayout {
        tp_rank: 0,
        tp_size: 1,
        logical_block_size: 12,
        kernel_block_size: 4,
        num_logical_blocks: num_blocks,
        total_num_kv_heads: 1,
        layers,
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
    }
}
