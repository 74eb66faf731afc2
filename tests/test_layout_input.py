"""The input boundary refuses, never silently mis-plans: misspelled keys, a declared page layout the tensors
contradict, unknown layout names, malformed hashes and overflowing sizes are each refused with the value and the
field named, as ``ValueError``/``TypeError`` subclasses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hybrid_kv import LayoutError, PeerPlan, compat_hash, handshake_target_ranks  # noqa: E402
from hybrid_kv.layout import build_region_table, layer, rank_layout  # noqa: E402
from hybrid_kv.torch_adapter import region_table_from_tensors  # noqa: E402

NAME = "model.layers.0.self_attn"
FACTORS = {
    "model": "tiny-gqa",
    "dtype": "float16",
    "cache_dtype": "auto",
    "total_num_kv_heads": 4,
    "head_size": 4,
    "num_hidden_layers": 1,
    "attn_backend": "TEST",
    "hma": False,
    "speculative": [],
    "transfer_mode": "pull",
}
HASH = compat_hash(FACTORS)


def gqa(heads: int, k: int = 3, v: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": "full_attention", "num_kv_heads": heads, "head_size": k, "dtype_bytes": 2}
    if v is not None:
        spec["head_size_v"] = v
    return spec


def one_layer(spec: dict[str, Any], **memory: Any) -> dict[str, Any]:
    entry = layer(NAME, 0, spec, base=0x10000, nbytes=1 << 20)
    entry["memory"].update(memory)
    return rank_layout([entry], logical_block_size=16, kernel_block_size=16, num_logical_blocks=4)


def info(layout: str | None, mode: str = "pull", engine: str = "e") -> dict[str, Any]:
    out = {"engine_id": engine, "attn_backend": "TEST", "transfer_mode": mode, "compat_hash": HASH}
    if layout is not None:
        out["kv_layout"] = layout
    return out


def test_a_misspelled_spec_key_is_refused_naming_layer_and_key() -> None:
    # K 4 / V 8 with V misspelled: before, V defaulted to K and 2/3 of every 768-byte page moved (512-byte descriptors)
    spec = {**gqa(2, 4), "head_size_V": 8}
    with pytest.raises(LayoutError, match=rf'^layer "{NAME}" \(layers\[0\]\)\.spec: unknown field `head_size_V`'):
        build_region_table(one_layer(spec))
    assert issubclass(LayoutError, ValueError)
    table = build_region_table(one_layer(gqa(2, 4, 8)))
    assert table.block_lens == [16 * 2 * (4 + 8) * 2]  # 768 bytes: the whole page moves


def test_misspelled_memory_and_layout_keys_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\(layers\[0\]\)\.memory: unknown field `block_strid`"):
        build_region_table(one_layer(gqa(2), block_strid=1024))
    layout = one_layer(gqa(2))
    layout["total_num_kv_head"] = 4
    with pytest.raises(LayoutError, match="^layout: unknown field `total_num_kv_head`"):
        build_region_table(layout)
    layout = one_layer(gqa(2))
    layout["layers"][0]["spec"]["type"] = "full_atention"
    with pytest.raises(LayoutError, match=r"\.spec: unknown variant `full_atention`"):
        build_region_table(layout)


def test_block_size_ratios_are_checked_before_counting() -> None:
    table = build_region_table(one_layer(gqa(2)))
    for bsr in (2**62, 0, 5):
        with pytest.raises(LayoutError, match=f"block size ratio {bsr} is invalid"):
            table.num_fa_descs(bsr)
        with pytest.raises(LayoutError, match=f"block size ratio {bsr} is invalid"):
            table.local_descs(bsr)
    assert table.num_fa_descs(2) == 2 * table.num_kernel_blocks


def nhd_tensor(blocks: int, tokens: int, heads: int, cell: int = 6) -> torch.Tensor:
    """Token-major pages: ``[blocks, tokens, heads, K|V]`` float16, each byte numbered."""
    t = torch.empty(blocks, tokens, heads, cell, dtype=torch.float16)
    t.view(torch.uint8).view(-1).copy_(torch.arange(t.numel() * 2) % 251)
    return t


def nhd_rank(tp: int, rank: int, tokens: int, blocks: int, kv_layout: str | None = None) -> Any:
    heads = 4 // tp
    t = nhd_tensor(blocks, tokens, heads)
    table = region_table_from_tensors(
        [(NAME, 0, gqa(heads), t)],
        logical_block_size=tokens,
        kernel_block_size=tokens,
        num_logical_blocks=blocks,
        tp_rank=rank,
        tp_size=tp,
        total_num_kv_heads=4,
        kv_layout=kv_layout,
    )
    return table, t


def test_a_declared_layout_the_tensors_contradict_is_refused() -> None:
    # the case: HND declared for token-major pages (P TP 2 -> D TP 1, 16-token pages) planned 30 of 32 cells
    # into the wrong place; the tensors' strides now say NHD, and the declaration is refused
    with pytest.raises(
        LayoutError, match=f"layer {NAME}: its tensor stores token-major pages \\(NHD\\), but kv_layout"
    ):
        nhd_rank(2, 0, 16, 4, kv_layout="HND")
    table, _ = nhd_rank(2, 0, 16, 4)
    with pytest.raises(ValueError, match=r'^engine_info\["kv_layout"\]: "HND" means HND pages, but'):
        table.handshake_payload(info("HND"))
    with pytest.raises(ValueError, match=r'engine_info\["kv_layout"\]: unknown KV-cache layout "XYZ"'):
        table.handshake_payload(info("XYZ"))
    # a vLLM-style logical [B, H, N, C] view of token-major memory says the same
    base = nhd_tensor(4, 16, 2)
    view = base.permute(0, 2, 1, 3)
    assert region_table_from_tensors(
        [(NAME, 0, gqa(2), view)], logical_block_size=16, kernel_block_size=16, num_logical_blocks=4, kv_layout="NHD"
    ).base_addrs == [base.data_ptr()]


def apply(plan: Any, result: Any, local: torch.Tensor, remotes: dict[int, torch.Tensor], mode: str) -> np.ndarray:
    """Copy the plan's byte moves between the tensors (pull: remote to local; push: local to remote); return how
    often each destination byte was written, for the destination side's tensors concatenated."""
    lb = local.view(torch.uint8).view(-1).numpy()
    rb = {r: t.view(torch.uint8).view(-1).numpy() for r, t in remotes.items()}
    written = (
        {r: np.zeros(len(b), dtype=np.int32) for r, b in rb.items()}
        if mode == "push"
        else {0: np.zeros(len(lb), dtype=np.int32)}
    )
    for i, t in enumerate(result.transfers):
        remote = remotes[t.remote_rank]
        for la, ra, n in result.moves(i).tolist():
            lo, ro = la - local.data_ptr(), ra - remote.data_ptr()
            if mode == "pull":
                lb[lo : lo + n] = rb[t.remote_rank][ro : ro + n]
                written[0][lo : lo + n] += 1
            else:
                rb[t.remote_rank][ro : ro + n] = lb[lo : lo + n]
                written[t.remote_rank][ro : ro + n] += 1
    return np.concatenate(list(written.values()))


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_token_major_pages_under_a_head_split_are_planned_per_token(p_tp: int, d_tp: int, mode: str) -> None:
    """The issue's case planned right: token-major pages of 16 tokens, P TP 2 -> D TP 1 and TP 1 -> TP 2, every
    (token, head) cell where it belongs (before: 30 of 32 wrong), each destination byte written once."""
    p_ranks = [nhd_rank(p_tp, r, 16, 4) for r in range(p_tp)]
    d_ranks = [nhd_rank(d_tp, r, 16, 4) for r in range(d_tp)]
    for _, t in d_ranks:
        t.zero_()
    p_ids, d_ids = [3, 0], [1, 2]  # 32 tokens
    pay = {
        side: [tab.handshake_payload(info(None, mode, side)) for tab, _ in ranks]
        for side, ranks in (("p", p_ranks), ("d", d_ranks))
    }
    local_side, remote_side = (d_ranks, p_ranks) if mode == "pull" else (p_ranks, d_ranks)
    lkey, rkey = ("d", "p") if mode == "pull" else ("p", "d")
    for r, (table, tensor) in enumerate(local_side):
        targets = handshake_target_ranks(r, len(local_side), len(remote_side))
        plan = PeerPlan(table, [pay[rkey][t] for t in targets], mode, own_payload=pay[lkey][r])
        ids = ([d_ids], [p_ids]) if mode == "pull" else ([p_ids], [d_ids])
        result = plan.plan(*ids)
        written = apply(plan, result, tensor, {t: remote_side[t][1] for t in targets}, mode)
        assert written.max() == 1
    # every decode cell (token, global head) holds the prefill cell of the same token and head
    heads_p, heads_d = 4 // p_tp, 4 // d_tp
    for j in range(32):
        for h in range(4):
            pr, ph = divmod(h, heads_p)
            dr, dh = divmod(h, heads_d)
            p_cell = p_ranks[pr][1][p_ids[j // 16], j % 16, ph]
            d_cell = d_ranks[dr][1][d_ids[j // 16], j % 16, dh]
            assert torch.equal(p_cell.view(torch.uint8), d_cell.view(torch.uint8)), (j, h)


def test_token_major_pages_of_different_block_sizes_are_planned_byte_exact() -> None:
    """With the page order known, a token range of an NHD page is one byte range at any head count: decode pages of
    16 tokens read from prefill pages of 8 tokens, 4 KV heads per rank."""
    d, dt = nhd_rank(1, 0, 16, 6)
    p, pt = nhd_rank(1, 0, 8, 12)
    dt.zero_()
    plan = PeerPlan(
        d, [p.handshake_payload(info(None, engine="p"))], "pull", own_payload=d.handshake_payload(info("NHD"))
    )
    d_ids, p_ids = [2, 5], [7, 1, 10, 3]  # 32 tokens: decode blocks 2 and 5 from prefill blocks 7, 1, 10, 3
    result = plan.plan([d_ids], [p_ids])
    d_bytes, p_bytes = dt.view(torch.uint8).view(-1).numpy(), pt.view(torch.uint8).view(-1).numpy()
    written = np.zeros_like(d_bytes, dtype=np.int32)
    for i in range(len(result)):
        for la, ra, n in result.moves(i).tolist():
            lo, ro = la - dt.data_ptr(), ra - pt.data_ptr()
            d_bytes[lo : lo + n] = p_bytes[ro : ro + n]
            written[lo : lo + n] += 1
    assert written.max() == 1
    tokens_d = dt.view(torch.uint8).view(6 * 16, 4 * 6 * 2)
    tokens_p = pt.view(torch.uint8).view(12 * 8, 4 * 6 * 2)
    for j in range(32):
        d_tok = d_ids[j // 16] * 16 + j % 16
        p_tok = p_ids[j // 8] * 8 + j % 8
        assert torch.equal(tokens_d[d_tok], tokens_p[p_tok]), j
    assert int(written.sum()) == 32 * 4 * 6 * 2


def hnd_rank(tp: int, rank: int, tokens: int, blocks: int, seed: int) -> Any:
    """A rank of heads-major pages ``[blocks, heads, tokens, K|V]`` (4 KV heads in all), its bytes numbered from
    ``seed`` so that no two ranks hold the same bytes."""
    heads = 4 // tp
    t = torch.empty(blocks, heads, tokens, 6, dtype=torch.float16)
    t.view(torch.uint8).view(-1).copy_((torch.arange(t.numel() * 2) * 7 + seed) % 251)
    table = region_table_from_tensors(
        [(NAME, 0, gqa(heads), t)],
        logical_block_size=tokens,
        kernel_block_size=tokens,
        num_logical_blocks=blocks,
        tp_rank=rank,
        tp_size=tp,
        total_num_kv_heads=4,
    )
    return table, t


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize(("p_tokens", "d_tokens"), [(8, 16), (16, 8)])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_heads_major_pages_of_different_block_sizes_are_planned_per_head(
    p_tp: int, d_tp: int, p_tokens: int, d_tokens: int, mode: str
) -> None:
    """Heads-major pages of 4 (or 2) KV heads per rank with 8- and 16-token kernel blocks on the two sides, at equal
    TP and under a head split both ways (before: refused, "would need a per-head layout conversion"): every
    (token, head) cell where it belongs, each destination byte written once."""
    p_ranks = [hnd_rank(p_tp, r, p_tokens, 96 // p_tokens, 11 + r) for r in range(p_tp)]
    d_ranks = [hnd_rank(d_tp, r, d_tokens, 96 // d_tokens, 101 + r) for r in range(d_tp)]
    for _, t in d_ranks:
        t.zero_()
    p_ids = [[9, 2, 5, 0], [4, 1]][p_tokens // 16]  # 32 tokens
    d_ids = [[3, 10, 7, 1], [5, 0]][d_tokens // 16]
    pay = {
        side: [tab.handshake_payload(info(None, mode, side)) for tab, _ in ranks]
        for side, ranks in (("p", p_ranks), ("d", d_ranks))
    }
    local_side, remote_side = (d_ranks, p_ranks) if mode == "pull" else (p_ranks, d_ranks)
    lkey, rkey = ("d", "p") if mode == "pull" else ("p", "d")
    total = 0
    for r, (table, tensor) in enumerate(local_side):
        targets = handshake_target_ranks(r, len(local_side), len(remote_side))
        plan = PeerPlan(table, [pay[rkey][t] for t in targets], mode, own_payload=pay[lkey][r])
        ids = ([d_ids], [p_ids]) if mode == "pull" else ([p_ids], [d_ids])
        written = apply(plan, plan.plan(*ids), tensor, {t: remote_side[t][1] for t in targets}, mode)
        assert written.max() == 1
        total += int(written.sum())
    assert total == 32 * 4 * 6 * 2
    heads_p, heads_d = 4 // p_tp, 4 // d_tp
    for j in range(32):
        for h in range(4):
            p_cell = p_ranks[h // heads_p][1][p_ids[j // p_tokens], h % heads_p, j % p_tokens]
            d_cell = d_ranks[h // heads_d][1][d_ids[j // d_tokens], h % heads_d, j % d_tokens]
            assert torch.equal(p_cell.view(torch.uint8), d_cell.view(torch.uint8)), (j, h)


def test_pages_keeping_k_and_v_apart_are_refused() -> None:
    t = torch.zeros(4, 2, 4, 16, 3, dtype=torch.float16)  # [blocks, K/V, heads, tokens, head_size]
    with pytest.raises(LayoutError, match="its pages keep K and V apart"):
        region_table_from_tensors(
            [(NAME, 0, gqa(4), t)], logical_block_size=16, kernel_block_size=16, num_logical_blocks=4
        )


@pytest.mark.parametrize(("order", "want"), [((0, 1, 2, 3), "HND"), ((0, 2, 1, 3), "NHD")], ids=["LBHNC", "LBNHC"])
def test_vllm_style_views_show_their_page_order(order: tuple[int, ...], want: str) -> None:
    """vLLM hands ``[B, H, N, C]`` views whatever the layout; their strides say the page order (``dims="BHNC"``),
    also where heads and tokens have the same size."""
    from hybrid_kv.torch_adapter import page_layout, tensor_memory

    blocks, heads, tokens, cell = 4, 8, 8, 6
    physical = [(blocks, heads, tokens, cell)[d] for d in order]
    raw = torch.zeros(*physical, dtype=torch.float16)
    view = raw.permute(*[order.index(d) for d in range(4)])  # logical [B, H, N, C]
    assert tuple(view.shape) == (blocks, heads, tokens, cell)
    assert page_layout(view, NAME, gqa(heads), tokens, "BHNC") == want
    assert page_layout(view, NAME, gqa(heads), tokens) is None  # without axis names 8 heads / 8 tokens are ambiguous
    assert tensor_memory(view, NAME, gqa(heads), tokens, "BHNC")["page_layout"] == want
    with pytest.raises(LayoutError, match="give 8 heads and 8 tokens, but the spec says 4 heads"):
        page_layout(view, NAME, gqa(4), tokens, "BHNC")


def test_a_peer_advertising_an_unknown_layout_is_malformed() -> None:
    from hybrid_kv import HandshakeError, decode_meta
    from hybrid_kv._core import encode_meta

    table, _ = nhd_rank(1, 0, 16, 4)
    meta = decode_meta(table.handshake_payload(info(None)))
    assert meta["kv_layout"] == "NHD"
    for bad in ("XYZ", "LHBNC"):  # unknown, or heads kept apart from their pages
        with pytest.raises(HandshakeError, match="kv_layout"):
            decode_meta(encode_meta({**meta, "kv_layout": bad}))
