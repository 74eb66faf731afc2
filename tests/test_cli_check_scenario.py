"""``hybrid-kv check SCENARIO.json``: every rank pair handshake-checked, a verdict table, exit 0 only when all pass."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import pytest

from hybrid_kv.cli import main

SCENARIOS = Path(__file__).parent / "data" / "scenarios"


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((SCENARIOS / name).read_text())
    return data


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["check", *argv])
    cap = capsys.readouterr()
    return status, cap.out, cap.err


def write(tmp_path: Path, scenario: dict[str, Any]) -> str:
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario))
    return str(path)


def kimi_pull() -> dict[str, Any]:
    s = load("kimi_tiny_8p2d_push.json")
    s["mode"] = "pull"
    return s


def tp_not_dividing() -> dict[str, Any]:
    """12 temporal heads and 12/12/24 conv channels split over 6 and over 4 ranks, but 6 and 4 do not divide."""
    s = kimi_pull()
    s["model"]["groups"][1]["temporal_shape"] = [12, 2, 2]
    s["prefill"]["tp_size"], s["decode"]["tp_size"] = 6, 4
    return s


def hybrid_mla_mismatch() -> dict[str, Any]:
    """An SSM-only tensor pages at the per-rank state, which the MLA tensors' block-size ratio does not scale."""
    s = kimi_pull()
    s["model"]["tensors"].append({"layers": [{"name": "kda.2", "group": 1}]})
    s["decode"]["logical_block_size"] = 16
    return s


@pytest.mark.parametrize(
    ("name", "pairs"),
    [("gqa_ssm_2p4d_pull.json", 4), ("hybrid_mla_f2.json", 1), ("kimi_tiny_8p2d_push.json", 8)],
)
def test_compatible_examples_exit_0_with_a_row_per_pair(
    name: str, pairs: int, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = run(capsys, str(SCENARIOS / name))
    assert status == 0, out
    assert "COMPATIBLE" in out and "INCOMPATIBLE" not in out
    assert ("the rank pair passes" if pairs == 1 else f"all {pairs} rank pairs pass") + " the handshake checks" in out
    assert out.count("│ compatible") == pairs
    assert "P rank" in out and "D rank" in out and "verdict" in out and "findings" in out


def test_gqa_pull_rows_pair_each_decode_rank_with_its_prefill_rank(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, str(SCENARIOS / "gqa_ssm_2p4d_pull.json"), "--json")
    assert status == 0
    rep = json.loads(out)
    assert [(p["prefill_rank"], p["decode_rank"]) for p in rep["pairs"]] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert rep["summary"]["compatible"] is True and rep["summary"]["transfers"] == 4
    assert rep["mode"] == "pull" and rep["local_side"] == "decode" and rep["tp"] == [2, 4]


def test_tp_sizes_that_do_not_divide_fail_every_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, write(tmp_path, tp_not_dividing()))
    assert status == 1, out
    assert "INCOMPATIBLE" in out and "4 of 4 rank pairs fail with 4 findings" in out
    assert out.count("tp_divisibility: local 4, remote 6") == 4
    assert out.count("│ incompatible") == 4


def test_every_finding_of_a_pair_is_listed_with_both_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, write(tmp_path, hybrid_mla_mismatch()))
    assert status == 1
    assert out.count("hybrid_mla_block_len: local [256, 256, 208], remote [128, 128, 52]") == 8
    # TP 3 against 2 as well: both findings on each pair, one per line.
    s = hybrid_mla_mismatch()
    s["model"]["groups"][1]["temporal_shape"] = [12, 2, 2]
    s["prefill"]["tp_size"], s["prefill"]["logical_block_size"] = 3, 16
    status, out, _ = run(capsys, write(tmp_path, s))
    assert status == 1
    assert out.count("tp_divisibility: local 2, remote 3") == 2
    assert out.count("hybrid_mla_block_len: local [256, 256, 240], remote [128, 128, 80]") == 2
    status, out, _ = run(capsys, write(tmp_path, s), "--json")
    assert status == 1
    rep = json.loads(out)
    for pair in rep["pairs"]:
        assert pair["verdict"] == "incompatible"
        assert [(f["check"], f["local"], f["remote"]) for f in pair["findings"]] == [
            ("tp_divisibility", "2", "3"),
            ("hybrid_mla_block_len", "[256, 256, 240]", "[128, 128, 80]"),
        ]
    assert rep["summary"] | {"compatible": False, "incompatible_pairs": 2} == rep["summary"]


