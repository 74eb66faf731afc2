//! SSM states split over several tensors (SGLang's `MambaPool`: one conv tensor of Q|K|V channels or one per
//! sub-projection, `ds` or `sd`, and a temporal tensor), each holding its own number of state slots beside a page
//! pool of another size: plans between every TP pair, pull and push, moved byte by byte and checked against a
//! byte model of what each byte means (written here from docs/byte-layouts.md, not from the planner), every byte
//! no request names left as it was; and fused states planned exactly as before.

use proptest::prelude::*;

use super::layout::{LayerInput, LayerMemory, MemType, RankLayout};
use super::meta::{AgentMeta, EngineInfo, TransferMode};
use super::oracle_tests::mix;
use super::plan::{PeerPlan, PlanError};
use super::region::RegionTable;
use super::spec::{AttentionSpec, ConvLayout, LayerSpec, MambaKind, SsmSpec, StatePart};
use super::tp::handshake_target_ranks;

/// Global Q, K, V conv channels (GDN: `[K/2 | K/2 | heads x head_v]`), conv rows, bytes per conv element.
const PROJ: [u64; 3] = [4, 4, 8];
const ROWS: u64 = 3;
const CONV_E: u64 = 2;
/// Global temporal heads and bytes per head (`[heads, 4, 2]` of 4-byte elements).
const HEADS: u64 = 2;
const HEAD_BYTES: u64 = 4 * 2 * 4;
/// Attention: global KV heads, head size, tokens per page, pages in the pool.
const KV_HEADS: u64 = 2;
const HEAD_SIZE: u64 = 4;
const PAGE_TOKENS: u64 = 4;
pub(crate) const PAGES: u64 = 6;
/// State slots of each state tensor (a pool of its own size, larger than the page pool here).
pub(crate) const SLOTS: u64 = 9;
const LAYERS: u64 = 2;

/// How a rank's states are stored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Store {
    /// One tensor per layer holding whole states (`[conv ds | temporal | 8 bytes padding]`).
    Fused,
    /// One conv tensor of Q|K|V channels and a temporal tensor (SGLang's Qwen3-Next pools).
    OneConv(ConvLayout),
    /// A conv tensor per sub-projection and a temporal tensor (SGLang's Kimi-Linear pools).
    ThreeConv(ConvLayout),
}

/// What one tensor holds.
#[derive(Debug, Clone)]
enum Content {
    Attn,
    Whole,
    Conv(Vec<u32>, ConvLayout),
    Temporal,
}

#[derive(Debug, Clone)]
struct Tensor {
    layer: u64,
    content: Content,
    base: u64,
    page: u64,
    count: u64,
}

fn local(global: u64, tp: u64) -> u64 {
    global / tp
}

fn conv_bytes(projs: &[u32], tp: u64) -> u64 {
    projs.iter().map(|&p| local(PROJ[p as usize], tp)).sum::<u64>() * ROWS * CONV_E
}

fn tensors(store: Store, tp: u64, rank: u64) -> Vec<Tensor> {
    let mut out = Vec::new();
    let mut base = 0x10_0000 * (rank + 1) + if tp == 2 { 0x100_0000 } else { 0 };
    let mut push = |layer, content: Content, page: u64, count: u64| {
        out.push(Tensor {
            layer,
            content,
            base,
            page,
            count,
        });
        base += (page * count).next_multiple_of(0x1000) + 0x1000;
    };
    let temporal = local(HEADS, tp) * HEAD_BYTES;
    push(
        0,
        Content::Attn,
        local(KV_HEADS, tp) * PAGE_TOKENS * 2 * HEAD_SIZE * 2,
        PAGES,
    );
    for layer in 0..LAYERS {
        match store {
            Store::Fused => push(layer, Content::Whole, conv_bytes(&[0, 1, 2], tp) + temporal + 8, SLOTS),
            Store::OneConv(l) => {
                push(
                    layer,
                    Content::Conv(vec![0, 1, 2], l),
                    conv_bytes(&[0, 1, 2], tp),
                    SLOTS,
                );
                push(layer, Content::Temporal, temporal, SLOTS);
            }
            Store::ThreeConv(l) => {
                for p in 0..3 {
                    push(layer, Content::Conv(vec![p], l), conv_bytes(&[p], tp), SLOTS);
                }
                push(layer, Content::Temporal, temporal, SLOTS);
            }
        }
    }
    out
}

