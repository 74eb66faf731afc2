//! Simulation oracle: plan random deployments, copy bytes as the plans' moves say, and check every decode rank
//! against docs/byte-layouts.md's logical layout — independently of descriptor indexing.
//!
//! Prefill memory holds, in every request block, a hash of what each byte *means* (tensor, group, request,
//! token, global head, element; or SSM state, sub-projection, global channel/row, byte), so replicated data
//! is identical on every prefill rank. Everything else holds junk. After the moves, each decode byte must be
//! the hash of what it means where the request should fill it, and unchanged everywhere else; no decode
//! byte may be written twice, and prefill memory must be untouched.

use std::collections::HashMap;

use proptest::prelude::*;

use super::meta::TransferMode;
use super::scenario::{Deployment, Engine, Group, Model, RankState, Request, Scenario, Tensor, TensorLayer};
use super::spec::{ConvLayout, MambaKind};

pub(crate) fn mix(mut h: u64, v: u64) -> u64 {
    h ^= v
        .wrapping_add(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(h << 6)
        .wrapping_add(h >> 2);
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb) ^ (h >> 31)
}

fn key(fields: &[u64]) -> u8 {
    fields.iter().fold(0x1234_5678, |h, &f| mix(h, f)) as u8
}

/// One rank's memory: `(base, bytes)` per tensor, in model tensor order.
struct Mem {
    tensors: Vec<(u64, Vec<u8>)>,
}

impl Mem {
    fn at(&mut self, addr: u64, len: u64) -> &mut [u8] {
        for (base, bytes) in &mut self.tensors {
            if addr >= *base && addr + len <= *base + bytes.len() as u64 {
                let off = (addr - *base) as usize;
                return &mut bytes[off..off + len as usize];
            }
        }
        panic!("move [{addr:#x}, +{len}) is outside every tensor of the rank");
    }
}

/// Byte layout of one group on one rank, from the model alone.
enum Kind {
    /// `(heads on this rank, first global head, cell bytes, element bytes)`; MLA has one head, global index 0,
    /// and element bytes 0 (its latents are never K-transposed).
    Attn(u64, u64, u64, u64),
    /// `(sub-projections: (offset, local channels, first global channel, bytes per channel), temporal (offset,
    /// local rows, first global row, bytes per row))`.
    Ssm(Vec<(u64, u64, u64, u64)>, (u64, u64, u64, u64)),
}

fn kind(g: &Group, tp: u64, rank: u64) -> Kind {
    match g {
        Group::Mla { head_size, dtype_bytes } => Kind::Attn(1, 0, head_size * dtype_bytes, 0),
        Group::Attention {
            num_kv_heads: k,
            head_size,
            head_size_v,
            dtype_bytes,
        } => {
            let cell = (head_size + head_size_v.unwrap_or(*head_size)) * dtype_bytes;
            if tp <= *k {
                Kind::Attn(k / tp, rank * k / tp, cell, *dtype_bytes)
            } else {
                Kind::Attn(1, rank * k / tp, cell, *dtype_bytes)
            }
        }
        Group::Ssm {
            mamba,
            conv_dim,
            conv_rows,
            conv_dtype_bytes,
            temporal_shape,
            temporal_dtype_bytes,
            conv_layout,
        } => {
            assert!(
                conv_layout.is_ds(),
                "the oracle models ds conv states (state_split_tests covers sd)"
            );
            let first = temporal_shape[0] * temporal_shape.get(1).copied().unwrap_or(1);
            let dims = match mamba {
                MambaKind::Mamba1 => vec![*conv_dim],
                MambaKind::Mamba2 => vec![first, (conv_dim - first) / 2, (conv_dim - first) / 2],
                MambaKind::Gdn => vec![(conv_dim - first) / 2, (conv_dim - first) / 2, first],
            };
            let per_ch = conv_rows * conv_dtype_bytes;
            let mut off = 0;
            let mut projs = Vec::new();
            for d in dims {
                let local = d / tp;
                projs.push((off, local, rank * local, per_ch));
                off += local * per_ch;
            }
            let rows = temporal_shape[0] / tp;
            let row_bytes = temporal_shape[1..].iter().product::<u64>() * temporal_dtype_bytes;
            Kind::Ssm(projs, (off, rows, rank * rows, row_bytes))
        }
    }
}

