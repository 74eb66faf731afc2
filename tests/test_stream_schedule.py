"""The stream schedule and staged plans through the binding: real model shapes (presets), the stages of a
request together exactly its whole plan, and the errors a caller can meet."""

from __future__ import annotations

import numpy as np
import pytest

import hybrid_kv
from hybrid_kv import LayoutError, PeerPlan, PlanError, StreamSchedule
from hybrid_kv.peer_link import PreparedLink
from hybrid_kv.presets import get_preset


def table(preset: str, tp: int = 1, rank: int = 0, blocks: int = 64) -> hybrid_kv.RegionTable:
    return hybrid_kv.build_region_table(get_preset(preset).rank_layout(tp=tp, rank=rank, num_blocks=blocks))


@pytest.mark.parametrize(
    ("preset", "layer_stages", "region_hooks"),
    [
        ("kimi-linear-48b-a3b", 7, [19, 23, 26]),
        ("qwen3-next-80b-a3b", 12, [35, 39, 43, 47]),
    ],
)
def test_real_models_stream_per_attention_layer(preset: str, layer_stages: int, region_hooks: list[int]) -> None:
    """Per layer, every attention hook releases a stage; per region, HMA's tensors (each holding late layers of
    the linear groups) are final only in the last third of the forward."""
    t = table(preset)
    s = StreamSchedule(t)
    assert s.granularity == "layer" and s.num_stages == layer_stages
    assert [n for _, n in s.hooks] == list(range(1, layer_stages + 1))
    assert all(h is not None for h in s.stage_hooks)
    r = StreamSchedule(t, granularity="region")
    assert r.stage_hooks == [f"model.layers.{i}.self_attn" for i in region_hooks]
    assert sorted({reg for units in r.stage_units for reg, _ in units}) == list(range(t.num_regions))


def pairs(t: hybrid_kv.RankTransfer) -> list[tuple[int, int]]:
    return list(zip(t.local_ids.tolist(), t.remote_ids.tolist(), strict=True))


def test_stages_of_a_request_are_its_whole_plan() -> None:
    kimi = get_preset("kimi-linear-48b-a3b")
    p, d = table("kimi-linear-48b-a3b", blocks=32), table("kimi-linear-48b-a3b", blocks=48)
    info = kimi.engine_info("decode", "push")
    peer = PeerPlan(p, [d.handshake_payload(info)], "push")
    kinds = kimi.group_kinds()
    local = [list(range(0, 9)) if k != "ssm" else [20 + g] for g, k in enumerate(kinds)]
    remote = [list(range(3, 12)) if k != "ssm" else [30 + g] for g, k in enumerate(kinds)]
    whole = peer.plan(local, remote)
    for granularity in ("layer", "region"):
        stages = peer.plan_staged(local, remote, StreamSchedule(p, granularity=granularity))
        got: dict[tuple[int, str], list[tuple[int, int]]] = {}
        moves = []
        for plan in stages:
            for i, t in enumerate(plan.transfers):
                got.setdefault((t.remote_rank, t.local_table), []).extend(pairs(t))
                moves.append(plan.moves(i))
        want = {(t.remote_rank, t.local_table): pairs(t) for t in whole.transfers}
        assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in want.items()}
        all_moves = np.concatenate(moves)
        whole_moves = np.concatenate([whole.moves(i) for i in range(len(whole))])
        assert sorted(map(tuple, all_moves.tolist())) == sorted(map(tuple, whole_moves.tolist()))
    link = PreparedLink("decode", [0], {0: "tcp://127.0.0.1:9"}, {}, PeerPlan(p, [d.handshake_payload(info)], "push"))
    staged = link.staged_transfers(local, remote, StreamSchedule(p))
    assert len(staged) == 7 and sum(len(s) for s in staged) >= len(link.transfers(local, remote))


def test_schedule_and_staged_plan_errors() -> None:
    t = table("tiny-kimi-linear")
    with pytest.raises(LayoutError, match='no layer named "model.layers.99.mlp"'):
        StreamSchedule(t, ["model.layers.99.mlp"])
    with pytest.raises(ValueError, match='granularity must be "layer" or "region"'):
        StreamSchedule(t, granularity="tensor")
    other = table("kimi-linear-48b-a3b")
    info = get_preset("tiny-kimi-linear").engine_info("decode", "push")
    peer = PeerPlan(t, [t.handshake_payload(info)], "push")
    ids = [[0] for _ in get_preset("tiny-kimi-linear").group_kinds()]
    with pytest.raises(PlanError, match="stage map: made for"):
        peer.plan_staged(ids, ids, StreamSchedule(other))
    assert "StreamSchedule(granularity=layer" in repr(StreamSchedule(t))