pub(crate) fn layout(store: Store, tp: u64, rank: u64) -> RankLayout {
    let ssm = |part: Option<StatePart>, conv_layout| {
        LayerSpec::Ssm(SsmSpec {
            kind: MambaKind::Gdn,
            conv_shape: [PROJ.iter().sum::<u64>() / tp, ROWS],
            conv_dtype_bytes: CONV_E,
            temporal_shape: vec![HEADS / tp, 4, 2],
            temporal_dtype_bytes: 4,
            page_size_padded: (store == Store::Fused).then(|| conv_bytes(&[0, 1, 2], tp) + HEADS / tp * HEAD_BYTES + 8),
            conv_layout,
            part,
        })
    };
    let layers = tensors(store, tp, rank)
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let (name, group, spec) = match &t.content {
                Content::Attn => (
                    "model.layers.0.attn".to_string(),
                    0,
                    LayerSpec::FullAttention(AttentionSpec {
                        num_kv_heads: KV_HEADS / tp,
                        head_size: HEAD_SIZE,
                        head_size_v: None,
                        dtype_bytes: 2,
                        page_size_padded: None,
                    }),
                ),
                Content::Whole => (
                    format!("model.layers.{}.linear", t.layer + 1),
                    1,
                    ssm(None, ConvLayout::Ds),
                ),
                Content::Conv(p, l) => (
                    format!("model.layers.{}.linear.conv{i}", t.layer + 1),
                    1,
                    ssm(Some(StatePart::Conv(p.clone())), *l),
                ),
                Content::Temporal => (
                    format!("model.layers.{}.linear.temporal", t.layer + 1),
                    1,
                    ssm(Some(StatePart::Temporal), ConvLayout::Ds),
                ),
            };
            // the conv layout is the state's: every layer of a state says it
            let conv_layout = match store {
                Store::OneConv(l) | Store::ThreeConv(l) => l,
                Store::Fused => ConvLayout::Ds,
            };
            let spec = match spec {
                LayerSpec::Ssm(s) => LayerSpec::Ssm(SsmSpec { conv_layout, ..s }),
                other => other,
            };
            let is_ssm = spec.is_ssm();
            LayerInput {
                name,
                group,
                spec,
                memory: LayerMemory {
                    base: t.base,
                    bytes: t.page * t.count,
                    block_stride: 0,
                    device: 0,
                    mem_type: MemType::Dram,
                    num_blocks: is_ssm.then_some(t.count),
                    page_layout: None,
                },
            }
        })
        .collect();
    RankLayout {
        tp_rank: rank as u32,
        tp_size: tp as u32,
        logical_block_size: PAGE_TOKENS,
        kernel_block_size: PAGE_TOKENS,
        num_logical_blocks: PAGES,
        total_num_kv_heads: KV_HEADS,
        kv_layout: None,
        layers,
    }
}

/// Every byte of a rank's share of one request's content in tensor `t`'s page: `(offset in page, value)`.
/// `item` is the request's page index for attention (its tokens), 0 for a state.
fn visit(t: &Tensor, tp: u64, rank: u64, item: u64, f: &mut dyn FnMut(u64, u8)) {
    let v = |fields: &[u64]| fields.iter().fold(0x51u64, |h, &x| mix(h, x)) as u8;
    let conv = |projs: &[u32], l: ConvLayout, f: &mut dyn FnMut(u64, u8)| {
        let width: u64 = projs.iter().map(|&p| local(PROJ[p as usize], tp)).sum();
        let mut before = 0;
        for &p in projs {
            let d = local(PROJ[p as usize], tp);
            for c in 0..d {
                let global = rank * d + c;
                for j in 0..ROWS {
                    let elem = match l {
                        ConvLayout::Ds => (before + c) * ROWS + j,
                        ConvLayout::Sd => j * width + before + c,
                    };
                    for b in 0..CONV_E {
                        f(elem * CONV_E + b, v(&[1, t.layer, u64::from(p), global, j, b]));
                    }
                }
            }
            before += d;
        }
        width * ROWS * CONV_E
    };
    let temporal = |off: u64, f: &mut dyn FnMut(u64, u8)| {
        let h_local = local(HEADS, tp);
        for h in 0..h_local {
            for b in 0..HEAD_BYTES {
                f(off + h * HEAD_BYTES + b, v(&[2, t.layer, rank * h_local + h, b]));
            }
        }
    };
    match &t.content {
        Content::Attn => {
            let (heads, cell) = (local(KV_HEADS, tp), 2 * HEAD_SIZE * 2);
            for h in 0..heads {
                for tok in 0..PAGE_TOKENS {
                    for b in 0..cell {
                        let global = (rank * heads + h, item * PAGE_TOKENS + tok);
                        f((h * PAGE_TOKENS + tok) * cell + b, v(&[3, global.0, global.1, b]));
                    }
                }
            }
        }
        Content::Whole => {
            let off = conv(&[0, 1, 2], ConvLayout::Ds, f);
            temporal(off, f);
        }
        Content::Conv(p, l) => {
            conv(p, *l, f);
        }
        Content::Temporal => temporal(0, f),
    }
}