/// Whether the engine's attention pages are token-major (its `kv_layout`).
fn token_major(e: &Engine) -> bool {
    e.kv_layout
        .as_deref()
        .is_some_and(|l| super::kv_layout::page_order_of(l) == Ok(Some(super::kv_layout::PageOrder::TokenMajor)))
}

/// Whether the engine's attention pages are heads-major with K transposed (`HKTV`).
fn k_transposed(e: &Engine) -> bool {
    e.kv_layout.as_deref() == Some("HKTV")
}

/// Write `f(byte offset in tensor, key)` for every byte of request block `b` (list position `pos`) of group `g`.
#[allow(clippy::too_many_arguments)]
fn visit(
    k: &Kind,
    e: &Engine,
    page: u64,
    b: u64,
    token0: u64,
    tokens: u64,
    ssm_pos: u64,
    head: &[u64],
    f: &mut dyn FnMut(u64, u8),
) {
    match k {
        Kind::Attn(heads, h0, cell, elem) => {
            let kb = e.kernel_block_size;
            let kpage = kb * heads * cell;
            let hktv = k_transposed(e) && *elem > 0;
            for t in 0..tokens.min(e.logical_block_size) {
                let (j, tt) = (t / e.kernel_block_size, t % e.kernel_block_size);
                for h in 0..*heads {
                    for c in 0..*cell {
                        // docs/byte-layouts.md: heads-major `[heads, tokens, cell]` or token-major `[tokens, heads, cell]`;
                        // HKTV: each head's K as `[elements, tokens]`, then its V as `[tokens, elements]`
                        let half = cell / 2;
                        let at = if token_major(e) {
                            tt * heads * cell + h * cell + c
                        } else if hktv && c < half {
                            h * kb * cell + (c / elem) * kb * elem + tt * elem + c % elem
                        } else if hktv {
                            h * kb * cell + kb * half + tt * half + (c - half)
                        } else {
                            h * kb * cell + tt * cell + c
                        };
                        let off = b * page + j * kpage + at;
                        f(off, key(&[head, &[1, token0 + t, h0 + h, c]].concat()));
                    }
                }
            }
        }
        Kind::Ssm(projs, (t_off, rows, r0, row_bytes)) => {
            for (p, &(off, n, c0, per_ch)) in projs.iter().enumerate() {
                for ch in 0..n {
                    for by in 0..per_ch {
                        f(
                            b * page + off + ch * per_ch + by,
                            key(&[head, &[2, ssm_pos, p as u64, c0 + ch, by]].concat()),
                        );
                    }
                }
            }
            for r in 0..*rows {
                for by in 0..*row_bytes {
                    f(
                        b * page + t_off + r * row_bytes + by,
                        key(&[head, &[3, ssm_pos, r0 + r, by]].concat()),
                    );
                }
            }
        }
    }
}

fn junk(side: u64, rank: u64, t: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| key(&[side, rank, t as u64, i as u64, 0xdead]))
        .collect()
}

