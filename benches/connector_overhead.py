"""Per-request Python time of hybrid-kv's vLLM connector against the transfer time, side by side in one run.

The Kimi-Linear seed case (tiny-kimi-linear shapes, MLA + KDA in shared HMA tensors), pull, prefill TP 1 ->
decode TP 2 and TP 2 -> TP 1, driven by vLLM 0.33's real Scheduler with one process per TP worker and real
NIXL transfers of CPU tensors (the harness of ``tests/integrations``). A warm-up round connects the engines
(the handshake runs on a background thread and is not counted); then ``--requests`` requests are moved and:

- scheduler half: Python time in the connector's scheduler hooks of both engines (``scheduler_s``:
  ``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``, ``request_finished``);
- worker half: Python time in the worker hooks of every worker of both engines (``worker_s``: ``start_load_kv``,
  ``get_finished`` with its polling, leases and releases), summed over every step of the round;
- worker steps: the harness's whole per-step worker call (bind metadata, ``start_load_kv``, ``wait_for_save``,
  ``get_transfer_results``, ``get_block_ids_with_load_errors``, ``get_kv_connector_stats``), summed;
- transfer: NIXL's telemetry per request and decode rank (post to completion of its longest transfer).

Overheads are per request (totals / requests); the ratio is overhead / mean transfer time. Not a timed test.

Run (vLLM venv), from the repository root:
``PYTHONPATH=python:tests:tests/integrations ~/.venvs/hybrid-kv-vllm/bin/python benches/connector_overhead.py``
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HYBRID_KV_SECRET", "hybrid-kv-connector-overhead-bench")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from vllm_harness import Engine, EngineSpec, prompt, run_until, side_channel_ports, write_model_dirs  # noqa: E402

PARTS = ("worker_post_s", "worker_control_s", "worker_poll_s")  # parts of the worker half (stats.TIMERS)
PREFILL_BATCH = 4  # requests per prefill step: 4 x at most 955 tokens stay under the 4096-token budget


def _prefilled(p: Engine, names: list[str]) -> bool:
    return all(f"p-{n}" in p.outputs for n in names)


def _round(p: Engine, d: Engine, tag: str, lengths: list[int]) -> None:
    """Prefill ``lengths`` in batches that fit one step's token budget (the harness samples a token for every
    scheduled request, so a chunked prefill would finish early), then load them all on the decode at once."""
    names = [f"{tag}-{i}" for i in range(len(lengths))]
    for k in range(0, len(names), PREFILL_BATCH):
        batch = names[k : k + PREFILL_BATCH]
        for i, name in enumerate(batch, start=k):
            p.add(f"p-{name}", prompt(i, lengths[i]), {"do_remote_decode": True}, i)
        run_until([p], functools.partial(_prefilled, p, batch))
    for i, (name, n) in enumerate(zip(names, lengths, strict=True)):
        d.add(f"d-{name}", prompt(i, n), dict(p.outputs[f"p-{name}"]), i)
    run_until([p, d], lambda: all(f"d-{n}" in d.outputs for n in names) and p.idle() and d.idle(), 300)


def _sched_s(e: Engine) -> float:
    return float(e.connector.scheduler.stats.data["scheduler_s"])


def _reset(e: Engine) -> None:
    e.stats.clear()
    e.worker_step_s = 0.0


def measure(model_dir: str, p_tp: int, d_tp: int, requests: int) -> dict[str, Any]:
    p_port, d_port = side_channel_ports(2)
    p = Engine.start(EngineSpec("prefill", "kimi", model_dir, p_tp, "pull", p_port, num_blocks=1024))
    d = Engine.start(EngineSpec("decode", "kimi", model_dir, d_tp, "pull", d_port, num_blocks=1024))
    try:
        _round(p, d, "warm", [300, 517])
        for e in (p, d):
            _reset(e)
        s0 = _sched_s(p) + _sched_s(d)
        lengths = [256 + (i * 97) % 700 for i in range(requests)]
        _round(p, d, "run", lengths)
        sched = _sched_s(p) + _sched_s(d) - s0
        worker = sum(s["worker_s"] for e in (p, d) for s in e.stats)
        parts = {k: sum(s[k] for e in (p, d) for s in e.stats) for k in PARTS}
        nixl_post = sum(t for s in d.stats for t in s["post_time_s"])
        steps = p.worker_step_s + d.worker_step_s
        xfer = [t for s in d.stats for t in s["xfer_time_s"]]
        nbytes = [b for s in d.stats for b in s["bytes"]]
        desc = [n for s in d.stats for n in s["descriptors"]]
        claims = [t for s in d.stats for t in s.get("claim_time_s", [])]
        assert len(xfer) == requests * d_tp, (len(xfer), requests, d_tp)
        mean_xfer = statistics.fmean(xfer)
        return {
            "case": f"P TP{p_tp} -> D TP{d_tp}",
            "requests": requests,
            "sched_us": sched / requests * 1e6,
            "worker_us": worker / requests * 1e6,
            "steps_us": steps / requests * 1e6,
            "xfer_us": mean_xfer * 1e6,
            "xfer_median_us": statistics.median(xfer) * 1e6,
            "kib": statistics.fmean(nbytes) / 1024,
            "descriptors": statistics.fmean(desc),
            "ratio": (sched + worker) / requests / mean_xfer,
            **{k: v / requests * 1e6 for k, v in parts.items()},
            "nixl_post_us": nixl_post / requests * 1e6,
            "rest_us": (worker - sum(parts.values())) / requests * 1e6,
            "ratio_steps": (sched + steps) / requests / mean_xfer,
            "claim_median_us": statistics.median(claims) * 1e6 if claims else 0.0,
            "claim_p90_us": sorted(claims)[int(0.9 * (len(claims) - 1))] * 1e6 if claims else 0.0,
        }
    finally:
        p.close()
        d.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16, help="requests in the measured round (default 16)")
    args = ap.parse_args()
    dirs = write_model_dirs(Path(tempfile.mkdtemp(prefix="hkv-overhead-")))
    rows = [measure(dirs["kimi"], p_tp, d_tp, args.requests) for p_tp, d_tp in ((1, 2), (2, 1))]
    print(
        "| case | requests | KiB per request and decode rank | descriptors (NIXL) | transfer (mean / median) "
        "| scheduler half | worker half (hooks) | overhead / transfer | worker steps (whole call) "
        "| (scheduler + steps) / transfer |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['requests']} | {r['kib']:.1f} | {r['descriptors']:.1f} "
            f"| {r['xfer_us']:.0f} / {r['xfer_median_us']:.0f} us | {r['sched_us']:.0f} us "
            f"| {r['worker_us']:.0f} us | {r['ratio']:.2f}x | {r['steps_us']:.0f} us | {r['ratio_steps']:.2f}x |"
        )
    print()
    print(
        "| case | worker half per request | Endpoint.post (NIXL posting in it) | control messages "
        "| Endpoint.poll | the rest (planning, bookkeeping) | lease claim round trip (median / p90) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['worker_us']:.0f} us | {r['worker_post_s']:.0f} us ({r['nixl_post_us']:.0f} us) "
            f"| {r['worker_control_s']:.0f} us | {r['worker_poll_s']:.0f} us | {r['rest_us']:.0f} us "
            f"| {r['claim_median_us']:.0f} / {r['claim_p90_us']:.0f} us |"
        )


if __name__ == "__main__":
    main()
