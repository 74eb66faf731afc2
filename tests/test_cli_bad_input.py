"""Bad command-line arguments and scenario files: one line on stderr naming the value and its limit, exit 2.

Every case runs the installed entry point (``python -m hybrid_kv``) in a subprocess with its address space
capped, so an input that would allocate without bound fails the test (killed, aborted or timed out) instead
of exhausting the machine.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
F2 = ROOT / "tests" / "data" / "scenarios" / "hybrid_mla_f2.json"
MEMORY_CAP = 6 * 2**30
"""Address-space cap of the subprocess: ample for the CLI (torch included), far below an unbounded input."""


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def run_cli(*argv: str, stdin: bytes = b"") -> subprocess.CompletedProcess[str]:
    """Run ``hybrid-kv ARGV`` as a subprocess (capped memory, 120 s, ``stdin`` as raw bytes)."""
    proc = subprocess.run(
        [sys.executable, "-m", "hybrid_kv", *argv],
        input=stdin,
        capture_output=True,
        timeout=120,
        preexec_fn=_cap_memory,
        check=False,
    )
    out, err = (b.decode("utf-8", errors="replace") for b in (proc.stdout, proc.stderr))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], command: str, *needles: str) -> str:
    """Exit 2, exactly one line on stderr starting ``hybrid-kv COMMAND: error:``, containing every needle."""
    err = proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\n{err[-2000:]}"
    assert "Traceback" not in err, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(f"hybrid-kv {command}: error: "), err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    return err


def f2_with(tmp_path: Path, name: str, edit: dict[str, dict[str, object]]) -> Path:
    """The F.2 scenario with some engine fields replaced, written to ``tmp_path/name``."""
    s = json.loads(F2.read_text())
    for side, fields in edit.items():
        s[side].update(fields)
    path = tmp_path / name
    path.write_text(json.dumps(s))
    return path


# ------------------------------------------------------------------------------------------- scenario files


@pytest.mark.parametrize("command", ["plan", "check"])
def test_huge_tp_size_is_refused_before_any_rank_is_reserved(tmp_path: Path, command: str) -> None:
    path = f2_with(tmp_path, "tp.json", {"prefill": {"tp_size": 2**32 - 1}})
    assert_one_line_error(run_cli(command, str(path)), command, "prefill.tp_size", "4294967295", "1024")


def test_huge_tp_size_of_an_mla_only_model_is_refused(tmp_path: Path) -> None:
    """No SSM group whose TP split fails first: the parser's own bound must stop it."""
    s = json.loads(F2.read_text())
    s["model"] = {"groups": [s["model"]["groups"][0]], "tensors": [{"layers": [{"name": "mla.0", "group": 0}]}]}
    s["requests"] = []
    s["decode"]["tp_size"] = 2**31
    path = tmp_path / "mla.json"
    path.write_text(json.dumps(s))
    assert_one_line_error(run_cli("plan", str(path)), "plan", "decode.tp_size", str(2**31), "1024")


@pytest.mark.parametrize("command", ["plan", "check"])
def test_non_utf8_scenario_file_is_one_line(tmp_path: Path, command: str) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"name": "caf\xe9"}')
    assert_one_line_error(run_cli(command, str(path)), command, "latin1.json", "UTF-8", "byte 13")


def test_non_utf8_scenario_on_stdin_is_one_line() -> None:
    proc = run_cli("plan", "-", stdin=b'{"name": "\xff"}')
    assert_one_line_error(proc, "plan", "stdin", "UTF-8")


def test_scenario_file_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    with path.open("wb") as f:
        f.truncate(64 * 2**20 + 1)  # sparse: nothing is written, the size alone must be refused
    assert_one_line_error(run_cli("check", str(path)), "check", "big.json", str(64 * 2**20 + 1), str(64 * 2**20))


# ------------------------------------------------------------------------------------------- check --preset

