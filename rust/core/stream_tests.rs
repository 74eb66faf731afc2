//! Stream schedules of vLLM-named hybrid layouts: which layer hook makes which (region, group) pairs final.

use super::error::LayoutError;
use super::fixtures::{dense_memory, f2_page, kda_spec, mla_spec};
use super::layout::{LayerInput, MemType, RankLayout};
use super::region::RegionTable;
use super::stream::{Granularity, StreamSchedule};

/// A hybrid pool as vLLM's HMA builds it from a layer pattern (`A` MLA attention, `S` KDA), with vLLM layer
/// names: layers of one kind cut into groups of `size` in model order, attention groups first; layer *j* of
/// each group in tensor *j*.
pub(crate) fn hma(pattern: &str, size: usize) -> RankLayout {
    let page = f2_page();
    let blocks = 8;
    let mut layers = Vec::new();
    let mut group = 0u32;
    for (letter, suffix) in [('A', "self_attn.attn"), ('S', "linear_attn")] {
        let idx: Vec<usize> = pattern
            .char_indices()
            .filter(|&(_, c)| c == letter)
            .map(|(i, _)| i)
            .collect();
        for chunk in idx.chunks(size) {
            for (j, &i) in chunk.iter().enumerate() {
                let base = 0x1000_0000 * (j as u64 + 1);
                layers.push(LayerInput {
                    name: format!("model.layers.{i}.{suffix}"),
                    group,
                    spec: if letter == 'A' { mla_spec() } else { kda_spec(page) },
                    memory: dense_memory(base, blocks * page, MemType::Dram),
                });
            }
            group += 1;
        }
    }
    RankLayout {
        tp_rank: 0,
        tp_size: 1,
        logical_block_size: 12,
        kernel_block_size: 4,
        num_logical_blocks: blocks,
        total_num_kv_heads: 1,
        layers,
        kv_layout: None,
    }
}

/// Kimi-Linear-48B: 27 layers, MLA at 1-based 4, 8, ..., 24 and 27; 7 MLA and 20 KDA layers, groups of 7.
pub(crate) fn kimi_48b_pattern() -> String {
    (0..27)
        .map(|i| if (i + 1) % 4 == 0 || i == 26 { 'A' } else { 'S' })
        .collect()
}

fn units(s: &StreamSchedule) -> Vec<Vec<(u32, u32)>> {
    s.stages.iter().map(|st| st.units.clone()).collect()
}

fn hooks(s: &StreamSchedule) -> Vec<Option<&str>> {
    s.stages.iter().map(|st| st.hook.as_deref()).collect()
}

#[test]
fn layer_granularity_posts_each_layer_at_the_next_attention_hook() {
    let table = RegionTable::build(&hma(&kimi_48b_pattern(), 7)).unwrap();
    let s = StreamSchedule::new(&table, None, Granularity::Layer).unwrap();
    let mla = [3, 7, 11, 15, 19, 23, 26];
    let want: Vec<Option<String>> = mla
        .iter()
        .map(|i| Some(format!("model.layers.{i}.self_attn.attn")))
        .collect();
    assert_eq!(hooks(&s), want.iter().map(Option::as_deref).collect::<Vec<_>>());
    // Every hook makes exactly its own stage final (no stage waits for the end: the last layer is MLA).
    assert_eq!(
        s.hooks.iter().map(|h| h.1).collect::<Vec<_>>(),
        (1..=7).collect::<Vec<_>>()
    );
    // The first hook (layer 3): KDA layers 0, 1, 2 (tensors 0-2 of group 1) and MLA layer 3 (tensor 0, group 0).
    assert_eq!(units(&s)[0], vec![(0, 0), (0, 1), (1, 1), (2, 1)]);
    // Every pair some layer writes is in exactly one stage: 7 MLA + 20 KDA layers.
    assert_eq!(units(&s).iter().map(Vec::len).sum::<usize>(), 27);
}

