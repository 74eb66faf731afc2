//! The region table: one region per distinct base address, with its kernel-block geometry.
//!
//! HMA pools layer *i* of every KV-cache group into one tensor, so one region can be an MLA page and an
//! SSM state at the same time. The region is MLA if *any* sharer is MLA (OR-merge), and every sharer must
//! agree on the kernel page, so the result never depends on the order layers are given in.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::alias::{can_alias, check_aliases, check_no_overlap};
use super::coalesce::ChunkedBases;
use super::error::LayoutError;
use super::kv_layout::{rank_page_order, LayerOrder, PageOrder};
use super::layout::{LayerInput, MemType, RankLayout};
use super::natural::natural_cmp;
use super::spec::{ConvSplit, LayerSpec, StatePart};
use super::state_parts::{check_state_parts, ssm_states};

/// What a KV-cache group holds, which decides how it is split across TP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GroupKind {
    /// Non-MLA attention (heads split across TP).
    Attention,
    /// MLA attention (replicated on every TP rank).
    Mla,
    /// SSM state (sharded across TP; one state per logical block).
    Ssm,
}

impl GroupKind {
    /// True for attention and MLA groups (the ones addressed per kernel block).
    pub fn is_attention(self) -> bool {
        !matches!(self, GroupKind::Ssm)
    }

    fn of(spec: &LayerSpec) -> GroupKind {
        if spec.is_mla() {
            GroupKind::Mla
        } else if spec.is_ssm() {
            GroupKind::Ssm
        } else {
            GroupKind::Attention
        }
    }
}

/// Whether region `group` (its owner group, `None` when shared) hosts attention pages of `groups`.
pub(crate) fn hosts_attention(group: Option<u32>, groups: &[GroupKind]) -> bool {
    match group {
        Some(g) => groups.get(g as usize).is_some_and(|k| k.is_attention()),
        None => groups.iter().any(|k| k.is_attention()),
    }
}

/// One registered memory region (a distinct base address).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    /// Name of the first layer (in natural order) that maps this region.
    pub name: String,
    /// Base address.
    pub base: u64,
    /// Registered bytes from `base`.
    pub bytes: u64,
    /// Kernel-granular page (the attention transfer unit).
    pub block_len: u64,
    /// Bytes between kernel blocks.
    pub block_stride: u64,
    /// Kernel blocks in the region.
    pub num_blocks: u64,
    /// REPLICATE (true: some sharer is MLA) or SPLIT (heads sharded).
    pub is_mla: bool,
    /// Group of every sharer, or `None` when groups share the region.
    pub group: Option<u32>,
    /// Whether some sharer is an SSM layer.
    pub has_ssm: bool,
    /// The part of an SSM state this region's tensor holds (`None`: whole states, or no SSM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_part: Option<StatePart>,
    /// States an SSM region's tensor holds when it declares its own count (a slot-indexed state pool beside a
    /// page pool); `None`: the rank's logical blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub states: Option<u64>,
}

/// Where one layer's KV lives: the region (tensor) it maps and its KV-cache group. In a hybrid (HMA) pool
/// tensor *i* holds layer *i* of every group, so a (region, group) pair is one layer's own pages and states.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerPlace {
    /// Layer name (vLLM's `kv_caches` key).
    pub name: String,
    /// Index of the region the layer maps.
    pub region: u32,
    /// KV-cache group of the layer.
    pub group: u32,
    /// Whether it is an SSM layer (vLLM gives those no per-layer save hook).
    pub is_ssm: bool,
}

/// Block geometry of a rank: logical versus kernel blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockGeometry {
    /// Tokens per logical block.
    pub logical_block_size: u64,
    /// Tokens per kernel block.
    pub kernel_block_size: u64,
    /// Kernel blocks per logical block (`ppl`).
    pub ppl: u64,
    /// Logical blocks.
    pub num_logical_blocks: u64,
    /// Kernel blocks (`num_logical_blocks * ppl`).
    pub num_kernel_blocks: u64,
}

