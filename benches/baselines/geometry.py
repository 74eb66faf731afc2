"""The plain inputs every baseline works from: one rank's region geometry, as vLLM keeps it.

vLLM's connector keeps these as attributes (``seen_base_addresses``, ``block_len_per_layer``,
``block_strides``, ``_ssm_region_indices``, conv offsets, ...) after ``register_kv_caches``; building
them is not part of the timed work, so the benchmark extracts them once from ``RegionTable.to_json()``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]


@dataclass(frozen=True)
class Geometry:
    """Region geometry of one rank (arrays for the NumPy baseline, lists for the loop baseline)."""

    bases: U64
    block_lens: U64
    strides: U64
    num_blocks: U64
    is_mla: npt.NDArray[np.bool_]
    ssm_regions: npt.NDArray[np.intp]
    #: ``(offset, len)`` of every SSM sub-stream in page order: conv sub-projections, then the state.
    streams: list[tuple[int, int]]
    ppl: int
    num_logical_blocks: int
    num_kernel_blocks: int
    device: int

    @property
    def num_regions(self) -> int:
        return len(self.bases)

    @property
    def has_ssm(self) -> bool:
        return len(self.ssm_regions) > 0

    @classmethod
    def from_table(cls, table: Any) -> Geometry:
        """Read a ``hybrid_kv.RegionTable`` through its JSON form."""
        info = json.loads(table.to_json())
        regs = info["regions"]
        geo = info["geometry"]
        split = info.get("conv_split")
        streams: list[tuple[int, int]] = []
        if split is not None:
            off = 0
            for b in split["proj_bytes"]:
                streams.append((off, b))
                off += b
            streams.append((split["conv_bytes"], split["ssm_bytes"]))

        def col(key: str) -> U64:
            return np.array([r[key] for r in regs], dtype=np.uint64)

        return cls(
            bases=col("base"),
            block_lens=col("block_len"),
            strides=col("block_stride"),
            num_blocks=col("num_blocks"),
            is_mla=np.array([r["is_mla"] for r in regs], dtype=bool),
            ssm_regions=np.array(info["ssm_regions"], dtype=np.intp),
            streams=streams,
            ppl=int(geo["ppl"]),
            num_logical_blocks=int(geo["num_logical_blocks"]),
            num_kernel_blocks=int(geo["num_kernel_blocks"]),
            device=int(info["device"]),
        )
