//! `PeerPlan::failed_blocks` against the flat expansion: every descriptor of every local table (unit, split,
//! SSM, chunk and whole-state rows) resolved to bytes and checked block by block against every region.

use super::{PeerPlan, PlanError, TableKey};
use crate::core::adversary::cases;
use crate::core::descs::DescTable;
use crate::core::region::{GroupKind, RegionTable};
use proptest::prelude::*;

/// The blocks per group of flat descriptor `id`, by brute force: every logical block of every region whose
/// bytes the descriptor overlaps, listed under each group that addresses the region.
fn brute_force(local: &RegionTable, table: &DescTable, ids: &[i32]) -> Vec<Vec<u64>> {
    let flat = table.to_flat();
    let ppl = local.geometry.ppl;
    let mut out = vec![Vec::new(); local.groups.len()];
    for &id in ids {
        let (addr, len) = (flat[id as usize * 3], flat[id as usize * 3 + 1]);
        for (i, r) in local.regions.iter().enumerate() {
            let page = r.block_stride * ppl;
            for b in 0..r.num_blocks / ppl {
                let (lo, hi) = (r.base + b * page, r.base + (b + 1) * page);
                if addr < hi && lo < addr + len {
                    for (g, kind) in local.groups.iter().enumerate() {
                        let attention = kind.is_attention() && (r.group.is_none() || r.group == Some(g as u32));
                        let ssm = *kind == GroupKind::Ssm && local.ssm_regions.contains(&i);
                        if attention || ssm {
                            out[g].push(b);
                        }
                    }
                }
            }
        }
    }
    for v in &mut out {
        v.sort_unstable();
        v.dedup();
    }
    out
}

/// Every fixture case, coalesced and not: its name, local table, peer plan, and the remote blocks that hold the
/// tokens of 4 local blocks.
type Peer = (&'static str, RegionTable, PeerPlan, u64);

fn peers() -> Vec<Peer> {
    let mut out = Vec::new();
    for case in cases() {
        for coalesce in [true, false] {
            let peer = PeerPlan::with_coalescing(&case.local, &case.remotes, case.mode, coalesce).unwrap();
            let tokens = 4 * case.local.geometry.logical_block_size;
            let remote_blocks = tokens.div_ceil(case.remotes[0].logical_block_size);
            out.push((case.name, case.local.clone(), peer, remote_blocks));
        }
    }
    out
}

#[test]
fn every_descriptor_of_every_local_table_maps_to_the_blocks_its_bytes_are_in() {
    let mut appended = 0;
    for (name, local, peer, _) in peers() {
        appended += peer.local_tables.iter().filter(|(_, t)| t.len() > t.num_fa).count();
        for (key, table) in &peer.local_tables {
            for id in 0..table.len() as i32 {
                assert_eq!(
                    peer.failed_blocks(*key, &[id]).unwrap(),
                    brute_force(&local, table, &[id]),
                    "{name} {key} id {id}"
                );
            }
        }
    }
    assert!(appended > 0, "some tables have SSM, chunk or whole-state rows");
}

#[test]
fn a_failed_transfer_names_exactly_the_blocks_it_moves() {
    // Requests of contiguous runs (so coalesced plans use chunk rows): the blocks of a transfer's local ids,
    // intersected with the request's ids, are the request's transferred blocks.
    for (name, local, peer, remote_blocks) in peers() {
        let n = local.groups.len();
        let side = |blocks: u64| -> Vec<Vec<u64>> {
            (0..n)
                .map(|g| {
                    if local.groups[g].is_attention() {
                        (1..1 + blocks).collect()
                    } else {
                        vec![11 + g as u64]
                    }
                })
                .collect()
        };
        let (ids, remote) = (side(4), side(remote_blocks));
        let plan = peer.plan(&ids, &remote).unwrap();
        let mut seen: Vec<Vec<u64>> = vec![Vec::new(); n];
        for t in &plan.transfers {
            let blocks = peer.failed_blocks(t.local_table, &t.local_ids).unwrap();
            for g in 0..n {
                seen[g].extend(blocks[g].iter().filter(|b| ids[g].contains(b)));
            }
        }
        for v in &mut seen {
            v.sort_unstable();
            v.dedup();
        }
        assert_eq!(seen, ids, "{name}");
    }
}

#[test]
fn bad_keys_and_ids_are_refused_naming_the_table() {
    let (_, _, peer, _) = peers().remove(0);
    let len = peer.local_tables[0].1.len();
    let err = peer.failed_blocks(TableKey::Split(99), &[0]).unwrap_err();
    assert_eq!(err, PlanError::BadTransfer("no local table split:99".into()));
    for id in [-1, len as i32] {
        let err = peer
            .failed_blocks(peer.local_tables[0].0, &[0, id])
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!("local descriptor id {id} is out of range for table whole of {len} descriptors")
        );
    }
    assert_eq!(
        peer.failed_blocks(TableKey::Whole, &[]).unwrap(),
        vec![Vec::<u64>::new(); 4]
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    /// Any set of ids of any table maps to the union of what its descriptors map to in the flat expansion.
    #[test]
    fn any_id_set_maps_like_the_flat_expansion(case in 0usize..12, table in 0usize..4, picks in prop::collection::vec(any::<u32>(), 0..64)) {
        let (name, local, peer, _) = peers().swap_remove(case);
        let (key, t) = &peer.local_tables[table % peer.local_tables.len()];
        let ids: Vec<i32> = picks.iter().map(|&p| (u64::from(p) % t.len()) as i32).collect();
        prop_assert_eq!(peer.failed_blocks(*key, &ids).unwrap(), brute_force(&local, t, &ids), "{} {}", name, key);
    }
}