PRESET = ["check", "--preset", "tiny-kimi-linear", "--prefill-tp", "2", "--decode-tp", "1"]


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--tokens", str(2**70)], ["--tokens", str(2**70), "16777216"]),
        (["--tokens", "0"], ["--tokens", "got 0", "16777216"]),
        (["--tokens", "1.5"], ["--tokens", "'1.5'", "integer"]),
        (["--kv-gib", "nan"], ["--kv-gib", "nan", "16384"]),
        (["--kv-gib", "inf"], ["--kv-gib", "inf", "16384"]),
        (["--kv-gib", "-1"], ["--kv-gib", "-1", "16384"]),
        (["--num-blocks", "0"], ["--num-blocks", "got 0", "2147483647"]),
        (["--num-blocks", str(2**40)], ["--num-blocks", str(2**40), "2147483647"]),
        (["--prefill-block-size", str(2**64)], ["--prefill-block-size", str(2**64), "1048576"]),
    ],
)
def test_check_preset_arguments_name_the_value_and_the_limit(extra: list[str], needles: list[str]) -> None:
    assert_one_line_error(run_cli(*PRESET, *extra), "check", *needles)


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--kv-gib", "16384"], ["prefill pool of", "kernel blocks, over the limit of 2147483647", "--kv-gib"]),
        (["--num-blocks", "2147483647"], ["4294967294 kernel blocks, over the limit of 2147483647", "--num-blocks"]),
    ],
)
def test_check_preset_pools_past_int32_descriptor_ids_are_one_line(extra: list[str], needles: list[str]) -> None:
    """In range alone, but a pool whose kernel blocks int32 ids cannot address (tiny-kimi-linear: 2 per block)."""
    assert_one_line_error(run_cli(*PRESET, *extra), "check", *needles)


@pytest.mark.parametrize("flag", ["--prefill-tp", "--decode-tp"])
def test_check_preset_tp_sizes_are_bounded(flag: str) -> None:
    argv = list(PRESET)
    argv[argv.index(flag) + 1] = str(2**40)
    assert_one_line_error(run_cli(*argv), "check", flag, str(2**40), "1024")


# ------------------------------------------------------------------------------------------- demo and regions


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--tokens", str(2**70)], ["--tokens", str(2**70), "1048576"]),
        (["--requests", str(2**62)], ["--requests", str(2**62), "1024"]),
        (["--num-blocks", "0"], ["--num-blocks", "got 0", "131072"]),
        (["--num-blocks", str(2**40)], ["--num-blocks", str(2**40), "131072"]),
        (["--timeout", "nan"], ["--timeout", "nan", "86400"]),
        (["--timeout", "-1"], ["--timeout", "-1", "86400"]),
        (["--timeout", "0"], ["--timeout", "got 0", "86400"]),
        (["--timeout", "1e300"], ["--timeout", "1e+300", "86400"]),
        (["--prefill-tp", str(2**40)], ["--prefill-tp", str(2**40), "16"]),
        (["--seed", "-1"], ["--seed", "-1", str(2**63 - 1)]),
        (["--requests", "1024", "--tokens", "2048"], ["--requests 1024", "--tokens 2048", "1048576"]),
    ],
)
def test_demo_arguments_name_the_value_and_the_limit(extra: list[str], needles: list[str]) -> None:
    assert_one_line_error(run_cli("demo", *extra), "demo", *needles)


@pytest.mark.parametrize(("value", "needle"), [(str(2**70), str(2**70)), ("0", "got 0"), ("x", "'x'")])
def test_regions_count_is_bounded(value: str, needle: str) -> None:
    assert_one_line_error(run_cli("regions", "--regions", value), "regions", "--regions", needle, "4096")


def test_multi_line_errors_are_printed_as_one_line() -> None:
    from hybrid_kv.cli import one_line

    message = "invalid handshake metadata:\n  num_blocks: value 9\n  regions[0]: value 9 blocks\n"
    assert one_line(message) == "invalid handshake metadata: num_blocks: value 9; regions[0]: value 9 blocks"
    assert one_line("plain") == "plain" and one_line("") == ""
