"""The ``regions`` subcommand: exit codes, key output lines, --json."""

from __future__ import annotations

import json

import pytest

from hybrid_kv.cli import main


def test_regions_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["regions"]) == 0
    out = capsys.readouterr().out
    assert "56 descriptors (24 attention + 32 SSM) in 10 strided rows" in out
    assert "kda_a.0" in out and "shared" in out


def test_regions_json_parses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["regions", "--regions", "3", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [r["is_mla"] for r in info["regions"]] == [True, True, True]


def test_zero_regions_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["regions", "--regions", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybrid-kv regions: error:") and err.count("\n") == 1
