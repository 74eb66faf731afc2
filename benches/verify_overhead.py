"""What ``verify=all`` adds to the demo's transfer phase, side by side with ``verify=off``, per preset and size.

Each round runs the demo (real rank processes, real NIXL over host memory) once with ``verify=off`` and once with
``verify=all`` (in alternating order), the same preset, TP sizes and batch; a run's transfer phase is the slowest
posting rank's time from its claims to its last request done, with its digests (the lease claims happen in both:
the connector claims every lease before its READs; a verified request's prefill digests follow the claim's answer
while the READs run). Reports medians over the rounds and their ratio, with the decode's and the prefill's digest
times and how long the decode's checks waited for the prefill's digests, and the median (and range) of each
round's own ratio (its two runs ran back to back, so a ratio cancels what the machine did meanwhile).

    python benches/verify_overhead.py --rounds 5 [--presets tiny-kimi-linear,tiny-qwen3-next] [--tokens 1000,4000]
        [--split-cores]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from hybrid_kv.demo.run import DemoConfig, run_demo


def one(preset: str, tokens: int, requests: int, verify: str, start_method: str, split: bool) -> dict[str, float]:
    cfg = DemoConfig(
        preset=preset, tokens=tokens, requests=requests, verify=verify, start_method=start_method, split_cores=split
    )
    res = run_demo(cfg)
    if not res.verified:
        raise SystemExit(f"{preset} {tokens} tokens verify={verify}: not verified: {res.problems[:3]}")
    return {
        "phase_s": res.transfer_total_s,
        "transfer_s": res.transfer_s,
        "claim_s": res.claim_s,
        "digest_s": res.digest_s,
        "peer_digest_s": res.peer_digest_s,
        "wait_s": res.digest_wait_s,
        "bytes": res.bytes_moved,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="tiny-kimi-linear,tiny-qwen3-next,tiny-deepseek-v3")
    ap.add_argument("--tokens", default="1000,4000", help="prompt lengths of the batch's largest request")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--start-method", default="forkserver", choices=("spawn", "forkserver"))
    ap.add_argument(
        "--split-cores", action="store_true", help="prefill and decode ranks on cores of their own (the demo's option)"
    )
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows = []
    print(
        "| preset | tokens | MiB | transfer phase, off | verify=all | added | added per round [range] | decode digests "
        "| prefill digests | decode waited for them |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for preset in args.presets.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            runs: dict[str, list[dict[str, float]]] = {"off": [], "all": []}
            for k in range(args.rounds):
                for verify in ("off", "all") if k % 2 == 0 else ("all", "off"):
                    runs[verify].append(one(preset, tokens, args.requests, verify, args.start_method, args.split_cores))

            def med(v: str, key: str, runs: dict[str, list[dict[str, float]]] = runs) -> float:
                return statistics.median(r[key] for r in runs[v])

            off, on = med("off", "phase_s"), med("all", "phase_s")
            # each round's pair ran back to back: its ratio cancels what the machine did meanwhile
            paired = sorted(a["phase_s"] / b["phase_s"] - 1 for a, b in zip(runs["all"], runs["off"], strict=True))
            row = {
                "preset": preset,
                "tokens": tokens,
                "mib": runs["off"][0]["bytes"] / 2**20,
                "off_ms": off * 1e3,
                "all_ms": on * 1e3,
                "added": on / off - 1,
                "added_paired": statistics.median(paired),
                "added_paired_range": [paired[0], paired[-1]],
                "decode_digest_ms": med("all", "digest_s") * 1e3,
                "prefill_digest_ms": med("all", "peer_digest_s") * 1e3,
                "wait_ms": med("all", "wait_s") * 1e3,
            }
            rows.append(row)
            print(
                f"| {preset} | {tokens} | {row['mib']:.1f} | {row['off_ms']:.1f} ms | {row['all_ms']:.1f} ms | "
                f"{row['added']:+.0%} | {row['added_paired']:+.0%} [{paired[0]:+.0%} to {paired[-1]:+.0%}] | "
                f"{row['decode_digest_ms']:.1f} ms | {row['prefill_digest_ms']:.1f} ms | "
                f"{row['wait_ms']:.1f} ms |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
