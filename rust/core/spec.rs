//! KV-cache layer specs (attention, MLA, SSM state) and the per-rank SSM conv split.
//!
//! Specs are per TP rank, as vLLM's are: `num_kv_heads` and the SSM shapes are the rank's share.

use serde::{Deserialize, Serialize};

use super::error::LayoutError;
pub use super::state_parts::{ConvLayout, StatePart, MAX_CONV_PROJS, MAX_CONV_ROWS};

/// Non-MLA attention (full or sliding window): K and V per head, packed per token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionSpec {
    /// KV heads on this rank.
    pub num_kv_heads: u64,
    /// Elements per head for K.
    pub head_size: u64,
    /// Elements per head for V (defaults to `head_size`); 0 for a tensor that holds one of K and V alone (an
    /// engine keeping K and V in separate tensors describes each as its own layer, with its elements as
    /// `head_size`).
    #[serde(default)]
    pub head_size_v: Option<u64>,
    /// Bytes per element.
    pub dtype_bytes: u64,
    /// Page size override (bytes per logical block), as vLLM's `page_size_padded`.
    #[serde(default)]
    pub page_size_padded: Option<u64>,
}

/// MLA attention: one latent per token, identical on every TP rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MlaSpec {
    /// Latent elements per token (e.g. 512 + 64 for DeepSeek-V3).
    pub head_size: u64,
    /// Bytes per element.
    pub dtype_bytes: u64,
    /// Page size override (bytes per logical block).
    #[serde(default)]
    pub page_size_padded: Option<u64>,
}

/// Which state-space layer an SSM spec describes; fixes the conv sub-projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MambaKind {
    /// Mamba1: conv holds `x` only.
    Mamba1,
    /// Mamba2: conv holds `x | B | C`.
    Mamba2,
    /// Gated DeltaNet / Kimi Delta Attention: conv holds `Q | K | V`.
    Gdn,
}

/// A linear-attention / SSM state (one full state per logical block, never split).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SsmSpec {
    /// Conv sub-projection family.
    pub kind: MambaKind,
    /// Conv state shape on this rank in DS layout: `(conv_dim_local, conv_rows)`.
    pub conv_shape: [u64; 2],
    /// Bytes per conv element.
    pub conv_dtype_bytes: u64,
    /// Temporal (SSM) state shape on this rank; dim 0 is sharded across TP.
    pub temporal_shape: Vec<u64>,
    /// Bytes per temporal element.
    pub temporal_dtype_bytes: u64,
    /// Page size (bytes per logical block) after HMA padding; defaults to the raw state size (of the part, for
    /// a part).
    #[serde(default)]
    pub page_size_padded: Option<u64>,
    /// How the conv state is stored (`ds` by default).
    #[serde(default, skip_serializing_if = "ConvLayout::is_ds")]
    pub conv_layout: ConvLayout,
    /// The part of the state this layer's tensor holds; `None` (the default): the whole state in one page,
    /// `[conv sub-projections | temporal | padding]`. The shapes stay those of the whole state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub part: Option<StatePart>,
}

/// The spec of one layer's KV cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LayerSpec {
    /// Full (GQA/MHA) attention.
    FullAttention(AttentionSpec),
    /// Sliding-window attention (same bytes as full attention for transfers).
    SlidingWindow(AttentionSpec),
    /// MLA attention.
    Mla(MlaSpec),
    /// Sliding-window MLA (DeepSeek-V4 compressor layers); treated as MLA.
    SlidingWindowMla(MlaSpec),
    /// SSM / linear-attention state (Mamba1, Mamba2, GDN/KDA).
    Ssm(SsmSpec),
}

/// Byte layout of one rank's SSM state page: `[conv sub-projections | temporal state | padding]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConvSplit {
    /// Channels per conv sub-projection on this rank (1 for Mamba1, 3 otherwise).
    pub proj_dims: Vec<u64>,
    /// Bytes per conv sub-projection on this rank.
    pub proj_bytes: Vec<u64>,
    /// Conv state bytes (sum of `proj_bytes`); the temporal state starts here.
    pub conv_bytes: u64,
    /// Temporal state bytes on this rank.
    pub ssm_bytes: u64,
    /// Conv rows (TP-independent; what an `sd` conv state repeats its channels over).
    #[serde(default)]
    pub conv_rows: u64,
    /// How the conv state is stored.
    #[serde(default)]
    pub conv_layout: ConvLayout,
}

impl ConvSplit {
    /// `(offset, len)` of every sub-stream in page order: the conv sub-projections, then the temporal state.
    pub fn streams(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::with_capacity(self.proj_bytes.len() + 1);
        let mut off = 0;
        for &b in &self.proj_bytes {
            out.push((off, b));
            off += b;
        }
        out.push((self.conv_bytes, self.ssm_bytes));
        out
    }

