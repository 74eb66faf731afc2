"""Step ``registration``: NIXL registration of preset-shaped pools at realistic one-GPU sizes.

For each real preset (Kimi-Linear-48B-A3B, Qwen3-Next-80B-A3B, DeepSeek-V3) one TP-1 rank's HMA pool of about
``registration_mib`` (at most half the free device memory) is allocated on the device, its region table built,
and the pool registered with a NIXL agent on UCX, timed piece by piece: creating the backend, registering the
regions (``VRAM`` on a GPU), prepping the rank's whole local table (strided rows) and taking the agent's
metadata; then released. The same pool then opens and closes a ``hybrid_kv.transport.Endpoint`` (the path the
connector takes), which must leave no NIXL handle behind.
"""

from __future__ import annotations

import time
from typing import Any

from ..config import REAL, KitConfig
from ..device import Device
from ..step import Report

__all__ = ["run"]


def run(cfg: KitConfig, report: Report) -> None:
    dev = Device(cfg.device, cfg.chunk)
    dev.activate()
    budget = cfg.registration_mib << 20
    if dev.is_cuda:
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(dev.name))
        budget = min(budget, free // 2)
    report.put("pool_budget_bytes", budget)
    for name in REAL:
        try:
            report.put(name, _one(dev, name, budget, cfg.ucx_error_mode))
        except Exception as exc:  # noqa: BLE001 - the next preset still runs
            import traceback

            report.problem(f"{name}: {type(exc).__name__}: {exc}", traceback.format_exc())
        dev.release()


def _one(dev: Device, name: str, budget: int, error_mode: str) -> dict[str, Any]:
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    from ...presets import get_preset
    from ...torch_adapter import region_table_from_tensors
    from ...transport import Endpoint
    from ...transport.agent import LOCAL

    preset = get_preset(name)
    geo = preset.geometry(1)
    blocks = max(2, budget // (geo.page_bytes * preset.num_tensors))
    t0 = time.perf_counter()
    pools, layers, geo = preset.torch_layers(1, 0, blocks, device=dev.name)
    dev.sync()
    alloc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    table = region_table_from_tensors(
        layers,
        logical_block_size=geo.logical_block_size,
        kernel_block_size=geo.kernel_block_size,
        num_logical_blocks=blocks,
        total_num_kv_heads=preset.attention.num_kv_heads,
    )
    reg, rows = table.registration(), table.local_rows()
    table_s = time.perf_counter() - t0
    nbytes = int(reg[:, 1].sum())
    agent: Any = nixl_agent(f"kit-reg-{name}", nixl_agent_config(enable_prog_thread=False, backends=[]))
    times: dict[str, float] = {}

    def timed(what: str, fn: Any) -> Any:
        t = time.perf_counter()
        out = fn()
        times[what] = time.perf_counter() - t
        return out

    timed("backend_s", lambda: agent.create_backend("UCX", {"ucx_error_handling_mode": error_mode}))
    handle = timed("register_s", lambda: agent.register_memory(reg, table.mem_type))
    dlist = timed("prep_s", lambda: agent.prep_xfer_dlist(LOCAL, rows, table.mem_type))
    metadata = timed("metadata_s", agent.get_agent_metadata)
    timed("release_s", lambda: (dlist.release(), agent.deregister_memory(handle)))
    t0 = time.perf_counter()
    ep = Endpoint(
        f"kit-reg-ep-{name}",
        reg,
        {"whole": rows},
        mem_type=table.mem_type,
        listen=None,
        huge_pages="off",
        ucx_error_handling_mode=error_mode,
    )
    open_s = time.perf_counter() - t0
    ep.close()
    left = ep.handle_counts()
    if any(left.values()):
        raise RuntimeError(f"the endpoint left NIXL handles after close: {left}")
    del pools, layers
    return {
        "mem_type": table.mem_type,
        "bytes": nbytes,
        "regions": int(reg.shape[0]),
        "blocks": blocks,
        "page_bytes": geo.page_bytes,
        "table_rows": int(rows.shape[0]),
        "descriptors": int(np.asarray(rows[:, 4], dtype=np.uint64).sum()),
        "alloc_s": alloc_s,
        "table_s": table_s,
        **times,
        "register_gbps": nbytes / times["register_s"] / 1e9 if times["register_s"] else None,
        "metadata_bytes": len(metadata),
        "endpoint_open_s": open_s,
    }
