//! Bounds on every count and size a scenario gives, checked as soon as it is parsed (and again before an
//! engine is built), before any of them sizes an allocation.
//!
//! A scenario is untrusted input: building it lays out, tables and plans every rank of both engines, so the
//! TP sizes multiply everything the model lists and the local ranks multiply every request. Each count has a
//! named limit, and the products that size the build have one too; an error names the field, the value and
//! the limit. Zero sizes are refused here too, by field name (the schema's `minimum: 1`).

use super::{Engine, Group, Request, Scenario, ScenarioError};
use crate::core::tp::MAX_TP_SIZE;
use crate::core::TransferMode;

/// Most KV-cache groups in a model, and most id lists in one side of a request (models have a handful).
pub const MAX_GROUPS: usize = 256;
/// Most layers in a model, summed over its tensors (models have at most a few hundred).
pub const MAX_LAYERS: usize = 4096;
/// Most layers over all ranks of one engine (`tp_size` x layers): every rank's layout, region table,
/// metadata and peer tables are built, about 15 KiB per rank-layer (1024 ranks of 64 layers, or 16 of 4096).
pub const MAX_RANK_LAYERS: u64 = 1 << 16;
/// Most dims of an SSM temporal shape (real states have 2 or 3).
pub const MAX_TEMPORAL_DIMS: usize = 8;
/// Longest layer name or request id in characters (each is copied once per rank), as the schema's
/// `maxLength`.
pub const MAX_NAME_CHARS: usize = 256;
/// Largest logical or kernel block in tokens (a block longer than any context is a mistake).
pub const MAX_BLOCK_TOKENS: u64 = 1 << 20;
/// Most logical blocks in a pool: descriptor ids are int32, so a larger pool could not be addressed.
pub const MAX_NUM_BLOCKS: u64 = i32::MAX as u64;
/// Most requests in a scenario.
pub const MAX_REQUESTS: usize = 1 << 16;
/// Most block ids one side of one request lists, over all its groups (a 16M-token context at 16 tokens per
/// block).
pub const MAX_IDS_PER_REQUEST: usize = 1 << 20;
/// Most (request, local rank) plans (`requests` x the posting engine's `tp_size`): each is built and kept,
/// and `hybrid-kv plan` prints one table row per plan.
pub const MAX_RANK_PLANS: u64 = 1 << 16;
/// Most block ids the plans read in all (every request's ids, both sides, once per posting rank): each plan
/// emits descriptor ids in proportion.
pub const MAX_PLANNED_IDS: u64 = 1 << 24;

fn over(field: String, value: u64, limit: u64) -> ScenarioError {
    ScenarioError::OverLimit { field, value, limit }
}

/// `Err` naming `field` when `value` is over `limit`.
fn at_most(field: impl FnOnce() -> String, value: u64, limit: u64) -> Result<(), ScenarioError> {
    if value > limit {
        return Err(over(field(), value, limit));
    }
    Ok(())
}

/// `Err` naming `field` when `value` is zero.
fn positive(field: impl FnOnce() -> String, value: u64) -> Result<(), ScenarioError> {
    if value == 0 {
        return Err(ScenarioError::Invalid(format!("{} must be positive, got 0", field())));
    }
    Ok(())
}

fn len(n: usize) -> u64 {
    n as u64
}

/// Check every count and size of `s` against its bound (see the constants of this module).
///
/// # Errors
/// `OverLimit` naming the field, its value and the limit; `Invalid` naming a field that is zero.
pub fn check_bounds(s: &Scenario) -> Result<(), ScenarioError> {
    check_engine(&s.prefill, "prefill")?;
    check_engine(&s.decode, "decode")?;
    let groups = &s.model.groups;
    at_most(|| "model.groups (count)".into(), len(groups.len()), len(MAX_GROUPS))?;
    for (g, group) in groups.iter().enumerate() {
        check_group(group, g)?;
    }
    let tensors = &s.model.tensors;
    at_most(|| "model.tensors (count)".into(), len(tensors.len()), len(MAX_LAYERS))?;
    let mut layers = 0usize;
    for (t, tensor) in tensors.iter().enumerate() {
        layers += tensor.layers.len();
        at_most(
            || "model layers (count over all tensors)".into(),
            len(layers),
            len(MAX_LAYERS),
        )?;
        for (l, layer) in tensor.layers.iter().enumerate() {
            let name = || format!("model.tensors[{t}].layers[{l}].name (characters)");
            at_most(name, len(layer.name.chars().count()), len(MAX_NAME_CHARS))?;
        }
    }
    for (engine, side) in [(&s.prefill, "prefill"), (&s.decode, "decode")] {
        let tp = u64::from(engine.tp_size);
        at_most(
            || format!("{side}.tp_size x model layers ({tp} x {layers})"),
            tp * len(layers),
            MAX_RANK_LAYERS,
        )?;
    }
    let requests = &s.requests;
    at_most(|| "requests (count)".into(), len(requests.len()), len(MAX_REQUESTS))?;
    let (local, side) = match s.mode {
        TransferMode::Pull => (&s.decode, "decode"),
        TransferMode::Push => (&s.prefill, "prefill"),
    };
    let (n, tp) = (len(requests.len()), u64::from(local.tp_size));
    at_most(
        || format!("requests x {side}.tp_size ({n} x {tp})"),
        n * tp,
        MAX_RANK_PLANS,
    )?;
    let mut ids = 0u64;
    for (r, req) in requests.iter().enumerate() {
        ids += check_request(req, r)?;
    }
    at_most(
        || format!("block ids of all requests x {side}.tp_size ({ids} x {tp})"),
        ids * tp,
        MAX_PLANNED_IDS,
    )
}

