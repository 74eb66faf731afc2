"""KV pools of exactly the shapes and strides SGLang's token-to-KV pools allocate, described to hybrid-kv
unchanged, and the processes of a two-engine transfer between them.

SGLang's own classes are not imported: its ``memory_pool`` module pulls in the serving stack (transformers,
fastapi, its CUDA kernels), which the CPU test machines do not have. The pools are built as its code builds them
(SGLang 0.5.23, ``MHATokenToKVPool`` with the ``nhd`` layout and ``MLATokenToKVPool``):

- MHA: per layer, K and V are the two halves of one ``[2, slots, heads, head_dim]`` allocation
  (``k_buffer[i] = buf[0]``, ``v_buffer[i] = buf[1]``), token-major, ``slots = size + page_size``: slot 0's
  page absorbs padded-token writes and is never transferred;
- MLA: per layer one ``[slots, 1, kv_lora_rank + qk_rope_head_dim]`` buffer.

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
class Model:
    """A model's KV shapes (the whole model; ranks hold ``heads / tp``)."""

    name: str
    kind: str  # "mha" or "mla"
    layers: int
    heads: int  # KV heads (1 for MLA)
    head_dim: int  # K (and V) elements per head; the latent size for MLA


# Qwen3-Next's full-attention layers: 2 KV heads of 256 (head_dim cut to 32 to keep the test small); an MLA model
# with DeepSeek's 512 + 64 latent cut to 64.
QWEN3_NEXT_ATTN = Model("qwen3-next-attn", "mha", layers=2, heads=2, head_dim=32)
MLA = Model("deepseek-mla", "mla", layers=2, heads=1, head_dim=64)


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
        self.table = region_table_from_tensors(
            layers,
            logical_block_size=page_size,
            kernel_block_size=page_size,
            num_logical_blocks=pages,
            tp_rank=rank,
            tp_size=tp,
            total_num_kv_heads=model.heads,
            kv_layout="NHD",
        )
        info = {"engine_id": engine, "attn_backend": "sglang-test", "transfer_mode": mode}
        self.payload = self.table.handshake_payload({**info, "compat_hash": compat_hash(factors(model, mode))})

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
        """Every buffer's bytes (K layers then V layers, or the MLA layers)."""
        return [b.contiguous().view(torch.uint8).numpy().tobytes() for bufs in self.buffers.values() for b in bufs]


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
) -> None:
    """The passive engine's ranks in one process (one endpoint each): fill ``fill_pages`` (prefill), serve the
    payloads, answer READs or await ``expect``'s pushed requests ``(request id, senders)``; report the endpoints'
    addresses, then (on ``"stop"``) every rank's bytes."""
    from hybrid_kv.transport import Endpoint

    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    pools = [Pool(model, engine, tp, r, pages, page_size, mode) for r in range(tp)]
    if fill_pages is not None:
        for p in pools:
            p.fill(fill_pages)
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
