"""The demo: its content model (pure), request allocation, and ``hybrid-kv demo`` end to end over real NIXL."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from hybrid_kv import LayoutError
from hybrid_kv.cli import main
from hybrid_kv.demo.content import Content, Side, expect_decode, fill_prefill, first_mismatch, kernel_ids
from hybrid_kv.demo.run import DemoConfig, make_requests


def sides(cfg: DemoConfig) -> tuple[Side, Side]:
    return cfg.validate()


def pools_of(side: Side, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, side.num_blocks * side.geometry.page_bytes, dtype=np.uint8) for _ in range(3)]


def simulate(
    prefill: Side, decode: Side, p_pools: list[list[np.ndarray]], d_pool: list[np.ndarray], d_rank: int, reqs: list
) -> None:
    """Move bytes the way docs/byte-layouts.md says, independently of ``expect_decode``: attention kernel pages whole
    from prefill rank 0 (MLA), SSM sub-streams from every prefill rank whose shard overlaps (P TP >= D TP)."""
    pg, dg = prefill.geometry, decode.geometry
    s = prefill.preset.ssm
    assert s is not None and pg.kernel_page_bytes == dg.kernel_page_bytes
    ratio = prefill.tp // decode.tp
    for req in reqs:
        for g, kind in enumerate(prefill.preset.group_kinds()):
            for region in range(3):
                src0, dst = p_pools[0][region], d_pool[region]
                if kind != "ssm":
                    kp = pg.kernel_page_bytes
                    pk, dk = kernel_ids(req.prefill_ids[g], pg.ppl), kernel_ids(req.decode_ids[g], dg.ppl)
                    for a, b in zip(pk, dk, strict=False):  # front-aligned, shorter list bounds
                        dst[b * kp : (b + 1) * kp] = src0[a * kp : (a + 1) * kp]
                    continue
                (pb,), (db,) = req.prefill_ids[g], req.decode_ids[g]
                d_off = db * dg.page_bytes
                p_streams = [c // prefill.tp * s.conv_rows * s.conv_dtype_bytes for c in s.conv_proj_dims]
                p_streams.append(pg.temporal_bytes)
                for i, n in enumerate(p_streams):
                    for k in range(ratio):
                        src = p_pools[d_rank * ratio + k][region]
                        p_off = pb * pg.page_bytes + sum(p_streams[:i])
                        dst[d_off : d_off + n] = src[p_off : p_off + n]
                        d_off += n


@pytest.mark.parametrize(("ptp", "dtp"), [(1, 1), (2, 1), (4, 2), (4, 1)])
def test_content_model_matches_an_independent_byte_simulation(ptp: int, dtp: int) -> None:
    cfg = DemoConfig(prefill_tp=ptp, decode_tp=dtp, requests=3, tokens=150)
    prefill, decode = sides(cfg)
    reqs = make_requests(cfg, prefill, decode)
    contents = [Content(prefill.preset, 5, r.index, r.content_tokens) for r in reqs]
    p_pools = [pools_of(prefill, 100 + r) for r in range(ptp)]
    for r in range(ptp):
        for req, c in zip(reqs, contents, strict=True):
            fill_prefill(p_pools[r], prefill, r, req, c, 5)
    for d in range(dtp):
        before = pools_of(decode, 200 + d)
        want = expect_decode(before, decode, prefill, d, reqs, contents)
        got = [p.copy() for p in before]
        simulate(prefill, decode, p_pools, got, d, reqs)
        assert first_mismatch(got, want, decode) is None
        assert first_mismatch(before, want, decode) is not None  # the requests do change decode memory
        got[1][5] ^= 1
        assert "1 bytes differ in tensor 1" in (first_mismatch(got, want, decode) or "")


def test_requests_get_disjoint_ids_with_holes_between_them() -> None:
    cfg = DemoConfig(requests=4, tokens=100)
    prefill, decode = sides(cfg)
    reqs = make_requests(cfg, prefill, decode)
    for side_ids, side in ((lambda r: r.prefill_ids, prefill), (lambda r: r.decode_ids, decode)):
        flat = [b for r in reqs for g in side_ids(r) for b in g]
        assert len(flat) == len(set(flat)) and max(flat) < side.num_blocks
        assert len(flat) < max(flat) + 1  # some blocks stay unallocated
    assert [r.tokens for r in reqs] == [100, 88, 75, 63]
    assert all(
        len(g) == 1 for r in reqs for g, k in zip(r.decode_ids, decode.preset.group_kinds(), strict=True) if k == "ssm"
    )


def test_bad_configs_fail_before_any_process_starts() -> None:
    with pytest.raises(
        LayoutError, match="decode TP size 3 does not divide num_attention_heads=4, .*conv channels 64$"
    ):
        DemoConfig(prefill_tp=2, decode_tp=3).validate()
    with pytest.raises(LayoutError, match="decode TP size 8 does not divide"):
        DemoConfig(decode_tp=8).validate()
    with pytest.raises(LayoutError, match="unknown preset"):
        DemoConfig(preset="nope").validate()
    with pytest.raises(LayoutError, match="too small for the batch"):
        cfg = DemoConfig(num_blocks=3)
        make_requests(cfg, *cfg.validate())


def test_split_cores_gives_each_side_half_of_the_usable_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    import hybrid_kv.demo.run as run

    monkeypatch.setattr(run.os, "sched_getaffinity", lambda pid: {5, 1, 3, 7, 9})
    assert run.core_share("prefill") == (1, 3) and run.core_share("decode") == (5, 7, 9)
    monkeypatch.setattr(run.os, "sched_getaffinity", lambda pid: {4})
    with pytest.raises(LayoutError, match="split_cores needs 2 cores, this process may use 1"):
        DemoConfig(split_cores=True).validate()


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="--split-cores needs 2 usable cores")
def test_a_run_with_split_cores_is_verified(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--split-cores", "--requests", "4", "--tokens", "300", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["verified"] and res["problems"] == [] and res["config"]["split_cores"] is True


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--preset", "nope"],
        ["demo", "--prefill-tp", "3"],
        ["demo", "--decode-tp", "0"],
        ["demo", "--requests", "0"],
    ],
)
def test_bad_arguments_are_one_line_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybrid-kv demo: error:") and err.count("\n") == 1, err


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "--prefill-tp" in out and "tiny-kimi-linear" in out


# ---------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_the_readme_command_runs_to_a_verified_success(capsys: pytest.CaptureFixture[str]) -> None:
    """``hybrid-kv demo`` with no arguments: tiny Kimi-Linear, prefill TP 2 -> decode TP 1, pull, real NIXL."""
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "prefill TP 2 -> decode TP 1, pull" in out
    assert "decode-0 <-> prefill [0, 1]" in out  # the SSM shards come from both prefill ranks
    assert "VERIFIED: every byte of the decode rank's memory matches the logical model" in out
    for key in ("bytes moved", "descriptors posted", "planning", "transfer", "memcpy"):
        assert key in out
    # the phases of the transfer each on its line with its own throughput (the default verifies every request);
    # rich wraps long lines, so they are read with their whitespace collapsed
    flat = " ".join(out.split())
    claims = r" lease claims [\d.]+ (ms|µs) in the slowest decode rank: one message per prefill rank"
    assert re.search(claims, flat), out
    transfer = r" transfer [\d.]+ (ms|µs) in the slowest rank: [\d.]+ GB/s \([\d.]+ (ms|µs) with the claims and digests"
    assert re.search(transfer, flat), out
    posted = re.search(r" descriptors posted (\d+) by NIXL", flat)
    assert posted, out
    floor = rf" NIXL floor [\d.]+ (ms|µs): [\d.]+ GB/s, the same {posted[1]} descriptors posted with bare NIXL calls"
    assert re.search(floor, flat), out
    assert re.search(r" memcpy one contiguous memcpy of the same bytes: [\d.]+ GB/s", flat), out
    digests = (
        r" verify=all: 16 requests checked on the decode ranks, no mismatch .* 14\.3 MiB digested in [\d.]+ (ms|µs) "
        r"by the slowest decode rank \([\d.]+ GB/s\) and in [\d.]+ (ms|µs) by the slowest prefill rank while the "
        r"READs ran \(the decode's checks waited [\d.]+ (ms|µs) for them after the last request landed\), no round "
        r"trip of its own; added [\d.]+ (ms|µs): \+\d+% to the transfer phase, \+\d+% to the transfer alone"
    )
    assert re.search(digests, flat), out


@pytest.mark.slow
def test_push_into_more_decode_ranks_of_a_gqa_model_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--preset", "tiny-qwen3-next", "--prefill-tp", "1", "--decode-tp", "2", "--mode", "push"]
    assert main([*argv, "--requests", "4", "--tokens", "300", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["verified"] and res["problems"] == []
    assert res["peers"] == {"prefill-0": [0, 1]}
    assert res["requests"] == 4 and res["bytes_moved"] > 0 and res["descriptors"] > 0
    # what NIXL posted (telemetry, after merging consecutive ids) is never more than the ids handed to it
    assert res["descriptors"] <= res["descriptor_ids"]
    # the NIXL floor posted the very same descriptors again (NIXL's own count), after the bytes were verified
    assert res["floor_descriptors"] == res["descriptors"] and res["floor_s"] > 0
    assert 0 < res["transfer_s"] <= res["transfer_total_s"] and res["verified_bytes"] == res["bytes_moved"]
    decode_ranks, tensors = 2, 2  # every byte of both decode ranks' pools is compared
    assert res["bytes_verified"] == decode_ranks * tensors * res["decode"]["num_blocks"] * res["decode"]["page_bytes"]


@pytest.mark.slow
def test_a_corrupted_byte_fails_verification_with_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--requests", "2", "--tokens", "100", "--inject-corruption"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "1 bytes differ in tensor 0" in out


@pytest.mark.slow
def test_phase_timings_add_up_to_the_total_and_every_phase_is_named() -> None:
    """Each phase timed under its own name, the phases plus ``other`` are the total, ``--json`` agrees."""
    from hybrid_kv.cli.demo import PHASE_NAMES
    from hybrid_kv.demo.run import PHASES

    entry = "import sys; from hybrid_kv.cli import main; sys.exit(main())"  # the console script's entry point
    argv = [sys.executable, "-c", entry, "demo", "--requests", "4", "--tokens", "300"]
    res = json.loads(subprocess.run([*argv, "--json"], capture_output=True, text=True, check=True).stdout)
    phases = res["phases"]
    assert list(phases) == list(PHASES)
    assert all(v >= 0 for v in phases.values()) and phases["startup"] > 0 and phases["shutdown"] > 0
    assert res["other_s"] >= 0 and res["total_s"] > 0
    assert sum(phases.values()) + res["other_s"] == pytest.approx(res["total_s"], abs=1e-6)
    assert res["other_s"] <= max(0.5, 0.1 * res["total_s"])  # the remainder stays small: nothing hides there
    assert res["startup_s"] == phases["startup"]
    human = subprocess.run(argv, capture_output=True, text=True, check=True)
    assert "0/?" not in human.stdout + human.stderr
    for phase in PHASES:
        assert f"  {PHASE_NAMES[phase]} " in human.stdout, phase
    assert "  other " in human.stdout and "  total " in human.stdout