/// Run the scenario through the planner and the byte simulation; panic on any difference.
/// Simulate `s` with the default (coalesced) plans; returns whether some plan used chunk descriptors (fewer
/// id pairs than the reference plans).
fn simulate(s: &Scenario) -> bool {
    let dep = Deployment::build(s).unwrap_or_else(|e| panic!("build: {e}\n{}", serde_json::to_string(s).unwrap()));
    let plans = dep
        .plan_all()
        .unwrap_or_else(|e| panic!("plan: {e}\n{}", serde_json::to_string(s).unwrap()));
    let tensor_of = |layout: &super::layout::RankLayout| -> Vec<(u64, u64)> {
        s.model
            .tensors
            .iter()
            .map(|t| {
                let l = layout.layers.iter().find(|l| l.name == t.layers[0].name).unwrap();
                (l.memory.base, l.memory.bytes)
            })
            .collect()
    };
    // Every rank of a side (1 prefill, 2 decode) starts as junk.
    let junk_ranks = |side: u64, ranks: &[RankState]| -> Vec<Mem> {
        ranks
            .iter()
            .enumerate()
            .map(|(r, st)| Mem {
                tensors: tensor_of(&st.layout)
                    .iter()
                    .enumerate()
                    .map(|(t, &(b, n))| (b, junk(side, r as u64, t, n as usize)))
                    .collect(),
            })
            .collect()
    };
    // Fill prefill request blocks with meaning hashes, decode with junk; compute the expected decode bytes.
    let mut p_mem = junk_ranks(1, &dep.prefill);
    let mut d_mem = junk_ranks(2, &dep.decode);
    let mut expected: Vec<Vec<Vec<u8>>> = d_mem
        .iter()
        .map(|m| m.tensors.iter().map(|(_, v)| v.clone()).collect())
        .collect();
    let (pe, de) = (&s.prefill, &s.decode);
    for (ri, req) in s.requests.iter().enumerate() {
        for (g, group) in s.model.groups.iter().enumerate() {
            let (pl, dl) = (&req.prefill[g], &req.decode[g]);
            let (np, nd) = (pl.len() as u64, dl.len() as u64);
            for (t, tensor) in s.model.tensors.iter().enumerate() {
                if !tensor.layers.iter().any(|l| l.group == g as u32) {
                    continue;
                }
                let head = [ri as u64, t as u64, g as u64];
                for (rank, mem) in p_mem.iter_mut().enumerate() {
                    let k = kind(group, u64::from(pe.tp_size), rank as u64);
                    let page = mem.tensors[t].1.len() as u64 / pe.num_blocks;
                    for (i, &b) in pl.iter().enumerate() {
                        let i = i as u64;
                        let bytes = &mut mem.tensors[t].1;
                        visit(
                            &k,
                            pe,
                            page,
                            b,
                            i * pe.logical_block_size,
                            u64::MAX,
                            np - 1 - i,
                            &head,
                            &mut |o, v| bytes[o as usize] = v,
                        );
                    }
                }
                let is_ssm = matches!(group, Group::Ssm { .. });
                let same = pe.logical_block_size == de.logical_block_size;
                // Decode tokens (or states) the request fills: end-aligned on a prefix hit, else front-aligned.
                let (skip, filled) = if is_ssm {
                    (
                        0,
                        if nd <= np {
                            nd
                        } else if nd == np + 1 {
                            np
                        } else {
                            0
                        },
                    )
                } else if same && nd < np {
                    ((np - nd) * pe.logical_block_size, nd * de.logical_block_size)
                } else {
                    (0, (nd * de.logical_block_size).min(np * pe.logical_block_size))
                };
                for (rank, exp) in expected.iter_mut().enumerate() {
                    let k = kind(group, u64::from(de.tp_size), rank as u64);
                    let page = exp[t].len() as u64 / de.num_blocks;
                    for (i, &b) in dl.iter().enumerate() {
                        let i = i as u64;
                        let bytes = &mut exp[t];
                        if is_ssm {
                            if i < filled {
                                let pos = if nd <= np { nd - 1 - i } else { np - 1 - i };
                                visit(&k, de, page, b, 0, 0, pos, &head, &mut |o, v| bytes[o as usize] = v);
                            }
                        } else {
                            let first = i * de.logical_block_size;
                            let n = filled.saturating_sub(first);
                            visit(&k, de, page, b, skip + first, n, 0, &head, &mut |o, v| {
                                bytes[o as usize] = v
                            });
                        }
                    }
                }
            }
        }
    }
    let p_before: Vec<Vec<Vec<u8>>> = p_mem
        .iter()
        .map(|m| m.tensors.iter().map(|(_, v)| v.clone()).collect())
        .collect();
    let mut written: HashMap<(usize, u64), ()> = HashMap::new();
    for rp in &plans {
        let peer = &dep.peers[rp.local_rank as usize];
        for (i, t) in rp.plan.transfers.iter().enumerate() {
            for [la, ra, len] in rp.plan.moves(peer, i).unwrap() {
                let (p_rank, p_addr, d_rank, d_addr) = match s.mode {
                    TransferMode::Pull => (t.remote_rank as usize, ra, rp.local_rank as usize, la),
                    TransferMode::Push => (rp.local_rank as usize, la, t.remote_rank as usize, ra),
                };
                let src = p_mem[p_rank].at(p_addr, len).to_vec();
                d_mem[d_rank].at(d_addr, len).copy_from_slice(&src);
                for a in d_addr..d_addr + len {
                    assert!(
                        written.insert((d_rank, a), ()).is_none(),
                        "decode rank {d_rank} byte {a:#x} written twice"
                    );
                }
            }
        }
    }
    let json = serde_json::to_string(s).unwrap();
    for (r, mem) in p_mem.iter().enumerate() {
        assert!(
            mem.tensors.iter().map(|(_, v)| v).eq(p_before[r].iter()),
            "prefill rank {r} changed\n{json}"
        );
    }
    for (r, mem) in d_mem.iter().enumerate() {
        for (t, (_, got)) in mem.tensors.iter().enumerate() {
            if let Some(o) = (0..got.len()).find(|&o| got[o] != expected[r][t][o]) {
                panic!(
                    "decode rank {r} tensor {t} byte {o} differs (page {})\n{json}",
                    got.len() as u64 / de.num_blocks
                );
            }
        }
    }
    let ids = |plans: &[super::scenario::RankPlan]| -> usize {
        plans
            .iter()
            .flat_map(|p| &p.plan.transfers)
            .map(|t| t.local_ids.len())
            .sum()
    };
    let reference = Deployment::build_with(s, false).unwrap().plan_all().unwrap();
    ids(&plans) < ids(&reference)
}

