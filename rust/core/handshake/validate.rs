//! `validate(local, remote)`: every applicable check, all run, all reported at once.
//!
//! Directions follow the reference: `tp_ratio` is from the local side's view (in pull mode local is decode,
//! in push mode prefill). Checks that are about prefill versus decode (GQA head replication) resolve the
//! roles from the transfer mode. Every finding names the check and both values.
//!
//! Kernel block sizes follow the planner, not vLLM: both sides are cut into their common token unit
//! ([`BlockUnits`]) in pull and in push, so a pair is accepted exactly when the planner can address it
//! (vLLM accepts a larger local block, and a hybrid MLA pull after its C.6 remote split, and converts
//! heads-major pages after the transfer; hybrid-kv moves bytes only, so it refuses what needs a conversion).

use super::error::{Finding, HandshakeError};
use super::fingerprint::{fingerprint, GeometryKey};
use super::wellformed::{placement_findings, structure_findings};
use crate::core::alias::alias_roots;
use crate::core::kv_layout::PageOrder;
use crate::core::meta::{AgentMeta, TransferMode};
use crate::core::region::GroupKind;
use crate::core::tp::handshake_target_ranks;
use crate::core::tp::tp_ratio;
use crate::core::units::BlockUnits;

/// Layouts whose pages are heads-major (heads, tokens, cell): a head range is contiguous.
pub const HEAD_CONTIGUOUS_LAYOUTS: [&str; 4] = ["HND", "LBHNC", "BLHNC", "HKTV"];

/// The page order of a well-formed metadata (structure findings ran first: a known, contiguous layout).
fn order(m: &AgentMeta) -> PageOrder {
    m.page_order().unwrap_or_default()
}

/// What the local side already knows about the peer it is connecting to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expected {
    /// The engine id this side meant to reach.
    pub engine_id: Option<String>,
    /// The peer engine's TP size, as configured or learned from its other ranks.
    pub tp_size: Option<u32>,
    /// The kernel block count the peer engine's other ranks advertised (all ranks must agree).
    pub num_blocks: Option<u64>,
}

fn has_ssm(m: &AgentMeta) -> bool {
    m.groups.contains(&GroupKind::Ssm)
}

fn list<T: std::fmt::Debug>(v: &[T]) -> String {
    format!("{v:?}")
}

/// Every failed check between `local` and `remote` (empty when compatible).
pub fn findings(local: &AgentMeta, remote: &AgentMeta, expected: &Expected) -> Vec<Finding> {
    let mut out = Vec::new();
    let own = |check: fn(&AgentMeta) -> Vec<Finding>, out: &mut Vec<Finding>| {
        for (side, m) in [("local", local), ("remote", remote)] {
            for mut f in check(m) {
                f.check = format!("{side}.{}", f.check);
                out.push(f);
            }
        }
    };
    own(structure_findings, &mut out);
    if !out.is_empty() {
        return out; // values that are inconsistent on their own cannot be compared safely
    }
    own(placement_findings, &mut out);
    // regions at one base that may not alias are reported as an overlap already
    let overlapping = out.iter().any(|f| f.check.ends_with("region_overlap"));
    let mut add = |check: &str, l: String, r: String, why: String| out.push(Finding::new(check, l, r, why));
    if local.version != remote.version {
        add(
            "version",
            local.version.to_string(),
            remote.version.to_string(),
            String::new(),
        );
    }
    if local.compat_hash != remote.compat_hash {
        add(
            "compat_hash",
            local.compat_hash.clone(),
            remote.compat_hash.clone(),
            "model factors differ".into(),
        );
    }
    identity(local, remote, expected, &mut add);
    let ratio = tp(local, remote, expected, &mut add);
    regions(local, remote, overlapping, &mut add);

    let units = block_units(local, remote, &mut add);
    heads(local, remote, ratio, &mut add);
    if has_ssm(local)
        && local.logical_block_size != remote.logical_block_size
        && (local.prefix_caching || remote.prefix_caching)
    {
        add(
            "prefix_caching_hetero_ppl",
            format!(
                "logical block {} tokens, prefix caching {}",
                local.logical_block_size, local.prefix_caching
            ),
            format!(
                "logical block {} tokens, prefix caching {}",
                remote.logical_block_size, remote.prefix_caching
            ),
            "SSM hybrids cannot trim prefix hits when logical blocks hold different numbers of tokens".into(),
        );
    }
    let same_count = local.regions.len() == remote.regions.len();
    if let (Some(units), true) = (units, same_count) {
        if has_ssm(local) && local.use_mla {
            hybrid_mla_block_len(local, remote, units, &mut add);
        } else {
            attention_block_len(local, remote, units, ratio, &mut add);
        }
    }
    if has_ssm(local) && has_ssm(remote) {
        ssm_sizes(local, remote, &mut add);
    }
    if local.attn_backend != remote.attn_backend {
        add(
            "attn_backend",
            local.attn_backend.clone(),
            remote.attn_backend.clone(),
            String::new(),
        );
    }
    if out.is_empty() && GeometryKey::of(local) != GeometryKey::of(remote) {
        out.push(Finding::new(
            "geometry_fingerprint",
            fingerprint(local),
            fingerprint(remote),
            "TP-invariant region geometry differs",
        ));
    }
    out
}