fn check_engine(e: &Engine, side: &str) -> Result<(), ScenarioError> {
    let bounds = [
        ("tp_size", u64::from(e.tp_size), u64::from(MAX_TP_SIZE)),
        ("logical_block_size", e.logical_block_size, MAX_BLOCK_TOKENS),
        ("kernel_block_size", e.kernel_block_size, MAX_BLOCK_TOKENS),
        ("num_blocks", e.num_blocks, MAX_NUM_BLOCKS),
    ];
    let slots = e.state_slots.map(|v| ("state_slots", v, MAX_NUM_BLOCKS));
    for (field, value, limit) in bounds.into_iter().chain(slots) {
        positive(|| format!("{side}.{field}"), value)?;
        at_most(|| format!("{side}.{field}"), value, limit)?;
    }
    Ok(())
}

fn check_group(group: &Group, g: usize) -> Result<(), ScenarioError> {
    let field = |name: &str| format!("model.groups[{g}].{name}");
    match group {
        Group::Attention {
            num_kv_heads,
            head_size,
            head_size_v,
            dtype_bytes,
        } => {
            positive(|| field("num_kv_heads"), *num_kv_heads)?;
            positive(|| field("head_size"), *head_size)?;
            let _ = head_size_v; // 0: the group's tensors hold K or V alone (engines keeping them apart)
            positive(|| field("dtype_bytes"), *dtype_bytes)
        }
        Group::Mla { head_size, dtype_bytes } => {
            positive(|| field("head_size"), *head_size)?;
            positive(|| field("dtype_bytes"), *dtype_bytes)
        }
        Group::Ssm {
            conv_dim,
            conv_rows,
            conv_dtype_bytes,
            temporal_shape,
            temporal_dtype_bytes,
            ..
        } => {
            positive(|| field("conv_dim"), *conv_dim)?;
            positive(|| field("conv_rows"), *conv_rows)?;
            positive(|| field("conv_dtype_bytes"), *conv_dtype_bytes)?;
            positive(|| field("temporal_dtype_bytes"), *temporal_dtype_bytes)?;
            positive(|| field("temporal_shape (dims)"), len(temporal_shape.len()))?;
            let dims = len(temporal_shape.len());
            at_most(|| field("temporal_shape (dims)"), dims, len(MAX_TEMPORAL_DIMS))?;
            for (i, &d) in temporal_shape.iter().enumerate() {
                positive(|| field(&format!("temporal_shape[{i}]")), d)?;
            }
            Ok(())
        }
    }
}

/// Check one request's bounds and return how many block ids it lists (both sides).
fn check_request(req: &Request, r: usize) -> Result<u64, ScenarioError> {
    let id = || format!("requests[{r}].id (characters)");
    at_most(id, len(req.id.chars().count()), len(MAX_NAME_CHARS))?;
    let mut total = 0;
    for (lists, side) in [(&req.prefill, "prefill"), (&req.decode, "decode")] {
        let groups = || format!("requests[{r}].{side} (id lists)");
        at_most(groups, len(lists.len()), len(MAX_GROUPS))?;
        let ids: usize = lists.iter().map(Vec::len).sum();
        let field = || format!("requests[{r}].{side} (block ids over all groups)");
        at_most(field, len(ids), len(MAX_IDS_PER_REQUEST))?;
        total += len(ids);
    }
    Ok(total)
}