def test_heads_major_pages_with_different_kernel_blocks_are_compatible(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 32-token decode pages against 16-token prefill pages of 2 KV heads per rank: cut per (head, unit)
    s = load("gqa_ssm_2p4d_pull.json")
    s["decode"]["logical_block_size"] = s["decode"]["kernel_block_size"] = 32
    status, out, _ = run(capsys, write(tmp_path, s), "--json")
    assert status == 0, out
    rep = json.loads(out)
    assert all(pair["findings"] == [] for pair in rep["pairs"]), rep["pairs"]
    assert rep["summary"]["incompatible_pairs"] == 0


def test_an_unplannable_request_names_both_lengths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = load("hybrid_mla_f2.json")
    s["decode"]["num_blocks"] = 8  # room for ids no other group names (the groups share tensors)
    s["requests"][0]["decode"][1] = [4, 5, 6]
    status, out, _ = run(capsys, write(tmp_path, s))
    assert status == 1
    assert "plan_request: local 3 states, remote 1 states" in out and "request req-0" in out


def test_json_report_parses(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, str(SCENARIOS / "hybrid_mla_f2.json"), "--json")
    assert status == 0
    rep = json.loads(out)
    assert set(rep) == {"name", "mode", "local_side", "tp", "pairs", "summary", "compatible", "reasons"}
    assert rep["compatible"] is True and rep["reasons"] == []
    assert rep["pairs"] == [
        {
            "prefill_rank": 0,
            "decode_rank": 0,
            "local_rank": 0,
            "remote_rank": 0,
            "verdict": "compatible",
            "findings": [],
        }
    ]
    assert rep["summary"]["plans"] == 1 and rep["summary"]["bytes"] > 0


def test_scenario_from_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO((SCENARIOS / "hybrid_mla_f2.json").read_text()))
    status, out, _ = run(capsys, "-")
    assert status == 0 and "COMPATIBLE" in out


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda s: s.update(modes="pull"), "unknown field `modes`"),
        (lambda s: s.update(prefill=3), "invalid type"),
    ],
)
def test_malformed_scenarios_are_one_line_errors(
    edit: Any, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = copy.deepcopy(load("hybrid_mla_f2.json"))
    edit(s)
    status, out, err = run(capsys, write(tmp_path, s))
    assert status == 2 and out == ""
    assert err.startswith("hybrid-kv check: error:") and err.count("\n") == 1 and needle in err, err
    assert "Traceback" not in err


def test_not_json_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    status, _, err = run(capsys, str(path))
    assert status == 2 and err.count("\n") == 1 and "scenario JSON" in err and "Traceback" not in err


def test_an_engine_the_tp_size_cannot_split_is_incompatible_as_check_preset_reports_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Not a malformed file: the deployment is incompatible, exit 1, with the verdict and the reason at the top
    # of the JSON, the same keys as `check --preset` (which reports the same kind of problem the same way).
    s = copy.deepcopy(load("hybrid_mla_f2.json"))
    s["prefill"]["tp_size"] = 3
    path = write(tmp_path, s)
    status, out, err = run(capsys, path)
    assert status == 1 and err == "" and "INCOMPATIBLE" in out and "must all divide by" in out
    status, out, _ = run(capsys, path, "--json")
    report = json.loads(out)
    assert status == 1 and report["compatible"] is False and report["pairs"] == []
    assert len(report["reasons"]) == 1 and "must all divide by prefill TP 3" in report["reasons"][0]
    status, out, _ = run(capsys, "--preset", "tiny-qwen3-next", "--prefill-tp", "3", "--decode-tp", "1", "--json")
    preset = json.loads(out)
    assert status == 1 and preset["compatible"] is False and "does not divide" in preset["reasons"][0]
    assert {"compatible", "reasons"} <= set(report) & set(preset)


def test_incompatible_pairs_are_listed_as_reasons_at_the_top(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = run(capsys, write(tmp_path, tp_not_dividing()), "--json")
    report = json.loads(out)
    assert status == 1 and report["compatible"] is False
    assert report["reasons"] and all(r.startswith("prefill rank ") for r in report["reasons"])
    assert sum(len(p["findings"]) for p in report["pairs"]) == len(report["reasons"])
