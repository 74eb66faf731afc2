"""The GPU kit's dry run (``scripts/gpu-kit.sh --device cpu``): every step of the kit the accelerator runs, here on
host memory with real NIXL transfers between rank processes, so the kit cannot rot between accelerator runs. The
summary must say that every step ran and passed, that every byte the plans moved was checked equal on every decode
rank (and every prefill byte unchanged), and carry the figures the accelerator run reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("nixl")

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("environment", "registration", "transfer", "streaming", "planner")
CASES = ("pull P2->D1", "pull P1->D2", "push P2->D1", "push P1->D2")
TINY = ("tiny-kimi-linear", "tiny-qwen3-next", "tiny-deepseek-v3")


def kit(tmp_path: Path, *args: str, timeout: float = 420) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``scripts/gpu-kit.sh`` with this interpreter and no carried wheels (an empty folder, whatever ``.gpu-kit/``
    holds); returns the process and the summary."""
    out = tmp_path / "kit.json"
    empty = tmp_path / "no-wheels"
    empty.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHON": sys.executable, "HYBRID_KV_KIT_WHEELS": str(empty)}
    cmd = ["bash", str(ROOT / "scripts" / "gpu-kit.sh"), "--device", "cpu", "--out", str(out), *args]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    return run, json.loads(out.read_text())


@pytest.mark.slow
def test_dry_run_every_step_passes_with_every_byte_checked(tmp_path: Path) -> None:
    run, summary = kit(tmp_path)
    assert run.returncode == 0, json.dumps({k: v.get("problems") for k, v in summary["steps"].items()}, indent=1)
    assert summary["ok"] and list(summary["steps"]) == list(STEPS)
    steps = {name: s["figures"] for name, s in summary["steps"].items()}
    assert all(s["ok"] and s["finished"] and not s["problems"] for s in summary["steps"].values())

    env = steps["environment"]
    assert env["pattern_device_equals_cpu"] and env["device"]["mem_type"] == "DRAM"
    assert "UCX" in env["nixl"]["plugins"] and env["zmq"]["curve"]

    for preset in ("kimi-linear-48b-a3b", "qwen3-next-80b-a3b", "deepseek-v3"):
        reg = steps["registration"][preset]
        assert reg["mem_type"] == "DRAM" and reg["bytes"] > 0 and reg["descriptors"] >= reg["regions"] > 0
        assert reg["register_s"] > 0 and reg["prep_s"] > 0 and reg["metadata_bytes"] > 0

    transfer = steps["transfer"]
    assert set(transfer) == {f"{p} {c}" for p in TINY for c in CASES}
    for key, case in transfer.items():
        assert case["ok"] and not case["problems"], key
        assert case["mem_types"] == ["DRAM"]
        # every byte the plans moved was compared on the decode rank it landed on; nothing else changed anywhere
        assert case["bytes"] > 0 and case["checked_from_peers"] == case["bytes"], key
        assert case["bytes_mismatched"] == 0 and case["checked_bytes"] >= sum(case["pool_bytes"].values())
        assert case["descriptors_posted"] > 0 and case["descriptors_per_s"] > 0
        assert case["batch_gbps"] > 0 and case["single_gbps"] > 0 and case["copy_gbps"] > 0
        assert case["digest_algorithm"] == "xxh3" and case["digests_passive"] > 0
        assert case["transports"]["rma_kinds"].get("host"), key  # UCX's own report of what moved the bytes

    for preset in TINY:
        s = steps["streaming"][preset]
        assert s["ok"] and s["stages"] >= 2 and s["bytes"] > 0
        assert s["tail_whole_s"] > 0 and s["tail_layer_s"] > 0 and s["hidden_fraction"] is not None

    planner = steps["planner"]
    cases = [k for k, v in planner.items() if isinstance(v, dict)]
    assert len(cases) == 6
    for key in cases:
        assert all(r["plan_us"] > 0 and r["ids"] > 0 for r in planner[key]["requests"].values()), key
        assert planner[key]["peer_plan_s"] > 0 and planner[key]["parallel"]["plans_per_s_all_threads"] > 0
    assert "every step ok" in run.stdout


@pytest.mark.slow
def test_a_flipped_byte_fails_its_case_and_is_named(tmp_path: Path) -> None:
    """Fault injection: one byte a request moved is flipped on a decode rank before the check, in every case."""
    small = ("--presets", "tiny-kimi-linear", "--requests", "1", "--repeats", "1")
    run, summary = kit(tmp_path, "--steps", "transfer", *small, "--corrupt")
    assert run.returncode == 1 and not summary["ok"]
    step = summary["steps"]["transfer"]
    assert not step["ok"] and len(step["problems"]) == 4
    for key, case in step["figures"].items():
        assert not case["ok"] and case["bytes_mismatched"] == 1, key
        assert "moved from address" in case["problems"][0], case["problems"]


def test_a_step_past_its_bound_is_stopped_and_the_next_runs(tmp_path: Path) -> None:
    run, summary = kit(tmp_path, "--steps", "planner,environment", "--bound", "planner=0.05", timeout=120)
    assert run.returncode == 1
    planner, env = summary["steps"]["planner"], summary["steps"]["environment"]
    assert not planner["ok"] and "time bound" in planner["problems"][-1]
    assert env["ok"] and env["figures"]["python"]