/// The region table of one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionTable {
    /// Regions in natural layer-name order.
    pub regions: Vec<Region>,
    /// Indices of regions hosting SSM layers, in first-touch order.
    pub ssm_regions: Vec<usize>,
    /// Kind of every KV-cache group, in group order.
    pub groups: Vec<GroupKind>,
    /// Block geometry.
    pub geometry: BlockGeometry,
    /// SSM state layout on this rank, when the model has SSM layers.
    pub conv_split: Option<ConvSplit>,
    /// Model-level MLA: every attention group is MLA.
    pub use_mla: bool,
    /// Total KV heads across TP (1 for MLA).
    pub total_num_kv_heads: u64,
    /// Order of the (head, token) cells in this rank's attention pages (from its tensors or its `kv_layout`).
    #[serde(default)]
    pub page_order: PageOrder,
    /// K elements per head of `HKTV` pages (the rows of each head's transposed K); 0 for every other order.
    #[serde(default)]
    pub k_rows: u64,
    /// This rank's TP index.
    pub tp_rank: u32,
    /// TP size.
    pub tp_size: u32,
    /// Device index of every region.
    pub device: u32,
    /// Memory type of every region.
    pub mem_type: MemType,
    /// Every layer in natural layer-name order (vLLM's forward order) with the region and group it maps.
    #[serde(default)]
    pub layers: Vec<LayerPlace>,
    /// The chunked base local tables of this rank, built once for all its peer plans (`coalesce.rs`).
    #[serde(skip)]
    pub chunked_bases: ChunkedBases,
}

/// A layer's region view after applying the block geometry.
struct LayerView {
    block_len: u64,
    block_stride: u64,
    num_blocks: u64,
}

fn layer_view(layer: &LayerInput, geo: &BlockGeometry) -> Result<LayerView, LayoutError> {
    let name = &layer.name;
    let page = layer.spec.page_bytes(geo.logical_block_size, name)?;
    let not_div = |what: &str, value: u64| LayoutError::NotDivisibleByPpl {
        layer: name.clone(),
        what: what.to_string(),
        value,
        ppl: geo.ppl,
    };
    if page % geo.ppl != 0 {
        return Err(not_div("page", page));
    }
    let block_len = page / geo.ppl;
    let mem = &layer.memory;
    let (block_stride, holds, unit_len, unit_stride) = if layer.spec.is_ssm() {
        // SSM views are indexed by logical block (one whole state each), or by the tensor's own state slots.
        let stride = if mem.block_stride == 0 { page } else { mem.block_stride };
        if stride % geo.ppl != 0 {
            return Err(not_div("stride", stride));
        }
        (stride / geo.ppl, ssm_states(layer, geo)?, page, stride)
    } else {
        let stride = if mem.block_stride == 0 {
            block_len
        } else {
            mem.block_stride
        };
        let n = mem.num_blocks.unwrap_or(geo.num_kernel_blocks);
        (stride, n, block_len, stride)
    };
    if unit_stride < unit_len {
        return Err(LayoutError::StrideTooSmall {
            layer: name.clone(),
            stride: unit_stride,
            block_len: unit_len,
        });
    }
    if holds == 0 {
        return Err(LayoutError::Zero {
            what: format!("number of blocks of layer {name}"),
        });
    }
    let needed = (holds - 1)
        .checked_mul(unit_stride)
        .and_then(|v| v.checked_add(unit_len))
        .ok_or_else(|| LayoutError::AddressOverflow {
            what: format!("extent of {name}"),
            addr: 0,
            len: holds,
        })?;
    if needed > mem.bytes {
        return Err(LayoutError::TensorTooSmall {
            layer: name.clone(),
            bytes: mem.bytes,
            num_blocks: holds,
            block_len: unit_len,
            stride: unit_stride,
            needed,
        });
    }
    let num_blocks = match (layer.spec.is_ssm(), mem.num_blocks) {
        // checked against MAX_KERNEL_BLOCKS by `ssm_states`, so the product fits
        (true, Some(states)) => states.saturating_mul(geo.ppl),
        (true, None) => geo.num_kernel_blocks,
        (false, _) => holds,
    };
    Ok(LayerView {
        block_len,
        block_stride,
        num_blocks,
    })
}

