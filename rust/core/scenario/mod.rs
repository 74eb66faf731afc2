//! Scenarios: a whole prefill/decode deployment described without GPUs (the JSON contract documented by
//! `schemas/scenario.schema.json` and `docs/scenario.md`), turned into every rank's layout, region table,
//! handshake metadata and peer plans, and planned request by request.
//!
//! Specs are global (total KV heads, total SSM conv width and temporal dim 0) and divided per rank as
//! docs/byte-layouts.md says. Every tensor's page is its attention sharers' page (all must agree), or the largest SSM
//! state when it has no attention sharer; SSM sharers are padded to it. Addresses are synthetic: each rank's
//! tensors are laid out back to back (4 KiB aligned, with a 4 KiB gap), prefill and decode far apart.

pub mod bounds;
pub mod check;
pub mod ranks;
pub mod report;

#[cfg(test)]
mod check_tests;
#[cfg(test)]
mod state_parts_tests;
#[cfg(test)]
mod tests;

use serde::{Deserialize, Serialize};

use self::bounds::check_bounds;
use super::error::LayoutError;
use super::layout::{LayerInput, LayerMemory, MemType, RankLayout};
use super::meta::{AgentMeta, EngineInfo, TransferMode};
use super::plan::PlanError;
use super::plan::{PeerPlan, Plan};
use super::region::RegionTable;
use super::spec::{AttentionSpec, ConvLayout, LayerSpec, MambaKind, MlaSpec, SsmSpec, StatePart};
use super::tp::handshake_target_ranks;

/// A whole deployment: model, both engines, mode and requests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Free-form description.
    #[serde(default)]
    pub name: Option<String>,
    /// The model's KV-cache groups and tensors.
    pub model: Model,
    /// The prefill engine.
    pub prefill: Engine,
    /// The decode engine.
    pub decode: Engine,
    /// Who initiates transfers.
    #[serde(default)]
    pub mode: TransferMode,
    /// Requests to plan.
    #[serde(default)]
    pub requests: Vec<Request>,
}

/// KV-cache groups (in group order) and the tensors their layers share.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Model {
    /// Every KV-cache (transfer) group; a layer's `group` indexes this list.
    pub groups: Vec<Group>,
    /// Every KV-cache tensor and the layers sharing it (one layer per group at most, HMA-style).
    pub tensors: Vec<Tensor>,
}

/// One KV-cache group, with its spec given for the whole model (not per rank).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Group {
    /// GQA/MHA attention, heads split across TP.
    Attention {
        /// Total KV heads of the model.
        num_kv_heads: u64,
        /// K elements per head.
        head_size: u64,
        /// V elements per head (defaults to `head_size`).
        #[serde(default)]
        head_size_v: Option<u64>,
        /// Bytes per element.
        dtype_bytes: u64,
    },
    /// MLA latents, replicated on every rank.
    Mla {
        /// Latent elements per token.
        head_size: u64,
        /// Bytes per element.
        dtype_bytes: u64,
    },
    /// SSM / linear-attention state, sharded across TP.
    Ssm {
        /// State family (conv sub-projections).
        mamba: MambaKind,
        /// Total conv channels (all sub-projections) across TP.
        conv_dim: u64,
        /// Conv rows (`d_conv - 1`).
        conv_rows: u64,
        /// Bytes per conv element.
        conv_dtype_bytes: u64,
        /// Temporal state shape with dim 0 across TP.
        temporal_shape: Vec<u64>,
        /// Bytes per temporal element.
        temporal_dtype_bytes: u64,
        /// How the conv state is stored: `ds` (channels x rows, the default) or `sd` (rows x channels).
        #[serde(default, skip_serializing_if = "ConvLayout::is_ds")]
        conv_layout: ConvLayout,
    },
}

/// One tensor and its layers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tensor {
    /// Layers viewing this tensor.
    pub layers: Vec<TensorLayer>,
}

/// One layer of a tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorLayer {
    /// Layer name (natural-sorted to fix region order).
    pub name: String,
    /// Index into `model.groups`.
    pub group: u32,
    /// SSM layers only: the part of the state this tensor holds, for a state split over several tensors
    /// (`{"conv": [0, 1, 2]}`, `"temporal"`; SGLang's `MambaPool`); the whole state when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub part: Option<StatePart>,
}