type Add<'a> = dyn FnMut(&str, String, String, String) + 'a;

fn identity(local: &AgentMeta, remote: &AgentMeta, expected: &Expected, add: &mut Add<'_>) {
    if remote.engine_id.is_empty() || remote.engine_id == local.engine_id {
        add(
            "engine_id",
            format!("{:?}", local.engine_id),
            format!("{:?}", remote.engine_id),
            "the peer must be another, named engine".into(),
        );
    }
    if let Some(want) = &expected.engine_id {
        if *want != remote.engine_id {
            add(
                "engine_id",
                format!("expected {want:?}"),
                format!("{:?}", remote.engine_id),
                String::new(),
            );
        }
    }
    if local.transfer_mode != remote.transfer_mode {
        add(
            "transfer_mode",
            format!("{:?}", local.transfer_mode),
            format!("{:?}", remote.transfer_mode),
            String::new(),
        );
    }
    if let Some(n) = expected.num_blocks {
        if n != remote.num_blocks {
            add(
                "num_blocks",
                format!("expected {n} (the peer's other ranks)"),
                remote.num_blocks.to_string(),
                "all ranks of an engine advertise the same kernel block count".into(),
            );
        }
    }
    // unless its state tensors say their own slot counts (a state pool beside a page pool, as SGLang's)
    if has_ssm(remote) && remote.regions.iter().all(|r| r.states.is_none()) {
        let uneven: Vec<u64> = remote.regions.iter().map(|r| r.num_blocks).collect();
        if uneven.iter().any(|&n| n != remote.num_blocks) {
            add(
                "region_num_blocks",
                format!("num_blocks {}", remote.num_blocks),
                list(&uneven),
                "SSM models use one kernel block count for every region".into(),
            );
        }
    }
}

fn tp(local: &AgentMeta, remote: &AgentMeta, expected: &Expected, add: &mut Add<'_>) -> Option<i64> {
    if let Some(t) = expected.tp_size {
        if t != remote.tp_size {
            add(
                "tp_size",
                format!("expected {t}"),
                remote.tp_size.to_string(),
                String::new(),
            );
        }
    }
    match tp_ratio(local.tp_size, remote.tp_size) {
        Ok(r) => {
            // Cannot fail: the ratio is valid and well-formed metas have tp_rank < tp_size.
            let targets = handshake_target_ranks(local.tp_rank, local.tp_size, remote.tp_size).unwrap_or_default();
            if !targets.contains(&remote.tp_rank) {
                add(
                    "tp_peer",
                    format!("rank {}/{}", local.tp_rank, local.tp_size),
                    format!("rank {}/{}", remote.tp_rank, remote.tp_size),
                    format!("local rank exchanges with remote ranks {targets:?}"),
                );
            }
            Some(r)
        }
        Err(msg) => {
            add(
                "tp_divisibility",
                local.tp_size.to_string(),
                remote.tp_size.to_string(),
                msg,
            );
            None
        }
    }
}

