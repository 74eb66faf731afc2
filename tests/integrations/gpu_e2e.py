"""The vLLM connector end to end with CUDA tensors: what ``test_vllm_connector.py`` checks on CPU memory, with
every worker's KV caches allocated by vLLM on a GPU, so the connector registers them as NIXL ``VRAM`` and UCX
moves GPU memory (cuda_ipc on one machine). Run by ``scripts/gpu-e2e.sh`` in the vLLM test venv.

Each case starts a prefill and a decode engine (vLLM's real Scheduler here, one process per TP worker; ranks
share GPUs round-robin when there are fewer GPUs than ranks), moves Kimi-Linear-shaped requests and checks
every byte of the decode workers' memory, that the prefill's memory did not change, and that every worker
registered ``VRAM`` only. ``stream`` cases are push with streaming: the router sends each request to
both engines at once (``route_concurrent``), the prefill workers run the last prefill forward layer by layer
on the GPU (each layer's KV copied to the device, then vLLM's ``save_kv_layer`` hook, which records a CUDA
event the poster thread waits for before posting that layer's stage), and every request must have streamed.

Exit status (also of ``--probe``, which only looks for a device): 0 every case passed, 1 a case failed
(the reason printed), 3 no CUDA device (nothing was run).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

NO_CUDA = 3
"""Exit status when torch sees no CUDA device: distinct from a pass (0) and a failure (1)."""

CASES = ("pull:1:2", "push:1:2", "pull:2:1", "stream:1:2", "stream:2:1")
"""Default cases, ``MODE:P_TP:D_TP``: the seed case both ways in pull, push, and streaming push both ways."""


def cuda_devices() -> tuple[int, str]:
    """``(number of CUDA devices torch sees, why none)``; the reason is empty when there is one."""
    try:
        import torch
    except ImportError as exc:
        return 0, f"torch cannot be imported ({exc})"
    if not torch.cuda.is_available():
        return 0, f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
    return int(torch.cuda.device_count()), ""


def run_case(models: dict[str, str], mode: str, p_tp: int, d_tp: int, lengths: list[int]) -> dict[str, Any]:
    """One P -> D transfer on CUDA memory, every byte checked; returns what was measured."""
    from vllm_harness import Engine, EngineSpec, move, route_concurrent, side_channel_ports, verify_moved

    p_port, d_port = side_channel_ports(2)
    stream = mode == "stream"
    mode = "push" if stream else mode
    layers = {"layerwise": stream, "layer_s": 0.005}
    p = Engine.start(EngineSpec("prefill", "kimi", models["kimi"], p_tp, mode, p_port, device="cuda", **layers))
    try:
        d = Engine.start(EngineSpec("decode", "kimi", models["kimi"], d_tp, mode, d_port, device="cuda"))
    except BaseException:
        p.close()
        raise
    try:
        for engine in (p, d):
            for rank, ready in enumerate(engine.workers.ready):
                if ready["mem_types"] != ["VRAM"]:
                    raise AssertionError(
                        f"{engine.spec.engine_id} rank {rank} registered {ready['mem_types']}, expected ['VRAM']"
                    )
        t0 = time.perf_counter()
        reqs = route_concurrent(p, d, lengths) if stream else move(p, d, lengths)
        wall = time.perf_counter() - t0
        checked = verify_moved(p, d, reqs)
        stats = [s for s in (d if mode == "pull" else p).stats]
        moved = sum(sum(s["bytes"]) for s in stats)
        xfer = sum(sum(s["xfer_time_s"]) for s in stats)
        failed = sum(int(s["num_failed_transfers"]) for s in stats)
        if failed or moved <= 0:
            raise AssertionError(f"{failed} failed transfers, {moved} bytes moved")
        streamed = sum(int(s.get("num_streamed_requests", 0)) for s in p.stats)
        if stream and streamed != len(lengths) * p_tp:
            raise AssertionError(f"{streamed} of {len(lengths) * p_tp} requests streamed (per prefill worker)")
        return {"moved": moved, "checked": checked, "xfer_s": xfer, "wall_s": wall}
    finally:
        p.close()
        d.close()


def main(argv: list[str] | None = None) -> int:
    """Run the cases; see the module doc for the exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", help=f"MODE:P_TP:D_TP (repeatable; default {' '.join(CASES)})")
    ap.add_argument("--lengths", default="300,517,64", help="prompt lengths of the requests (comma-separated)")
    ap.add_argument("--probe", action="store_true", help="only check for a CUDA device (exit 0 or 3)")
    args = ap.parse_args(argv)
    n, why = cuda_devices()
    if n == 0:
        print(f"gpu-e2e: no CUDA device: {why}; nothing was run (exit {NO_CUDA})", file=sys.stderr)
        return NO_CUDA
    if args.probe:
        return 0
    cases = []
    for text in args.case or CASES:
        mode, p_tp, d_tp = text.split(":")
        if mode not in ("pull", "push", "stream"):
            ap.error(f"--case {text!r}: mode must be pull, push or stream")
        cases.append((mode, int(p_tp), int(d_tp)))
    lengths = [int(x) for x in args.lengths.split(",")]
    os.environ.setdefault("HYBRID_KV_SECRET", "hybrid-kv-gpu-e2e-secret-0123456789")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    # TP ranks may share a GPU: vLLM's NCCL and all-reduce communicators need one GPU per rank and the
    # connector uses none of them (spawned workers inherit these)
    os.environ["VLLM_DISABLE_PYNCCL"] = "1"
    os.environ["VLLM_ALLREDUCE_USE_SYMM_MEM"] = "0"
    os.environ["VLLM_ALLREDUCE_USE_FLASHINFER"] = "0"
    from vllm_harness import write_model_dirs  # beside this script, which Python puts on sys.path

    print(f"gpu-e2e: {n} CUDA device(s); cases {' '.join(f'{m}:{a}:{b}' for m, a, b in cases)}", flush=True)
    failures = 0
    with tempfile.TemporaryDirectory(prefix="hkv-gpu-e2e-") as tmp:
        models = write_model_dirs(Path(tmp))
        for mode, p_tp, d_tp in cases:
            name = f"kimi {mode} P TP{p_tp} -> D TP{d_tp} (VRAM)"
            try:
                r = run_case(models, mode, p_tp, d_tp, lengths)
            except Exception as exc:  # noqa: BLE001 - every case runs; the status says whether any failed
                failures += 1
                print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc()
                continue
            print(
                f"ok   {name}: {r['moved']} KV bytes moved in {r['xfer_s'] * 1e3:.2f} ms of transfers "
                f"(summed over requests and ranks), {r['checked']} decode bytes checked, {r['wall_s']:.2f} s",
                flush=True,
            )
    print(f"gpu-e2e: {len(cases) - failures}/{len(cases)} cases passed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