/// One engine (prefill or decode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Engine {
    /// TP size.
    pub tp_size: u32,
    /// Tokens per logical (scheduler) block.
    pub logical_block_size: u64,
    /// Tokens per kernel block.
    pub kernel_block_size: u64,
    /// Logical blocks in the pool.
    pub num_blocks: u64,
    /// State slots of every tensor holding SSM layers alone: a slot-indexed state pool sized apart from the
    /// page pool (SGLang's `MambaPool`); such tensors hold `num_blocks` states when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_slots: Option<u64>,
    /// The engine's KV-cache layout name (`HND`, `NHD`, vLLM's `LBHNC`...): the order of (head, token) cells
    /// in its attention pages (heads-major when absent). Both engines' pages must order cells alike.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_layout: Option<String>,
}

/// One request: each engine's logical block ids per group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// Request id.
    pub id: String,
    /// Prefill block ids per group (every block of the prompt).
    pub prefill: Vec<Vec<u64>>,
    /// Decode block ids per group (the blocks decode still needs).
    pub decode: Vec<Vec<u64>>,
}

/// A scenario that cannot be built or planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScenarioError {
    /// The JSON does not parse or does not match the schema.
    #[error("scenario JSON: {0}")]
    Json(String),
    /// A value the scenario format forbids.
    #[error("scenario: {0}")]
    Invalid(String),
    /// A count or size over its bound (see `bounds.rs`), refused before it sizes anything.
    #[error("scenario: {field} is {value}, over the limit of {limit}")]
    OverLimit {
        /// The field (a JSON path, with what was counted).
        field: String,
        /// Its value.
        value: u64,
        /// The largest accepted value.
        limit: u64,
    },
    /// The model cannot be laid out at one side's TP size (heads, conv channels or temporal rows that do not
    /// split over its ranks): a deployment that is incompatible, not a malformed file.
    #[error("scenario: {0}")]
    Deployment(String),
    /// A rank's layout is invalid.
    #[error("{side} rank {rank}: {source}")]
    Layout {
        /// "prefill" or "decode".
        side: &'static str,
        /// TP rank.
        rank: u32,
        /// The layout error.
        source: LayoutError,
    },
    /// Planning failed.
    #[error("{context}: {source}")]
    Plan {
        /// Which rank / request.
        context: String,
        /// The planning error.
        source: PlanError,
    },
}

/// One rank of an engine: its layout, region table and handshake metadata.
#[derive(Debug, Clone)]
pub struct RankState {
    /// What the rank registers.
    pub layout: RankLayout,
    /// Its region table.
    pub table: RegionTable,
    /// What it advertises.
    pub meta: AgentMeta,
}

/// A built deployment: every rank of both engines and a peer plan per local rank.
#[derive(Debug, Clone)]
pub struct Deployment {
    /// The scenario it was built from.
    pub scenario: Scenario,
    /// Prefill ranks.
    pub prefill: Vec<RankState>,
    /// Decode ranks.
    pub decode: Vec<RankState>,
    /// Peer plan of every local rank (decode ranks in pull mode, prefill ranks in push mode), by rank.
    pub peers: Vec<PeerPlan>,
}

/// The plan of one request on one local rank.
#[derive(Debug, Clone)]
pub struct RankPlan {
    /// Request id.
    pub request: String,
    /// Local rank (decode in pull mode, prefill in push mode).
    pub local_rank: u32,
    /// The plan.
    pub plan: Plan,
}

impl Scenario {
    /// Parse a scenario from JSON and check its bounds ([`check_bounds`]).
    ///
    /// # Errors
    /// `Json` with serde's message (line and column) for malformed JSON, unknown fields or wrong types;
    /// `OverLimit` or `Invalid` naming a field over its bound or zero.
    pub fn from_json(text: &str) -> Result<Scenario, ScenarioError> {
        let s: Scenario = serde_json::from_str(text).map_err(|e| ScenarioError::Json(e.to_string()))?;
        check_bounds(&s)?;
        Ok(s)
    }
}

fn invalid(msg: String) -> ScenarioError {
    ScenarioError::Invalid(msg)
}

