//! Internal consistency of one metadata, checked before its values are trusted for any arithmetic.
//!
//! A decoded [`AgentMeta`] is well-typed but may still lie: a rank outside its TP size, a stride shorter than
//! its block, an SSM region index past the region list, an extent that wraps the address space. Planning
//! from such a table could index out of bounds or overflow, so these are rejected at decode.
//!
//! Two kinds of finding: [`structure_findings`] make the values unsafe to compute with (a validation stops
//! there), [`placement_findings`] describe memory a plan must never touch (regions overlapping one another, an
//! SSM state larger than its page: a push plan would write past the page or into another region). The
//! decoder rejects structure findings; a validation lists placement findings beside the comparisons; `PeerPlan`
//! refuses both ([`check_well_formed`]).

use super::error::Finding;
use crate::core::alias::tensor_extents;
use crate::core::kv_layout::{page_order_of, PageOrder};
use crate::core::meta::AgentMeta;
use crate::core::region::{GroupKind, MAX_K_ROWS};
use crate::core::spec::{ConvLayout, StatePart, MAX_CONV_PROJS, MAX_CONV_ROWS};
use crate::core::tp::MAX_TP_SIZE;

/// Most regions a peer may advertise (one per KV-cache tensor; today's largest models have about 100 layers).
pub const MAX_REGIONS: usize = 1024;
/// Most KV-cache groups a peer may advertise.
pub const MAX_GROUPS: usize = 64;
/// Most kernel blocks per region: every block gets an int32 descriptor id.
pub const MAX_KERNEL_BLOCKS: u64 = i32::MAX as u64;

/// Every inconsistency in `meta`, one finding each (empty when well formed).
pub fn check_well_formed(m: &AgentMeta) -> Vec<Finding> {
    let mut out = structure_findings(m);
    out.extend(placement_findings(m));
    out
}