fn regions(local: &AgentMeta, remote: &AgentMeta, overlapping: bool, add: &mut Add<'_>) {
    let (lk, rk) = (GeometryKey::of(local), GeometryKey::of(remote));
    if lk.region_names.len() != rk.region_names.len() {
        add(
            "region_count",
            lk.region_names.len().to_string(),
            rk.region_names.len().to_string(),
            "both sides must register the same caches".into(),
        );
    }
    let mut diff = |check: &str, l: String, r: String, why: &str| {
        if l != r {
            add(check, l, r, why.to_string());
        }
    };
    let same = "must name the same model caches in the same order";
    diff("region_names", list(&lk.region_names), list(&rk.region_names), same);
    if lk.region_names.len() == rk.region_names.len() {
        diff(
            "region_mla_flags",
            list(&lk.region_is_mla),
            list(&rk.region_is_mla),
            "REPLICATE/SPLIT must agree",
        );
        diff("region_groups", list(&lk.region_groups), list(&rk.region_groups), "");
        let roots = |m: &AgentMeta| alias_roots(&m.regions.iter().map(|r| r.base).collect::<Vec<_>>());
        let roots = |m: &AgentMeta| if overlapping { Vec::new() } else { roots(m) };
        diff(
            "region_aliases",
            list(&roots(local)),
            list(&roots(remote)),
            "the same regions must alias one tensor on both sides",
        );
    }
    diff("group_kinds", list(&lk.groups), list(&rk.groups), "");
    diff("ssm_regions", list(&lk.ssm_regions), list(&rk.ssm_regions), "");
    diff(
        "state_parts",
        format!("{:?}", lk.state_parts),
        format!("{:?}", rk.state_parts),
        "both sides must split SSM states over the same tensors",
    );
    diff(
        "conv_layout",
        format!("{:?}", (local.conv_layout, lk.sd_conv_rows)),
        format!("{:?}", (remote.conv_layout, rk.sd_conv_rows)),
        "both sides must store conv state alike (sd: with the same rows)",
    );
    diff("use_mla", lk.use_mla.to_string(), rk.use_mla.to_string(), "");
    diff(
        "total_num_kv_heads",
        lk.total_num_kv_heads.to_string(),
        rk.total_num_kv_heads.to_string(),
        "",
    );
    diff(
        "k_rows",
        local.k_rows.to_string(),
        remote.k_rows.to_string(),
        "HKTV pages must hold K heads of the same elements on both sides",
    );
    if !local.use_mla && local.groups.contains(&GroupKind::Attention) && order(local) != order(remote) {
        add(
            "kv_layout",
            local.kv_layout.clone(),
            remote.kv_layout.clone(),
            format!(
                "attention pages must order their cells alike ({} vs {})",
                order(local).name(),
                order(remote).name()
            ),
        );
    }
}