/// The layer spec of `group` on one rank of a `tp`-rank engine.
fn rank_spec(group: &Group, g: usize, tp: u32, side: &str) -> Result<LayerSpec, ScenarioError> {
    let tp64 = u64::from(tp);
    Ok(match group {
        Group::Attention {
            num_kv_heads: k,
            head_size,
            head_size_v,
            dtype_bytes,
        } => {
            if *k == 0 || (tp64 <= *k && k % tp64 != 0) || (tp64 > *k && tp64 % k != 0) {
                return Err(ScenarioError::Deployment(format!(
                    "group {g}: {k} KV heads do not split evenly over {side} TP {tp} (heads must divide by TP or TP by heads)"
                )));
            }
            LayerSpec::FullAttention(AttentionSpec {
                num_kv_heads: (k / tp64).max(1),
                head_size: *head_size,
                head_size_v: *head_size_v,
                dtype_bytes: *dtype_bytes,
                page_size_padded: None,
            })
        }
        Group::Mla { head_size, dtype_bytes } => LayerSpec::Mla(MlaSpec {
            head_size: *head_size,
            dtype_bytes: *dtype_bytes,
            page_size_padded: None,
        }),
        Group::Ssm {
            mamba,
            conv_dim,
            conv_rows,
            conv_dtype_bytes,
            temporal_shape,
            temporal_dtype_bytes,
            conv_layout,
        } => {
            let global = SsmSpec {
                kind: *mamba,
                conv_shape: [*conv_dim, *conv_rows],
                conv_dtype_bytes: *conv_dtype_bytes,
                temporal_shape: temporal_shape.clone(),
                temporal_dtype_bytes: *temporal_dtype_bytes,
                page_size_padded: None,
                conv_layout: *conv_layout,
                part: None,
            };
            let split = global
                .conv_split(&format!("group {g}"))
                .map_err(|e| invalid(e.to_string()))?;
            let dim0 = temporal_shape[0];
            if split.proj_dims.iter().any(|d| d % tp64 != 0) || dim0 % tp64 != 0 {
                return Err(ScenarioError::Deployment(format!(
                    "group {g}: conv sub-projections {:?} and temporal dim 0 ({dim0}) must all divide by {side} TP {tp}",
                    split.proj_dims
                )));
            }
            let mut temporal = temporal_shape.clone();
            temporal[0] /= tp64;
            LayerSpec::Ssm(SsmSpec {
                conv_shape: [conv_dim / tp64, *conv_rows],
                temporal_shape: temporal,
                ..global
            })
        }
    })
}

/// The spec of layer `l` on this rank: its group's, holding the layer's state part if it names one.
fn layer_spec(specs: &[LayerSpec], l: &TensorLayer) -> Result<LayerSpec, ScenarioError> {
    let n = specs.len();
    let spec = specs.get(l.group as usize).ok_or_else(|| {
        invalid(format!(
            "layer {} names group {} but the model has {n} group{}",
            l.name,
            l.group,
            if n == 1 { "" } else { "s" }
        ))
    })?;
    match (spec, &l.part) {
        (_, None) => Ok(spec.clone()),
        (LayerSpec::Ssm(ssm), Some(part)) => Ok(LayerSpec::Ssm(SsmSpec {
            part: Some(part.clone()),
            ..ssm.clone()
        })),
        (_, Some(_)) => Err(invalid(format!(
            "layer {}: part is for the layers of an ssm group; group {} is not one",
            l.name, l.group
        ))),
    }
}

const GAP: u64 = 4096;

fn round_up(v: u64, to: u64) -> Option<u64> {
    v.checked_add(to - 1).map(|x| x / to * to)
}