/// Values that make `m` unsafe to compute with: out-of-range ranks and indices, counts over their limits,
/// zero sizes, extents that wrap the address space.
pub fn structure_findings(m: &AgentMeta) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut bad = |field: &str, value: String, why: String| out.push(Finding::invalid(field, value, why));
    if m.tp_size == 0 || m.tp_rank >= m.tp_size {
        bad(
            "tp_rank",
            format!("{}/{}", m.tp_rank, m.tp_size),
            "tp_rank must be below a positive tp_size".into(),
        );
    }
    if let Err(e) = page_order_of(&m.kv_layout) {
        bad("kv_layout", format!("{:?}", m.kv_layout), e);
    } else if m.groups.contains(&GroupKind::Attention) && m.page_order().is_none() {
        bad(
            "kv_layout",
            format!("{:?}", m.kv_layout),
            "attention pages must be one contiguous range per block (L and B axes outermost)".into(),
        );
    }
    let hktv = m.page_order() == Some(PageOrder::HeadsMajorKTransposed);
    if (hktv && m.groups.contains(&GroupKind::Attention) && m.k_rows == 0)
        || m.k_rows > MAX_K_ROWS
        || (!hktv && m.k_rows != 0)
    {
        bad(
            "k_rows",
            m.k_rows.to_string(),
            format!("HKTV attention pages need 1 to {MAX_K_ROWS} K rows; other layouts none"),
        );
    }
    if m.tp_size > MAX_TP_SIZE {
        bad(
            "tp_size",
            m.tp_size.to_string(),
            format!("must be at most {MAX_TP_SIZE}"),
        );
    }
    for (field, count, limit) in [
        ("regions", m.regions.len(), MAX_REGIONS),
        ("groups", m.groups.len(), MAX_GROUPS),
    ] {
        if count > limit {
            bad(
                field,
                format!("{count} entries"),
                format!("at most {limit} are accepted"),
            );
        }
    }
    if m.num_blocks > MAX_KERNEL_BLOCKS {
        bad(
            "num_blocks",
            m.num_blocks.to_string(),
            format!("at most {MAX_KERNEL_BLOCKS} kernel blocks (int32 descriptor ids)"),
        );
    }
    let (logical, kernel) = (m.logical_block_size, m.kernel_block_size);
    if kernel == 0 || logical == 0 || logical % kernel != 0 || m.ppl != logical / kernel {
        bad(
            "ppl",
            m.ppl.to_string(),
            format!("must equal logical block size {logical} / kernel block size {kernel}, both positive"),
        );
    }
    if m.num_logical_blocks == 0 || m.num_logical_blocks.checked_mul(m.ppl) != Some(m.num_blocks) {
        bad(
            "num_blocks",
            m.num_blocks.to_string(),
            format!("must equal num_logical_blocks {} * ppl {}", m.num_logical_blocks, m.ppl),
        );
    }
    if m.regions.is_empty() {
        bad("regions", "[]".into(), "at least one region is required".into());
    }
    if m.groups.is_empty() {
        bad("groups", "[]".into(), "at least one group is required".into());
    }
    for (i, r) in m.regions.iter().enumerate() {
        // Named only when something is wrong: formatting it for every region was a twentieth of decoding a
        // well-formed DeepSeek-V3 payload.
        let field = || format!("regions[{i}]");
        if r.block_len == 0 || r.block_stride < r.block_len || r.num_blocks == 0 {
            bad(
                &field(),
                format!(
                    "block_len {} stride {} blocks {}",
                    r.block_len, r.block_stride, r.num_blocks
                ),
                "needs a positive block_len, stride >= block_len and at least one block".into(),
            );
            continue;
        }
        if r.num_blocks > MAX_KERNEL_BLOCKS {
            bad(
                &field(),
                format!("{} blocks", r.num_blocks),
                format!("at most {MAX_KERNEL_BLOCKS} kernel blocks (int32 descriptor ids)"),
            );
        }
        if let Some(states) = r.states {
            // a state tensor's own slots: each a logical page of `ppl` kernel blocks inside the region
            if states == 0 || states.checked_mul(m.ppl).is_none_or(|k| k > r.num_blocks) {
                bad(
                    &format!("regions[{i}].states"),
                    states.to_string(),
                    format!("must be positive and at most {} blocks / ppl {}", r.num_blocks, m.ppl),
                );
            }
        }
        if r.end().is_none() {
            bad(
                &field(),
                format!("base {:#x}", r.base),
                "its extent overflows the 64-bit address space".into(),
            );
        }
        if let Some(g) = r.group {
            if g as usize >= m.groups.len() {
                bad(
                    &field(),
                    format!("group {g}"),
                    format!("only {} groups exist", m.groups.len()),
                );
            }
        }
    }
    let has_ssm = m.groups.contains(&GroupKind::Ssm);
    let mut seen = vec![false; m.regions.len()];
    for &i in &m.ssm_regions {
        match seen.get_mut(i as usize) {
            Some(s) if !*s => *s = true,
            _ => bad(
                "ssm_regions",
                format!("{:?}", m.ssm_regions),
                format!("indices must be distinct and below {} regions", m.regions.len()),
            ),
        }
    }
    let (conv, ssm) = m.ssm_sizes;
    let proj_sum = m.conv_proj_bytes.iter().try_fold(0u64, |a, &b| a.checked_add(b));
    if has_ssm {
        if m.ssm_regions.is_empty() || conv == 0 || ssm == 0 {
            bad(
                "ssm_sizes",
                format!("{:?} over {} ssm regions", m.ssm_sizes, m.ssm_regions.len()),
                "an SSM model needs positive state sizes and SSM regions".into(),
            );
        }
        if !matches!(m.conv_proj_bytes.len(), 1 | 3) || proj_sum != Some(conv) {
            bad(
                "conv_proj_bytes",
                format!("{:?}", m.conv_proj_bytes),
                format!("needs 1 or 3 sub-projections summing to conv bytes {conv}"),
            );
        }
        state_part_findings(m, &mut bad);
    } else if m.ssm_sizes != (0, 0) || !m.conv_proj_bytes.is_empty() || !m.ssm_regions.is_empty() {
        bad(
            "ssm_sizes",
            format!("{:?}", m.ssm_sizes),
            "a model without SSM groups advertises no SSM state".into(),
        );
    }
    let use_mla = m.groups.contains(&GroupKind::Mla) && !m.groups.contains(&GroupKind::Attention);
    if m.use_mla != use_mla {
        bad(
            "use_mla",
            m.use_mla.to_string(),
            format!("groups {:?} imply {use_mla}", m.groups),
        );
    }
    if m.total_num_kv_heads == 0 || (m.use_mla && m.total_num_kv_heads != 1) {
        bad(
            "total_num_kv_heads",
            m.total_num_kv_heads.to_string(),
            "must be positive, and 1 for MLA".into(),
        );
    }
    out
}

