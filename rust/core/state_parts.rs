//! SSM states stored in several tensors (SGLang's `MambaPool`: conv apart from temporal, one conv tensor or one
//! per sub-projection) and conv states stored rows-major (`sd`): which part of a state a tensor holds, the streams
//! of each part (what a TP share of it is cut from), and the rule that split states be whole.

use serde::{Deserialize, Serialize};

use super::error::LayoutError;
use super::handshake::MAX_KERNEL_BLOCKS;
use super::layout::LayerInput;
use super::region::{BlockGeometry, Region};
use super::spec::ConvSplit;

/// How a conv state is stored in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ConvLayout {
    /// Channels x conv rows (vLLM's and SGLang's Mamba2 layout): a channel range of a sub-projection is one range.
    #[default]
    Ds,
    /// Conv rows x channels ("state-len major", SGLang's Kimi-Linear layout): a channel range is one range per row.
    Sd,
}

impl ConvLayout {
    pub(crate) fn is_ds(&self) -> bool {
        *self == ConvLayout::Ds
    }
}

/// Which part of an SSM state one tensor holds, for engines keeping conv and temporal state in separate tensors
/// (SGLang's `MambaPool`: one conv tensor, or one per Q/K/V sub-projection, and one temporal tensor).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StatePart {
    /// The conv state of these sub-projections (ascending indices into the kind's sub-projections, e.g. `[0, 1,
    /// 2]` for one tensor of concatenated Q|K|V channels, `[1]` for a tensor of K alone).
    Conv(Vec<u32>),
    /// The temporal (SSM) state.
    Temporal,
}

/// Most sub-projections a conv part may list (Mamba2's x|B|C, GDN's Q|K|V).
pub const MAX_CONV_PROJS: usize = 3;
/// Most conv rows of an `sd` conv state (a conv kernel of 4 keeps 3): a state's streams are one per row and
/// sub-projection, so this bounds a table's rows.
pub const MAX_CONV_ROWS: u64 = 64;

impl ConvSplit {
    /// Bytes of `part` of one state (the whole state for `None`).
    pub fn part_bytes(&self, part: Option<&StatePart>) -> u64 {
        match part {
            None => self.conv_bytes.saturating_add(self.ssm_bytes),
            Some(StatePart::Temporal) => self.ssm_bytes,
            Some(StatePart::Conv(projs)) => projs
                .iter()
                .map(|&p| self.proj_bytes.get(p as usize).copied().unwrap_or(0))
                .fold(0u64, u64::saturating_add),
        }
    }

    /// `(offset, len)` of every stream of `part` (the whole state for `None`) inside its page, in page order:
    /// each conv sub-projection the part holds (with an `sd` conv state, its channels of each conv row, row by
    /// row), then the temporal state. A stream is a channel range of one sub-projection (or the temporal
    /// state), so a TP share of it is one range: [`ConvSplit::streams`] for a whole `ds` state.
    ///
    /// Sizes were checked when the split was derived (or bounded by the handshake), so sums cannot wrap;
    /// saturating all the same.
    pub fn part_streams(&self, part: Option<&StatePart>) -> Vec<(u64, u64)> {
        let all: Vec<u32> = (0..self.proj_bytes.len() as u32).collect();
        let (projs, temporal): (&[u32], bool) = match part {
            None => (&all, true),
            Some(StatePart::Conv(p)) => (p, false),
            Some(StatePart::Temporal) => (&[], true),
        };
        let bytes = |p: u32| self.proj_bytes.get(p as usize).copied().unwrap_or(0);
        let mut out = Vec::new();
        let mut conv = 0u64;
        if self.conv_layout == ConvLayout::Sd && self.conv_rows > 0 {
            let per_row = |p: u32| bytes(p) / self.conv_rows;
            let row_bytes = projs.iter().map(|&p| per_row(p)).fold(0u64, u64::saturating_add);
            for j in 0..self.conv_rows {
                let mut off = j.saturating_mul(row_bytes);
                for &p in projs {
                    out.push((off, per_row(p)));
                    off = off.saturating_add(per_row(p));
                }
            }
            conv = row_bytes.saturating_mul(self.conv_rows);
        } else {
            for &p in projs {
                out.push((conv, bytes(p)));
                conv = conv.saturating_add(bytes(p));
            }
        }
        if temporal {
            // a whole state's temporal part starts at the conv bytes (every sub-projection precedes it)
            out.push((conv, self.ssm_bytes));
        }
        out
    }
}

/// Split states must be whole: each conv sub-projection in as many SSM regions as hold the temporal state, and
/// whole-state regions not mixed with parts (every state layer of a rank is stored one way).
pub(crate) fn check_state_parts(regions: &[Region], ssm_regions: &[usize], projs: usize) -> Result<(), LayoutError> {
    let parts: Vec<&Region> = ssm_regions.iter().map(|&i| &regions[i]).collect();
    let split = parts.iter().filter(|r| r.state_part.is_some()).count();
    if split == 0 {
        return Ok(());
    }
    if split != parts.len() {
        let whole = parts.iter().find(|r| r.state_part.is_none()).map_or("", |r| &r.name);
        return Err(LayoutError::BadSsmSpec {
            layer: whole.to_string(),
            reason: "it holds whole states while other state layers hold parts (conv, temporal) of theirs".into(),
        });
    }
    let temporal = parts
        .iter()
        .filter(|r| r.state_part == Some(StatePart::Temporal))
        .count();
    let mut conv = [0usize; MAX_CONV_PROJS];
    for r in &parts {
        if let Some(StatePart::Conv(projs)) = &r.state_part {
            for &p in projs {
                if let Some(c) = conv.get_mut(p as usize) {
                    *c += 1;
                }
            }
        }
    }
    let used = projs.min(conv.len());
    if temporal == 0 || conv[..used].iter().any(|&c| c != temporal) {
        return Err(LayoutError::BadSsmSpec {
            layer: parts[0].name.clone(),
            reason: format!(
                "split states are not whole: {temporal} temporal tensors but conv tensors per sub-projection {:?}",
                &conv[..used]
            ),
        });
    }
    Ok(())
}

/// States an SSM layer's tensor holds: its own `num_blocks` (a slot-indexed state pool beside a page pool, as
/// SGLang's `MambaPool`), at most [`MAX_KERNEL_BLOCKS`] kernel blocks' worth, or the rank's logical blocks.
pub(crate) fn ssm_states(layer: &LayerInput, geo: &BlockGeometry) -> Result<u64, LayoutError> {
    let Some(states) = layer.memory.num_blocks else {
        return Ok(geo.num_logical_blocks);
    };
    if states.checked_mul(geo.ppl).is_none_or(|k| k > MAX_KERNEL_BLOCKS) {
        return Err(LayoutError::BadField {
            at: format!("layer {:?} memory.num_blocks", layer.name),
            reason: format!(
                "{states} states of {} kernel blocks each exceed the limit of {MAX_KERNEL_BLOCKS} kernel blocks",
                geo.ppl
            ),
        });
    }
    Ok(states)
}