/// Build the layout of one rank. `origin` is its first address.
fn rank_layout(
    s: &Scenario,
    engine: &Engine,
    side: &'static str,
    rank: u32,
    origin: u64,
) -> Result<RankLayout, ScenarioError> {
    let groups = &s.model.groups;
    let specs: Vec<LayerSpec> = groups
        .iter()
        .enumerate()
        .map(|(g, grp)| rank_spec(grp, g, engine.tp_size, side))
        .collect::<Result<_, _>>()?;
    let heads: Vec<u64> = groups
        .iter()
        .filter_map(|g| {
            if let Group::Attention { num_kv_heads, .. } = g {
                Some(*num_kv_heads)
            } else {
                None
            }
        })
        .collect();
    if heads.windows(2).any(|w| w[0] != w[1]) {
        return Err(invalid(format!(
            "attention groups must share one KV head count, got {heads:?}"
        )));
    }
    if !heads.is_empty() && groups.iter().any(|g| matches!(g, Group::Mla { .. })) {
        return Err(invalid(
            "a model mixing MLA and non-MLA attention groups is not supported".into(),
        ));
    }
    let layout_err = |e: LayoutError| ScenarioError::Layout { side, rank, source: e };
    let mut layers = Vec::new();
    let mut addr = origin;
    for (t, tensor) in s.model.tensors.iter().enumerate() {
        if tensor.layers.is_empty() {
            return Err(invalid(format!("tensor {t} has no layers")));
        }
        let tensor_specs: Vec<LayerSpec> = tensor
            .layers
            .iter()
            .map(|l| layer_spec(&specs, l))
            .collect::<Result<_, _>>()?;
        let mut attn_page: Option<u64> = None;
        let mut state = 0u64;
        for (l, spec) in tensor.layers.iter().zip(&tensor_specs) {
            if let LayerSpec::Ssm(ssm) = spec {
                state = state.max(ssm.state_bytes(&l.name).map_err(layout_err)?);
            } else {
                let page = spec
                    .page_bytes(engine.logical_block_size, &l.name)
                    .map_err(layout_err)?;
                if attn_page.is_some_and(|p| p != page) {
                    return Err(invalid(format!(
                        "tensor {t}: attention layers disagree on the page ({page} vs {attn_page:?} bytes)"
                    )));
                }
                attn_page = Some(page);
            }
        }
        let page = match attn_page {
            Some(p) if p < state => {
                return Err(invalid(format!(
                    "tensor {t}: {side} SSM state of {state} bytes does not fit the attention page of {p} bytes; raise {side} logical_block_size"
                )))
            }
            Some(p) => p,
            None => state,
        };
        // a tensor of states alone is a slot pool of the engine's `state_slots` when it gives them
        let slots = engine.state_slots.filter(|_| attn_page.is_none());
        let bytes = slots
            .unwrap_or(engine.num_blocks)
            .checked_mul(page)
            .ok_or_else(|| invalid(format!("tensor {t}: size overflows")))?;
        for (l, mut spec) in tensor.layers.iter().zip(tensor_specs) {
            if let LayerSpec::Ssm(ssm) = &mut spec {
                ssm.page_size_padded = Some(page);
            }
            let memory = LayerMemory {
                base: addr,
                bytes,
                block_stride: 0,
                device: rank,
                mem_type: MemType::Vram,
                num_blocks: slots,
                page_layout: None,
            };
            layers.push(LayerInput {
                name: l.name.clone(),
                group: l.group,
                spec,
                memory,
            });
        }
        addr = bytes
            .checked_add(addr)
            .and_then(|a| round_up(a, GAP))
            .and_then(|a| a.checked_add(GAP))
            .ok_or_else(|| invalid(format!("{side} rank {rank}: synthetic addresses overflow 64 bits")))?;
    }
    Ok(RankLayout {
        tp_rank: rank,
        tp_size: engine.tp_size,
        logical_block_size: engine.logical_block_size,
        kernel_block_size: engine.kernel_block_size,
        num_logical_blocks: engine.num_blocks,
        total_num_kv_heads: heads.first().copied().unwrap_or(1),
        layers,
        kv_layout: engine.kv_layout.clone(),
    })
}

/// One past the last byte of a rank's tensors (`None` without layers).
fn layout_end(layout: &RankLayout) -> Option<u64> {
    layout.layers.iter().map(|l| l.memory.base + l.memory.bytes).max()
}

fn build_engine(
    s: &Scenario,
    engine: &Engine,
    side: &'static str,
    origin: u64,
) -> Result<Vec<RankState>, ScenarioError> {
    let info = EngineInfo {
        engine_id: side.into(),
        transfer_mode: s.mode,
        kv_layout: engine.kv_layout.clone().unwrap_or_default(),
        ..EngineInfo::default()
    };
    let mut out = Vec::with_capacity(engine.tp_size as usize);
    let mut next = origin;
    for rank in 0..engine.tp_size {
        let layout = rank_layout(s, engine, side, rank, next)?;
        let end = layout_end(&layout).unwrap_or(next);
        next = round_up(end, 1 << 30)
            .and_then(|a| a.checked_add(1 << 30))
            .ok_or_else(|| invalid(format!("{side}: addresses overflow")))?;
        let table = RegionTable::build(&layout).map_err(|e| ScenarioError::Layout { side, rank, source: e })?;
        let meta = AgentMeta::from_table(&table, &info);
        out.push(RankState { layout, table, meta });
    }
    Ok(out)
}

