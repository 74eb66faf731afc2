"""``hybrid-kv check --preset``: the pre-flight report of a real deployment (exit codes, key lines, --json)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hybrid_kv.cli import main
from hybrid_kv.preflight import preflight


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["check", *argv])
    cap = capsys.readouterr()
    return status, cap.out, cap.err


def test_kimi_linear_8p1d_is_compatible_and_reports_every_rank(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "--preset", "kimi-linear-48b-a3b", "--prefill-tp", "8", "--decode-tp", "1")
    assert status == 0, out
    assert "COMPATIBLE" in out and "INCOMPATIBLE" not in out
    assert "logical block 256 tokens = 4 x 64-token kernel blocks" in out  # prefill TP 8
    assert "logical block 1920 tokens = 30 x 64-token kernel blocks" in out  # decode TP 1
    assert "decode 0 *" in out and "prefill 7" in out


def test_json_report_parses_with_peers_tables_and_request_costs(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys, "--preset", "kimi-linear-48b-a3b", "--prefill-tp", "4", "--decode-tp", "1", "--tokens", "8000", "--json"
    )
    assert status == 0
    rep = json.loads(out)
    assert rep["compatible"] is True and rep["reasons"] == []
    ranks = {(r["role"], r["rank"]): r for r in rep["ranks"]}
    d0 = ranks[("decode", 0)]
    assert d0["posts"] and d0["peers"] == [0, 1, 2, 3]  # SSM shards come from every prefill rank
    assert d0["regions"] == 7 and d0["request_descriptors"] > 0 and d0["request_bytes"] > 0
    assert set(d0["remote_descriptors"]) == {"0", "1", "2", "3"}
    assert all(0 in ranks[("prefill", p)]["peers"] for p in range(4))
    assert rep["prefill"]["tp"] == 4 and rep["decode"]["logical_block_size"] == 1920


def test_deepseek_v3_at_block_16_warns_descriptor_bound(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys,
        "--preset", "deepseek-v3", "--prefill-tp", "1", "--decode-tp", "1",
        "--prefill-block-size", "16", "--decode-block-size", "16", "--num-blocks", "4000", "--json",
        "--no-coalesce",
    )  # fmt: skip
    assert status == 0
    rep = json.loads(out)
    assert any("descriptor-bound" in w for w in rep["warnings"]), rep["warnings"]
    d0 = next(r for r in rep["ranks"] if r["role"] == "decode")
    assert d0["request_descriptors"] == 61 * 2048  # 61 regions x 32768/16 kernel blocks


def test_deepseek_v3_at_block_16_coalesced_is_not_descriptor_bound(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--preset", "deepseek-v3", "--prefill-tp", "1", "--decode-tp", "1", "--prefill-block-size", "16"]
    args += ["--decode-block-size", "16", "--num-blocks", "4000", "--json"]
    reports = []
    for extra in ([], ["--no-coalesce"]):
        status, out, _ = run(capsys, *args, *extra)
        assert status == 0
        reports.append(json.loads(out))
    coalesced, reference = reports
    assert not any("descriptor-bound" in w for w in coalesced["warnings"]), coalesced["warnings"]
    d0, r0 = (next(r for r in rep["ranks"] if r["role"] == "decode") for rep in reports)
    assert d0["request_descriptors"] == 61 * 2048 // 64  # one 64-block chunk per 64 kernel blocks
    assert d0["request_bytes"] == r0["request_bytes"]


def test_incompatible_deployment_is_a_report_with_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "--preset", "qwen3.5-27b", "--prefill-tp", "3", "--decode-tp", "1")
    assert status == 1
    assert "INCOMPATIBLE" in out and "prefill TP size 3 does not divide" in out
    rep = preflight("qwen3.5-27b", 3, 1)
    assert not rep.compatible and rep.ranks == []


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--preset", "llama-7b", "--prefill-tp", "1", "--decode-tp", "1"], "unknown preset 'llama-7b'"),
        (["--preset", "deepseek-v3", "--prefill-tp", "1"], "--preset needs --prefill-tp and --decode-tp"),
        (
            ["--preset", "deepseek-v3", "--prefill-tp", "0", "--decode-tp", "1"],
            "argument --prefill-tp: must be an integer in [1, 1024], got 0",
        ),
        (
            ["--preset", "deepseek-v3", "--prefill-tp", "1", "--decode-tp", "1", "--tokens", "0"],
            "argument --tokens: must be an integer in [1, 16777216], got 0",
        ),
    ],
)
def test_bad_arguments_are_one_line_errors(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, *argv)
    assert status == 2
    assert err.startswith("hybrid-kv check: error:") and err.count("\n") == 1 and needle in err, err


def test_help_lists_presets_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["check", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--preset" in out and "kimi-linear-48b-a3b" in out and "--prefill-tp 8 --decode-tp 1" in out


def test_scenario_files_from_a_preset_and_malformed_ones(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from hybrid_kv.presets import get_preset

    good = tmp_path / "kimi.json"
    good.write_text(json.dumps(get_preset("tiny-kimi-linear").scenario(2, 1)))
    status, out, _ = run(capsys, str(good))
    assert status == 0 and "COMPATIBLE" in out
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": {"groups": [], "tensors": []}, "prefill": 3}')
    status, _, err = run(capsys, str(bad))
    assert status == 2 and err.startswith("hybrid-kv check: error:") and err.count("\n") == 1, err
    status, _, err = run(capsys, str(tmp_path / "missing.json"))
    assert status == 2 and "missing.json" in err and err.count("\n") == 1
    status, _, err = run(capsys)
    assert status == 2 and "give a scenario file or --preset" in err