/// Model families of the oracle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    HybridMla,
    GqaSsm,
    GqaMamba1,
    PureMla,
    PureGqa,
    /// K and V in separate tensors (SGLang's MHA pool): a K group and a V group, each `head_size_v` 0.
    KvApart,
}

fn ssm(mamba: MambaKind) -> Group {
    if mamba == MambaKind::Mamba1 {
        let temporal_shape = vec![8, 2];
        return Group::Ssm {
            mamba,
            conv_dim: 8,
            conv_rows: 2,
            conv_dtype_bytes: 1,
            temporal_shape,
            temporal_dtype_bytes: 2,
            conv_layout: ConvLayout::Ds,
        };
    }
    Group::Ssm {
        mamba,
        conv_dim: 24,
        conv_rows: 2,
        conv_dtype_bytes: 1,
        temporal_shape: vec![8, 1, 1],
        temporal_dtype_bytes: 2,
        conv_layout: ConvLayout::Ds,
    }
}

fn layer(name: String, group: u32) -> TensorLayer {
    TensorLayer {
        name,
        group,
        part: None,
    }
}

/// The family's model; `equal_kv`: K and V heads of one size (2-byte elements, as `HKTV` pages need).
fn model(f: Family, heads: u64, equal_kv: bool) -> Model {
    let mla = Group::Mla {
        head_size: 4,
        dtype_bytes: 2,
    };
    let attn = if equal_kv {
        Group::Attention {
            num_kv_heads: heads,
            head_size: 3,
            head_size_v: None,
            dtype_bytes: 2,
        }
    } else {
        Group::Attention {
            num_kv_heads: heads,
            head_size: 1,
            head_size_v: Some(2),
            dtype_bytes: 1,
        }
    };
    let (groups, tensors): (Vec<Group>, Vec<Vec<TensorLayer>>) = match f {
        Family::HybridMla => (
            vec![mla, ssm(MambaKind::Gdn), ssm(MambaKind::Gdn)],
            (0..2)
                .map(|i| {
                    vec![
                        layer(format!("kda_a.{i}"), 1),
                        layer(format!("mla.{i}"), 0),
                        layer(format!("kda_b.{i}"), 2),
                    ]
                })
                .collect(),
        ),
        Family::GqaSsm => (
            vec![attn, ssm(MambaKind::Mamba2)],
            (0..2)
                .map(|i| vec![layer(format!("attn.{i}"), 0), layer(format!("mamba.{i}"), 1)])
                .collect(),
        ),
        Family::GqaMamba1 => (
            vec![attn, ssm(MambaKind::Mamba1)],
            (0..2)
                .map(|i| vec![layer(format!("attn.{i}"), 0), layer(format!("mamba.{i}"), 1)])
                .collect(),
        ),
        Family::PureMla => (
            vec![mla],
            (0..2).map(|i| vec![layer(format!("layers.{i}"), 0)]).collect(),
        ),
        Family::KvApart => {
            let part = |head_size| Group::Attention {
                num_kv_heads: heads,
                head_size,
                head_size_v: Some(0),
                dtype_bytes: 1,
            };
            (
                vec![part(1), part(2)],
                (0..2)
                    .flat_map(|i| {
                        [
                            vec![layer(format!("attn.{i}.k"), 0)],
                            vec![layer(format!("attn.{i}.v"), 1)],
                        ]
                    })
                    .collect(),
            )
        }
        Family::PureGqa => (
            vec![attn.clone(), attn],
            vec![
                vec![layer("layers.0".into(), 0)],
                vec![layer("layers.1".into(), 1)],
                vec![layer("layers.2".into(), 0)],
            ],
        ),
    };
    Model {
        groups,
        tensors: tensors.into_iter().map(|layers| Tensor { layers }).collect(),
    }
}