/// Head-split checks for non-MLA attention: heterogeneous TP that splits heads needs one page order on both
/// sides, and a prefill with more ranks than the decode must not replicate its KV heads.
fn heads(local: &AgentMeta, remote: &AgentMeta, ratio: Option<i64>, add: &mut Add<'_>) {
    let Some(ratio) = ratio else { return };
    if local.use_mla || !local.groups.contains(&GroupKind::Attention) {
        return;
    }
    let k = local.total_num_kv_heads;
    let replicated = |m: &AgentMeta| u64::from(m.tp_size) > k;
    // One head per rank on both sides: a page is one head, whatever its cell order.
    let one_head = GeometryKey::local_heads(local) == 1 && GeometryKey::local_heads(remote) == 1;
    if ratio.abs() != 1 && !replicated(remote) && !one_head {
        for (side, m) in [("local", local), ("remote", remote)] {
            // token-major pages are split per token, heads-major ones per page: both sides must be one or the other
            if order(m) != order(local) || order(m) != order(remote) {
                add(
                    "head_contiguity",
                    local.kv_layout.clone(),
                    remote.kv_layout.clone(),
                    format!(
                        "heterogeneous TP splits heads, which needs one page order on both sides (heads-major: one of \
                         {HEAD_CONTIGUOUS_LAYOUTS:?}) ({side})"
                    ),
                );
                break;
            }
        }
    }
    let (p, d) = match local.transfer_mode {
        TransferMode::Pull => (remote, local),
        TransferMode::Push => (local, remote),
    };
    if p.tp_size > d.tp_size && replicated(p) {
        add(
            "gqa_replication",
            format!("tp {}", local.tp_size),
            format!("tp {}", remote.tp_size),
            format!(
                "prefill TP {} > decode TP {} while prefill replicates the {k} KV heads is not supported",
                p.tp_size, d.tp_size
            ),
        );
    }
}

/// The common token unit of both kernel block sizes, when the planner can address it: at most
/// [`MAX_UNITS_PER_BLOCK`](crate::core::units::MAX_UNITS_PER_BLOCK) units per block (token-major pages split
/// between TP sizes: tokens per block). Heads-major pages of several heads per rank are cut per head.
fn block_units(local: &AgentMeta, remote: &AgentMeta, add: &mut Add<'_>) -> Option<BlockUnits> {
    let (lk, rk) = (local.kernel_block_size, remote.kernel_block_size);
    let (lh, rh) = (GeometryKey::local_heads(local), GeometryKey::local_heads(remote));
    let has_gqa = local.groups.contains(&GroupKind::Attention);
    // Both sides' page orders must agree (checked beside this); token-major or K-transposed only when both are.
    let same = order(local) == order(remote);
    let gqa_order = has_gqa.then_some(if same { order(local) } else { PageOrder::HeadsMajor });
    match BlockUnits::for_pages((lk, rk), gqa_order, (lh, rh), local.k_rows) {
        Ok(u) => Some(u),
        Err(e) => {
            add(
                "block_size_ratio",
                format!("kernel block {lk}"),
                format!("kernel block {rk}"),
                e.to_string(),
            );
            None
        }
    }
}

/// As vLLM's NIXL connector checks, in common units: hybrid MLA+SSM kernel pages must hold the same bytes per token,
/// i.e. `local block_len / local units == remote block_len / remote units` for every region.
fn hybrid_mla_block_len(local: &AgentMeta, remote: &AgentMeta, u: BlockUnits, add: &mut Add<'_>) {
    let l: Vec<u64> = local.regions.iter().map(|r| r.block_len).collect();
    let r: Vec<u64> = remote.regions.iter().map(|r| r.block_len).collect();
    let scaled = |b: u64, by: u64| u128::from(b) * u128::from(by);
    if l.iter()
        .zip(&r)
        .any(|(&l, &r)| scaled(l, u.remote_sub) != scaled(r, u.local_sub))
    {
        add(
            "hybrid_mla_block_len",
            list(&l),
            list(&r),
            format!(
                "hybrid MLA+SSM requires equal kernel-page bytes per {} tokens: local block_len / {} == remote block_len / {} per region",
                u.unit_tokens, u.local_sub, u.remote_sub
            ),
        );
    }
}