fn geometry(layout: &RankLayout) -> Result<BlockGeometry, LayoutError> {
    let zero = |what: &str| LayoutError::Zero { what: what.to_string() };
    if layout.tp_size == 0 {
        return Err(zero("tp_size"));
    }
    if layout.tp_rank >= layout.tp_size {
        return Err(LayoutError::Groups(format!(
            "tp_rank {} is out of range for tp_size {}",
            layout.tp_rank, layout.tp_size
        )));
    }
    if layout.logical_block_size == 0 {
        return Err(zero("logical_block_size"));
    }
    if layout.kernel_block_size == 0 {
        return Err(zero("kernel_block_size"));
    }
    if layout.num_logical_blocks == 0 {
        return Err(zero("num_logical_blocks"));
    }
    if layout.logical_block_size % layout.kernel_block_size != 0 {
        return Err(LayoutError::KernelBlockNotDividing {
            kernel: layout.kernel_block_size,
            logical: layout.logical_block_size,
        });
    }
    let ppl = layout.logical_block_size / layout.kernel_block_size;
    let num_kernel_blocks = layout
        .num_logical_blocks
        .checked_mul(ppl)
        .ok_or_else(|| LayoutError::AddressOverflow {
            what: "kernel block count".into(),
            addr: layout.num_logical_blocks,
            len: ppl,
        })?;
    Ok(BlockGeometry {
        logical_block_size: layout.logical_block_size,
        kernel_block_size: layout.kernel_block_size,
        ppl,
        num_logical_blocks: layout.num_logical_blocks,
        num_kernel_blocks,
    })
}

fn group_kinds(layers: &[&LayerInput]) -> Result<Vec<GroupKind>, LayoutError> {
    let mut kinds: Vec<Option<(GroupKind, &str)>> = Vec::new();
    for layer in layers {
        let g = layer.group as usize;
        if g >= kinds.len() {
            kinds.resize(g + 1, None);
        }
        let kind = GroupKind::of(&layer.spec);
        match kinds[g] {
            None => kinds[g] = Some((kind, &layer.name)),
            Some((k, first)) if k != kind => {
                return Err(LayoutError::Groups(format!(
                    "group {g} mixes {k:?} layer {first} with {kind:?} layer {}",
                    layer.name
                )))
            }
            Some(_) => {}
        }
    }
    kinds
        .into_iter()
        .enumerate()
        .map(|(g, k)| {
            k.map(|(kind, _)| kind)
                .ok_or_else(|| LayoutError::Groups(format!("group {g} has no layers; group ids must be 0..n-1")))
        })
        .collect()
}

/// Most K rows (elements per head) an `HKTV` page may have: each is one descriptor per head and token unit.
pub const MAX_K_ROWS: u64 = 1024;

/// The K rows of `HKTV` pages: the one K head size every (non-MLA) attention layer has, whose V head size must be
/// the same (a head's page is its K then its V, each `head_size` elements per token); 0 for other orders.
fn k_transposed_rows(order: PageOrder, layers: &[&LayerInput]) -> Result<u64, LayoutError> {
    if order != PageOrder::HeadsMajorKTransposed {
        return Ok(0);
    }
    let mut rows: Option<(u64, &str)> = None;
    for l in layers {
        let (LayerSpec::FullAttention(a) | LayerSpec::SlidingWindow(a)) = &l.spec else {
            continue;
        };
        let v = a.head_size_v.unwrap_or(a.head_size);
        if v != a.head_size || a.head_size == 0 || a.head_size > MAX_K_ROWS || a.page_size_padded.is_some() {
            return Err(LayoutError::PageLayout(format!(
                "layer {}: HKTV pages need K and V of one head size of at most {MAX_K_ROWS} elements and no page \
                 padding (head_size {}, head_size_v {v}, page_size_padded {:?})",
                l.name, a.head_size, a.page_size_padded
            )));
        }
        match rows {
            Some((r, first)) if r != a.head_size => {
                return Err(LayoutError::PageLayout(format!(
                    "layer {}: HKTV pages need one head size on the rank: {} here, {r} on layer {first}",
                    l.name, a.head_size
                )))
            }
            Some(_) => {}
            None => rows = Some((a.head_size, &l.name)),
        }
    }
    Ok(rows.map_or(0, |(r, _)| r))
}