struct Rank {
    tensors: Vec<Tensor>,
    bytes: Vec<Vec<u8>>,
}

impl Rank {
    fn new(store: Store, tp: u64, rank: u64, salt: u64) -> Rank {
        let tensors = tensors(store, tp, rank);
        let bytes = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                (0..t.page * t.count)
                    .map(|b| mix(mix(salt, rank * 100 + i as u64), b) as u8)
                    .collect()
            })
            .collect();
        Rank { tensors, bytes }
    }

    fn at(&mut self, addr: u64, len: u64) -> &mut [u8] {
        for (t, bytes) in self.tensors.iter().zip(&mut self.bytes) {
            if addr >= t.base && addr + len <= t.base + bytes.len() as u64 {
                let off = (addr - t.base) as usize;
                return &mut bytes[off..off + len as usize];
            }
        }
        panic!("move [{addr:#x}, +{len}) is outside every tensor of the rank");
    }

    /// Write the request's content: pages `pages` of attention, state slot `slot` of every state tensor.
    fn fill(&mut self, tp: u64, rank: u64, pages: &[u64], slot: u64) {
        for (t, bytes) in self.tensors.iter().zip(&mut self.bytes) {
            let blocks: Vec<(u64, u64)> = match t.content {
                Content::Attn => pages.iter().enumerate().map(|(i, &p)| (i as u64, p)).collect(),
                _ => vec![(0, slot)],
            };
            for (item, block) in blocks {
                let at = block * t.page;
                visit(t, tp, rank, item, &mut |o, v| bytes[(at + o) as usize] = v);
            }
        }
    }
}

fn meta(table: &RegionTable, engine: &str, mode: TransferMode) -> AgentMeta {
    let info = EngineInfo {
        engine_id: engine.into(),
        transfer_mode: mode,
        ..EngineInfo::default()
    };
    AgentMeta::from_table(table, &info)
}

