"""What a user of the installed wheel sees: ``--version``, one-line errors naming the extra to install
when torch, nixl or zmq is missing, quiet exit on a closed pipe, piped output without trailing spaces, flags
that only apply to ``--json`` refused without it, counted nouns, merged warnings, and a TP the preset
refuses reported with both TP sizes.

Every case runs the installed ``hybrid-kv`` entry point in a subprocess. "Without torch/nixl/zmq" puts a
``sitecustomize`` on ``PYTHONPATH`` whose import hook refuses those modules, as a venv without the extras
would (``scripts/wheel.sh`` checks the same in real fresh venvs of other Python versions).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hybrid_kv
from hybrid_kv.cli.demo import layout_claims

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "tests" / "data" / "scenarios"
ENTRY = Path(sys.executable).parent / "hybrid-kv"

BLOCKER = """
import importlib.abc, sys
class _NoExtras(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _NoExtras())
"""


def run_cli(*argv: str, blocked: tuple[str, ...] = (), tmp: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if blocked:
        assert tmp is not None
        (tmp / "sitecustomize.py").write_text(BLOCKER.format(BLOCKED=repr(set(blocked))))
        env["PYTHONPATH"] = str(tmp)
    return subprocess.run(
        [str(ENTRY), *argv], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for n in needles:
        assert n in proc.stderr, proc.stderr


def test_entry_point_is_installed() -> None:
    assert ENTRY.exists(), f"{ENTRY}: install the package (maturin develop) first"


def test_version_prints_the_package_version() -> None:
    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"hybrid-kv {importlib.metadata.version('hybrid-kv')}"
    assert hybrid_kv.__version__ == importlib.metadata.version("hybrid-kv")


def test_license_is_apache_2_and_shipped() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in pyproject and 'license-files = ["LICENSE"]' in pyproject


def test_regions_without_torch_names_the_extra(tmp_path: Path) -> None:
    proc = run_cli("regions", blocked=("torch",), tmp=tmp_path)
    assert_one_line_error(proc, "hybrid-kv regions: error: needs torch", "pip install 'hybrid-kv[torch]'")


def test_demo_without_torch_nixl_zmq_names_the_extras_before_starting_ranks(tmp_path: Path) -> None:
    proc = run_cli("demo", blocked=("torch", "nixl", "zmq"), tmp=tmp_path)
    assert_one_line_error(
        proc, "hybrid-kv demo: error: needs torch, nixl and zmq", "pip install 'hybrid-kv[torch,nixl]'"
    )
    proc = run_cli("demo", blocked=("zmq",), tmp=tmp_path)
    assert_one_line_error(proc, "needs zmq, which is not installed", "pip install 'hybrid-kv[nixl]'")
    # msgspec too (the digest messages of verified transfers): a wheel installed alone has none of them
    proc = run_cli("demo", blocked=("msgspec",), tmp=tmp_path)
    assert_one_line_error(proc, "needs msgspec, which is not installed", "pip install 'hybrid-kv[nixl]'")


def test_check_preset_needs_neither_nixl_nor_zmq_nor_torch(tmp_path: Path) -> None:
    proc = run_cli(
        "check", "--preset", "tiny-kimi-linear", "--prefill-tp", "2", "--decode-tp", "1",
        blocked=("torch", "nixl", "zmq"), tmp=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "COMPATIBLE" in proc.stdout and not proc.stderr


def test_plan_and_scenario_check_without_extras(tmp_path: Path) -> None:
    for cmd in ("plan", "check"):
        proc = run_cli(cmd, str(SCENARIOS / "hybrid_mla_f2.json"), blocked=("torch", "nixl", "zmq"), tmp=tmp_path)
        assert proc.returncode == 0, proc.stderr


def test_closed_pipe_exits_quietly() -> None:
    proc = subprocess.Popen(
        [str(ENTRY), "plan", str(SCENARIOS / "kimi_tiny_8p2d_push.json"), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().strip() == b"{"
    proc.stdout.close()  # what `| head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert err == "", err


@pytest.mark.parametrize(
    "argv",
    [
        ("plan", str(SCENARIOS / "kimi_tiny_8p2d_push.json")),
        ("check", str(SCENARIOS / "gqa_ssm_2p4d_pull.json")),
        ("check", "--preset", "tiny-kimi-linear", "--prefill-tp", "2", "--decode-tp", "2"),
        ("regions",),
    ],
)
def test_piped_output_has_no_trailing_spaces(argv: tuple[str, ...]) -> None:
    proc = run_cli(*argv)
    assert proc.returncode == 0, proc.stderr
    padded = [line for line in proc.stdout.splitlines() if line != line.rstrip()]
    assert not padded, padded[:3]


@pytest.mark.parametrize("flag", ["--compact", "--no-moves"])
def test_json_only_flags_need_json(flag: str) -> None:
    proc = run_cli("plan", str(SCENARIOS / "hybrid_mla_f2.json"), flag)
    assert_one_line_error(proc, f"{flag} only applies to --json output")
    assert run_cli("plan", str(SCENARIOS / "hybrid_mla_f2.json"), flag, "--json").returncode == 0


def test_counted_nouns_agree() -> None:
    out = run_cli("check", str(SCENARIOS / "hybrid_mla_f2.json")).stdout
    assert "(s)" not in out and "the rank pair passes" in out, out
    out = run_cli("check", "--preset", "tiny-kimi-linear", "--prefill-tp", "3", "--decode-tp", "1").stdout
    assert "INCOMPATIBLE: 1 reason\n" in out, out
    out = run_cli("demo", "--help").stdout
    assert "(s)" not in out


def test_identical_warnings_are_merged_naming_every_rank() -> None:
    proc = run_cli("check", "--preset", "tiny-qwen3-next", "--prefill-tp", "2", "--decode-tp", "2")
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning:")]
    assert warnings and len(warnings) == len(set(warnings)), warnings
    assert any("decode ranks 0-1: descriptor-bound" in w for w in warnings), warnings


def test_preset_check_with_a_bad_tp_names_both_tp_sizes() -> None:
    args = ("check", "--preset", "tiny-kimi-linear", "--prefill-tp", "3", "--decode-tp", "1")
    proc = run_cli(*args)
    assert proc.returncode == 1, proc.stderr
    assert "?" not in proc.stdout and "prefill TP 3 -> decode TP 1" in proc.stdout, proc.stdout
    report = json.loads(run_cli(*args, "--json").stdout)
    assert report["prefill"] == {"tp": 3} and report["decode"] == {"tp": 1}
    assert report["compatible"] is False and report["reasons"]


@pytest.mark.parametrize(
    ("kinds", "claims"),
    [
        (["mla", "ssm"], "MLA pages replicated, SSM state sharded"),
        (["ssm", "attention"], "attention heads split across ranks, SSM state sharded"),
        (["mla"], "MLA pages replicated"),
    ],
)
def test_verified_line_claims_only_what_the_model_has(kinds: list[str], claims: str) -> None:
    assert layout_claims(kinds) == claims


def test_every_cited_document_is_in_the_repo() -> None:
    import re

    files = [p for ext in ("*.py", "*.rs", "*.md") for p in ROOT.glob(f"**/{ext}") if "target" not in p.parts]
    for path in files:
        text = path.read_text(errors="replace")
        assert "DESIGN " + "\u00a7" not in text, path  # the design notes are not part of the repo
        for doc in re.findall(r"\bdocs/[\w./-]+\.md\b", text):
            assert (ROOT / doc).exists(), f"{path} cites {doc}, which is not in the repo"
