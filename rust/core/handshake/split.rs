//! The remote block split of hybrid MLA+SSM pulls (reference C.6, vLLM 0.33.0 pre-step).
//!
//! Hybrid kernel block sizes follow the TP-sharded SSM page, so P and D can pick kernel blocks that are not
//! multiples of each other. In pull mode the decode side then views the remote kernel blocks in their common
//! unit `gcd(local, remote)`: every remote kernel page is cut into `split = remote / unit` pieces. Validation
//! and planning both see the rewritten metadata.

use crate::core::meta::AgentMeta;
use crate::core::region::GroupKind;

/// Largest split (and largest resulting block-size ratio) vLLM accepts.
pub const MAX_SPLIT: u64 = 128;

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The remote metadata as a hybrid MLA+SSM pull must see it, when a split applies: local is the pulling
/// (decode) side, both are SSM + MLA models, and the local kernel block is not a multiple of the remote one.
/// `None` when no split applies or the remote layout cannot be cut (strides differ from block lengths, a
/// block length does not divide by the split, or the split or resulting ratio exceeds [`MAX_SPLIT`]); the
/// block-size-ratio check then reports the pair.
pub fn remote_block_split(local: &AgentMeta, remote: &AgentMeta) -> Option<AgentMeta> {
    let hybrid_mla = |m: &AgentMeta| m.use_mla && m.groups.contains(&GroupKind::Ssm);
    let (lk, rk) = (local.kernel_block_size, remote.kernel_block_size);
    if local.transfer_mode != crate::core::meta::TransferMode::Pull
        || !hybrid_mla(local)
        || !hybrid_mla(remote)
        || lk == 0
        || rk == 0
        || lk % rk == 0
    {
        return None;
    }
    let unit = gcd(lk, rk);
    let split = rk / unit;
    if split.max(lk / unit) > MAX_SPLIT {
        return None;
    }
    let cuttable = remote
        .regions
        .iter()
        .all(|r| r.block_stride == r.block_len && r.block_len % split == 0);
    if !cuttable {
        return None;
    }
    let mut out = remote.clone();
    out.kernel_block_size = rk / split;
    out.ppl = remote.ppl.checked_mul(split)?;
    out.num_blocks = remote.num_blocks.checked_mul(split)?;
    for r in &mut out.regions {
        r.block_len /= split;
        r.block_stride = r.block_len;
        r.num_blocks = r.num_blocks.checked_mul(split)?;
    }
    Some(out)
}
