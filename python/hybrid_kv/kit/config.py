"""What the kit runs: the device, the presets and the sizes of each step, with one set of defaults for a GPU
(realistic one-GPU sizes, about 3-4 minutes on an H200) and one for ``--device cpu`` (the dry run: the same steps
on host memory with the presets' tiny variants, about a minute on 2 cores).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["BOUNDS_S", "KitConfig", "STEPS"]

STEPS = ("environment", "registration", "transfer", "streaming", "planner")
"""The kit's steps, in the order they run."""

BOUNDS_S = {"environment": 60, "registration": 120, "transfer": 300, "streaming": 180, "planner": 120}
"""Each step's time bound by default (seconds); the kit's overall budget may cut a later step's shorter."""

REAL = ("kimi-linear-48b-a3b", "qwen3-next-80b-a3b", "deepseek-v3")


@dataclass
class KitConfig:
    """Every setting of a kit run (JSON-able: each step's process gets it as JSON)."""

    device: str = "cuda"
    chunk: int = 64 << 20
    """Bytes the byte check and the pattern fill handle per step on the device."""
    presets: list[str] = field(default_factory=lambda: list(REAL))
    """Presets of the transfer and streaming steps (registration always uses the real ones)."""
    registration_mib: int = 32 << 10
    """Pool bytes registered per preset (MiB), bounded by half the free device memory."""
    tokens: int = 32768
    """Longest request of a transfer batch (the others step down to half of it, as the demo's do)."""
    requests: int = 4
    repeats: int = 3
    stream_tokens: int = 16384
    """Prompt of the streamed request (the forward's matrix products scale with it)."""
    stream_repeats: int = 2
    compute_dim: int = 0
    """Matrix side of the streaming forward's per-layer product; 0: sized like each model's layers."""
    planner_pool_gib: int = 40
    """Each rank's KV pool in the planner step's layouts (synthetic addresses: nothing is allocated)."""
    planner_calls: int = 200
    ucx_error_mode: str = "peer"
    """UCX error handling of the ranks' endpoints: ``peer`` (the connector's: a dead peer is an error, not a hang;
    UCX leaves out transports that cannot report it) or ``none``."""
    log_dir: str = "."
    corrupt: bool = False
    """Fault injection (tests): the transfer step flips one byte a request moved on a decode rank before checking."""

    @classmethod
    def for_device(cls, device: str, **overrides: Any) -> KitConfig:
        """The defaults for ``device`` (``cpu``: the dry run's sizes), then ``overrides`` (``None`` values
        ignored)."""
        # torch's CUDA calls (set_device, mem_get_info) want an index: plain "cuda" is the first visible GPU
        base: dict[str, Any] = {"device": "cuda:0" if device == "cuda" else device}
        if device == "cpu":
            base.update(
                chunk=1 << 20,
                presets=["tiny-kimi-linear", "tiny-qwen3-next", "tiny-deepseek-v3"],
                registration_mib=24,
                tokens=1200,
                requests=3,
                repeats=1,
                stream_tokens=600,
                stream_repeats=1,
                compute_dim=256,
                planner_calls=50,
            )
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> KitConfig:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def public(self) -> dict[str, Any]:
        """The settings as the summary shows them."""
        return asdict(self)