/// Tokens per logical block needed so the attention page holds the SSM state (GQA+SSM, hybrid MLA).
fn min_logical(f: Family, heads: u64, tp: u64) -> u64 {
    let state = 24 * 2 / tp + 8 / tp * 2;
    let per_token = match f {
        Family::HybridMla => 8,
        Family::GqaSsm | Family::GqaMamba1 => (heads / tp).max(1) * 3,
        _ => return 1,
    };
    state.div_ceil(per_token)
}

prop_compose! {
    /// A random deployment: every family, both modes, any TP pair, mixed kernel blocks, prefix hits.
    pub(crate) fn scenario()(
        fam in prop::sample::select(vec![Family::HybridMla, Family::GqaSsm, Family::GqaMamba1, Family::PureMla, Family::PureGqa, Family::KvApart]),
        heads in prop::sample::select(vec![1u64, 2, 4, 8]),
        tps in (prop::sample::select(vec![1u32, 2, 4, 8]), prop::sample::select(vec![1u32, 2, 4, 8])),
        kernels in (prop::sample::select(vec![2u64, 4, 8]), prop::sample::select(vec![2u64, 4, 8])),
        extra_ppl in (0u64..2, 0u64..2),
        push in any::<bool>(),
        contiguous in any::<bool>(),
        layouts in prop::sample::select(vec![(None, None), (Some("LBHNC"), Some("HND")), (Some("NHD"), Some("LBNHC")), (Some("BLNHC"), Some("NHD")), (Some("HKTV"), Some("HKTV"))]),
        seed in any::<u64>(),
    ) -> Scenario {
        let (ptp, dtp) = tps;
        // Token-major pages split between TP sizes are cut per token (at most 128 tokens per kernel block, which
        // the kernels here always are); heads-major pages of several heads per rank per (head, unit).
        let (pk, dk) = kernels;
        let lbs = |k: u64, tp: u32, extra: u64| {
            let need = min_logical(fam, heads, u64::from(tp));
            (need.div_ceil(k).max(1) + extra) * k
        };
        let (mut pl, mut dl) = (lbs(pk, ptp, extra_ppl.0), lbs(dk, dtp, extra_ppl.1));
        let mut rng = seed;
        let mut next = |n: u64| { rng = mix(rng, 7); rng % n.max(1) };
        if pk == dk && next(2) == 0 {
            dl = dl.max(pl);
            pl = dl; // same logical size: prefix hits possible
        }
        // HKTV pages hold K and V of one head size (K and V apart in tensors of their own are never HKTV)
        let hktv = layouts.0 == Some("HKTV");
        let layouts = if hktv && fam == Family::KvApart { (None, None) } else { layouts };
        let m = model(fam, heads, hktv);
        let mut counts = Vec::new();
        for _ in 0..1 + next(2) {
            let tokens = 1 + next(3 * pl.max(dl));
            let mut c = Vec::new();
            for g in &m.groups {
                c.push(if matches!(g, Group::Ssm { .. }) {
                    let np = 1 + next(3);
                    (np, next(np + 2))
                } else {
                    let (np, nd) = (tokens.div_ceil(pl), tokens.div_ceil(dl));
                    let hit = if pl == dl { next(np + 1) } else { 0 };
                    (np, nd - hit.min(nd))
                });
            }
            counts.push(c);
        }
        // Block ids: a permutation of a small prime-sized pool per engine, so ids are scattered but distinct;
        // or (contiguous) ascending runs that wrap around the pool, so dense regions plan chunk descriptors.
        let step = if contiguous { 1 } else { 3 };
        let prime = |n: u64| [11u64, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 79, 83, 89, 97, 101]
            .into_iter().find(|&p| p >= n).unwrap_or(127);
        let (pn, dn) = (prime(counts.iter().flatten().map(|c| c.0).sum()), prime(counts.iter().flatten().map(|c| c.1).sum()));
        let (mut pi, mut di) = (seed % 5, seed % 7);
        let requests = counts.iter().enumerate().map(|(r, c)| {
            let (mut pg, mut dg) = (Vec::new(), Vec::new());
            for &(np, nd) in c {
                pg.push((pi..pi + np).map(|b| b * step % pn).collect::<Vec<_>>());
                dg.push((di..di + nd).map(|b| b * step % dn).collect::<Vec<_>>());
                pi += np;
                di += nd;
            }
            Request { id: format!("req-{r}"), prefill: pg, decode: dg }
        }).collect();
        Scenario {
            name: Some(format!("{fam:?}")),
            model: m,
            prefill: Engine { tp_size: ptp, logical_block_size: pl, kernel_block_size: pk, num_blocks: pn, kv_layout: layouts.0.map(String::from), state_slots: None },
            decode: Engine { tp_size: dtp, logical_block_size: dl, kernel_block_size: dk, num_blocks: dn, kv_layout: layouts.1.map(String::from), state_slots: None },
            mode: if push { TransferMode::Push } else { TransferMode::Pull },
            requests,
        }
    }
}

