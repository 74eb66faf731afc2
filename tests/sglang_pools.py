"""KV pools of exactly the shapes and strides SGLang's token-to-KV pools allocate, described to hybrid-kv
unchanged, and the processes of a two-engine transfer between them.

SGLang's own classes are not imported: its ``memory_pool`` module pulls in the serving stack (transformers,
fastapi, its CUDA kernels), which the CPU test machines do not have. The pools are built as its code builds them
(SGLang 0.5.23, ``MHATokenToKVPool`` with the ``nhd`` layout and ``MLATokenToKVPool``):

- MHA: per layer, K and V are the two halves of one ``[2, slots, heads, head_dim]`` allocation
  (``k_buffer[i] = buf[0]``, ``v_buffer[i] = buf[1]``), token-major, ``slots = size + page_size``: slot 0's
  page absorbs padded-token writes and is never transferred;
- MLA: per layer one ``[slots, 1, kv_lora_rank + qk_rope_head_dim]`` buffer;
- linear attention (``MambaPool`` inside ``HybridReqToTokenPool``, SGLang 0.5.x): per conv shape one
  ``[mamba layers, size + 1, *conv_shape]`` tensor and one ``[mamba layers, size + 1, *temporal_shape]`` temporal
  tensor, indexed by the request's mamba slot (``req_index_to_mamba_index_mapping``), the shapes exactly
  ``Mamba2StateShape.create`` (Qwen3-Next's GDN: one conv tensor of Q|K|V channels, ``(conv_dim / tp, kernel - 1)``,
  channels x rows) and ``KimiLinearStateShape.create`` (Kimi-Linear's KDA: in SGLang 0.5.23 one conv tensor
  ``(kernel - 1, (proj + 2 proj_k) / tp)``, rows x channels, its ``conv_shard_groups`` q|k|v each TP-sharded on
  its own; in earlier SGLang three conv tensors, each ``(kernel - 1, proj / tp)``) make them; conv in bfloat16,
  temporal in float32 (``SGLANG_MAMBA_SSM_DTYPE``). ``tests/test_sglang_pool_shapes.py`` compares them with
  SGLang's own ``MambaPool`` where SGLang is installed.
  Each layer's slice (``conv[i][layer]``, ``temporal[layer]``) is one hybrid-kv layer holding its part of the
  state, with the pool's own slot count (``state_slots``): a few slots beside the page pool.

SGLang's disaggregation hands a transfer backend the request's *page* indices on each side (token slot //
page size). Viewed as ``[pages, page_size, heads, head_dim]``, page ``p`` of a buffer is hybrid-kv's block
``p``: K and V are separate layers (``head_size_v`` 0), and the page order is declared token-major (``NHD``)
since a rank holding one head cannot show it.
"""

from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_kv import compat_hash
from hybrid_kv.torch_adapter import region_table_from_tensors

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Linear:
    """A linear-attention model's state shapes (the whole model), as SGLang's config code takes them."""

    # "gdn" (Qwen3-Next: Mamba2StateShape, one ds conv tensor), "kda" (Kimi-Linear, SGLang 0.5.23: one sd conv
    # tensor) or "kda3" (Kimi-Linear in earlier SGLang: three sd conv tensors)
    kind: str
    layers: int
    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int
    conv_kernel: int = 4


@dataclass(frozen=True)
class Model:
    """A model's KV shapes (the whole model; ranks hold ``heads / tp``)."""

    name: str
    kind: str  # "mha" or "mla"
    layers: int
    heads: int  # KV heads (1 for MLA)
    head_dim: int  # K (and V) elements per head; the latent size for MLA
    linear: Linear | None = None  # linear-attention layers beside the attention layers (a hybrid model)


