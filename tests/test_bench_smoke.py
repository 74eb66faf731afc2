"""The side-by-side benchmark still runs: ``bench_planner.py --quick`` checks, before timing anything, that
hybrid-kv's tables equal the NumPy and Python-loop baselines', that its reference plans have NumPy's id
pairs and that its coalesced plans move the reference plans' bytes (real NIXL transfers in ``e2e``, data
verified). Nothing here asserts a time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_planner_quick_runs_every_section_and_its_checks(tmp_path: Path) -> None:
    out = tmp_path / "planner.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    cmd = [sys.executable, str(ROOT / "benches" / "bench_planner.py"), "--quick", "--json", str(out)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for title in (
        "Local descriptor tables, fresh pages",
        "Local descriptor tables, reused pages",
        "Table -> prepped NIXL handle",
        "Per-request planning",
        "Planning overhead on a real NIXL READ",
        "Descriptors posted",
    ):
        assert title in run.stdout, f"section {title!r} missing"
    assert out.stat().st_size > 0


def test_stream_push_bench_runs_all_three_pushes(tmp_path: Path) -> None:
    """``benches/stream_push.py`` on the tiny Kimi-Linear shapes: every push mode completes (the bench raises
    unless the decode's request completed from every done-notice); no time is asserted."""
    out = tmp_path / "stream.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    cmd = [sys.executable, str(ROOT / "benches" / "stream_push.py"), "--models", "tiny-kimi-linear"]
    cmd += ["--tokens", "300", "--repeats", "1", "--prefill-tok-s", "1000000", "--json", str(out)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    import json

    (row,) = json.loads(out.read_text())
    assert set(row["tail_ms"]) == {"whole", "region", "layer"} and row["stages"]["layer"] >= row["stages"]["region"]


def test_fuzz_decoders_finds_no_defect_in_a_short_run(tmp_path: Path) -> None:
    """``benches/fuzz_decoders.py`` (10^6 inputs per decoder for the record) on 3,000 inputs per decoder: every
    decoder of peer or client bytes accepts or refuses with its own error type, nothing else escapes."""
    out = tmp_path / "fuzz.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    cmd = [sys.executable, str(ROOT / "benches" / "fuzz_decoders.py"), "--iterations", "3000", "--json", str(out)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    import json

    counts = json.loads(out.read_text())
    assert set(counts) == {"control", "ticket", "params", "notification", "payload", "frames"}
    for name, c in counts.items():
        assert c["defects"] == 0 and c["accepted"] + c["refused"] == 3000, name
        assert c["refused"] > 0 and c["accepted"] > 0, f"{name}: the mutations never reach both outcomes"


@pytest.mark.slow
def test_nixl_floor_bench_lands_the_same_bytes_on_every_path(tmp_path: Path) -> None:
    """``benches/nixl_floor.py`` on a small batch: hybrid-kv, the endpoint's raw path and a bare NIXL agent post the
    same descriptors between three processes (the bench raises unless the decode's memory after each path has one
    digest and NIXL posted as many descriptors on every path); no time is asserted."""
    import json

    out = tmp_path / "floor.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    cmd = [sys.executable, str(ROOT / "benches" / "nixl_floor.py"), "--rounds", "1", "--requests", "2"]
    cmd += ["--tokens", "300", "--json", str(out)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["descriptors"] > 0 and set(res["times"]) == {"hybrid-kv", "endpoint raw", "bare NIXL", "memcpy"}