    /// Number of sub-streams per state (conv sub-projections + 1).
    pub fn num_streams(&self) -> usize {
        self.proj_bytes.len() + 1
    }
}

fn checked_product(dims: &[u64], what: &str, layer: &str) -> Result<u64, LayoutError> {
    dims.iter().try_fold(1u64, |acc, &d| {
        acc.checked_mul(d).ok_or_else(|| LayoutError::BadSsmSpec {
            layer: layer.to_string(),
            reason: format!("{what} shape {dims:?} overflows 64 bits"),
        })
    })
}

impl SsmSpec {
    /// Derive the per-rank conv split (vLLM's `derive_mamba_conv_split`) and state sizes.
    ///
    /// # Errors
    /// `BadSsmSpec` when the shapes are inconsistent with the kind (e.g. an odd Mamba2 remainder).
    pub fn conv_split(&self, layer: &str) -> Result<ConvSplit, LayoutError> {
        let bad = |reason: String| LayoutError::BadSsmSpec {
            layer: layer.to_string(),
            reason,
        };
        let [conv_dim, conv_rows] = self.conv_shape;
        if conv_dim == 0 || conv_rows == 0 || self.conv_dtype_bytes == 0 || self.temporal_dtype_bytes == 0 {
            return Err(bad(format!(
                "conv shape {:?} and dtype sizes ({}, {}) must be positive",
                self.conv_shape, self.conv_dtype_bytes, self.temporal_dtype_bytes
            )));
        }
        let t = &self.temporal_shape;
        if t.is_empty() || t.contains(&0) {
            return Err(bad(format!("temporal shape {t:?} must be non-empty and positive")));
        }
        let proj_dims = match self.kind {
            MambaKind::Mamba1 => {
                if t[0] != conv_dim {
                    return Err(bad(format!(
                        "mamba1 temporal dim 0 ({}) must equal the conv dim ({conv_dim})",
                        t[0]
                    )));
                }
                vec![conv_dim]
            }
            MambaKind::Mamba2 | MambaKind::Gdn => {
                if t.len() < 2 {
                    return Err(bad(format!("temporal shape {t:?} needs at least 2 dims")));
                }
                let first = t[0]
                    .checked_mul(t[1])
                    .ok_or_else(|| bad("temporal dims overflow".into()))?;
                if first >= conv_dim || (conv_dim - first) % 2 != 0 {
                    return Err(bad(format!(
                        "conv dim {conv_dim} minus {} ({}x{}) must be positive and even",
                        first, t[0], t[1]
                    )));
                }
                let half = (conv_dim - first) / 2;
                match self.kind {
                    MambaKind::Mamba2 => vec![first, half, half],
                    _ => vec![half, half, first],
                }
            }
        };
        let row_bytes = conv_rows
            .checked_mul(self.conv_dtype_bytes)
            .ok_or_else(|| bad("conv row bytes overflow".into()))?;
        let proj_bytes: Vec<u64> = proj_dims.iter().map(|d| d * row_bytes).collect();
        let conv_bytes = checked_product(&self.conv_shape, "conv", layer)?
            .checked_mul(self.conv_dtype_bytes)
            .ok_or_else(|| bad("conv bytes overflow".into()))?;
        let ssm_bytes = checked_product(t, "temporal", layer)?
            .checked_mul(self.temporal_dtype_bytes)
            .ok_or_else(|| bad("temporal bytes overflow".into()))?;
        if self.conv_layout == ConvLayout::Sd && conv_rows > MAX_CONV_ROWS {
            return Err(bad(format!(
                "an sd conv state of {conv_rows} conv rows is over the limit of {MAX_CONV_ROWS}"
            )));
        }
        if let Some(StatePart::Conv(projs)) = &self.part {
            let ascending = projs.windows(2).all(|w| w[0] < w[1]);
            if projs.is_empty() || !ascending || projs.iter().any(|&p| p as usize >= proj_dims.len()) {
                return Err(bad(format!(
                    "conv part {projs:?} must list distinct ascending sub-projections below {} of kind {:?}",
                    proj_dims.len(),
                    self.kind
                )));
            }
        }
        Ok(ConvSplit {
            proj_dims,
            proj_bytes,
            conv_bytes,
            ssm_bytes,
            conv_rows,
            conv_layout: self.conv_layout,
        })
    }

    /// Raw bytes of the state (conv + temporal), or of the part of it this layer's tensor holds.
    pub fn state_bytes(&self, layer: &str) -> Result<u64, LayoutError> {
        let s = self.conv_split(layer)?;
        Ok(s.part_bytes(self.part.as_ref()))
    }
}

impl LayerSpec {
    /// True for MLA and sliding-window MLA (the REPLICATE class).
    pub fn is_mla(&self) -> bool {
        matches!(self, LayerSpec::Mla(_) | LayerSpec::SlidingWindowMla(_))
    }

