"""The README's examples run: every fenced ``python`` block as a script of its own, and every command line of a
fenced ``sh`` block that runs hybrid-kv's CLI, so the README cannot drift from the code again.

A command line the test does not run must be listed in ``NOT_RUN`` with the reason (and where it is tested); a
new line that is neither run nor listed fails the test.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

NOT_RUN = {
    "bash scripts/demo.sh": "the demo itself (tests/test_demo.py runs its README command)",
    "bash scripts/test.sh": "runs this very test suite",
    "bash scripts/gpu-kit.sh": "runs on the accelerator image (tests/test_gpu_kit.py runs its dry run)",
    "export HYBRID_KV_SECRET=": "sets the secret of the engines below",
    "vllm serve ": "real vLLM engines (tests/engines, tests/integrations/test_multihost.py)",
}


def blocks(lang: str) -> list[tuple[int, str]]:
    """``(line number, body)`` of every fenced block of ``lang``."""
    out = []
    for m in re.finditer(rf"^```{lang}\n(.*?)^```$", README, re.M | re.S):
        out.append((README.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


def commands() -> list[tuple[int, str]]:
    """Every command line of the ``sh`` blocks, continuation lines joined, comments dropped."""
    out = []
    for line_no, body in blocks("sh"):
        joined = re.sub(r"\\\n\s*", " ", body)
        pending = ""
        for line in joined.splitlines():
            line = (pending + "\n" + line if pending else line).strip()
            try:
                shlex.split(line, comments=True)
            except ValueError:  # a quoted argument goes on over the next line
                pending = line
                continue
            pending = ""
            if line and not line.startswith("#"):
                out.append((line_no, line))
        assert not pending, f"README.md line {line_no}: unbalanced quotes in {pending!r}"
    return out


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), *filter(None, [e.get("PYTHONPATH")])])
    return e


def test_the_readme_shows_what_this_test_runs() -> None:
    assert len(blocks("python")) >= 4
    assert any(c.startswith("hybrid-kv ") for _, c in commands())


@pytest.mark.parametrize(("line_no", "body"), blocks("python"), ids=lambda v: f"line-{v}" if isinstance(v, int) else "")
def test_python_block_runs(line_no: int, body: str, tmp_path: Path) -> None:
    if "hybrid_kv.transport" in body:
        pytest.importorskip("nixl", reason="the transport needs NIXL")
    if "torch" in body:
        pytest.importorskip("torch")
    script = tmp_path / f"readme_{line_no}.py"
    script.write_text(body)
    run = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, f"README.md line {line_no}:\n{body}\n--- stderr:\n{run.stderr[-4000:]}"


def test_every_command_line_is_run_or_listed() -> None:
    for line_no, line in commands():
        if not line.startswith("hybrid-kv "):
            listed = any(line.startswith(prefix) for prefix in NOT_RUN)
            assert listed, f"README.md line {line_no}: {line!r} is neither run here nor listed in NOT_RUN"


@pytest.mark.parametrize(
    ("line_no", "line"),
    [(n, c) for n, c in commands() if c.startswith("hybrid-kv ")],
    ids=lambda v: f"line-{v}" if isinstance(v, int) else "",
)
def test_cli_line_runs(line_no: int, line: str) -> None:
    args = shlex.split(line, comments=True)[1:]
    run = subprocess.run(
        [sys.executable, "-m", "hybrid_kv", *args], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, f"README.md line {line_no}: {line}\n--- stderr:\n{run.stderr[-4000:]}"
