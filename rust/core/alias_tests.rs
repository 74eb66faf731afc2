//! DeepSeek-V4-style aliases against the byte model: per layer, an indexer cache aliasing a sliding-window MLA
//! cache with a shorter page (same tensor, same stride), and a compressor cache of its own; planned between
//! prefill and decode, every move copied as bytes: each group's blocks land whole (its own page length, at the
//! tensor's page of the block), nothing else changes, no destination byte is written twice. Aliases of another
//! stride, partial overlaps and one block id in two aliasing groups are refused.

use std::collections::HashMap;

use super::layout::{LayerInput, LayerMemory, MemType, RankLayout};
use super::meta::{AgentMeta, EngineInfo, TransferMode};
use super::plan::{PeerPlan, PlanError};
use super::spec::{LayerSpec, MlaSpec};
use super::{LayoutError, RegionTable};

const TOKENS: u64 = 4;
const BLOCKS: u64 = 8;
/// Per-token bytes: sliding-window MLA latent, indexer key (aliasing it), compressor state (own tensor).
const SWA: u64 = 12;
const INDEXER: u64 = 5;
const COMPRESSOR: u64 = 16;

fn mla(sliding: bool, per_token: u64) -> LayerSpec {
    let m = MlaSpec {
        head_size: per_token,
        dtype_bytes: 1,
        page_size_padded: None,
    };
    if sliding {
        LayerSpec::SlidingWindowMla(m)
    } else {
        LayerSpec::Mla(m)
    }
}

fn layer(name: String, group: u32, spec: LayerSpec, base: u64, stride: u64) -> LayerInput {
    LayerInput {
        name,
        group,
        spec,
        memory: LayerMemory {
            base,
            bytes: BLOCKS * stride,
            block_stride: stride,
            device: 0,
            mem_type: MemType::Dram,
            num_blocks: None,
            page_layout: None,
        },
    }
}

/// Two layers: tensor `swa.i` (sliding-window MLA, group 0) aliased by `indexer.i` (group 1), and `compressor.i`
/// (group 2) in its own tensor.
fn layout(origin: u64, tp: u32, rank: u32) -> RankLayout {
    let swa_page = TOKENS * SWA;
    let comp_page = TOKENS * COMPRESSOR;
    let mut layers = Vec::new();
    for i in 0..2u64 {
        let base = origin + i * 0x10000;
        layers.push(layer(format!("layers.{i}.swa"), 0, mla(true, SWA), base, swa_page));
        layers.push(layer(
            format!("layers.{i}.indexer"),
            1,
            mla(false, INDEXER),
            base,
            swa_page,
        ));
        layers.push(layer(
            format!("layers.{i}.compressor"),
            2,
            mla(false, COMPRESSOR),
            base + 0x8000,
            comp_page,
        ));
    }
    RankLayout {
        tp_rank: rank,
        tp_size: tp,
        logical_block_size: TOKENS,
        kernel_block_size: TOKENS,
        num_logical_blocks: BLOCKS,
        total_num_kv_heads: 1,
        kv_layout: None,
        layers,
    }
}

fn meta(t: &RegionTable, engine: &str, mode: TransferMode) -> AgentMeta {
    let info = EngineInfo {
        engine_id: engine.into(),
        transfer_mode: mode,
        ..EngineInfo::default()
    };
    AgentMeta::from_table(t, &info)
}

/// A rank's memory: every byte of every tensor, keyed by base.
struct Mem(HashMap<u64, Vec<u8>>);

impl Mem {
    fn of(t: &RegionTable, seed: u64) -> Mem {
        Mem(t
            .registration()
            .iter()
            .map(|&[base, bytes, _]| {
                // the same for every prefill rank (MLA is replicated); junk keyed by the seed otherwise
                let v = (0..bytes).map(|o| ((o * 31 + (base & 0xff_ffff) / 0x1000 * 7 + seed) % 251) as u8);
                (base, v.collect())
            })
            .collect())
    }

    fn at(&mut self, addr: u64, len: u64) -> &mut [u8] {
        for (&base, bytes) in &mut self.0 {
            if addr >= base && addr + len <= base + bytes.len() as u64 {
                let o = (addr - base) as usize;
                return &mut bytes[o..o + len as usize];
            }
        }
        panic!("move [{addr:#x}, +{len}) is outside every registered tensor");
    }
}

