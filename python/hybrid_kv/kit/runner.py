"""Runs the kit's steps one after another, each in its own process group with a time bound, and writes the
JSON summary after every step.

A step that fails, raises or runs past its bound is recorded (its problems, the tail of its log, and whatever
figures it had saved) and the next step runs: one missing transport or one hung transfer costs its own step,
never the run. The overall budget bounds the whole: a later step gets what is left of it, and one left with less
than ``MIN_STEP_S`` is skipped as such. Every process of a step (the rank processes too) is in the step's
process group, which is what is stopped at the bound.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .config import KitConfig

__all__ = ["MIN_STEP_S", "run_kit", "run_step"]

MIN_STEP_S = 10.0
"""A step is started only with at least this much of the budget left."""


def _tail(path: str, lines: int = 30) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in f.readlines()[-lines:]]
    except OSError:
        return []


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop the step's process group: SIGTERM, then SIGKILL whatever is left after a few seconds."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:  # the leader is gone; its rank processes may not be
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return


def run_step(name: str, config_path: str, bound_s: float, log_dir: str, env: Mapping[str, str]) -> dict[str, Any]:
    """Run step ``name`` in a new process group, stopped after ``bound_s``; its result with the verdict."""
    result_path = os.path.join(log_dir, f"{name}.json")
    log_path = os.path.join(log_dir, f"{name}.log")
    if os.path.exists(result_path):
        os.remove(result_path)
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "hybrid_kv.kit.step", name, config_path, result_path]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)
        timed_out = False
        try:
            proc.wait(bound_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop_group(proc)
    result: dict[str, Any] = {"ok": False, "figures": {}, "problems": [], "finished": False}
    try:
        with open(result_path) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError):
        pass
    if timed_out:
        result["ok"] = False
        result["problems"].append(f"stopped at its time bound of {bound_s:.0f} s (figures saved so far are kept)")
    elif not result.get("finished"):
        result["ok"] = False
        result["problems"].append(f"its process exited with status {proc.returncode} before finishing")
    result["seconds"] = time.monotonic() - t0
    result["bound_s"] = bound_s
    result["log"] = log_path
    if not result["ok"]:
        result["log_tail"] = _tail(log_path)
    return result


def _write(path: str, summary: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, path)


def run_kit(
    cfg: KitConfig,
    out: str,
    steps: Sequence[str],
    budget_s: float,
    bounds: Mapping[str, float],
    echo: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Run ``steps`` (each bounded by ``bounds[step]`` and what is left of ``budget_s``), writing the summary to
    ``out`` after each; returns the summary (``ok`` when every step was)."""
    import hybrid_kv

    os.makedirs(cfg.log_dir, exist_ok=True)
    config_path = os.path.join(cfg.log_dir, "config.json")
    with open(config_path, "w") as f:
        f.write(cfg.to_json())
    env = dict(os.environ)
    # the rank processes' side channels authenticate with a secret of this run unless the caller set one
    env.setdefault("HYBRID_KV_SECRET", secrets.token_hex(32))
    summary: dict[str, Any] = {
        "kit": "hybrid-kv gpu-kit",
        "version": hybrid_kv.__version__,
        "device": cfg.device,
        "config": cfg.public(),
        "budget_s": budget_s,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "ok": False,
        "steps": {},
    }
    t0 = time.monotonic()
    for name in steps:
        left = budget_s - (time.monotonic() - t0)
        bound = min(bounds[name], left)
        if left < MIN_STEP_S:
            summary["steps"][name] = {
                "ok": False,
                "skipped": True,
                "problems": [f"not run: {max(0.0, left):.0f} s of the {budget_s:.0f} s budget left"],
            }
            echo(f"{name}: skipped (budget spent)")
            _write(out, summary)
            continue
        echo(f"{name}: running (bound {bound:.0f} s)")
        result = run_step(name, config_path, bound, cfg.log_dir, env)
        summary["steps"][name] = result
        verdict = "ok" if result["ok"] else f"FAILED: {'; '.join(result['problems'][:3])}"
        echo(f"{name}: {verdict} ({result['seconds']:.1f} s)")
        _write(out, summary)
    summary["total_s"] = time.monotonic() - t0
    summary["ok"] = all(summary["steps"].get(s, {}).get("ok") for s in steps)
    _write(out, summary)
    return summary