/// 160 random deployments, or `PROPTEST_CASES` when set (e.g. 1000 for a longer run).
fn oracle_cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(160)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: oracle_cases(), failure_persistence: None, ..ProptestConfig::default() })]

    /// Random deployments of every family, both modes, any TP pair, mixed kernel blocks and prefix hits; the
    /// handshake accepts every rank pair the planner plans.
    #[test]
    fn oracle_random_deployments(s in scenario()) {
        simulate(&s);
        let report = super::scenario::check::check_scenario(&s).unwrap();
        let findings = report.pairs.iter().flat_map(|p| &p.findings);
        let other: Vec<_> = findings.filter(|f| f.check != "gqa_replication").collect();
        prop_assert!(other.is_empty(), "{:?}", other);
    }
}

/// Contiguous requests on dense pure-MLA and pure-GQA tensors at every TP pair, both modes: chunk descriptors
/// are used where the regions are dense and whole on both sides, and the bytes are still exactly right.
#[test]
fn oracle_contiguous_requests_use_chunks() {
    let mut chunked = 0;
    for fam in [Family::PureMla, Family::PureGqa] {
        for (ptp, dtp) in [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2)] {
            for mode in [TransferMode::Pull, TransferMode::Push] {
                let m = model(fam, 2, false);
                let n = m.groups.len();
                // GQA kernels equal: chunk descriptors need whole units (per-head pieces take none).
                let dk = if matches!(fam, Family::PureMla) { 2 } else { 4 };
                let req = Request {
                    id: "r".into(),
                    prefill: (0..n as u64).map(|g| (20 * g + 1..20 * g + 12).collect()).collect(),
                    decode: (0..n as u64).map(|g| (20 * g + 3..20 * g + 14).collect()).collect(),
                };
                let s = Scenario {
                    name: None,
                    model: m,
                    prefill: Engine {
                        tp_size: ptp,
                        logical_block_size: 4,
                        kernel_block_size: 4,
                        num_blocks: 48,
                        kv_layout: None,
                        state_slots: None,
                    },
                    decode: Engine {
                        tp_size: dtp,
                        logical_block_size: 4,
                        kernel_block_size: dk,
                        num_blocks: 48,
                        kv_layout: None,
                        state_slots: None,
                    },
                    mode,
                    requests: vec![req],
                };
                chunked += usize::from(simulate(&s));
            }
        }
    }
    assert!(chunked >= 10, "{chunked} of 20 deployments used chunk descriptors");
}