# Qwen3-Next's full-attention layers: 2 KV heads of 256 (head_dim cut to 32 to keep the test small); an MLA model
# with DeepSeek's 512 + 64 latent cut to 64.
QWEN3_NEXT_ATTN = Model("qwen3-next-attn", "mha", layers=2, heads=2, head_dim=32)
MLA = Model("deepseek-mla", "mla", layers=2, heads=1, head_dim=64)
# Hybrid models, cut small: Qwen3-Next (GDN; 16 key heads of 128 and 32 value heads of 128 in the real model) and
# Kimi-Linear (KDA; 32 heads of 128), attention layers as above.
QWEN3_NEXT = Model("qwen3-next", "mha", 1, 2, 32, Linear("gdn", layers=2, k_heads=2, k_dim=4, v_heads=4, v_dim=4))
KIMI_LINEAR = Model("kimi-linear", "mha", 1, 2, 32, Linear("kda", layers=2, k_heads=2, k_dim=4, v_heads=2, v_dim=4))
KIMI_LINEAR_3 = Model("kimi-linear", "mha", 1, 2, 32, Linear("kda3", layers=2, k_heads=2, k_dim=4, v_heads=2, v_dim=4))
MAMBA_SIZE = 6  # mamba slots (``mamba_size``); the tensors hold ``size + 1``
STATE_DTYPES = (torch.bfloat16, torch.float32)  # conv, temporal