/// Move one request (prefill pages `pp`, slot `ps` to decode pages `dp`, slot `ds`) between `store` pools of
/// TP `p_tp` and `d_tp` in `mode`, and check every decode byte against the model.
fn transfer(
    store: Store,
    (p_tp, d_tp): (u64, u64),
    mode: TransferMode,
    (pp, ps): (&[u64], u64),
    (dp, ds): (&[u64], u64),
) {
    let mut prefill: Vec<Rank> = (0..p_tp).map(|r| Rank::new(store, p_tp, r, 1)).collect();
    let mut decode: Vec<Rank> = (0..d_tp).map(|r| Rank::new(store, d_tp, r, 2)).collect();
    for (r, rank) in prefill.iter_mut().enumerate() {
        rank.fill(p_tp, r as u64, pp, ps);
    }
    let mut expected: Vec<Vec<Vec<u8>>> = decode.iter().map(|r| r.bytes.clone()).collect();
    for (r, exp) in expected.iter_mut().enumerate() {
        let mut want = Rank::new(store, d_tp, r as u64, 2);
        want.fill(d_tp, r as u64, dp, ds);
        *exp = want.bytes;
    }
    let p_before: Vec<Vec<Vec<u8>>> = prefill.iter().map(|r| r.bytes.clone()).collect();
    let tables = |tp: u64| -> Vec<RegionTable> {
        (0..tp)
            .map(|r| RegionTable::build(&layout(store, tp, r)).unwrap_or_else(|e| panic!("{store:?} tp {tp}: {e}")))
            .collect()
    };
    let (p_tables, d_tables) = (tables(p_tp), tables(d_tp));
    let (locals, remotes, remote_engine) = match mode {
        TransferMode::Pull => (&d_tables, &p_tables, "prefill"),
        TransferMode::Push => (&p_tables, &d_tables, "decode"),
    };
    let metas: Vec<AgentMeta> = remotes.iter().map(|t| meta(t, remote_engine, mode)).collect();
    let mut written = std::collections::HashSet::new();
    for (lr, table) in locals.iter().enumerate() {
        let targets = handshake_target_ranks(table.tp_rank, table.tp_size, metas.len() as u32).unwrap();
        let metas: Vec<AgentMeta> = targets.iter().map(|&r| metas[r as usize].clone()).collect();
        let peer = PeerPlan::new(table, &metas, mode).unwrap_or_else(|e| panic!("{store:?}: {e}"));
        let (mine, theirs) = match mode {
            TransferMode::Pull => ((dp, ds), (pp, ps)),
            TransferMode::Push => ((pp, ps), (dp, ds)),
        };
        let plan = peer
            .plan(&[mine.0.to_vec(), vec![mine.1]], &[theirs.0.to_vec(), vec![theirs.1]])
            .unwrap_or_else(|e| panic!("{store:?}: {e}"));
        for (i, t) in plan.transfers.iter().enumerate() {
            for [la, ra, len] in plan.moves(&peer, i).unwrap() {
                let (p, pa, d, da) = match mode {
                    TransferMode::Pull => (t.remote_rank as usize, ra, lr, la),
                    TransferMode::Push => (lr, la, t.remote_rank as usize, ra),
                };
                let src = prefill[p].at(pa, len).to_vec();
                decode[d].at(da, len).copy_from_slice(&src);
                for a in da..da + len {
                    assert!(
                        written.insert((d, a)),
                        "{store:?}: decode rank {d} byte {a:#x} written twice"
                    );
                }
            }
        }
    }
    for (r, (got, want)) in decode.iter().zip(&expected).enumerate() {
        for (t, (g, w)) in got.bytes.iter().zip(want).enumerate() {
            let bad = g.iter().zip(w).position(|(a, b)| a != b);
            assert!(
                bad.is_none(),
                "{store:?} P{p_tp}->D{d_tp} {mode:?}: decode rank {r} tensor {t} ({:?}) byte {} differs",
                got.tensors[t].content,
                bad.unwrap_or(0)
            );
        }
    }
    let p_after: Vec<Vec<Vec<u8>>> = prefill.iter().map(|r| r.bytes.clone()).collect();
    assert!(p_before == p_after, "{store:?}: prefill memory changed");
}

pub(crate) const STORES: [Store; 5] = [
    Store::Fused,
    Store::OneConv(ConvLayout::Ds),
    Store::OneConv(ConvLayout::Sd),
    Store::ThreeConv(ConvLayout::Ds),
    Store::ThreeConv(ConvLayout::Sd),
];

