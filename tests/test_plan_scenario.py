"""Scenario files: the JSON Schema, ``plan_scenario`` and the ``hybrid-kv plan`` subcommand."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from hybrid_kv import LayoutError, PlanError
from hybrid_kv._core import plan_scenario
from hybrid_kv.cli import main

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "schemas" / "scenario.schema.json").read_text())
SCENARIOS = sorted((ROOT / "tests" / "data" / "scenarios").glob("*.json"))


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_example_scenarios_validate_and_plan(path: Path) -> None:
    text = path.read_text()
    jsonschema.validate(json.loads(text), SCHEMA)
    report = plan_scenario(text)
    assert report["requests"]
    for req in report["requests"]:
        for rank in req["ranks"]:
            for t in rank["transfers"]:
                assert len(t["local_ids"]) == len(t["remote_ids"]) == len(t["moves"])
                assert t["bytes"] == sum(m[2] for m in t["moves"])


def test_f2_scenario_report() -> None:
    text = (ROOT / "tests/data/scenarios/hybrid_mla_f2.json").read_text()
    report = plan_scenario(text, moves=False, coalesce=False)
    t = report["requests"][0]["ranks"][0]["transfers"][0]
    assert t["local_ids"][:6] == [3, 4, 5, 15, 16, 17] and t["moves"] == []
    assert (report["mode"], report["local_side"], report["tp"]) == ("pull", "decode", [1, 1])
    # Coalesced (the default): each MLA run 3,4,5 is odd, so it keeps its plain ids (NIXL merges them either
    # way); equal TP makes each of the 2 x 2 KDA states one whole-state id instead of four pieces.
    c = plan_scenario(text, moves=False)["requests"][0]["ranks"][0]["transfers"][0]
    assert c["local_ids"][:6] == t["local_ids"][:6] and (len(c["local_ids"]), len(t["local_ids"])) == (10, 22)
    assert c["bytes"] == t["bytes"]


def test_schema_and_parser_agree_on_unknown_fields() -> None:
    doc = json.loads(SCENARIOS[0].read_text())
    doc["prefill"]["tp"] = 2
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMA)
    with pytest.raises(PlanError, match="unknown field `tp`"):
        plan_scenario(json.dumps(doc))


def test_scenario_errors_map_to_python_exceptions() -> None:
    doc = json.loads((ROOT / "tests/data/scenarios/hybrid_mla_f2.json").read_text())
    doc["decode"]["logical_block_size"] = 4
    with pytest.raises(PlanError, match="does not fit the attention page"):
        plan_scenario(json.dumps(doc))
    doc = json.loads((ROOT / "tests/data/scenarios/hybrid_mla_f2.json").read_text())
    doc["decode"]["kernel_block_size"] = 5
    with pytest.raises(LayoutError, match="kernel block size 5 does not divide logical block size 12"):
        plan_scenario(json.dumps(doc))


def test_cli_plan_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(ROOT / "tests/data/scenarios/kimi_tiny_8p2d_push.json")
    assert main(["plan", path, "--json", "--compact"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["local_side"] == "prefill" and len(report["requests"][0]["ranks"]) == 8
    assert main(["plan", path]) == 0
    assert "prefill ranks post the transfers" in capsys.readouterr().out


def test_cli_plan_reports_errors_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": {}}')
    assert main(["plan", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybrid-kv plan: error: scenario JSON:") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("field", "value", "limit_name"),
    [
        ("tp_size", 1025, "MAX_TP_SIZE"),
        ("num_blocks", 2**31, "MAX_NUM_BLOCKS"),
        ("kernel_block_size", 2**20 + 1, "MAX_BLOCK_TOKENS"),
    ],
)
def test_cli_limits_mirror_the_scenario_parser(field: str, value: int, limit_name: str) -> None:
    """The CLI's bounds (``cli/_args.py``) are the parser's (``rust/core``): one value over, the same limit named."""
    from hybrid_kv.cli import _args

    s = json.loads((ROOT / "tests/data/scenarios/hybrid_mla_f2.json").read_text())
    s["decode"][field] = value
    with pytest.raises(PlanError) as e:
        plan_scenario(json.dumps(s))
    limit = getattr(_args, limit_name)
    assert str(e.value) == f"scenario: decode.{field} is {value}, over the limit of {limit}"
    assert value == limit + 1