impl RegionTable {
    /// Build the region table of one rank.
    ///
    /// # Errors
    /// A [`LayoutError`] naming the bad value: zero sizes, a kernel block that does not divide the logical
    /// block, a tensor too small for its blocks, overlapping regions, mixed memory, sharers that disagree on
    /// the kernel page, an inconsistent SSM spec, or address overflow.
    pub fn build(layout: &RankLayout) -> Result<RegionTable, LayoutError> {
        let geo = geometry(layout)?;
        if layout.layers.is_empty() {
            return Err(LayoutError::NoLayers);
        }
        let mut layers: Vec<&LayerInput> = layout.layers.iter().collect();
        layers.sort_by(|a, b| natural_cmp(&a.name, &b.name));
        for pair in layers.windows(2) {
            if pair[0].name == pair[1].name {
                return Err(LayoutError::Groups(format!(
                    "layer name {} appears twice",
                    pair[0].name
                )));
            }
        }
        let groups = group_kinds(&layers)?;
        let orders: Vec<LayerOrder<'_>> = layers
            .iter()
            .filter(|l| !l.spec.is_mla() && !l.spec.is_ssm())
            .map(|l| LayerOrder {
                name: &l.name,
                order: l.memory.page_layout,
            })
            .collect();
        let page_order = rank_page_order(layout.kv_layout.as_deref(), &orders)?;
        let k_rows = k_transposed_rows(page_order, &layers)?;
        let first = layers[0];
        let (device, mem_type) = (first.memory.device, first.memory.mem_type);

        let mut regions: Vec<Region> = Vec::new();
        let mut owner: Vec<&str> = Vec::new(); // layer that fixed each region's geometry
        let mut by_base: HashMap<u64, usize> = HashMap::new();
        let mut ssm_regions: Vec<usize> = Vec::new();
        let mut conv_split: Option<(ConvSplit, &str)> = None;
        let mut places: Vec<LayerPlace> = Vec::with_capacity(layers.len());
        let mut own_counts = false; // some SSM layer declares its own state count

        for layer in &layers {
            let mem = &layer.memory;
            if (mem.device, mem.mem_type) != (device, mem_type) {
                return Err(LayoutError::MixedMemory {
                    layer: layer.name.clone(),
                    found: format!("{} device {}", mem.mem_type.nixl_name(), mem.device),
                    first: first.name.clone(),
                    expected: format!("{} device {}", mem_type.nixl_name(), device),
                });
            }
            mem.base
                .checked_add(mem.bytes)
                .ok_or_else(|| LayoutError::AddressOverflow {
                    what: format!("tensor of {}", layer.name),
                    addr: mem.base,
                    len: mem.bytes,
                })?;
            let view = layer_view(layer, &geo)?;
            if let LayerSpec::Ssm(ssm) = &layer.spec {
                let split = ssm.conv_split(&layer.name)?;
                match &conv_split {
                    None => conv_split = Some((split, &layer.name)),
                    Some((s, other)) if *s != split => {
                        return Err(LayoutError::BadSsmSpec {
                            layer: layer.name.clone(),
                            reason: format!("its state layout {split:?} differs from {other}'s {s:?}"),
                        })
                    }
                    Some(_) => {}
                }
            }
            let is_mla = layer.spec.is_mla();
            // Regions are keyed by (base, page length): a layer joins the region of its base and page; a layer of
            // another page at a known base is an alias, a region of its own, when it steps by the same stride.
            let same_page = regions
                .iter()
                .position(|r| r.base == mem.base && r.block_len == view.block_len);
            let first = by_base.get(&mem.base).copied();
            let idx = match (same_page.or(first), first) {
                (Some(idx), Some(f))
                    if same_page.is_some() || !can_alias(&regions[f], (view.block_stride, view.num_blocks)) =>
                {
                    let r = &mut regions[idx];
                    if (r.block_len, r.block_stride, r.num_blocks)
                        != (view.block_len, view.block_stride, view.num_blocks)
                    {
                        return Err(LayoutError::SharedPageMismatch {
                            a: owner[idx].to_string(),
                            b: layer.name.clone(),
                            base: mem.base,
                            a_len: r.block_len,
                            b_len: view.block_len,
                            a_stride: r.block_stride,
                            b_stride: view.block_stride,
                        });
                    }
                    r.is_mla |= is_mla;
                    r.bytes = r.bytes.max(mem.bytes);
                    if r.group != Some(layer.group) {
                        r.group = None;
                    }
                    idx
                }
                _ => {
                    by_base.entry(mem.base).or_insert(regions.len());
                    owner.push(&layer.name);
                    regions.push(Region {
                        name: layer.name.clone(),
                        base: mem.base,
                        bytes: mem.bytes,
                        block_len: view.block_len,
                        block_stride: view.block_stride,
                        num_blocks: view.num_blocks,
                        is_mla,
                        group: Some(layer.group),
                        has_ssm: false,
                        state_part: None,
                        states: None,
                    });
                    regions.len() - 1
                }
            };
            places.push(LayerPlace {
                name: layer.name.clone(),
                region: u32::try_from(idx).map_err(|_| LayoutError::Groups(format!("{idx} regions")))?,
                group: layer.group,
                is_ssm: layer.spec.is_ssm(),
            });
            if let LayerSpec::Ssm(ssm) = &layer.spec {
                let r = &mut regions[idx];
                if r.has_ssm && r.state_part != ssm.part {
                    return Err(LayoutError::BadSsmSpec {
                        layer: layer.name.clone(),
                        reason: format!(
                            "it holds state part {:?} of a tensor whose other layers hold {:?}",
                            ssm.part, r.state_part
                        ),
                    });
                }
                r.has_ssm = true;
                r.state_part.clone_from(&ssm.part);
                if let Some(states) = layer.memory.num_blocks {
                    own_counts = true;
                    r.states = Some(states); // bounded by `ssm_states`; sharers agree (same kernel block count)
                }
                if !ssm_regions.contains(&idx) {
                    ssm_regions.push(idx);
                }
            }
        }
        check_aliases(&regions, &owner)?;
        check_no_overlap(&regions)?;
        let use_mla = groups.contains(&GroupKind::Mla) && !groups.contains(&GroupKind::Attention);
        let has_ssm = conv_split.is_some();
        check_state_parts(
            &regions,
            &ssm_regions,
            conv_split.as_ref().map_or(0, |(s, _)| s.proj_bytes.len()),
        )?;
        // A state tensor of its own slot count is a pool of its own (SGLang's `MambaPool` beside its page pool):
        // every region keeps its count. Otherwise the states are the pool's logical blocks, as in vLLM.
        if has_ssm && !own_counts {
            // Mamba forces uniform kernel block counts (vLLM does the same).
            for r in &mut regions {
                r.num_blocks = geo.num_kernel_blocks;
            }
        }
        Ok(RegionTable {
            regions,
            ssm_regions,
            groups,
            geometry: geo,
            conv_split: conv_split.map(|(s, _)| s),
            use_mla,
            total_num_kv_heads: if use_mla { 1 } else { layout.total_num_kv_heads.max(1) },
            page_order,
            k_rows,
            tp_rank: layout.tp_rank,
            tp_size: layout.tp_size,
            device,
            mem_type,
            layers: places,
            chunked_bases: ChunkedBases::default(),
        })
    }

