//! Internal consistency of one metadata, checked before its values are trusted for any arithmetic.
//!
//! A decoded [`AgentMeta`] is well-typed but may still lie: a rank outside its TP size, a stride shorter than
//! its block, an SSM region index past the region list, an extent that wraps the address space. Planning
//! from such a table could index out of bounds or overflow, so these are rejected at decode.

use super::error::Finding;
use crate::core::meta::AgentMeta;
use crate::core::region::GroupKind;

/// Every inconsistency in `meta`, one finding each (empty when well formed).
pub fn check_well_formed(m: &AgentMeta) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut bad = |field: &str, value: String, why: String| out.push(Finding::invalid(field, value, why));
    if m.tp_size == 0 || m.tp_rank >= m.tp_size {
        bad(
            "tp_rank",
            format!("{}/{}", m.tp_rank, m.tp_size),
            "tp_rank must be below a positive tp_size".into(),
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
        let field = format!("regions[{i}]");
        if r.block_len == 0 || r.block_stride < r.block_len || r.num_blocks == 0 {
            bad(
                &field,
                format!(
                    "block_len {} stride {} blocks {}",
                    r.block_len, r.block_stride, r.num_blocks
                ),
                "needs a positive block_len, stride >= block_len and at least one block".into(),
            );
            continue;
        }
        let extent = (r.num_blocks - 1)
            .checked_mul(r.block_stride)
            .and_then(|v| v.checked_add(r.block_len));
        if extent.and_then(|e| r.base.checked_add(e)).is_none() {
            bad(
                &field,
                format!("base {:#x}", r.base),
                "its extent overflows the 64-bit address space".into(),
            );
        }
        if let Some(g) = r.group {
            if g as usize >= m.groups.len() {
                bad(
                    &field,
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
