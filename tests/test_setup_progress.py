"""The README's set-up commands show what they do on a first run: one line per package pip
fetches or installs, instead of minutes of silence. Runs ``scripts/env.sh``'s own ``hkv_pip`` function with
a stand-in ``python`` that prints what pip prints, so no package is downloaded."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PIP_OUTPUT = """Collecting torch>=2.2
  Downloading torch-2.15.0-cp311-cp311-manylinux_2_28_x86_64.whl (900.1 MB)
Requirement already satisfied: numpy>=1.24 in ./lib/python3.11/site-packages
Installing collected packages: torch
Successfully installed torch-2.15.0
"""


def test_pip_progress_is_one_line_per_package_step(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{PIP_OUTPUT}EOF\n")
    fake.chmod(0o755)
    env_sh = (ROOT / "scripts/env.sh").read_text()
    start = env_sh.index("hkv_pip() {")
    function = env_sh[start : env_sh.index("\n}\n", start) + 3]
    script = f"set -euo pipefail\n{function}\nhkv_pip -r requirements-dev.txt\n"
    out = subprocess.run(
        ["bash", "-c", script],
        env={"PATH": f"{tmp_path}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    lines = out.stderr.splitlines()
    assert lines == [
        "[hybrid-kv]   Collecting torch>=2.2",
        "[hybrid-kv]   Downloading torch-2.15.0-cp311-cp311-manylinux_2_28_x86_64.whl (900.1 MB)",
        "[hybrid-kv]   Installing collected packages: torch",
        "[hybrid-kv]   Successfully installed torch-2.15.0",
    ], lines
    assert out.stdout == ""
