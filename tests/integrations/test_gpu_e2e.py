"""``scripts/gpu-e2e.sh`` without a GPU: one clear line and exit status 3 (not a pass, not a failure), before
any set-up or build. ``CUDA_VISIBLE_DEVICES=""`` hides every GPU, so this is the no-GPU path on any machine.
The GPU path itself runs only where a GPU is (``bash scripts/gpu-e2e.sh``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("HYBRID_KV_VLLM_VENV", Path.home() / ".venvs" / "hybrid-kv-vllm"))
NO_CUDA = 3


def _no_gpu_env() -> dict[str, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HYBRID_KV_VLLM_VENV=str(VLLM_VENV))
    env.pop("HKV_ENV_READY", None)  # a set-up or build would show as output and time; none may happen
    return env


def test_script_without_gpu_says_so_and_exits_3() -> None:
    """The script, in the vLLM venv this test runs in: exit 3 and exactly one line naming the reason."""
    assert Path(sys.prefix).resolve() == VLLM_VENV.resolve(), f"run in the vLLM venv {VLLM_VENV}, not {sys.prefix}"
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-e2e.sh")], env=_no_gpu_env(), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == NO_CUDA, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("gpu-e2e: no CUDA device: ") and "torch.cuda.is_available() is False" in lines[0]
    assert lines[0].endswith("nothing was run (exit 3)")


def test_python_entry_without_gpu_exits_3_for_run_and_probe() -> None:
    """``gpu_e2e.py`` itself (what the script runs after its set-up): exit 3 whether asked to run or to probe."""
    for extra in ([], ["--probe"]):
        r = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "integrations" / "gpu_e2e.py"), *extra],
            env=_no_gpu_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == NO_CUDA, (extra, r.returncode, r.stderr)
        assert r.stderr.strip().startswith("gpu-e2e: no CUDA device: "), r.stderr