#[test]
fn region_granularity_waits_for_each_tensor_s_last_layer() {
    // HMA puts late KDA layers into every tensor: tensor 0 holds layers 3 (MLA), 0, 9 and 18 (KDA), so it is
    // final only at the MLA hook after layer 18 (layer 19); tensors 1-3 at layer 23, tensors 4-6 at 26.
    let table = RegionTable::build(&hma(&kimi_48b_pattern(), 7)).unwrap();
    let s = StreamSchedule::new(&table, None, Granularity::Region).unwrap();
    let regions: Vec<Vec<u32>> = units(&s)
        .iter()
        .map(|u| {
            let mut r: Vec<u32> = u.iter().map(|p| p.0).collect();
            r.dedup();
            r
        })
        .collect();
    assert_eq!(regions, vec![vec![0], vec![1, 2, 3], vec![4, 5, 6]]);
    assert_eq!(
        hooks(&s),
        vec![
            Some("model.layers.19.self_attn.attn"),
            Some("model.layers.23.self_attn.attn"),
            Some("model.layers.26.self_attn.attn")
        ]
    );
    let counts: Vec<usize> = s.hooks.iter().map(|h| h.1).collect();
    assert_eq!(counts, vec![0, 0, 0, 0, 1, 2, 3]);
}

#[test]
fn ssm_layers_after_the_last_hook_wait_for_the_end_of_the_forward() {
    // Qwen3-Next-like tail: attention at 3, then three more linear layers.
    let table = RegionTable::build(&hma("SSSASSS", 4)).unwrap();
    let s = StreamSchedule::new(&table, None, Granularity::Layer).unwrap();
    assert_eq!(hooks(&s), vec![Some("model.layers.3.self_attn.attn"), None]);
    assert_eq!(s.hooks, vec![("model.layers.3.self_attn.attn".to_string(), 1)]);
    // Linear layers 0, 1, 2, 4 are group 1 in tensors 0-3, layers 5, 6 group 2 in tensors 0-1: 4-6 go at the end.
    assert_eq!(units(&s)[1], vec![(0, 2), (1, 2), (3, 1)]);
}

#[test]
fn modules_of_one_decoder_layer_are_not_assumed_in_name_order() {
    // Layer 0 has both an SSM mixer and attention: `linear_attn` sorts before `self_attn`, but the forward may
    // run it after the attention, so the hook of layer 0's attention does not make it final.
    let mut layout = hma("AA", 2);
    let page = f2_page();
    layout.layers.push(LayerInput {
        name: "model.layers.0.linear_attn".into(),
        group: 1,
        spec: kda_spec(page),
        memory: dense_memory(0x1000_0000, 8 * page, MemType::Dram),
    });
    let table = RegionTable::build(&layout).unwrap();
    let s = StreamSchedule::new(&table, None, Granularity::Layer).unwrap();
    assert_eq!(
        hooks(&s),
        vec![
            Some("model.layers.0.self_attn.attn"),
            Some("model.layers.1.self_attn.attn")
        ]
    );
    assert_eq!(units(&s), vec![vec![(0, 0)], vec![(0, 1), (1, 0)]]);
}

#[test]
fn explicit_hooks_must_be_layers_of_the_table() {
    let table = RegionTable::build(&hma("SA", 1)).unwrap();
    let only = ["model.layers.1.self_attn.attn".to_string()];
    let s = StreamSchedule::new(&table, Some(&only), Granularity::Layer).unwrap();
    assert_eq!(s.stages.len(), 1);
    let none: [String; 0] = [];
    let s = StreamSchedule::new(&table, Some(&none), Granularity::Layer).unwrap();
    assert_eq!(hooks(&s), vec![None], "no hook: everything at the end");
    let bad = ["model.layers.7.mlp".to_string()];
    let err = StreamSchedule::new(&table, Some(&bad), Granularity::Layer).unwrap_err();
    assert_eq!(err, LayoutError::UnknownLayer("model.layers.7.mlp".into()));
}
