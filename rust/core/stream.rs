//! The stream schedule of a rank: when each part of its KV is final during a request's last prefill forward,
//! and at which layer's save hook it may be posted (streaming push).
//!
//! vLLM runs the decoder layers in layer-number order (the table's natural name order) and calls the
//! connector's `save_kv_layer(L)` right after attention (or MLA) layer `L` wrote its KV; SSM layers get no
//! hook. So when the hook of `L` fires, `L` and every layer of an earlier decoder layer (a smaller layer
//! number) have written their KV for this step. Modules sharing one layer number (e.g. a parallel attention
//! and SSM mixer in one decoder layer) are not assumed to run in name order: only `L` itself among them.
//!
//! A (region, group) pair is one layer's pages or states (HMA puts layer *i* of every group in tensor *i*),
//! final once that layer ran: its stage is the first hook that proves it ran, or the end of the forward when
//! none does (the connector posts those at `wait_for_save`). With [`Granularity::Region`] every pair of a
//! region waits for the region's last layer: the per-region cut, coarser, since HMA puts layers of every
//! part of the model in each tensor. A pair no layer writes (a group with fewer layers than tensors) is final
//! from the start and joins the first stage.

use std::collections::HashSet;

use super::error::LayoutError;
use super::plan::StageMap;
use super::region::RegionTable;

/// How finely a request's KV is cut into stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Granularity {
    /// One (region, group) pair, i.e. one layer's KV, is posted once its layer ran.
    Layer,
    /// A region (tensor) is posted once every layer in it ran.
    Region,
}

/// One stage: what becomes final at one hook (or at the end of the forward).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    /// The layer whose save hook proves the stage final; `None`: only the end of the forward does.
    pub hook: Option<String>,
    /// The (region, group) pairs of the stage that some layer writes, region-major.
    pub units: Vec<(u32, u32)>,
}

/// When each (region, group) pair of a rank is final during a forward pass; see the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSchedule {
    /// Every hook layer in forward order, with the number of stages final once its hook fired (stages
    /// `0..n` may then be posted).
    pub hooks: Vec<(String, usize)>,
    /// The stages in forward order.
    pub stages: Vec<Stage>,
    /// The stage of every (region, group) pair, for [`crate::core::plan::PeerPlan::plan_staged`].
    pub map: StageMap,
}

/// The decoder-layer key of a layer name: the name up to the end of its first digit run (`model.layers.12`
/// of `model.layers.12.self_attn.attn`), or the whole name when it has no digit.
fn block_key(name: &str) -> &str {
    let b = name.as_bytes();
    match b.iter().position(u8::is_ascii_digit) {
        Some(i) => {
            let end = b[i..]
                .iter()
                .position(|c| !c.is_ascii_digit())
                .map_or(b.len(), |n| i + n);
            &name[..end]
        }
        None => name,
    }
}

impl StreamSchedule {
    /// The schedule of `table`. `hooks`: the layers vLLM calls `save_kv_layer` for (default: every attention
    /// and MLA layer of the table).
    ///
    /// # Errors
    /// `UnknownLayer` for a hook that is not a layer of `table`.
    pub fn new(
        table: &RegionTable,
        hooks: Option<&[String]>,
        granularity: Granularity,
    ) -> Result<StreamSchedule, LayoutError> {
        let layers = &table.layers;
        let is_hook: Vec<bool> = match hooks {
            None => layers.iter().map(|l| !l.is_ssm).collect(),
            Some(names) => {
                let known: HashSet<&str> = layers.iter().map(|l| l.name.as_str()).collect();
                if let Some(n) = names.iter().find(|n| !known.contains(n.as_str())) {
                    return Err(LayoutError::UnknownLayer(n.clone()));
                }
                let set: HashSet<&str> = names.iter().map(String::as_str).collect();
                layers.iter().map(|l| set.contains(l.name.as_str())).collect()
            }
        };
        // Decoder-layer index of every layer (natural order keeps each decoder layer's modules together).
        let mut block = Vec::with_capacity(layers.len());
        for (i, l) in layers.iter().enumerate() {
            let same = i > 0 && block_key(&layers[i - 1].name) == block_key(&l.name);
            block.push(if i == 0 { 0 } else { block[i - 1] + usize::from(!same) });
        }
        let (regions, groups) = (table.regions.len(), table.groups.len());
        // Forward position of the last layer writing each pair (region-major); `None`: no layer writes it.
        let mut last: Vec<Option<usize>> = vec![None; regions * groups];
        for (pos, l) in layers.iter().enumerate() {
            last[l.region as usize * groups + l.group as usize] = Some(pos);
        }
        let written: Vec<bool> = last.iter().map(Option::is_some).collect();
        if granularity == Granularity::Region {
            for r in last.chunks_mut(groups.max(1)) {
                let m = r.iter().flatten().max().copied();
                r.iter_mut().for_each(|p| *p = m);
            }
        }
        let hook_pos: Vec<usize> = (0..layers.len()).filter(|&i| is_hook[i]).collect();
        // The first hook proving position `p` ran: `p` itself, or a hook in a later decoder layer.
        let final_at = |p: usize| {
            let mut j = hook_pos.partition_point(|&h| h < p);
            while j < hook_pos.len() && hook_pos[j] != p && block[hook_pos[j]] == block[p] {
                j += 1;
            }
            j // hook_pos.len(): the end of the forward
        };
        let at: Vec<Option<usize>> = last.iter().map(|p| p.map(final_at)).collect();
        let mut keys: Vec<usize> = at.iter().flatten().copied().collect();
        keys.sort_unstable();
        keys.dedup();
        if keys.is_empty() {
            keys.push(hook_pos.len()); // nothing is written by a known layer: one stage, at the end
        }
        let stage_of: Vec<u32> = at
            .iter()
            .map(|a| a.map_or(0, |a| keys.partition_point(|&k| k < a)) as u32)
            .collect();
        let mut stages: Vec<Stage> = keys
            .iter()
            .map(|&k| Stage {
                hook: hook_pos.get(k).map(|&p| layers[p].name.clone()),
                units: Vec::new(),
            })
            .collect();
        for (i, (s, w)) in stage_of.iter().zip(&written).enumerate() {
            if *w {
                stages[*s as usize]
                    .units
                    .push(((i / groups) as u32, (i % groups) as u32));
            }
        }
        let hooks = hook_pos
            .iter()
            .enumerate()
            .map(|(j, &p)| (layers[p].name.clone(), keys.partition_point(|&k| k <= j)))
            .collect();
        let map = StageMap::new(regions, groups, stage_of, keys.len())
            .map_err(|e| LayoutError::Groups(format!("stream schedule: {e}")))?;
        Ok(StreamSchedule { hooks, stages, map })
    }
}