/// The F.2-scale hybrid MLA pull at every TP pair, deterministically.
#[test]
fn oracle_hybrid_mla_tp_grid() {
    for ptp in [1, 2, 4, 8] {
        for dtp in [1, 2, 4, 8] {
            for mode in [TransferMode::Pull, TransferMode::Push] {
                let m = model(Family::HybridMla, 1, false);
                let req = Request {
                    id: "r".into(),
                    prefill: vec![vec![1, 3], vec![4], vec![0]],
                    decode: vec![vec![2, 0], vec![1], vec![3]],
                };
                let s = Scenario {
                    name: None,
                    model: m,
                    prefill: Engine {
                        tp_size: ptp,
                        logical_block_size: 8,
                        kernel_block_size: 4,
                        num_blocks: 6,
                        kv_layout: None,
                        state_slots: None,
                    },
                    decode: Engine {
                        tp_size: dtp,
                        logical_block_size: 12,
                        kernel_block_size: 2,
                        num_blocks: 6,
                        kv_layout: None,
                        state_slots: None,
                    },
                    mode,
                    requests: vec![req],
                };
                simulate(&s);
            }
        }
    }
}

/// Token-major pages of several heads per rank with different kernel block sizes on the two sides, both modes
/// and both directions of the ratio: planned by token ranges, byte-exact; the same deployment with heads-major
/// pages is planned per (head, unit), byte-exact too.
#[test]
fn oracle_token_major_pages_of_different_block_sizes() {
    for (pk, dk) in [(8u64, 4u64), (4, 8), (4, 6)] {
        for tp in [1u32, 2] {
            for mode in [TransferMode::Pull, TransferMode::Push] {
                let m = model(Family::PureGqa, 4, false);
                let req = Request {
                    id: "r".into(),
                    prefill: vec![vec![3, 1, 4], vec![0, 2, 5]],
                    decode: vec![vec![5, 2, 0], vec![1, 4, 3]],
                };
                let engine = |k: u64, layout: &str| Engine {
                    tp_size: tp,
                    logical_block_size: 24,
                    kernel_block_size: k,
                    num_blocks: 6,
                    kv_layout: Some(layout.into()),
                    state_slots: None,
                };
                let mut s = Scenario {
                    name: None,
                    model: m,
                    prefill: engine(pk, "LBNHC"),
                    decode: engine(dk, "NHD"),
                    mode,
                    requests: vec![req],
                };
                simulate(&s);
                // heads-major pages of the same deployment: cut per (head, unit)
                s.prefill.kv_layout = Some("HND".into());
                s.decode.kv_layout = None;
                simulate(&s);
                // and the same token-major pages split between TP sizes (per-token head slices)
                s.prefill.kv_layout = Some("NHD".into());
                s.decode.kv_layout = Some("BLNHC".into());
                s.decode.tp_size = tp * 2;
                simulate(&s);
                s.decode.tp_size = tp;
                s.prefill.tp_size = tp * 2;
                simulate(&s);
            }
        }
    }
}