#[test]
fn aliases_of_unequal_length_are_planned_each_with_its_own_page() {
    let p_ids = [vec![1, 4], vec![6, 0], vec![3, 7]]; // swa, indexer, compressor: one tensor page each, never shared
    let d_ids = [vec![5, 2], vec![3, 7], vec![0, 6]];
    for (p_tp, mode) in [
        (1, TransferMode::Pull),
        (2, TransferMode::Pull),
        (1, TransferMode::Push),
    ] {
        let d = RegionTable::build(&layout(0x100_0000, 1, 0)).unwrap();
        let ps: Vec<RegionTable> = (0..p_tp)
            .map(|r| RegionTable::build(&layout(0x900_0000 + u64::from(r) * 0x100_0000, p_tp, r)).unwrap())
            .collect();
        assert_eq!(d.regions.len(), 6, "each alias is a region of its own");
        assert_eq!(d.registration().len(), 4, "aliases of one tensor are registered once");
        let mut d_mem = Mem::of(&d, 99);
        let d_before = d_mem.0.clone();
        let mut p_mem: Vec<Mem> = ps.iter().map(|t| Mem::of(t, 0)).collect();
        let mut written: HashMap<u64, ()> = HashMap::new();
        let mut copy = |d_mem: &mut Mem, p: &mut Mem, d_addr: u64, p_addr: u64, len: u64| {
            let src = p.at(p_addr, len).to_vec();
            d_mem.at(d_addr, len).copy_from_slice(&src);
            for a in d_addr..d_addr + len {
                assert!(written.insert(a, ()).is_none(), "decode byte {a:#x} written twice");
            }
        };
        match mode {
            TransferMode::Pull => {
                let metas: Vec<AgentMeta> = ps.iter().map(|t| meta(t, "p", mode)).collect();
                let peer = PeerPlan::new(&d, &metas, mode).unwrap();
                let plan = peer.plan(&d_ids, &p_ids).unwrap();
                for (i, t) in plan.transfers.iter().enumerate() {
                    for [la, ra, len] in plan.moves(&peer, i).unwrap() {
                        copy(&mut d_mem, &mut p_mem[t.remote_rank as usize], la, ra, len);
                    }
                }
            }
            TransferMode::Push => {
                let peer = PeerPlan::new(&ps[0], &[meta(&d, "d", mode)], mode).unwrap();
                let plan = peer.plan(&p_ids, &d_ids).unwrap();
                for (i, _) in plan.transfers.iter().enumerate() {
                    for [la, ra, len] in plan.moves(&peer, i).unwrap() {
                        copy(&mut d_mem, &mut p_mem[0], ra, la, len);
                    }
                }
            }
        }
        // the byte model: group g's block b is the first `per_token * TOKENS` bytes of its tensor's page b
        let mut expected = d_before.clone();
        for i in 0..2u64 {
            for (g, (off, per_token, stride)) in [
                (0, SWA, TOKENS * SWA),
                (0, INDEXER, TOKENS * SWA),
                (0x8000, COMPRESSOR, TOKENS * COMPRESSOR),
            ]
            .into_iter()
            .enumerate()
            {
                let (d_base, p_base) = (0x100_0000 + i * 0x10000 + off, 0x900_0000 + i * 0x10000 + off);
                for (&db, &pb) in d_ids[g].iter().zip(&p_ids[g]) {
                    let len = (per_token * TOKENS) as usize;
                    let src = &p_mem[0].0[&p_base][(pb * stride) as usize..][..len];
                    expected.get_mut(&d_base).unwrap()[(db * stride) as usize..][..len].copy_from_slice(src);
                }
            }
        }
        for (base, want) in &expected {
            assert!(
                d_mem.0[base] == *want,
                "{p_tp} {mode:?}: decode tensor {base:#x} differs from the byte model"
            );
        }
    }
}

#[test]
fn aliases_that_cannot_be_planned_are_refused() {
    // one block id in two groups aliasing one tensor: both would own the same page
    let d = RegionTable::build(&layout(0x100_0000, 1, 0)).unwrap();
    let p = RegionTable::build(&layout(0x900_0000, 1, 0)).unwrap();
    let peer = PeerPlan::new(&d, &[meta(&p, "p", TransferMode::Pull)], TransferMode::Pull).unwrap();
    let err = peer
        .plan(&[vec![2], vec![2], vec![5]], &[vec![1], vec![3], vec![4]])
        .unwrap_err();
    assert!(matches!(err, PlanError::SharedBlock { .. }), "{err}");
    // an alias stepping by another stride
    let mut l = layout(0x100_0000, 1, 0);
    l.layers[1].memory.block_stride = TOKENS * SWA * 2;
    l.layers[1].memory.bytes = BLOCKS * TOKENS * SWA * 2;
    let err = RegionTable::build(&l).unwrap_err();
    assert!(matches!(err, LayoutError::SharedPageMismatch { .. }), "{err}");
    // a partial overlap: a tensor starting inside another
    let mut l = layout(0x100_0000, 1, 0);
    l.layers[1].memory.base += 8;
    let err = RegionTable::build(&l).unwrap_err();
    assert!(matches!(err, LayoutError::Overlap { .. }), "{err}");
    // a peer whose aliases are not ours
    let mut remote = meta(&p, "p", TransferMode::Pull);
    remote.regions[1].base = remote.regions[0].base + 0x4000;
    assert!(PeerPlan::new(&d, &[remote], TransferMode::Pull).is_err());
}
