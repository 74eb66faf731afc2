"""The kit's device: where pools live (``cuda``, ``cuda:N`` or ``cpu``), how to wait for it, and the plain copy
every transfer is compared with.

On ``cpu`` everything runs on host memory (NIXL ``DRAM``), so the whole kit also runs where there is no GPU (its
dry run); on a CUDA device pools are device memory (NIXL ``VRAM``) and the comparison copy is a torch
device-to-device copy on the same device.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Device", "copy_seconds"]


@dataclass(frozen=True)
class Device:
    """A device as the kit uses it.

    Attributes:
        name: the torch device (``cpu``, ``cuda``, ``cuda:1``).
        chunk: bytes the byte check and the pattern fill handle per step (the temporaries are 8 bytes per byte).
    """

    name: str
    chunk: int

    @property
    def is_cuda(self) -> bool:
        return self.name.startswith("cuda")

    @property
    def mem_type(self) -> str:
        """The NIXL memory type of pools on this device."""
        return "VRAM" if self.is_cuda else "DRAM"

    def activate(self, threads: int = 1) -> None:
        """Make this device the current one of the process (CUDA) and bound torch's CPU threads."""
        import torch

        torch.set_num_threads(max(1, threads))
        if self.is_cuda:
            torch.cuda.set_device(torch.device(self.name))

    def sync(self) -> None:
        """Wait until every kernel queued on this device finished (nothing on ``cpu``)."""
        if self.is_cuda:
            import torch

            torch.cuda.synchronize(torch.device(self.name))

    def release(self) -> None:
        """Give the memory of freed tensors back (CUDA's caching allocator keeps it otherwise)."""
        if self.is_cuda:
            import torch

            torch.cuda.empty_cache()

    def event(self) -> Any:
        """A CUDA event recorded now on the current stream, or ``None`` on ``cpu`` (work there is synchronous)."""
        if not self.is_cuda:
            return None
        import torch

        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record()
        return ev

    def describe(self) -> dict[str, Any]:
        """What the device is: name, memory and (CUDA) the GPU's properties."""
        import torch

        out: dict[str, Any] = {"device": self.name, "mem_type": self.mem_type}
        if self.is_cuda:
            dev = torch.device(self.name)
            props = torch.cuda.get_device_properties(dev)
            free, total = torch.cuda.mem_get_info(dev)
            out.update(
                gpu=props.name,
                capability=f"{props.major}.{props.minor}",
                multiprocessors=props.multi_processor_count,
                memory_total_gib=total / 2**30,
                memory_free_gib=free / 2**30,
                gpus_visible=torch.cuda.device_count(),
            )
        return out


def copy_seconds(device: Device, nbytes: int, repeats: int) -> float:
    """Median time of one torch copy of ``nbytes`` contiguous bytes to another buffer on ``device`` (after a
    warm-up copy), waited for on the device: the plain copy a transfer of the same bytes is compared with."""
    import torch

    n = max(1, nbytes)
    src = torch.ones(n, dtype=torch.uint8, device=device.name)
    dst = torch.empty_like(src)
    dst.copy_(src)
    device.sync()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        dst.copy_(src)
        device.sync()
        times.append(time.perf_counter() - t0)
    del src, dst
    device.release()
    return statistics.median(times)