    /// True for SSM state layers.
    pub fn is_ssm(&self) -> bool {
        matches!(self, LayerSpec::Ssm(_))
    }

    /// Bytes of one logical block's page on this rank for `block_size` tokens per logical block.
    ///
    /// # Errors
    /// `BadSsmSpec` for an inconsistent SSM spec, `StateLargerThanPage` for an SSM page smaller than its
    /// state, `Zero` naming an attention field that is 0 (`head_size_v` may be: K or V alone), `AddressOverflow`
    /// for a page over 64 bits.
    pub fn page_bytes(&self, block_size: u64, layer: &str) -> Result<u64, LayoutError> {
        let overflow = || LayoutError::AddressOverflow {
            what: format!("page size of {layer}"),
            addr: 0,
            len: 0,
        };
        let positive = |v: u64, what: &str| {
            if v == 0 {
                Err(LayoutError::Zero {
                    what: format!("{what} of layer {layer}"),
                })
            } else {
                Ok(v)
            }
        };
        match self {
            LayerSpec::FullAttention(a) | LayerSpec::SlidingWindow(a) => {
                positive(a.num_kv_heads, "num_kv_heads")?;
                positive(a.head_size, "head_size")?;
                // `head_size_v` 0: a tensor of K (or of V) alone, as engines that keep K and V apart store them
                positive(a.dtype_bytes, "dtype_bytes")?;
                if let Some(p) = a.page_size_padded {
                    return positive(p, "page_size_padded");
                }
                let cell = a
                    .head_size
                    .checked_add(a.head_size_v.unwrap_or(a.head_size))
                    .and_then(|c| c.checked_mul(a.dtype_bytes))
                    .ok_or_else(overflow)?;
                let page = block_size
                    .checked_mul(a.num_kv_heads)
                    .and_then(|v| v.checked_mul(cell))
                    .ok_or_else(overflow)?;
                positive(page, "page size")
            }
            LayerSpec::Mla(m) | LayerSpec::SlidingWindowMla(m) => {
                positive(m.head_size, "head_size")?;
                positive(m.dtype_bytes, "dtype_bytes")?;
                if let Some(p) = m.page_size_padded {
                    return positive(p, "page_size_padded");
                }
                let page = block_size
                    .checked_mul(m.head_size)
                    .and_then(|v| v.checked_mul(m.dtype_bytes))
                    .ok_or_else(overflow)?;
                positive(page, "page size")
            }
            LayerSpec::Ssm(s) => {
                let state = s.state_bytes(layer)?;
                let page = s.page_size_padded.unwrap_or(state);
                if page < state {
                    return Err(LayoutError::StateLargerThanPage {
                        layer: layer.to_string(),
                        state,
                        page,
                    });
                }
                Ok(page)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ssm(kind: MambaKind, conv: [u64; 2], temporal: &[u64]) -> SsmSpec {
        SsmSpec {
            kind,
            conv_shape: conv,
            conv_dtype_bytes: 2,
            temporal_shape: temporal.to_vec(),
            temporal_dtype_bytes: 4,
            page_size_padded: None,
            conv_layout: ConvLayout::Ds,
            part: None,
        }
    }

    #[test]
    fn kda_test_spec_split_matches_reference_a5() {
        let s = ssm(MambaKind::Gdn, [8, 3], &[1, 4, 4]);
        let split = s.conv_split("kda").unwrap();
        assert_eq!(split.proj_dims, vec![2, 2, 4]);
        assert_eq!(split.proj_bytes, vec![12, 12, 24]);
        assert_eq!((split.conv_bytes, split.ssm_bytes), (48, 64));
        assert_eq!(split.streams(), vec![(0, 12), (12, 12), (24, 24), (48, 64)]);
    }

    /// Reference F.9 `derive_mamba_conv_split` table (conv_rows 3).
    #[test]
    fn conv_split_table_f9() {
        let cases: &[(MambaKind, u64, &[u64], &[u64])] = &[
            (MambaKind::Mamba2, 10240, &[128, 64, 128], &[8192, 1024, 1024]),
            (MambaKind::Mamba2, 2560, &[32, 64, 128], &[2048, 256, 256]),
            (MambaKind::Mamba2, 6144, &[64, 64, 128], &[4096, 1024, 1024]),
            (MambaKind::Gdn, 6144, &[16, 128, 128], &[2048, 2048, 2048]),
            (MambaKind::Gdn, 1536, &[4, 128, 128], &[512, 512, 512]),
            (MambaKind::Gdn, 8192, &[32, 128, 128], &[2048, 2048, 4096]),
            (MambaKind::Gdn, 10240, &[48, 128, 128], &[2048, 2048, 6144]),
            (MambaKind::Gdn, 1280, &[6, 128, 128], &[256, 256, 768]),
            (MambaKind::Mamba1, 8192, &[8192, 16], &[8192]),
            (MambaKind::Mamba1, 2048, &[2048, 16], &[2048]),
            (MambaKind::Mamba1, 1024, &[1024, 16], &[1024]),
        ];
        for (kind, conv, temporal, want) in cases {
            let split = ssm(*kind, [*conv, 3], temporal).conv_split("l").unwrap();
            assert_eq!(
                &split.proj_dims[..],
                *want,
                "{kind:?} conv {conv} temporal {temporal:?}"
            );
        }
    }

    #[test]
    fn odd_mamba2_remainder_is_an_error() {
        let err = ssm(MambaKind::Mamba2, [11, 3], &[1, 4, 4]).conv_split("m").unwrap_err();
        assert!(err.to_string().contains("must be positive and even"), "{err}");
    }

    #[test]
    fn ssm_page_smaller_than_state_is_an_error() {
        let mut s = ssm(MambaKind::Gdn, [8, 3], &[1, 4, 4]);
        s.page_size_padded = Some(100);
        let err = LayerSpec::Ssm(s).page_bytes(12, "kda").unwrap_err();
        assert_eq!(
            err,
            LayoutError::StateLargerThanPage {
                layer: "kda".into(),
                state: 112,
                page: 100
            }
        );
    }

    #[test]
    fn zero_attention_fields_are_named() {
        let fa = |heads, k, v, dtype| {
            LayerSpec::FullAttention(AttentionSpec {
                num_kv_heads: heads,
                head_size: k,
                head_size_v: v,
                dtype_bytes: dtype,
                page_size_padded: Some(64),
            })
        };
        let mla = |k, dtype| {
            LayerSpec::Mla(MlaSpec {
                head_size: k,
                dtype_bytes: dtype,
                page_size_padded: None,
            })
        };
        for (spec, field) in [
            (fa(0, 4, None, 2), "num_kv_heads"),
            (fa(2, 0, None, 2), "head_size"),
            (fa(2, 4, Some(4), 0), "dtype_bytes"),
            (mla(0, 2), "head_size"),
            (mla(6, 0), "dtype_bytes"),
        ] {
            let err = spec.page_bytes(16, "l.0").unwrap_err().to_string();
            assert_eq!(err, format!("{field} of layer l.0 must be positive, got 0"));
        }
        assert_eq!(fa(2, 4, Some(4), 2).page_bytes(16, "l.0").unwrap(), 64);
        let k_only = LayerSpec::FullAttention(AttentionSpec {
            num_kv_heads: 2,
            head_size: 4,
            head_size_v: Some(0),
            dtype_bytes: 2,
            page_size_padded: None,
        });
        assert_eq!(k_only.page_bytes(16, "l.0.k").unwrap(), 16 * 2 * 4 * 2);
    }

    #[test]
    fn attention_and_mla_pages() {
        let mla = LayerSpec::Mla(MlaSpec {
            head_size: 6,
            dtype_bytes: 2,
            page_size_padded: None,
        });
        assert_eq!(mla.page_bytes(12, "mla").unwrap(), 144);
        let fa = LayerSpec::FullAttention(AttentionSpec {
            num_kv_heads: 2,
            head_size: 4,
            head_size_v: None,
            dtype_bytes: 2,
            page_size_padded: None,
        });
        assert_eq!(fa.page_bytes(16, "fa").unwrap(), 16 * 2 * 8 * 2);
    }
}

/// Kernel blocks needed to hold one SSM state of `ssm_sizes = (conv, temporal)` bytes in pages of
/// `block_len` bytes: `ceil((conv + temporal) / block_len)` (vLLM's `compute_physical_blocks_per_logical`).
///
/// # Errors
/// `Zero` when `block_len` is 0.
pub fn physical_blocks_per_logical(ssm_sizes: (u64, u64), block_len: u64) -> Result<u64, LayoutError> {
    if block_len == 0 {
        return Err(LayoutError::Zero {
            what: "block_len".into(),
        });
    }
    Ok((ssm_sizes.0 + ssm_sizes.1).div_ceil(block_len))
}

#[cfg(test)]
mod ppl_tests {
    /// Reference F.9: Nemotron 30B at TP 1, 2 and 4.
    #[test]
    fn nemotron_30b_ppl_table() {
        for (sizes, len, want) in [
            ((36864, 2097152), 8192, 261),
            ((18432, 1048576), 4096, 261),
            ((9216, 524288), 4096, 131),
        ] {
            assert_eq!(super::physical_blocks_per_logical(sizes, len).unwrap(), want);
        }
        assert!(super::physical_blocks_per_logical((1, 1), 0).is_err());
    }
}
