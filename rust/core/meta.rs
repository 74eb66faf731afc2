//! What a rank advertises to its peers at the handshake: its identity and its region geometry.
//!
//! The planner builds remote descriptor tables from a peer's [`AgentMeta`] alone, so a peer can be planned
//! for without ever seeing its memory. Encoding, fingerprints and validation live in `handshake`.

use serde::{Deserialize, Serialize};

pub use super::engine_info::{is_compat_hash, EngineInfo, COMPAT_HASH_LEN};
use super::kv_layout::{page_order_of, PageOrder};
use super::layout::MemType;
use super::region::{GroupKind, RegionTable};
use super::spec::{ConvLayout, ConvSplit, StatePart};

fn is_ds(layout: &ConvLayout) -> bool {
    *layout == ConvLayout::Ds
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// Version of the metadata format; bumped on any incompatible change.
pub const META_VERSION: u32 = 1;

/// Who initiates transfers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TransferMode {
    /// Decode READs from prefill.
    #[default]
    Pull,
    /// Prefill WRITEs into decode.
    Push,
}

/// Geometry of one advertised region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionMeta {
    /// Name of the first layer mapping the region (regions must name the same caches on both sides).
    pub name: String,
    /// Base address.
    pub base: u64,
    /// Kernel page bytes.
    pub block_len: u64,
    /// Bytes between kernel blocks.
    pub block_stride: u64,
    /// Kernel blocks.
    pub num_blocks: u64,
    /// REPLICATE (MLA) flag.
    pub is_mla: bool,
    /// Group of every sharer, or `None` when shared by groups.
    pub group: Option<u32>,
    /// The part of an SSM state the region's tensor holds (`None`: whole states, or no SSM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_part: Option<StatePart>,
    /// States the region holds when its tensor has its own count (`None`: the rank's logical blocks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub states: Option<u64>,
}

impl RegionMeta {
    /// End (exclusive) of the region's extent, its last block's end: `None` when the region has no block or
    /// the extent wraps the 64-bit address space.
    pub fn end(&self) -> Option<u64> {
        let extent = self
            .num_blocks
            .checked_sub(1)?
            .checked_mul(self.block_stride)?
            .checked_add(self.block_len)?;
        self.base.checked_add(extent)
    }
}

/// Handshake metadata of one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentMeta {
    /// Format version ([`META_VERSION`]).
    pub version: u32,
    /// Engine id (the whole P or D instance).
    pub engine_id: String,
    /// TP rank.
    pub tp_rank: u32,
    /// TP size.
    pub tp_size: u32,
    /// Device index of the regions.
    pub device_id: u32,
    /// Memory type of the regions.
    pub mem_type: MemType,
    /// Opaque NIXL agent metadata (`get_agent_metadata()`).
    #[serde(with = "serde_bytes")]
    pub agent_metadata: Vec<u8>,
    /// Regions in order.
    pub regions: Vec<RegionMeta>,
    /// Indices of SSM regions in first-touch order.
    pub ssm_regions: Vec<u32>,
    /// Kind of every KV-cache group.
    pub groups: Vec<GroupKind>,
    /// Tokens per logical block.
    pub logical_block_size: u64,
    /// Tokens per kernel block.
    pub kernel_block_size: u64,
    /// Kernel blocks per logical block.
    pub ppl: u64,
    /// Kernel blocks per region.
    pub num_blocks: u64,
    /// Logical blocks.
    pub num_logical_blocks: u64,
    /// `(conv_bytes, ssm_bytes)` of one state on this rank; `(0, 0)` without SSM.
    pub ssm_sizes: (u64, u64),
    /// Bytes of each conv sub-projection on this rank (empty without SSM).
    pub conv_proj_bytes: Vec<u64>,
    /// How the conv state is stored (`ds` unless said).
    #[serde(default, skip_serializing_if = "is_ds")]
    pub conv_layout: ConvLayout,
    /// Conv rows of an `sd` conv state (0, and not sent, for `ds`: its streams do not depend on it).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub conv_rows: u64,
    /// Model-level MLA flag.
    pub use_mla: bool,
    /// Total KV heads across TP (1 for MLA).
    pub total_num_kv_heads: u64,
    /// KV layout name (`HND`, ...); hybrid-kv pages are heads-major.
    pub kv_layout: String,
    /// K elements per head of `HKTV` pages (0, and not sent, for every other layout).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub k_rows: u64,
    /// Attention backend name.
    pub attn_backend: String,
    /// Transfer mode.
    pub transfer_mode: TransferMode,
    /// Model compatibility hash (hex SHA-256 over the model factors).
    pub compat_hash: String,
    /// Whether this engine serves prefix-cache hits (with SSM, hetero ppl then cannot be trimmed).
    #[serde(default)]
    pub prefix_caching: bool,
}