/// Heads-major pages of several heads per rank with different kernel block sizes on the two sides: GQA (8 KV
/// heads, and 2 heads replicated over 4 ranks), a hybrid GQA + Mamba2 model and K/V in separate tensors, at
/// equal TP and under a TP head split in both directions, both modes, both directions of the ratio and a ratio
/// neither side divides: every decode byte is what the prefill page means.
#[test]
fn oracle_heads_major_pages_of_different_block_sizes() {
    let tps = [(1u32, 1u32), (2, 1), (1, 2), (2, 4), (4, 2), (1, 4), (8, 2)];
    for (fam, heads, layouts) in [
        (Family::PureGqa, 8u64, (Some("LBHNC"), None)),
        (Family::GqaSsm, 8, (Some("LBHNC"), None)),
        (Family::KvApart, 4, (Some("LBHNC"), None)),
        (Family::PureGqa, 2, (Some("LBHNC"), None)),
        (Family::PureGqa, 2, (Some("HKTV"), Some("HKTV"))),
        (Family::PureGqa, 1, (Some("HKTV"), Some("HKTV"))),
        (Family::GqaSsm, 4, (Some("HKTV"), Some("HKTV"))),
    ] {
        for (pk, dk) in [(8u64, 4u64), (4, 8), (4, 6)] {
            for (ptp, dtp) in tps {
                for mode in [TransferMode::Pull, TransferMode::Push] {
                    let m = model(fam, heads, layouts.0 == Some("HKTV"));
                    let n = m.groups.len();
                    let ssm = |g: usize| matches!(m.groups[g], Group::Ssm { .. });
                    // SSM states in blocks of their own (the tensors are shared with the attention pages)
                    let ids = |attn: &[u64], state: u64, g: usize| if ssm(g) { vec![state] } else { attn.to_vec() };
                    let req = Request {
                        id: "r".into(),
                        prefill: (0..n).map(|g| ids(&[3, 1, 4], 0, g)).collect(),
                        decode: (0..n).map(|g| ids(&[5, 2, 0], 1, g)).collect(),
                    };
                    let engine = |tp: u32, k: u64, layout: Option<&str>| Engine {
                        tp_size: tp,
                        logical_block_size: 24,
                        kernel_block_size: k,
                        num_blocks: 6,
                        kv_layout: layout.map(String::from),
                        state_slots: None,
                    };
                    let s = Scenario {
                        name: Some(format!(
                            "{fam:?} {heads} heads, P TP {ptp} k {pk} -> D TP {dtp} k {dk}, {mode:?}, {layouts:?}"
                        )),
                        model: m,
                        prefill: engine(ptp, pk, layouts.0),
                        decode: engine(dtp, dk, layouts.1),
                        mode,
                        requests: vec![req],
                    };
                    simulate(&s);
                    // the handshake accepts each pair (prefill ranks replicating heads for fewer decode ranks
                    // aside: refused whatever the block sizes, though planned byte-exact here)
                    let report = super::scenario::check::check_scenario(&s).unwrap();
                    let findings = report.pairs.iter().flat_map(|p| &p.findings);
                    let other: Vec<_> = findings.filter(|f| f.check != "gqa_replication").collect();
                    assert!(other.is_empty(), "{other:?}");
                }
            }
        }
    }
}