#[test]
fn split_states_move_byte_exact_between_every_tp_pair() {
    for store in STORES {
        for tps in [(1, 1), (2, 1), (1, 2), (2, 2)] {
            for mode in [TransferMode::Pull, TransferMode::Push] {
                transfer(store, tps, mode, (&[4, 1], 7), (&[2, 5], 8));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Any pages, any slots (each side's own slot count), any layout and TP pair: byte exact.
    #[test]
    fn split_states_move_any_request(
        store in 0..5usize,
        tps in prop::sample::select(vec![(1u64, 1u64), (2, 1), (1, 2), (2, 2)]),
        push in any::<bool>(),
        pages in prop::sample::subsequence((0..PAGES).collect::<Vec<_>>(), 1..4).prop_shuffle(),
        slots in (0..SLOTS, 0..SLOTS),
        shift in 0..PAGES,
    ) {
        let dp: Vec<u64> = pages.iter().map(|p| (p + shift) % PAGES).collect();
        let mode = if push { TransferMode::Push } else { TransferMode::Pull };
        transfer(STORES[store], tps, mode, (&pages, slots.0), (&dp, slots.1));
    }
}

#[test]
fn a_slot_past_a_state_pool_is_refused_naming_group_id_and_count() {
    let table = RegionTable::build(&layout(Store::OneConv(ConvLayout::Sd), 2, 0)).unwrap();
    let remote = RegionTable::build(&layout(Store::OneConv(ConvLayout::Sd), 1, 0)).unwrap();
    let peer = PeerPlan::new(&table, &[meta(&remote, "p", TransferMode::Pull)], TransferMode::Pull).unwrap();
    // pages go up to PAGES, slots to SLOTS: page ids past PAGES are fine for the state group
    assert!(peer
        .plan(&[vec![1], vec![PAGES + 1]], &[vec![2], vec![SLOTS - 1]])
        .is_ok());
    let err = peer.plan(&[vec![1], vec![SLOTS]], &[vec![2], vec![0]]).unwrap_err();
    assert!(
        matches!(err, PlanError::BlockOutOfRange { group: 1, id, limit, .. } if id == SLOTS && limit == SLOTS),
        "{err}"
    );
    let err = peer.plan(&[vec![PAGES], vec![0]], &[vec![2], vec![0]]).unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::BlockOutOfRange {
                group: 0,
                id: PAGES,
                limit: PAGES,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn split_state_tables_have_one_row_per_stream_of_each_part() {
    // sd conv over 3 rows: a stream per (row, sub-projection); the temporal state one stream
    let t = RegionTable::build(&layout(Store::OneConv(ConvLayout::Sd), 1, 0)).unwrap();
    assert_eq!(t.ssm_streams_per_region(), [9, 1, 9, 1]);
    assert_eq!(t.ssm_row_counts(), [SLOTS; 20]);
    let t = RegionTable::build(&layout(Store::ThreeConv(ConvLayout::Ds), 2, 1)).unwrap();
    assert_eq!(t.ssm_streams_per_region(), [1, 1, 1, 1, 1, 1, 1, 1]);
    // the attention region keeps its page count, the state regions their slots
    assert_eq!(t.regions[0].num_blocks, PAGES);
    assert!(t.ssm_regions.iter().all(|&i| t.regions[i].states == Some(SLOTS)));
    // a fused layout without its own counts is the vLLM one: no states field, every region of the pool's count
    let mut fused = layout(Store::Fused, 1, 0);
    fused.layers.iter_mut().for_each(|l| l.memory.num_blocks = None);
    fused.layers[0].memory.bytes *= SLOTS; // room for the forced count
    fused.num_logical_blocks = SLOTS;
    let t = RegionTable::build(&fused).unwrap();
    assert!(t.regions.iter().all(|r| r.states.is_none() && r.num_blocks == SLOTS));
}

#[test]
fn incomplete_or_mixed_state_parts_are_refused() {
    let mut l = layout(Store::ThreeConv(ConvLayout::Sd), 1, 0);
    l.layers.retain(|x| !x.name.ends_with("conv2")); // layer 1 loses its K conv tensor
    let err = RegionTable::build(&l).unwrap_err().to_string();
    assert!(err.contains("split states are not whole"), "{err}");
    let mut l = layout(Store::OneConv(ConvLayout::Ds), 1, 0);
    if let LayerSpec::Ssm(s) = &mut l.layers[1].spec {
        s.part = Some(StatePart::Conv(vec![2, 0]));
    }
    let err = RegionTable::build(&l).unwrap_err().to_string();
    assert!(err.contains("distinct ascending"), "{err}");
    let mut l = layout(Store::OneConv(ConvLayout::Ds), 1, 0);
    l.layers[1].memory.num_blocks = Some(u64::MAX / 2);
    let err = RegionTable::build(&l).unwrap_err().to_string();
    assert!(
        err.contains("memory.num_blocks") && err.contains("exceed the limit"),
        "{err}"
    );
}

#[test]
fn split_state_metadata_round_trips_and_hostile_parts_are_refused() {
    use super::handshake::{decode, encode};
    let t = RegionTable::build(&layout(Store::ThreeConv(ConvLayout::Sd), 2, 0)).unwrap();
    let m = meta(&t, "p", TransferMode::Pull);
    assert_eq!(m.conv_rows, ROWS);
    assert_eq!(decode(&encode(&m).unwrap()).unwrap(), m);
    let bad = |f: &dyn Fn(&mut AgentMeta), what: &str| {
        let mut m = m.clone();
        f(&mut m);
        let err = decode(&encode(&m).unwrap()).unwrap_err().to_string();
        assert!(err.contains(what), "{what}: {err}");
    };
    bad(
        &|m| m.regions[1].state_part = Some(StatePart::Conv(vec![0, 7])),
        "state_part",
    );
    bad(
        &|m| m.regions[0].state_part = Some(StatePart::Temporal),
        "only SSM regions",
    );
    bad(&|m| m.regions[1].state_part = None, "every SSM region");
    bad(&|m| m.conv_rows = 1000, "conv_rows");
    bad(&|m| m.regions[1].states = Some(u64::MAX), "regions[1].states");
    // a fused vLLM payload carries none of the new fields
    let fused = {
        let mut l = layout(Store::Fused, 1, 0);
        l.layers.iter_mut().for_each(|x| x.memory.num_blocks = None);
        l.layers[0].memory.bytes *= 2;
        l.num_logical_blocks = SLOTS;
        meta(&RegionTable::build(&l).unwrap(), "p", TransferMode::Pull)
    };
    let bytes = encode(&fused).unwrap();
    for key in ["state_part", "states", "conv_rows", "conv_layout"] {
        assert!(!bytes.windows(key.len()).any(|w| w == key.as_bytes()), "{key} sent");
    }
}

#[test]
fn the_handshake_names_split_and_layout_mismatches_and_passes_twins() {
    use super::handshake::{validate, Expected};
    let meta_of = |store, tp, rank| {
        let engine = if tp == 1 { "prefill" } else { "decode" };
        meta(
            &RegionTable::build(&layout(store, tp, rank)).unwrap(),
            engine,
            TransferMode::Pull,
        )
    };
    let checks = |a: &AgentMeta, b: &AgentMeta| -> Vec<String> {
        super::handshake::findings(a, b, &Expected::default())
            .into_iter()
            .map(|f| f.check)
            .collect()
    };
    for store in STORES {
        let r = validate(&meta_of(store, 2, 0), &meta_of(store, 1, 0));
        assert!(r.is_ok(), "{store:?}: {r:?}");
    }
    let sd = meta_of(Store::OneConv(ConvLayout::Sd), 2, 0);
    let ds = meta_of(Store::OneConv(ConvLayout::Ds), 1, 0);
    assert!(
        checks(&sd, &ds).contains(&"conv_layout".to_string()),
        "{:?}",
        checks(&sd, &ds)
    );
    let three = meta_of(Store::ThreeConv(ConvLayout::Ds), 1, 0);
    assert!(checks(&ds, &three).contains(&"state_parts".to_string()));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// A peer lying about its state parts, slot counts or conv rows is refused at decode or by the plan, or
    /// planned with every remote range inside the regions it advertised: never a panic, never a stray byte.
    #[test]
    fn hostile_split_state_metadata_is_refused_or_contained(
        store in 1..5usize,
        field in 0..5u8,
        value in prop::sample::select(vec![0u64, 1, 2, 3, SLOTS - 1, SLOTS + 1, 64, 65, 1 << 31, u64::MAX]),
        region in 0..9usize,
        push in any::<bool>(),
    ) {
        use super::handshake::{decode, encode};
        let store = STORES[store];
        let mode = if push { TransferMode::Push } else { TransferMode::Pull };
        let local = RegionTable::build(&layout(store, 1, 0)).unwrap();
        let remotes: Vec<AgentMeta> = (0..2)
            .map(|r| {
                let mut m = meta(&RegionTable::build(&layout(store, 2, r)).unwrap(), "peer", mode);
                let i = region % m.regions.len();
                match field {
                    0 => m.regions[i].states = Some(value),
                    1 => m.regions[i].state_part = Some(StatePart::Conv(vec![(value % 7) as u32])),
                    2 => m.regions[i].state_part = Some(StatePart::Temporal),
                    3 => m.conv_rows = value,
                    _ => m.regions[i].num_blocks = value,
                }
                m
            })
            .collect();
        let decoded: Result<Vec<AgentMeta>, _> = remotes.iter().map(|m| decode(&encode(m).unwrap())).collect();
        let Ok(decoded) = decoded else { return Ok(()) };
        let Ok(peer) = PeerPlan::new(&local, &decoded, mode) else { return Ok(()) };
        let Ok(plan) = peer.plan(&[vec![1, 3], vec![2]], &[vec![0, 4], vec![5]]) else { return Ok(()) };
        for (i, t) in plan.transfers.iter().enumerate() {
            let m = &decoded[t.remote_rank as usize];
            for [_, ra, len] in plan.moves(&peer, i).unwrap() {
                let inside = m.regions.iter().any(|r| r.end().is_some_and(|end| ra >= r.base && ra + len <= end));
                prop_assert!(inside, "move {ra:#x}+{len} outside rank {}'s regions", t.remote_rank);
            }
        }
    }
}