    /// Whether the model has SSM layers.
    pub fn has_ssm(&self) -> bool {
        self.conv_split.is_some()
    }

    /// Registration descriptors `(addr, bytes, device)`, one per tensor (aliases of one base once), in region order.
    pub fn registration(&self) -> Vec<[u64; 3]> {
        // one per tensor: aliases of one base are registered once, to their furthest end
        let mut out: Vec<[u64; 3]> = Vec::with_capacity(self.regions.len());
        for r in &self.regions {
            match out.iter_mut().find(|e| e[0] == r.base) {
                Some(e) => e[1] = e[1].max(r.bytes),
                None => out.push([r.base, r.bytes, u64::from(self.device)]),
            }
        }
        out
    }

    /// Flat count of attention (FA) descriptors at block-size ratio `bsr`.
    ///
    /// # Errors
    /// `BadBlockSizeRatio` as [`RegionTable::local_table`] gives it (0, or not dividing a kernel page);
    /// `AddressOverflow` when the count does not fit 64 bits.
    pub fn num_fa_descs(&self, bsr: u64) -> Result<u64, LayoutError> {
        self.check_bsr(bsr)?;
        self.regions.iter().try_fold(0u64, |acc, r| {
            r.num_blocks
                .checked_mul(bsr)
                .and_then(|n| acc.checked_add(n))
                .ok_or_else(|| LayoutError::AddressOverflow {
                    what: format!("attention descriptor count at block size ratio {bsr}"),
                    addr: r.num_blocks,
                    len: bsr,
                })
        })
    }
}
