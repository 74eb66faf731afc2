"""Region tables from real torch CPU tensors: reference vectors F.1/F.2, adapter checks, error mapping."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hybrid_kv
from hybrid_kv import LayoutError
from hybrid_kv.fixtures import F2_PAGE, f2_geometry, f2_sharers, kda_spec, mla_spec
from hybrid_kv.layout import build_region_table, layer, rank_layout
from hybrid_kv.torch_adapter import region_table_from_tensors

MLA = mla_spec()
KDA = kda_spec()
GEOMETRY = f2_geometry()


def f2_layers(t0: torch.Tensor, t1: torch.Tensor) -> list:
    """Reference F.2 registration order: KDA first on both tensors."""
    return [(f"{name}.{i}", group, spec, t) for i, t in enumerate((t0, t1)) for name, group, spec in f2_sharers()]


@pytest.fixture
def tensors() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(576, dtype=torch.uint8), torch.zeros(576, dtype=torch.uint8)


def test_f2_dual_purpose_regions_from_torch(tensors: tuple[torch.Tensor, torch.Tensor]) -> None:
    t0, t1 = tensors
    table = region_table_from_tensors(f2_layers(t0, t1), **GEOMETRY)
    assert table.region_is_mla == [True, True]
    assert table.block_lens == [48, 48]
    assert table.base_addrs == [t0.data_ptr(), t1.data_ptr()]
    assert table.ppl == 3 and table.num_kernel_blocks == 12
    assert table.num_fa_descs() == 24
    descs = table.local_descs()
    assert descs.dtype == np.uint64 and descs.shape == (56, 3) and descs.flags.c_contiguous
    fa = descs[:24]
    assert list(fa[:12, 0]) == [t0.data_ptr() + 48 * k for k in range(12)]
    assert list(fa[12:, 0]) == [t1.data_ptr() + 48 * k for k in range(12)]
    assert set(fa[:, 1]) == {48}
    # SSM part: per region, conv Q|K|V then the temporal state, one descriptor per logical block.
    streams = [(0, 12), (12, 12), (24, 24), (48, 64)]
    for ri, base in enumerate([t0.data_ptr(), t1.data_ptr()]):
        for s, (off, ln) in enumerate(streams):
            rows = descs[24 + ri * 16 + s * 4 : 24 + ri * 16 + s * 4 + 4]
            assert list(rows[:, 0]) == [base + 144 * b + off for b in range(4)]
            assert set(rows[:, 1]) == {ln}
    rows = table.local_rows()
    assert rows.shape == (10, 5)
    assert list(rows[0]) == [t0.data_ptr(), 48, 0, 48, 12]
    assert int(rows[:, 4].sum()) == 56


def test_registration_covers_each_tensor(tensors: tuple[torch.Tensor, torch.Tensor]) -> None:
    t0, t1 = tensors
    reg = region_table_from_tensors(f2_layers(t0, t1), **GEOMETRY).registration()
    assert reg.tolist() == [[t0.data_ptr(), 576, 0], [t1.data_ptr(), 576, 0]]


def test_two_dimensional_views_use_their_block_stride() -> None:
    pool = torch.zeros(12, 48, dtype=torch.uint8)  # 12 kernel blocks of 48 bytes
    layers = [("mla.0", 0, MLA, pool), ("kda.0", 1, KDA, pool.view(4, 144))]
    table = region_table_from_tensors(layers, **GEOMETRY)
    assert table.block_lens == [48]
    assert table.base_addrs == [pool.data_ptr()]


def test_non_contiguous_blocks_are_rejected() -> None:
    pool = torch.zeros(48, 12, dtype=torch.uint8).t()  # dim 0 = 12 blocks, but each block is strided
    with pytest.raises(LayoutError, match="blocks must be contiguous"):
        region_table_from_tensors([("mla.0", 0, MLA, pool)], **GEOMETRY)


def test_too_small_tensor_names_sizes() -> None:
    small = torch.zeros(500, dtype=torch.uint8)
    with pytest.raises(LayoutError, match=r"too small .*needs 576"):
        region_table_from_tensors([("kda.0", 0, KDA, small)], **GEOMETRY)


def test_errors_share_one_base_class() -> None:
    from hybrid_kv import errors

    for cls in (hybrid_kv.LayoutError, hybrid_kv.PlanError, hybrid_kv.HandshakeError):
        assert cls.__module__ == "hybrid_kv"
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), hybrid_kv.HybridKvError), name
    arguments = (
        "LayoutError",
        "PlanError",
        "ControlError",
        "ClaimError",
        "TicketError",
        "ConfigError",
        "ArgumentError",
    )
    assert all(issubclass(getattr(errors, name), ValueError) for name in arguments)


def test_malformed_layout_json_is_a_layout_error() -> None:
    with pytest.raises(LayoutError, match="^layout: missing field `tp_size`"):
        hybrid_kv.RegionTable.from_json('{"tp_rank": 0}')
    with pytest.raises(LayoutError, match="^layout: not JSON"):
        hybrid_kv.RegionTable.from_json("{")


def test_overlapping_regions_are_rejected() -> None:
    layers = [
        layer("a", 0, MLA, base=0x1000, nbytes=48 * 12),
        layer("b", 0, MLA, base=0x1000 + 100, nbytes=48 * 12),
    ]
    with pytest.raises(LayoutError, match="overlaps"):
        build_region_table(rank_layout(layers, **GEOMETRY))


@settings(max_examples=30, deadline=None)
@given(st.permutations(range(6)), st.integers(min_value=1, max_value=8))
def test_any_registration_order_gives_the_same_table(order: list[int], num_blocks: int) -> None:
    bases = [0x10000, 0x10000 + F2_PAGE * num_blocks + 64]
    entries = []
    for i, base in enumerate(bases):
        for name, group, spec in f2_sharers():
            entries.append(layer(f"{name}.{i}", group, spec, base=base, nbytes=F2_PAGE * num_blocks))
    geometry = f2_geometry(num_blocks)
    reference = build_region_table(rank_layout(entries, **geometry))
    shuffled = build_region_table(rank_layout([entries[i] for i in order], **geometry))
    assert json.loads(shuffled.to_json()) == json.loads(reference.to_json())
    assert np.array_equal(shuffled.local_descs(), reference.local_descs())
    assert shuffled.region_is_mla == [True, True]