/// Block lengths of the attention regions of models that are not hybrid MLA, in common units, whether the remote
/// side replicates or splits its KV heads. vLLM skips SSM hybrids entirely; here only regions that host SSM state
/// are skipped.
fn attention_block_len(local: &AgentMeta, remote: &AgentMeta, u: BlockUnits, ratio: Option<i64>, add: &mut Add<'_>) {
    let Some(ratio) = ratio else { return };
    let (lh, rh) = (GeometryKey::local_heads(local), GeometryKey::local_heads(remote));
    // Remote page bytes expected from `bytes` of local page: rescaled from local to remote units.
    let to_remote = |bytes: u128| {
        let v = bytes * u128::from(u.remote_sub);
        (v % u128::from(u.local_sub) == 0).then(|| v / u128::from(u.local_sub))
    };
    let mut expected = Vec::new();
    let mut bad = false;
    for (i, (l, r)) in local.regions.iter().zip(&remote.regions).enumerate() {
        if local.ssm_regions.contains(&(i as u32)) {
            expected.push("ssm".to_string()); // padded state pages: covered by the SSM size checks
            continue;
        }
        let want = if local.use_mla || l.is_mla {
            to_remote(u128::from(l.block_len))
        } else {
            // Page bytes scale with the heads per rank (token-major pages cut per token, heads-major per head).
            to_remote(u128::from(l.block_len) * u128::from(rh) / u128::from(lh))
        };
        bad |= want != Some(u128::from(r.block_len));
        expected.push(want.map_or("-".into(), |w| w.to_string()));
    }
    if bad {
        let l: Vec<u64> = local.regions.iter().map(|r| r.block_len).collect();
        let r: Vec<u64> = remote.regions.iter().map(|r| r.block_len).collect();
        add(
            "attention_block_len",
            list(&l),
            list(&r),
            format!(
                "expected remote [{}] for kernel blocks {}/{} tokens, tp_ratio {ratio}, heads {lh}/{rh} per rank ('-': unsupported)",
                expected.join(", "),
                local.kernel_block_size,
                remote.kernel_block_size
            ),
        );
    }
}

/// Not checked by vLLM for non-MLA SSM hybrids: per-rank state sizes must scale with the TP ratio.
fn ssm_sizes(local: &AgentMeta, remote: &AgentMeta, add: &mut Add<'_>) {
    let (lt, rt) = (u128::from(local.tp_size), u128::from(remote.tp_size));
    let expect = |l: u64| {
        let global = u128::from(l) * lt;
        if global % rt == 0 {
            (global / rt).to_string()
        } else {
            format!("{global}/{rt} (not whole)")
        }
    };
    let mut check = |name: &str, l: u64, r: u64| {
        if u128::from(l) * lt != u128::from(r) * rt {
            add(
                name,
                format!("{l} at tp {}", local.tp_size),
                format!("{r} at tp {}", remote.tp_size),
                format!("expected remote {} (local x local tp / remote tp)", expect(l)),
            );
        }
    };
    check("ssm_conv_bytes", local.ssm_sizes.0, remote.ssm_sizes.0);
    check("ssm_temporal_bytes", local.ssm_sizes.1, remote.ssm_sizes.1);
    if local.conv_proj_bytes.len() != remote.conv_proj_bytes.len() {
        add(
            "conv_proj_count",
            local.conv_proj_bytes.len().to_string(),
            remote.conv_proj_bytes.len().to_string(),
            String::new(),
        );
    } else {
        for (i, (&l, &r)) in local.conv_proj_bytes.iter().zip(&remote.conv_proj_bytes).enumerate() {
            check(&format!("conv_proj_bytes[{i}]"), l, r);
        }
    }
}

/// Validate a peer with nothing known in advance about it.
///
/// # Errors
/// [`HandshakeError::Incompatible`] listing every finding.
pub fn validate(local: &AgentMeta, remote: &AgentMeta) -> Result<(), HandshakeError> {
    validate_expected(local, remote, &Expected::default())
}

/// Validate a peer against what this side expects of it (engine id, TP size, block count).
///
/// # Errors
/// [`HandshakeError::Incompatible`] listing every finding, one line each.
pub fn validate_expected(local: &AgentMeta, remote: &AgentMeta, expected: &Expected) -> Result<(), HandshakeError> {
    let f = findings(local, remote, expected);
    if f.is_empty() {
        Ok(())
    } else {
        Err(HandshakeError::Incompatible(f))
    }
}
