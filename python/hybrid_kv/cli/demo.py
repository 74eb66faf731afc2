"""``hybrid-kv demo``: real P/D transfers of a model preset between rank processes, every decode byte verified."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..errors import CliError
from . import require
from ._args import MAX_BLOCK_TOKENS, int_in, positive_float, positive_int
from ._console import console as make_console
from ._console import count

__all__ = [
    "EXAMPLES",
    "MAX_DEMO_BATCH_TOKENS",
    "MAX_DEMO_NUM_BLOCKS",
    "MAX_DEMO_REQUESTS",
    "MAX_DEMO_TP",
    "MAX_SAMPLE_EVERY",
    "MAX_SEED",
    "MAX_TIMEOUT_S",
    "PHASE_NAMES",
    "cfg_peer",
    "layout_claims",
    "phase_table",
    "register",
    "run",
]

MAX_DEMO_TP = 16
"""Largest TP size per engine: the demo starts one process per rank, each with its own torch pools."""
MAX_DEMO_REQUESTS = 1024
"""Most requests in the batch."""
MAX_DEMO_BATCH_TOKENS = 2**20
"""Most tokens in the batch (requests x longest request): every rank's pools hold all of them, about 5 KiB per
token per rank for the tiny presets."""
MAX_DEMO_NUM_BLOCKS = 2**17
"""Most logical blocks per pool (at most 16 KiB per block over a tiny preset's tensors: 2 GiB per rank)."""
MAX_TIMEOUT_S = 86400.0
"""Longest bound on a wait (one day)."""
MAX_SEED = 2**63 - 1
"""Largest content seed."""
MAX_SAMPLE_EVERY = 1 << 20
"""The largest N of ``--verify sampled:N`` (``hybrid_kv.verify.MAX_SAMPLE_EVERY``; the CLI imports no msgspec)."""

EXAMPLES = """examples:
  hybrid-kv demo                                     tiny Kimi-Linear, prefill TP 2 -> decode TP 1, pull
  hybrid-kv demo --prefill-tp 1 --decode-tp 2        the other direction
  hybrid-kv demo --mode push --requests 16           prefill WRITEs into decode
  hybrid-kv demo --preset tiny-qwen3-next --prefill-tp 2 --decode-tp 2
  hybrid-kv demo --tokens 4000 --json                machine-readable summary
  hybrid-kv demo --verify sampled:4                  digest every 4th request end to end (default: all)

Exit status: 0 only when every request completed and every decode byte matched; 1 when the transfer ran
but bytes differ; 2 for bad arguments or a failed run (one line on stderr)."""


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def _dur(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else _ms(s)


PHASE_NAMES = {
    "startup": "start-up",
    "handshake": "handshake",
    "fill": "filling",
    "planning": "planning",
    "transfer": "transfer",
    "verify": "verification",
    "floor": "NIXL floor",
    "shutdown": "shutdown",
}
"""How the summary names each of :data:`hybrid_kv.demo.run.PHASES`."""


def phase_table(result: Any, mode: str, tensors: int) -> Table:
    """Each phase's wall time, ``other`` (outside every phase) and the total: the rows add up to the total."""
    p, d = result.prefill["tp"], result.decode["tp"]
    what = {
        "startup": f"spawn {p + d} rank processes, torch pools, region tables, NIXL endpoints",
        "handshake": "fetch peer metadata, validate, build plans, connect over NIXL",
        "fill": f"prefill pools: {result.requests} requests x {count(p, 'rank')}; every pool snapshotted",
        "planning": f"descriptor ids for {count(result.requests, 'request')} (Rust planner)",
        "transfer": f"{'READ' if mode == 'pull' else 'WRITE'} {_size(result.bytes_moved)} over NIXL, "
        f"{count(result.requests, 'request')} done on {count(d, 'decode rank')}",
        "verify": f"every byte: {p + d} ranks x {count(tensors, 'tensor')}",
        "floor": "the same transfers again with bare NIXL calls (a measurement)",
        "shutdown": "close endpoints, ranks exit",
    }
    t = Table(show_header=False, box=None, padding=(0, 2))
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column()
    for phase, secs in result.phases.items():
        t.add_row("  " + PHASE_NAMES.get(phase, phase), _dur(secs), what.get(phase, ""))
    t.add_row("  other", _dur(result.other_s), "between phases: argument checks, request allocation, memcpy reference")
    t.add_row("  total", _dur(result.total_s), "")
    return t


def _side_line(name: str, side: dict[str, Any], tensors: int) -> str:
    return (
        f"{name}: TP {side['tp']}, logical block {side['logical_block_size']} tokens = "
        f"{count(side['ppl'], 'kernel block')} of {side['kernel_block_size']}, page {_size(side['page_bytes'])}, "
        f"{side['num_blocks']} blocks x {tensors} tensors per rank"
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its summary."""
    require("torch", "nixl", "zmq", "msgspec")  # the ranks need them all: one message naming every one missing
    from ..demo import DemoConfig, run_demo
    from ..presets import get_preset

    if args.requests * args.tokens > MAX_DEMO_BATCH_TOKENS:
        raise CliError(
            f"--requests {args.requests} x --tokens {args.tokens} is {args.requests * args.tokens} tokens, over the "
            f"limit of {MAX_DEMO_BATCH_TOKENS} per batch"
        )
    cfg = DemoConfig(
        preset=args.preset,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        mode=args.mode,
        requests=args.requests,
        tokens=args.tokens,
        prefill_block_size=args.prefill_block_size,
        decode_block_size=args.decode_block_size,
        num_blocks=args.num_blocks,
        seed=args.seed,
        timeout_s=args.timeout,
        corrupt=args.inject_corruption,
        verify=args.verify,
        split_cores=args.split_cores,
    )
    cfg.validate()  # bad arguments fail here, before any process starts
    preset = get_preset(cfg.preset)
    err = make_console(stderr=True)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=args.json or not err.is_terminal,
    ) as progress:
        task: list[Any] = []

        def on_event(kind: str, info: dict[str, Any]) -> None:
            if kind == "stage":
                if task:
                    progress.remove_task(task.pop())
                task.append(progress.add_task(info["name"], total=info["total"]))
            elif kind == "advance" and task:
                progress.advance(task[0])

        result = run_demo(cfg, on_event)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0 if result.verified else 1
    out = make_console()
    mode = "decode READs from prefill" if cfg.mode == "pull" else "prefill WRITEs into decode"
    out.print(
        f"[bold]hybrid-kv demo[/bold]: {preset.name} ({preset.description}); "
        f"prefill TP {cfg.prefill_tp} -> decode TP {cfg.decode_tp}, {cfg.mode} ({mode})"
    )
    out.print("  " + _side_line("prefill", result.prefill, preset.num_tensors))
    out.print("  " + _side_line("decode ", result.decode, preset.num_tensors))
    t = Table(show_header=False, box=None, padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    lo, hi = min(result.tokens), max(result.tokens)
    t.add_row("requests", f"{result.requests} ({lo}-{hi} tokens)")
    t.add_row("peers", ", ".join(f"{k} <-> {cfg_peer(k)} {v}" for k, v in sorted(result.peers.items())))
    t.add_row("bytes moved", f"{_size(result.bytes_moved)} ({result.bytes_moved} B)")
    avg = result.bytes_moved / result.descriptors if result.descriptors else 0
    t.add_row(
        "descriptors posted",
        f"{result.descriptors} by NIXL from {result.descriptor_ids} ids, in {result.nixl_transfers} NIXL transfers "
        f"({_size(avg)} per descriptor on average)",
    )
    tables = "; ".join(
        f"{rank}: {len(v)} x {next(iter(v.values()))['rows']} strided rows = "
        f"{next(iter(v.values()))['descriptors']} descriptors ({', '.join(v)})"
        for rank, v in sorted(result.tables.items())
    )
    t.add_row("local tables", tables)
    t.add_row("connect", f"{_ms(result.handshake_s)} NIXL connections in the slowest rank")
    t.add_row("planning", f"{_ms(result.plan_setup_s)} tables once + {_ms(result.plan_s)} for all requests (ranks)")
    if cfg.mode == "pull":
        t.add_row("lease claims", _claim_line(result))
    t.add_row("transfer", _transfer_line(result))
    t.add_row("NIXL floor", _floor_line(result))
    t.add_row("memcpy", f"one contiguous memcpy of the same bytes: {result.memcpy_gbps:.2f} GB/s")
    t.add_row("end-to-end digests", _digest_line(result, cfg.mode))
    t.add_row(
        "verified",
        f"{_size(result.bytes_verified)} of decode memory + {_size(result.prefill_bytes_verified)} of prefill "
        f"memory in {_ms(result.verify_s)} (slowest rank)",
    )
    out.print(t)
    out.print(f"[bold]wall time[/bold] by phase, {_dur(result.total_s)} in all:")
    out.print(phase_table(result, cfg.mode, preset.num_tensors))
    if result.verified:
        who = "the decode rank's memory" if cfg.decode_tp == 1 else f"all {cfg.decode_tp} decode ranks' memory"
        out.print(
            f"[bold green]VERIFIED[/bold green]: every byte of {who} matches the logical model "
            f"({layout_claims(preset.group_kinds())}, per docs/byte-layouts.md); every byte no request names is "
            "unchanged."
        )
        return 0
    out.print("[bold red]FAILED[/bold red]: decode memory differs from the logical model:")
    for p in result.problems:
        out.print(f"  {p}")
    return 1


def _gbps(nbytes: int, secs: float) -> str:
    return f"{nbytes / secs / 1e9:.2f} GB/s" if secs > 0 else "-"


def _claim_line(result: Any) -> str:
    """Pull: the claim round trip before the READs (every lease confirmed; the prefill's digests follow)."""
    after = "; the prefill's digests follow while the READs run" if result.verify != "off" else ""
    return (
        f"{_ms(result.claim_s)} in the slowest decode rank: one message per prefill rank confirming every request's "
        f"blocks before the READ{after}"
    )


def _transfer_line(result: Any) -> str:
    """The transfer alone: the slowest posting rank's time from posting to done, its claims and digests taken out."""
    line = f"{_ms(result.transfer_s)} in the slowest rank: {_gbps(result.bytes_moved, result.transfer_s)}"
    if result.transfer_total_s > result.transfer_s:
        line += f" ({_ms(result.transfer_total_s)} with the claims and digests)"
    return line


def _floor_line(result: Any) -> str:
    """The same transfers posted with bare NIXL calls (no checks, no bookkeeping), and hybrid-kv against it."""
    if result.floor_s <= 0:
        return "not measured"
    return (
        f"{_ms(result.floor_s)}: {_gbps(result.bytes_moved, result.floor_s)}, the same "
        f"{result.floor_descriptors} descriptors posted with bare NIXL calls (same handles, after verification: the "
        f"connection's second use, the transfer was its first); "
        f"transfer / floor {result.transfer_s / result.floor_s:.2f}x"
    )


def _digest_line(result: Any, mode: str) -> str:
    """What ``verify`` did: how many requests each decode rank checked, its time, throughput and share."""
    if result.verify == "off":
        return "verify=off: none (each request's bytes are not digested in flight)"
    if mode == "pull":
        how = "each prefill rank digested while the READ ran, each decode rank once it landed"
        cost = result.digest_s + result.digest_wait_s  # the prefill's digests cost only what the checks waited
        prefill = (
            f"in {_ms(result.peer_digest_s)} by the slowest prefill rank while the READs ran (the decode's checks "
            f"waited {_ms(result.digest_wait_s)} for them after the last request landed)"
        )
    else:
        how = "each prefill rank digested before its WRITEs, each decode rank once they landed"
        cost = result.digest_s + result.peer_digest_s
        prefill = f"in {_ms(result.peer_digest_s)} by the slowest prefill rank"
    share = ""
    if result.transfer_s > 0 and result.transfer_total_s > cost:
        without = result.transfer_total_s - cost  # the transfer phase as verify=off would have it
        share = (
            f"; added {_ms(cost)}: +{cost / without:.0%} to the transfer phase, +{cost / result.transfer_s:.0%} to "
            "the transfer alone (its verification time on this run's critical path; what the digests' CPU takes from "
            "the copies on shared cores shows only side by side: benches/verify_overhead.py)"
        )
    mismatches = "no mismatch" if not result.digest_mismatches else f"{len(result.digest_mismatches)} mismatched"
    return (
        f"verify={result.verify}: {count(result.digested_requests, 'request')} checked on the decode ranks, "
        f"{mismatches} ({how}); {_size(result.verified_bytes)} digested in {_ms(result.digest_s)} by the slowest "
        f"decode rank ({_gbps(result.verified_bytes, result.digest_s)}) and {prefill}, no round trip of its "
        f"own{share}"
    )


def layout_claims(kinds: list[str]) -> str:
    """What the verification checked, for the kinds of KV-cache groups the model has."""
    claims = {
        "mla": "MLA pages replicated",
        "attention": "attention heads split across ranks",
        "ssm": "SSM state sharded",
    }
    return ", ".join(claims[k] for k in claims if k in kinds)


def cfg_peer(key: str) -> str:
    """The other engine's name for a rank key (``decode-0`` -> ``prefill``)."""
    return "prefill" if key.startswith("decode") else "decode"


def _verify_arg(text: str) -> str:
    from ..verify_policy import VerifyPolicy

    try:
        return str(VerifyPolicy.parse(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub: Any) -> None:
    """Add the ``demo`` subcommand."""
    from ..presets import preset_names

    p = sub.add_parser(
        "demo",
        help="real P/D KV transfers of a model preset between processes, every byte verified",
        description="Start prefill and decode ranks as separate processes (torch CPU pools, NIXL over UCX), plan "
        "every request with the Rust planner, move the KV cache over NIXL and check every decode byte against the "
        "logical model: MLA pages replicated, attention heads and SSM state split across ranks, untouched bytes "
        "unchanged.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset",
        default="tiny-kimi-linear",
        metavar="NAME",
        help=f"model preset (default tiny-kimi-linear); one of: {', '.join(preset_names())}",
    )
    tp, kernel = positive_int(MAX_DEMO_TP), positive_int(MAX_BLOCK_TOKENS)
    p.add_argument(
        "--prefill-tp", type=tp, default=2, metavar="N", help=f"prefill TP size, 1-{MAX_DEMO_TP} (default 2)"
    )
    p.add_argument("--decode-tp", type=tp, default=1, metavar="M", help=f"decode TP size, 1-{MAX_DEMO_TP} (default 1)")
    p.add_argument("--mode", choices=("pull", "push"), default="pull", help="who posts transfers (default pull)")
    p.add_argument(
        "--requests",
        type=positive_int(MAX_DEMO_REQUESTS),
        default=16,
        metavar="N",
        help=f"requests in the batch, 1-{MAX_DEMO_REQUESTS} (default 16)",
    )
    p.add_argument(
        "--tokens",
        type=positive_int(MAX_DEMO_BATCH_TOKENS),
        default=4000,
        metavar="L",
        help=f"longest request; others down to L/2 (default 4000; requests x L at most {MAX_DEMO_BATCH_TOKENS})",
    )
    p.add_argument(
        "--prefill-block-size",
        type=kernel,
        metavar="K",
        help=f"prefill kernel block, 1-{MAX_BLOCK_TOKENS} (default: the preset's)",
    )
    p.add_argument(
        "--decode-block-size",
        type=kernel,
        metavar="K",
        help=f"decode kernel block, 1-{MAX_BLOCK_TOKENS} (default: the preset's)",
    )
    p.add_argument(
        "--num-blocks",
        type=positive_int(MAX_DEMO_NUM_BLOCKS),
        metavar="N",
        help=f"logical blocks per pool, 1-{MAX_DEMO_NUM_BLOCKS} (default: batch + 25%%)",
    )
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, help=f"content seed, 0-{MAX_SEED} (default 0)")
    p.add_argument(
        "--timeout",
        type=positive_float(MAX_TIMEOUT_S),
        default=120.0,
        metavar="S",
        help=f"bound on every wait, in (0, {MAX_TIMEOUT_S:g}] s (default 120 s)",
    )
    p.add_argument(
        "--verify",
        type=_verify_arg,
        default="all",
        metavar="WHICH",
        help="end-to-end transfer digests: 'all' (default), 'off', or 'sampled:N' (every Nth request, "
        f"1 <= N <= {MAX_SAMPLE_EVERY}); a mismatch fails its request",
    )
    p.add_argument(
        "--split-cores",
        action="store_true",
        help="run the prefill ranks on one half of the cores this process may use and the decode ranks on the "
        "other, as P and D on machines of their own (needs 2 cores; default: every rank on every core)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--inject-corruption", action="store_true", help=argparse.SUPPRESS)  # tests: verification must fail
    p.set_defaults(func=run)