/// State parts and the conv layout: parts only on SSM regions, listing distinct ascending sub-projections that
/// exist, either on every SSM region or on none; an `sd` conv state's rows positive, bounded, dividing every
/// sub-projection; a `ds` one sends none.
fn state_part_findings(m: &AgentMeta, bad: &mut impl FnMut(&str, String, String)) {
    let projs = m.conv_proj_bytes.len();
    let mut split = 0usize;
    for (i, r) in m.regions.iter().enumerate() {
        let Some(part) = &r.state_part else { continue };
        if !m.ssm_regions.contains(&(i as u32)) {
            bad(
                &format!("regions[{i}].state_part"),
                format!("{part:?}"),
                "only SSM regions hold state parts".into(),
            );
            continue;
        }
        split += 1;
        if let StatePart::Conv(list) = part {
            let ascending = list.windows(2).all(|w| w[0] < w[1]);
            if list.is_empty() || list.len() > projs || !ascending || list.iter().any(|&p| p as usize >= projs) {
                bad(
                    &format!("regions[{i}].state_part"),
                    format!("conv {:?}", list.iter().take(MAX_CONV_PROJS + 1).collect::<Vec<_>>()),
                    format!("must list distinct ascending sub-projections below {projs}"),
                );
            }
        }
    }
    if split != 0 && split != m.ssm_regions.len() {
        bad(
            "regions.state_part",
            format!("{split} of {} SSM regions", m.ssm_regions.len()),
            "every SSM region holds a state part, or none does".into(),
        );
    }
    match m.conv_layout {
        ConvLayout::Ds if m.conv_rows != 0 => bad(
            "conv_rows",
            m.conv_rows.to_string(),
            "only an sd conv state sends its rows".into(),
        ),
        ConvLayout::Sd
            if m.conv_rows == 0
                || m.conv_rows > MAX_CONV_ROWS
                || m.conv_proj_bytes.iter().any(|&b| b % m.conv_rows != 0) =>
        {
            bad(
                "conv_rows",
                m.conv_rows.to_string(),
                format!(
                    "an sd conv state needs 1 to {MAX_CONV_ROWS} rows dividing every sub-projection {:?}",
                    m.conv_proj_bytes
                ),
            );
        }
        _ => {}
    }
}

/// Memory a plan must never touch: regions overlapping one another, and an SSM state larger than its logical
/// page (`block_len x ppl`). Values that do not compute (see [`structure_findings`]) are skipped here.
pub fn placement_findings(m: &AgentMeta) -> Vec<Finding> {
    let mut out = Vec::new();
    let regions: Vec<_> = m.regions.iter().take(MAX_REGIONS).collect();
    let ssm = |i: usize| m.ssm_regions.iter().any(|&s| s as usize == i);
    for (i, r) in regions.iter().enumerate() {
        if let Some(j) = (0..i).find(|&j| regions[j].base == r.base) {
            let a = regions[j];
            let same_steps = (a.block_stride, a.num_blocks) == (r.block_stride, r.num_blocks);
            if !same_steps || a.block_len == r.block_len || ssm(i) || ssm(j) {
                let end = |x: &crate::core::meta::RegionMeta| x.end().unwrap_or(x.base);
                out.push(Finding::invalid(
                    "region_overlap",
                    format!(
                        "regions[{j}] [{:#x}, {:#x}) and regions[{i}] [{:#x}, {:#x})",
                        a.base,
                        end(a),
                        r.base,
                        end(r)
                    ),
                    "each region is its own tensor (only attention pages of different lengths may alias one, \
                     stepping by one stride over one block count): writes into one would land in the other",
                ));
            }
        }
    }
    // aliases of one base are one tensor; distinct tensors must not overlap
    let extents = tensor_extents(regions.iter().map(|r| (r.base, r.end().unwrap_or(r.base))));
    for pair in extents.windows(2) {
        let ((a_base, a_end, a), (b_base, b_end, b)) = (pair[0], pair[1]);
        if a_end > b_base {
            out.push(Finding::invalid(
                "region_overlap",
                format!("regions[{a}] [{a_base:#x}, {a_end:#x}) and regions[{b}] [{b_base:#x}, {b_end:#x})"),
                "each region is its own tensor: writes into one would land in the other",
            ));
        }
    }
    let (conv, ssm) = m.ssm_sizes;
    // what a region's page holds: the whole state, or its part of it
    let state = |part: Option<&StatePart>| match part {
        None => conv.checked_add(ssm),
        Some(StatePart::Temporal) => Some(ssm),
        Some(StatePart::Conv(list)) => list
            .iter()
            .try_fold(0u64, |a, &p| a.checked_add(*m.conv_proj_bytes.get(p as usize)?)),
    };
    let too_small: Vec<String> = m
        .ssm_regions
        .iter()
        .filter_map(|&i| m.regions.get(i as usize).map(|r| (i, r)))
        .filter(|(_, r)| {
            let state = state(r.state_part.as_ref());
            state.is_none() || r.block_len.checked_mul(m.ppl).is_none_or(|page| state > Some(page))
        })
        .map(|(i, r)| format!("regions[{i}] page {} x {}", r.block_len, m.ppl))
        .collect();
    if !too_small.is_empty() {
        out.push(Finding::invalid(
            "ssm_state_size",
            format!("state {conv} + {ssm} bytes"),
            format!(
                "an SSM state must fit its logical page (block_len x ppl): {}",
                too_small.join(", ")
            ),
        ));
    }
    out
}
