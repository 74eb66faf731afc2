//! Two digests both sides compute: the model compatibility hash and the geometry
//! fingerprint, a digest of the region-layout facts that must be equal whatever the two TP sizes are.
//!
//! What is TP-invariant (in the fingerprint): region names, count and order; per-region MLA flag and group;
//! the SSM region list; the group kinds; model-level MLA; total KV heads; the MLA page per token (the kernel
//! page over the kernel block size, so different kernel block sizes still agree); the non-MLA attention page
//! per token and head; the number of conv sub-projections and the *global* SSM state sizes (per-rank size x
//! TP size). What legitimately differs (left out): TP rank and size, addresses, block counts, logical and
//! kernel block sizes, ppl, per-rank SSM sizes, the SSM-only page, engine identity and mode.

use crate::core::spec::{ConvLayout, StatePart};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::core::meta::{AgentMeta, TransferMode, META_VERSION};
use crate::core::region::GroupKind;

/// The model facts hashed into the compatibility hash. TP size, block sizes and layout are
/// deliberately absent: they are validated field by field. An unknown field is refused, not ignored: a factor
/// a caller means to hash must never be dropped silently.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelFactors {
    /// Model name or path.
    pub model: String,
    /// Model dtype (`bfloat16`, ...).
    pub dtype: String,
    /// KV-cache dtype (`auto`, `fp8_e4m3`, ...).
    pub cache_dtype: String,
    /// Total KV heads across TP.
    pub total_num_kv_heads: u64,
    /// Attention head size.
    pub head_size: u64,
    /// Hidden layers.
    pub num_hidden_layers: u64,
    /// Attention backend name.
    pub attn_backend: String,
    /// Whether the hybrid memory allocator is on.
    pub hma: bool,
    /// Speculative-decoding factors (method, draft model, ...), as `key=value` strings; empty without.
    pub speculative: Vec<String>,
    /// Transfer mode.
    pub transfer_mode: TransferMode,
    /// Wire version of what an integration's halves exchange beyond the handshake payload (e.g. the vLLM
    /// connector's tickets and control messages, `hybrid-kv-vllm/1`); empty outside one, and then not
    /// serialized, so hashes without a connector are unchanged.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub connector: String,
}

fn hex_digest(domain: &str, body: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(domain.as_bytes());
    h.update([0u8]);
    h.update((body.len() as u64).to_be_bytes());
    h.update(body);
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Hex SHA-256 over the handshake wire-format version ([`META_VERSION`]) and the model factors.
///
/// The package version is deliberately not hashed: two releases that speak the same wire format (a rolling
/// upgrade of patch versions) must keep handshaking. A change to what the metadata means bumps
/// [`META_VERSION`], which changes every hash.
pub fn compat_hash(factors: &ModelFactors) -> String {
    compat_hash_for(META_VERSION, factors)
}

/// [`compat_hash`] as a given wire-format version computes it.
pub fn compat_hash_for(wire_version: u32, factors: &ModelFactors) -> String {
    let body = serde_json::to_vec(&(wire_version, factors)).unwrap_or_default();
    hex_digest("hybrid-kv/compat", &body)
}

/// A ratio `num/den` in lowest terms, so `48/4` and `24/2` compare equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ratio(pub u64, pub u64);

impl Ratio {
    fn new(num: u64, den: u64) -> Ratio {
        let (mut a, mut b) = (num, den);
        while b != 0 {
            (a, b) = (b, a % b);
        }
        match (num.checked_div(a), den.checked_div(a)) {
            (Some(n), Some(d)) => Ratio(n, d),
            _ => Ratio(num, den),
        }
    }
}

impl std::fmt::Display for Ratio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.1 == 1 {
            write!(f, "{}", self.0)
        } else {
            write!(f, "{}/{}", self.0, self.1)
        }
    }
}

/// The TP-invariant geometry of one rank (see the module docs); equal on every rank of a compatible pair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GeometryKey {
    /// Region names in order.
    pub region_names: Vec<String>,
    /// Per-region REPLICATE flag.
    pub region_is_mla: Vec<bool>,
    /// Per-region group (`None` when shared).
    pub region_groups: Vec<Option<u32>>,
    /// SSM region indices.
    pub ssm_regions: Vec<u32>,
    /// Group kinds.
    pub groups: Vec<GroupKind>,
    /// Model-level MLA.
    pub use_mla: bool,
    /// Total KV heads.
    pub total_num_kv_heads: u64,
    /// Per region: MLA bytes per token; non-MLA attention bytes per token and head; `None` for SSM-only
    /// regions and non-MLA regions shared with SSM (padded, TP-dependent pages).
    pub token_bytes: Vec<Option<Ratio>>,
    /// Conv bytes x TP, temporal bytes x TP, and each conv sub-projection x TP (empty without SSM).
    pub global_ssm: Vec<u128>,
    /// The state part of every region, when states are split over several tensors (empty otherwise, and
    /// then not hashed: a fused state's fingerprint is what it was).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state_parts: Vec<Option<StatePart>>,
    /// An `sd` conv state's rows (`None`, not hashed, for `ds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sd_conv_rows: Option<u64>,
}

impl GeometryKey {
    /// Heads one rank of `meta` holds: `max(1, K / tp)`.
    pub fn local_heads(meta: &AgentMeta) -> u64 {
        (meta.total_num_kv_heads / u64::from(meta.tp_size.max(1))).max(1)
    }

    /// The key of a (well-formed) metadata.
    pub fn of(m: &AgentMeta) -> GeometryKey {
        let heads = GeometryKey::local_heads(m);
        let token_bytes = m
            .regions
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let ssm = m.ssm_regions.contains(&(i as u32));
                if r.is_mla {
                    Some(Ratio::new(r.block_len, m.kernel_block_size))
                } else if ssm {
                    None
                } else {
                    Some(Ratio::new(r.block_len, m.kernel_block_size.saturating_mul(heads)))
                }
            })
            .collect();
        let tp = u128::from(m.tp_size);
        let mut global_ssm = Vec::new();
        if m.ssm_sizes != (0, 0) {
            global_ssm.push(u128::from(m.ssm_sizes.0) * tp);
            global_ssm.push(u128::from(m.ssm_sizes.1) * tp);
            global_ssm.extend(m.conv_proj_bytes.iter().map(|&b| u128::from(b) * tp));
        }
        GeometryKey {
            region_names: m.regions.iter().map(|r| r.name.clone()).collect(),
            region_is_mla: m.regions.iter().map(|r| r.is_mla).collect(),
            region_groups: m.regions.iter().map(|r| r.group).collect(),
            ssm_regions: m.ssm_regions.clone(),
            groups: m.groups.clone(),
            use_mla: m.use_mla,
            total_num_kv_heads: m.total_num_kv_heads,
            token_bytes,
            global_ssm,
            state_parts: if m.regions.iter().any(|r| r.state_part.is_some()) {
                m.regions.iter().map(|r| r.state_part.clone()).collect()
            } else {
                Vec::new()
            },
            sd_conv_rows: (m.conv_layout == ConvLayout::Sd).then_some(m.conv_rows),
        }
    }
}

/// Hex SHA-256 of the [`GeometryKey`]: equal on both sides of a compatible pair, whatever their TP sizes.
pub fn fingerprint(meta: &AgentMeta) -> String {
    let body = serde_json::to_vec(&GeometryKey::of(meta)).unwrap_or_default();
    hex_digest("hybrid-kv/geometry", &body)
}
