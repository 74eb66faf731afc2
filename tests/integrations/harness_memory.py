"""What the harness's KV memory must hold: ``Content`` (a request's logical, pre-TP KV, from a seed) and
``Memory`` (a worker's KV caches as vLLM allocated them, written and compared per layer view)."""

from __future__ import annotations

from typing import Any

import numpy as np

CONTENT_TOKENS = 2048  # tokens of KV each request's content holds (more than any prompt here)
INTERMEDIATE = 100_000  # content index offset of the SSM states a non-last chunk leaves


def _rand(seed: int, key: tuple[int, ...], n: int) -> np.ndarray:
    return np.random.default_rng([seed, *key]).integers(0, 256, n, dtype=np.uint8)


class Content:
    """The logical (pre-TP) KV of one request: per (region, group) attention cells or one SSM state."""

    def __init__(self, seed: int, index: int, tokens: int) -> None:
        self.seed, self.index, self.tokens = seed, index, tokens

    def cells(self, region: int, group: int, heads: int, cell: int) -> np.ndarray:
        data = _rand(self.seed, (1, self.index, region, group), self.tokens * heads * cell)
        return data.reshape(self.tokens, heads, cell)

    def state_share(self, region: int, group: int, spec: Any, rank: int, tp: int) -> np.ndarray:
        """Rank ``rank``'s state: its channel slice of each conv sub-projection (Q|K|V), then its temporal rows."""
        conv_local, rows = spec.shapes[0]
        temporal = spec.shapes[1]
        value = temporal[0] * temporal[1] * tp  # global V channels (GDN/KDA)
        key = (conv_local * tp - value) // 2
        esz = 2
        parts = []
        for p, dims in enumerate((key, key, value)):
            g = _rand(self.seed, (2, self.index, region, group, p), dims * rows * esz).reshape(dims, rows * esz)
            parts.append(g[rank * dims // tp : (rank + 1) * dims // tp].reshape(-1))
        s = temporal[0] * tp
        rest = int(np.prod(temporal[1:])) * 4
        t = _rand(self.seed, (3, self.index, region, group), s * rest).reshape(s, rest)
        parts.append(t[rank * s // tp : (rank + 1) * s // tp].reshape(-1))
        return np.concatenate(parts)


class Memory:
    """A worker's KV memory as vLLM allocated it, addressed per layer view (bytes)."""

    def __init__(self, kv_caches: dict[str, Any], kv_cfg: Any, specs: dict[str, Any], tp: int, rank: int) -> None:
        import torch

        self.torch = torch
        self.kv_caches = kv_caches
        self.storage = next(iter(kv_caches.values())).untyped_storage()
        self.base = self.storage.data_ptr()
        self.flat = torch.empty(0, dtype=torch.uint8, device=self.storage.device).set_(self.storage).view(-1)
        self.tp, self.rank, self.specs = tp, rank, specs
        self.num_blocks = kv_cfg.num_blocks
        self.group_of = {n: gi for gi, g in enumerate(kv_cfg.transfer_groups) for n in g.layer_names}
        ptrs = sorted({v.data_ptr() for v in kv_caches.values()})
        self.region_of = {n: ptrs.index(v.data_ptr()) for n, v in kv_caches.items()}

    def bytes_view(self, name: str, flat: Any) -> Any:
        """Layer ``name``'s view over ``flat`` (this memory or a copy of it) as uint8 ``(blocks, H, N, C bytes)``."""
        v = self.kv_caches[name]
        esz = v.element_size()
        shape = (*v.shape[:-1], v.shape[-1] * esz)
        stride = (*(s * esz for s in v.stride()[:-1]), 1)
        return self.torch.as_strided(flat, shape, stride, (v.data_ptr() - self.base)).numpy()

    def write(
        self,
        flat: Any,
        ids: list[list[int]],
        content: Content,
        tokens: int | None = None,
        *,
        layers: set[str] | None = None,
        states: Content | None = None,
    ) -> None:
        """Write ``content`` into the blocks ``ids`` (per transfer group) of this rank; attention cells only for
        the first ``tokens`` tokens when given (what a transfer covers). ``layers``: only these layers;
        ``states``: what SSM layers write (default ``content``; an earlier chunk's intermediate state)."""
        from vllm.v1.kv_cache_interface import MambaSpec

        for name in self.kv_caches:
            g = self.group_of.get(name)
            if g is None or g >= len(ids) or not ids[g] or (layers is not None and name not in layers):
                continue
            spec, region, view = self.specs[name], self.region_of[name], self.bytes_view(name, flat)
            if isinstance(spec, MambaSpec):
                share = (states or content).state_share(region, g, spec, self.rank, self.tp)
                for b in ids[g]:
                    view[b, 0, 0, : share.size] = share
                continue
            ppl = view.shape[0] // self.num_blocks
            kb, local_heads, cell = view.shape[2], view.shape[1], view.shape[3]
            total_heads = (
                local_heads * self.tp if spec.num_kv_heads > 1 or type(spec).__name__ == "FullAttentionSpec" else 1
            )
            heads = [self.rank * total_heads // self.tp + h for h in range(local_heads)] if total_heads > 1 else [0]
            cells = content.cells(region, g, total_heads, cell)
            limit = content.tokens if tokens is None else min(tokens, content.tokens)
            kernel = [b * ppl + k for b in ids[g] for k in range(ppl)]
            for j, k in enumerate(kernel):
                n = min(kb, limit - j * kb)
                if n <= 0:
                    break
                view[k, :, :n, :] = cells[j * kb : j * kb + n, heads].transpose(1, 0, 2)

    def snapshot(self) -> Any:
        """A host (CPU) copy of this memory's bytes; ``write`` and ``bytes_view`` work on it."""
        return self.flat.to("cpu", copy=True)

    def forward_order(self) -> list[str]:
        """The layers in the order a forward runs them (layer number, as vLLM's models do)."""
        return sorted(self.kv_caches, key=lambda n: (int(n.split("layers.")[1].split(".")[0]), n))

    def compute_layer(self, name: str, work: list[tuple[list[list[int]], int, int, bool]], seed: int) -> None:
        """Layer ``name`` of a forward writes its KV for each ``(ids, content index, tokens computed, last
        chunk)`` of ``work``: attention cells of the tokens computed so far (every cell of the blocks once it is
        the last chunk, what the byte check expects), SSM states final only in the last chunk."""
        host = self.snapshot()
        for ids, index, covered, last in work:
            content = Content(seed, index, CONTENT_TOKENS)
            states = None if last else Content(seed, index + INTERMEDIATE, CONTENT_TOKENS)
            self.write(host, ids, content, None if last else covered, layers={name}, states=states)
        self.flat.copy_(host)