def state_shapes(lin: Linear, tp: int) -> tuple[list[tuple[int, int]], tuple[int, int, int]]:
    """The conv shapes and the temporal shape of one rank, as SGLang computes them (``Mamba2StateShape.create``
    with Qwen3-Next's arguments, ``KimiLinearStateShape.create``)."""
    rows = lin.conv_kernel - 1
    if lin.kind == "gdn":
        # intermediate_size = value dim, n_groups = key heads, state_size = key head dim, num_heads = value heads
        conv_dim = lin.v_heads * lin.v_dim + 2 * lin.k_heads * lin.k_dim
        return [(conv_dim // tp, rows)], (lin.v_heads // tp, lin.v_dim, lin.k_dim)
    proj, proj_k = lin.v_heads * lin.v_dim, lin.k_heads * lin.k_dim
    temporal = (lin.v_heads // tp, lin.v_dim, lin.v_dim)
    if lin.kind == "kda":
        return [(rows, proj // tp + 2 * (proj_k // tp))], temporal
    return [(rows, proj // tp), (rows, proj_k // tp), (rows, proj_k // tp)], temporal


def proj_channels(lin: Linear) -> list[int]:
    """Global channels of the Q, K and V conv sub-projections."""
    if lin.kind == "gdn":
        return [lin.k_heads * lin.k_dim, lin.k_heads * lin.k_dim, lin.v_heads * lin.v_dim]
    return [lin.v_heads * lin.v_dim, lin.k_heads * lin.k_dim, lin.k_heads * lin.k_dim]


def conv_value(layer: int, proj: int, salt: int, channels: int, rows: int) -> torch.Tensor:
    """What a conv sub-projection's ``(global channel, row)`` holds, bf16-exact."""
    c = torch.arange(channels)[:, None]
    j = torch.arange(rows)[None, :]
    return ((layer * 7 + proj * 3 + c * 5 + j * 11 + salt * 13) % 251).to(torch.bfloat16)


def temporal_value(layer: int, salt: int, shape: tuple[int, int, int]) -> torch.Tensor:
    """What the temporal state holds at ``(global head, i, j)``."""
    n = shape[0] * shape[1] * shape[2]
    return (torch.arange(n, dtype=torch.float32) + layer * 1000 + salt * 100000).view(shape)


def factors(model: Model, mode: str) -> dict[str, Any]:
    return {
        "model": model.name,
        "dtype": "bfloat16",
        "cache_dtype": "auto",
        "total_num_kv_heads": model.heads,
        "head_size": model.head_dim,
        "num_hidden_layers": model.layers,
        "attn_backend": "sglang-test",
        "hma": False,
        "speculative": [],
        "transfer_mode": mode,
    }


class Pool:
    """One rank's pool, allocated as SGLang does, and its region table and handshake payload."""

    def __init__(self, model: Model, engine: str, tp: int, rank: int, pages: int, page_size: int, mode: str) -> None:
        slots = pages * page_size  # size + page_size, with size a whole number of pages
        self.model, self.tp, self.rank, self.page_size = model, tp, rank, page_size
        self.heads = max(1, model.heads // tp) if model.kind == "mha" else 1
        layers = []
        if model.kind == "mha":
            fused = [torch.zeros(2, slots, self.heads, model.head_dim, dtype=DTYPE) for _ in range(model.layers)]
            self.buffers = {"k": [b[0] for b in fused], "v": [b[1] for b in fused]}
            spec = {
                "type": "full_attention",
                "num_kv_heads": self.heads,
                "head_size": model.head_dim,
                "head_size_v": 0,
                "dtype_bytes": 2,
            }
            for i in range(model.layers):
                for kv in ("k", "v"):
                    view = self.buffers[kv][i].view(pages, page_size, self.heads, model.head_dim)
                    layers.append((f"model.layers.{i}.attn.{kv}", 0, spec, view))
        else:
            self.buffers = {"kv": [torch.zeros(slots, 1, model.head_dim, dtype=DTYPE) for _ in range(model.layers)]}
            spec = {"type": "mla", "head_size": model.head_dim, "dtype_bytes": 2}
            for i in range(model.layers):
                view = self.buffers["kv"][i].view(pages, page_size, 1, model.head_dim)
                layers.append((f"model.layers.{i}.attn.kv", 0, spec, view))
        self.states: list[torch.Tensor] = []
        if model.linear is not None:
            layers += self._state_layers(model.linear, model.layers)
        self.table = region_table_from_tensors(
            layers,
            logical_block_size=page_size,
            kernel_block_size=page_size,
            num_logical_blocks=pages,
            tp_rank=rank,
            tp_size=tp,
            total_num_kv_heads=model.heads,
            kv_layout="NHD",
            state_slots=True,
        )
        info = {"engine_id": engine, "attn_backend": "sglang-test", "transfer_mode": mode}
        self.payload = self.table.handshake_payload({**info, "compat_hash": compat_hash(factors(model, mode))})

    def _state_layers(self, lin: Linear, first: int) -> list[tuple[str, int, dict[str, Any], torch.Tensor]]:
        """``MambaPool``'s tensors, allocated as it allocates them, and each layer's slices as hybrid-kv layers."""
        conv_shapes, temporal_shape = state_shapes(lin, self.tp)
        size = MAMBA_SIZE
        self.conv = [torch.zeros((lin.layers, size + 1, *s), dtype=STATE_DTYPES[0]) for s in conv_shapes]
        self.temporal = torch.zeros((lin.layers, size + 1, *temporal_shape), dtype=STATE_DTYPES[1])
        self.states = [*self.conv, self.temporal]
        rows = lin.conv_kernel - 1
        spec: dict[str, Any] = {
            "type": "ssm",
            "kind": "gdn",
            "conv_shape": [sum(proj_channels(lin)) // self.tp, rows],
            "conv_dtype_bytes": 2,
            "temporal_shape": list(temporal_shape),
            "temporal_dtype_bytes": 4,
            "conv_layout": "ds" if lin.kind == "gdn" else "sd",
        }
        parts: list[Any] = [{"conv": [0, 1, 2]}] if lin.kind != "kda3" else [{"conv": [i]} for i in range(3)]
        out = []
        for layer in range(lin.layers):
            name = f"model.layers.{first + layer}.linear_attn"
            for i, (conv, part) in enumerate(zip(self.conv, parts, strict=True)):
                out.append((f"{name}.conv{i}", 1, {**spec, "part": part}, conv[layer]))
            out.append((f"{name}.temporal", 1, {**spec, "part": "temporal"}, self.temporal[layer]))
        return out

    def fill_state(self, slot: int, salt: int) -> None:
        """Write every (layer, sub-projection, global channel, row) and (layer, global head, ...) of this rank's
        state share into mamba slot ``slot``: SGLang's tensors, written through their own shapes."""
        lin = self.model.linear
        assert lin is not None
        rows, tp, r = lin.conv_kernel - 1, self.tp, self.rank
        _, temporal_shape = state_shapes(lin, 1)
        for layer in range(lin.layers):
            shares = []
            for p, ch in enumerate(proj_channels(lin)):
                shares.append(conv_value(layer, p, salt, ch, rows)[r * ch // tp : (r + 1) * ch // tp])
            if lin.kind == "gdn":  # one tensor: Q|K|V channels, channels x rows
                self.conv[0][layer, slot] = torch.cat(shares)
            elif lin.kind == "kda":  # one tensor: rows x Q|K|V channels
                self.conv[0][layer, slot] = torch.cat(shares).T
            else:  # one tensor per sub-projection, rows x channels
                for p, share in enumerate(shares):
                    self.conv[p][layer, slot] = share.T
            heads = temporal_shape[0]
            glob = temporal_value(layer, salt, temporal_shape)
            self.temporal[layer, slot] = glob[r * heads // tp : (r + 1) * heads // tp]

    def global_heads(self) -> range:
        """The model's heads this rank holds."""
        if self.model.kind == "mla":
            return range(1)
        first = self.rank * self.model.heads // self.tp  # replicated heads (tp > heads): head rank * heads // tp
        return range(first, first + self.heads)

    def fill(self, pages: list[int]) -> None:
        """Write the value of every (layer, K/V, global head, token, element) of a request into its slots."""
        for t in range(len(pages) * self.page_size):
            slot = pages[t // self.page_size] * self.page_size + t % self.page_size
            for name, bufs in self.buffers.items():
                for layer, buf in enumerate(bufs):
                    for local, head in enumerate(self.global_heads()):
                        buf[slot, local] = value(layer, name, head, t, self.model.head_dim)

    def bytes(self) -> list[bytes]:
        """Every buffer's bytes (K layers then V layers, or the MLA layers), then the state tensors'."""
        bufs = [b for bufs in self.buffers.values() for b in bufs] + self.states
        return [b.contiguous().view(torch.uint8).numpy().tobytes() for b in bufs]


def value(layer: int, name: str, head: int, token: int, dim: int) -> torch.Tensor:
    """What element ``e`` of a cell means, as a bf16-exact number (at most 8 significant bits)."""
    kv = {"k": 0, "v": 1, "kv": 2}[name]
    base = ((layer * 3 + kv) * 4 + head) * 61 + token * 7
    return torch.tensor([float((base + e * 3) % 251) for e in range(dim)], dtype=DTYPE)


def serve(
    model: Model,
    engine: str,
    tp: int,
    pages: int,
    page_size: int,
    mode: str,
    fill_pages: list[int] | None,
    expect: list[tuple[str, int]],
    out: Any,
    cmds: Any,
    fill_slot: int | None = None,
) -> None:
    """The passive engine's ranks in one process (one endpoint each): fill ``fill_pages`` (prefill), serve the
    payloads, answer READs or await ``expect``'s pushed requests ``(request id, senders)``; report the endpoints'
    addresses, then (on ``"stop"``) every rank's bytes. A hybrid prefill fills mamba slot ``fill_slot`` with the
    request's state and every other slot with a decoy state."""
    from hybrid_kv.transport import Endpoint

    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    pools = [Pool(model, engine, tp, r, pages, page_size, mode) for r in range(tp)]
    if fill_pages is not None:
        for p in pools:
            p.fill(fill_pages)
            if fill_slot is not None:
                for s in range(MAMBA_SIZE + 1):
                    p.fill_state(s, 0 if s == fill_slot else 1)
    eps = [
        Endpoint(f"{engine}-{p.rank}", p.table.registration(), {}, metadata_provider={p.rank: p.payload}, insecure=True)
        for p in pools
    ]
    try:
        for ep in eps:
            for rid, senders in expect:
                ep.expect(rid, 30.0, senders)
        out.put(("ready", [ep.address for ep in eps]))
        end = time.monotonic() + 120.0
        stop = False
        while not stop and time.monotonic() < end:
            for ep in eps:
                ev = ep.poll()
                for rid in ev.done:
                    out.put(("done", ep.name, rid))
                for f in ev.failed:
                    out.put(("failed", ep.name, str(f)))
            try:
                stop = cmds.get_nowait() == "stop"
            except queue.Empty:
                time.sleep(0.001)
    finally:
        for ep in eps:
            ep.close()
    out.put(("bytes", [p.bytes() for p in pools]))
