//! What one rank hands to the planner: its layers, their specs, and where their memory is.

use serde::{Deserialize, Serialize};

use super::error::LayoutError;
use super::kv_layout::PageOrder;
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
#[serde(deny_unknown_fields)]
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
    /// Order of the (head, token) cells in this attention layer's pages, as its tensor's strides show it
    /// (`None`: the tensor does not say, e.g. a flat byte pool, one head or one token per page).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_layout: Option<PageOrder>,
}

/// One layer: its name, KV-cache group, spec and memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
#[serde(deny_unknown_fields)]
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
    /// The engine's KV-cache layout name (`HND`, `NHD`, vLLM's `LBHNC`...), declared where no tensor says the
    /// page order; every layer's `page_layout` must agree with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_layout: Option<String>,
    /// The layers.
    pub layers: Vec<LayerInput>,
}

impl RankLayout {
    /// Parse a layout from JSON, refusing unknown, misspelled, missing and mistyped keys with the layer (name and
    /// index) and the part of it (`spec`, `memory`) named.
    ///
    /// # Errors
    /// `BadField` naming where and what.
    pub fn from_json(text: &str) -> Result<RankLayout, LayoutError> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| LayoutError::BadField {
            at: "layout".into(),
            reason: format!("not JSON: {e}"),
        })?;
        RankLayout::from_value(value)
    }

    /// [`RankLayout::from_json`] from an already parsed JSON value.
    ///
    /// # Errors
    /// As [`RankLayout::from_json`].
    pub fn from_value(value: serde_json::Value) -> Result<RankLayout, LayoutError> {
        if let Some(layers) = value.get("layers").and_then(|l| l.as_array()) {
            for (i, layer) in layers.iter().enumerate() {
                check_layer(i, layer)?;
            }
        }
        serde_json::from_value(value).map_err(|e| LayoutError::BadField {
            at: "layout".into(),
            reason: e.to_string(),
        })
    }
}

/// The first field error of layer `i`, located in its `spec` or `memory` when it is there.
fn check_layer(i: usize, layer: &serde_json::Value) -> Result<(), LayoutError> {
    let name = layer
        .get("name")
        .and_then(|n| n.as_str())
        .map_or_else(|| format!("layers[{i}]"), |n| format!("layer {n:?} (layers[{i}])"));
    let bad = |part: &str, e: serde_json::Error| LayoutError::BadField {
        at: format!("{name}{part}"),
        reason: e.to_string(),
    };
    if let Some(spec) = layer.get("spec") {
        LayerSpec::deserialize(spec).map_err(|e| bad(".spec", e))?;
    }
    if let Some(memory) = layer.get("memory") {
        LayerMemory::deserialize(memory).map_err(|e| bad(".memory", e))?;
    }
    LayerInput::deserialize(layer).map_err(|e| bad("", e))?;
    Ok(())
}

fn one() -> u64 {
    1
}
