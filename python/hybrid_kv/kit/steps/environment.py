"""Step ``environment``: what the kit runs on and with, so that every figure after it can be read.

Python, torch and its CUDA, the device, the package versions that were loaded (and from where), the UCX
version NIXL loaded, NIXL's plugins and the UCX backend's memory types, the UCX and NIXL environment
variables, whether the side channel runs authenticated (ZeroMQ CURVE), and one check that the byte pattern the
other steps fill and check is the same computed on the device and on the CPU.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import platform
import sys
from typing import Any

from ..config import KitConfig
from ..device import Device
from ..step import Report
from ..ucx import ucx_version

__all__ = ["run"]

PACKAGES = ("torch", "numpy", "nixl", "nixl-cu13", "nixl-cu12", "pyzmq", "msgspec", "cryptography", "rich")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def run(cfg: KitConfig, report: Report) -> None:
    import hybrid_kv

    report.put("python", sys.version.split()[0])
    report.put("platform", platform.platform())
    report.put("cpus", {"count": os.cpu_count(), "usable": len(os.sched_getaffinity(0))})
    report.put("packages", {p: _version(p) for p in PACKAGES})
    report.put("hybrid_kv", {"version": hybrid_kv.__version__, "path": os.path.dirname(hybrid_kv.__file__)})
    report.put("ucx", ucx_version())
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("UCX_", "NIXL_", "CUDA_", "PYTORCH_CUDA"))}
    report.put("environment", env)
    zmq = importlib.import_module("zmq")
    report.put("zmq", {"libzmq": zmq.zmq_version(), "pyzmq": zmq.pyzmq_version(), "curve": bool(zmq.has("curve"))})
    curve = bool(os.environ.get("HYBRID_KV_SECRET"))
    report.put("side_channel", "CURVE, keys from HYBRID_KV_SECRET" if curve else "no HYBRID_KV_SECRET")
    import torch

    cuda = torch.cuda.is_available()
    report.put("torch", {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_available": cuda})
    dev = Device(cfg.device, cfg.chunk)
    if dev.is_cuda and not torch.cuda.is_available():
        report.problem(f"device {cfg.device}: torch {torch.__version__} sees no CUDA device")
    else:
        dev.activate()
        report.put("device", dev.describe())
        _pattern_agrees(dev, report)
    _nixl(report, dev.mem_type)


def _pattern_agrees(dev: Device, report: Report) -> None:
    """The pattern bytes the device computes must be the CPU's (the checks compare on the device)."""
    import torch

    from ..pattern import byte_pattern

    start, n = (7 << 44) + 12345, 1 << 16
    here = byte_pattern(9, start, n, dev.name).cpu()
    cpu = byte_pattern(9, start, n, "cpu")
    same = bool(torch.equal(here, cpu))
    report.put("pattern_device_equals_cpu", same)
    if not same:
        report.problem(f"the byte pattern computed on {dev.name} differs from the CPU's")


def _nixl(report: Report, mem_type: str) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    agent: Any = nixl_agent("kit-environment", nixl_agent_config(enable_prog_thread=False, backends=[]))
    plugins = list(agent.get_plugin_list())
    out: dict[str, Any] = {"plugins": plugins}
    if "UCX" in plugins:
        out["ucx_mem_types"] = [str(m) for m in agent.get_plugin_mem_types("UCX")]
        if f"{mem_type}_SEG" not in out["ucx_mem_types"] and mem_type not in out["ucx_mem_types"]:
            report.problem(f"NIXL's UCX plugin does not list memory type {mem_type}: {out['ucx_mem_types']}")
    else:
        report.problem(f"NIXL has no UCX plugin (plugins: {plugins})")
    report.put("nixl", out)