impl AgentMeta {
    /// The order of cells in this rank's attention pages, from its `kv_layout` (`None` for an unknown name, or
    /// a layout whose pages are not contiguous; a well-formed metadata with attention groups has one).
    pub fn page_order(&self) -> Option<PageOrder> {
        page_order_of(&self.kv_layout).ok().flatten()
    }

    /// The SSM state split this rank advertises (its sizes, conv sub-projections and conv layout; the split's
    /// dims are a local fact and stay empty).
    pub fn conv_split(&self) -> ConvSplit {
        ConvSplit {
            proj_dims: Vec::new(),
            proj_bytes: self.conv_proj_bytes.clone(),
            conv_bytes: self.ssm_sizes.0,
            ssm_bytes: self.ssm_sizes.1,
            conv_rows: self.conv_rows,
            conv_layout: self.conv_layout,
        }
    }

    /// Describe a rank's region table for its peers.
    pub fn from_table(table: &RegionTable, info: &EngineInfo) -> AgentMeta {
        let split = table.conv_split.as_ref();
        AgentMeta {
            version: META_VERSION,
            engine_id: info.engine_id.clone(),
            tp_rank: table.tp_rank,
            tp_size: table.tp_size,
            device_id: table.device,
            mem_type: table.mem_type,
            agent_metadata: info.agent_metadata.clone(),
            regions: table
                .regions
                .iter()
                .map(|r| RegionMeta {
                    name: r.name.clone(),
                    base: r.base,
                    block_len: r.block_len,
                    block_stride: r.block_stride,
                    num_blocks: r.num_blocks,
                    is_mla: r.is_mla,
                    group: r.group,
                    state_part: r.state_part.clone(),
                    states: r.states,
                })
                .collect(),
            ssm_regions: table.ssm_regions.iter().map(|&i| i as u32).collect(),
            groups: table.groups.clone(),
            logical_block_size: table.geometry.logical_block_size,
            kernel_block_size: table.geometry.kernel_block_size,
            ppl: table.geometry.ppl,
            num_blocks: table.geometry.num_kernel_blocks,
            num_logical_blocks: table.geometry.num_logical_blocks,
            ssm_sizes: split.map_or((0, 0), |s| (s.conv_bytes, s.ssm_bytes)),
            conv_proj_bytes: split.map_or_else(Vec::new, |s| s.proj_bytes.clone()),
            conv_layout: split.map_or(ConvLayout::Ds, |s| s.conv_layout),
            conv_rows: split
                .filter(|s| s.conv_layout == ConvLayout::Sd)
                .map_or(0, |s| s.conv_rows),
            use_mla: table.use_mla,
            total_num_kv_heads: table.total_num_kv_heads,
            kv_layout: if info.kv_layout.is_empty() {
                table.page_order.name().to_string()
            } else {
                info.kv_layout.clone()
            },
            k_rows: table.k_rows,
            attn_backend: info.attn_backend.clone(),
            transfer_mode: info.transfer_mode,
            compat_hash: info.compat_hash.clone(),
            prefix_caching: info.prefix_caching,
        }
    }
}