/// Build every rank of both engines (layout, region table, handshake metadata), without any peer plan:
/// `(prefill, decode)`, each indexed by TP rank.
///
/// # Errors
/// `OverLimit` or `Invalid` for values the format forbids, `Layout` for a rank that cannot be laid out.
pub fn build_engines(s: &Scenario) -> Result<(Vec<RankState>, Vec<RankState>), ScenarioError> {
    check_bounds(s)?; // again: `s` may not come from `from_json`
    if s.model.groups.is_empty() || s.model.tensors.is_empty() {
        return Err(invalid("the model needs at least one group and one tensor".into()));
    }
    let prefill = build_engine(s, &s.prefill, "prefill", 0x1000_0000_0000)?;
    let prefill_end = prefill.last().and_then(|r| layout_end(&r.layout)).unwrap_or(0);
    let decode_origin =
        round_up(prefill_end.max(0x2000_0000_0000), 1 << 40).ok_or_else(|| invalid("addresses overflow".into()))?;
    let decode = build_engine(s, &s.decode, "decode", decode_origin)?;
    Ok((prefill, decode))
}

impl Deployment {
    /// Build every rank of both engines and the peer plan of every local rank.
    ///
    /// # Errors
    /// `Invalid` for values the format forbids, `Layout` for a rank that cannot be laid out, `Plan` for a
    /// combination that cannot be planned (naming both sides' values).
    pub fn build(s: &Scenario) -> Result<Deployment, ScenarioError> {
        Deployment::build_with(s, true)
    }

    /// [`Deployment::build`], choosing whether the peer plans coalesce runs into chunk descriptors (see
    /// [`PeerPlan::with_coalescing`]; `false` gives the reference one-id-per-unit plans).
    ///
    /// # Errors
    /// As [`Deployment::build`].
    pub fn build_with(s: &Scenario, coalesce: bool) -> Result<Deployment, ScenarioError> {
        let (prefill, decode) = build_engines(s)?;
        let (local, remote, local_side) = match s.mode {
            TransferMode::Pull => (&decode, &prefill, "decode"),
            TransferMode::Push => (&prefill, &decode, "prefill"),
        };
        let mut peers = Vec::with_capacity(local.len());
        for l in local {
            let rank = l.table.tp_rank;
            let plan_err = |e| ScenarioError::Plan {
                context: format!("{local_side} rank {rank}"),
                source: e,
            };
            let targets = handshake_target_ranks(rank, l.table.tp_size, remote.len() as u32).map_err(plan_err)?;
            let metas: Vec<AgentMeta> = targets.iter().map(|&r| remote[r as usize].meta.clone()).collect();
            peers.push(PeerPlan::with_coalescing(&l.table, &metas, s.mode, coalesce).map_err(plan_err)?);
        }
        Ok(Deployment {
            scenario: s.clone(),
            prefill,
            decode,
            peers,
        })
    }

    /// Plan every request on every local rank, request-major.
    ///
    /// # Errors
    /// `Plan` naming the request and local rank.
    pub fn plan_all(&self) -> Result<Vec<RankPlan>, ScenarioError> {
        let mut out = Vec::with_capacity(self.scenario.requests.len() * self.peers.len());
        for req in &self.scenario.requests {
            let (local, remote) = match self.scenario.mode {
                TransferMode::Pull => (&req.decode, &req.prefill),
                TransferMode::Push => (&req.prefill, &req.decode),
            };
            for peer in &self.peers {
                let rank = peer.mapping.tp_rank;
                let plan = peer.plan(local, remote).map_err(|e| ScenarioError::Plan {
                    context: format!("request {} on local rank {rank}", req.id),
                    source: e,
                })?;
                out.push(RankPlan {
                    request: req.id.clone(),
                    local_rank: rank,
                    plan,
                });
            }
        }
        Ok(out)
    }
}
