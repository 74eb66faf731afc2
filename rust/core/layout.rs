//! What one rank hands to the planner: its layers, their specs, and where their memory is.

use serde::{Deserialize, Serialize};

use super::spec::LayerSpec;

/// Memory kind of a region, as NIXL names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "UPPERCASE")]
pub enum MemType {
    /// Host memory.
    #[default]
    Dram,
    /// Device (GPU) memory.
    Vram,
}

impl MemType {
    /// NIXL's name for the memory type.
    pub fn nixl_name(self) -> &'static str {
        match self {
            MemType::Dram => "DRAM",
            MemType::Vram => "VRAM",
        }
    }
}

/// Where one layer's KV cache lives (plain integers; never dereferenced).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerMemory {
    /// Base address of the layer's view (`tensor.data_ptr()`); layers sharing it share a region.
    pub base: u64,
    /// Bytes addressable from `base` (the view's bytes, or the storage's from `base`).
    pub bytes: u64,
    /// Bytes between consecutive blocks of dim 0: kernel blocks for attention, logical blocks (states)
    /// for SSM. 0 means "dense": the page size.
    #[serde(default)]
    pub block_stride: u64,
    /// Device index (0 for host memory).
    #[serde(default)]
    pub device: u32,
    /// Memory type.
    #[serde(default)]
    pub mem_type: MemType,
    /// Kernel blocks this attention layer holds, when it differs from the rank's count (non-HMA pools).
    #[serde(default)]
    pub num_blocks: Option<u64>,
}

/// One layer: its name, KV-cache group, spec and memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerInput {
    /// Layer name (e.g. `model.layers.3.self_attn`); natural-sorted to fix region order.
    pub name: String,
    /// Index of the KV-cache (transfer) group the layer belongs to.
    pub group: u32,
    /// The layer's KV-cache spec.
    pub spec: LayerSpec,
    /// The layer's memory.
    pub memory: LayerMemory,
}

/// Everything one rank knows about its KV cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankLayout {
    /// This rank's TP index.
    pub tp_rank: u32,
    /// TP size of this engine.
    pub tp_size: u32,
    /// Tokens per logical block (the scheduler's block).
    pub logical_block_size: u64,
    /// Tokens per kernel block (the attention kernel's page).
    pub kernel_block_size: u64,
    /// Logical blocks in the pool.
    pub num_logical_blocks: u64,
    /// Total KV heads of the model across TP (ignored for MLA, where it is 1).
    #[serde(default = "one")]
    pub total_num_kv_heads: u64,
    /// The layers.
    pub layers: Vec<LayerInput>,
}

fn one() -> u64 {
    1
}
