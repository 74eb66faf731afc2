"""Streaming push against whole-request push, side by side in one run.

A prefill rank (this process) and a decode rank (a child process), each with its KV pool laid out from a
preset (real Kimi-Linear-48B-A3B and Qwen3-Next-80B-A3B shapes at TP 1, host memory on huge pages), real NIXL
WRITEs between them. Each request's last prefill forward is simulated layer by layer in forward order: every
layer "computes" for ``tokens / prefill_tok_s / num_layers`` seconds with the CPU idle (a sleep, as while a
GPU runs the layer), then, for attention layers, the save hook fires. Three ways to push, interleaved per
repeat so that they see the same machine:

* ``whole``: today's push: after the last layer, plan the request and post it whole;
* ``region``: streaming by tensor (the per-region cut): a tensor's KV is posted at the first hook after every
  layer in it ran (HMA puts early and late layers in every tensor, so this is late in the forward);
* ``layer``: streaming by layer (the default): each layer's pages and states are posted at the first hook
  after that layer ran.

Streaming requests are planned (``PeerPlan.plan_staged``) and posted staged before the forward, as the
connector does in ``bind_connector_metadata``; the stages are released by ``hybrid_kv.streaming``'s hooks and
poster thread, as in the connector. Measured: the tail, from the end of the last layer to the decode holding
every byte (its NIXL done-notices all arrived: ``Endpoint.expect`` completed; both processes read the same
``CLOCK_MONOTONIC``), and the fraction of the whole push's tail that streaming hides under compute
(``1 - tail / whole tail``).

Run: ``PYTHONPATH=python python benches/stream_push.py [--tokens 4096,8192,16384,32768] [--repeats 3]
[--prefill-tok-s 20000,200000]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import statistics
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

MODELS = ("kimi-linear-48b-a3b", "qwen3-next-80b-a3b")
MODES = ("whole", "region", "layer")
DEADLINE_S = 120.0


@dataclass(frozen=True)
class Side:
    preset: str
    num_blocks: int
    role: str  # "prefill" | "decode"


def build(side: Side) -> tuple[Any, Any, Any, Any]:
    """``(pools, table, payload, preset)`` of one rank at TP 1."""
    import torch

    from hybrid_kv.presets import get_preset
    from hybrid_kv.torch_adapter import region_table_from_tensors

    torch.set_num_threads(1)
    preset = get_preset(side.preset)
    pools, layers, geo = preset.torch_layers(1, 0, side.num_blocks)
    for i, p in enumerate(pools):  # fault every page in now (not during a timed transfer)
        p.numpy().reshape(-1)[:] = i + 1
    table = region_table_from_tensors(
        layers,
        logical_block_size=geo.logical_block_size,
        kernel_block_size=geo.kernel_block_size,
        num_logical_blocks=side.num_blocks,
        total_num_kv_heads=preset.attention.num_kv_heads,
    )
    return pools, table, table.handshake_payload(preset.engine_info(side.role, "push")), preset


def decode_main(side: Side, secret: str, conn: Any) -> None:
    """The decode rank: serve the handshake, await each request's WRITEs, report when it holds every byte."""
    os.environ["HYBRID_KV_SECRET"] = secret
    from hybrid_kv.transport import Endpoint, RequestState

    pools, table, payload, _ = build(side)
    with Endpoint("bench-decode", table.registration(), {}, metadata_provider={0: payload}) as ep:
        conn.send(ep.address)
        while True:
            cmd = conn.recv()
            if cmd is None:
                break
            handle = ep.expect(cmd, DEADLINE_S, writers={"bench-prefill"})
            conn.send("ready")
            while handle.state not in (RequestState.DONE, RequestState.FAILED):
                ep.poll()
                time.sleep(0.0002)
            conn.send((time.monotonic(), handle.state is RequestState.DONE, str(handle.error or "")))
    del pools


def request_ids(preset: Any, tokens: int, first: int) -> list[list[int]]:
    """Block ids of one request: ``tokens`` worth of attention blocks, one state per SSM group; ids of
    different groups never meet (HMA groups share tensors)."""
    logical = preset.geometry(1).logical_block_size
    out, nxt = [], first
    for kind in preset.group_kinds():
        n = 1 if kind == "ssm" else -(-tokens // logical)
        out.append(list(range(nxt, nxt + n)))
        nxt += n
    return out


def forward_layers(preset: Any) -> list[tuple[str, bool]]:
    """Every layer in forward order with whether vLLM gives it a save hook (attention) or not (SSM)."""
    slots = sorted(preset.slots(), key=lambda s: int(s.name.split(".")[2]))
    return [(s.name, s.kind == "attention") for s in slots]


def run_model(name: str, tokens_list: list[int], rates: list[float], repeats: int) -> list[dict[str, Any]]:
    from hybrid_kv import StreamSchedule
    from hybrid_kv.peer_link import attach_link, prepare_link
    from hybrid_kv.presets import get_preset
    from hybrid_kv.streaming import ForwardHooks, Stream, StreamPoster
    from hybrid_kv.transport import Endpoint, RequestState

    preset = get_preset(name)
    logical = preset.geometry(1).logical_block_size
    per_req = max(-(-t // logical) for t in tokens_list) + len(preset.group_kinds())
    side_p, side_d = Side(name, per_req + 2, "prefill"), Side(name, 2 * per_req + 2, "decode")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=decode_main, args=(side_d, os.environ["HYBRID_KV_SECRET"], there), daemon=True)
    child.start()
    rows: list[dict[str, Any]] = []
    pools, table, payload, _ = build(side_p)
    try:
        address = here.recv()
        ep = Endpoint("bench-prefill", table.registration(), {}, listen=None)
        prepared = prepare_link(table, payload, {0: address}, "push", sender="bench-prefill", timeout_s=30.0)
        link = attach_link(ep, prepared, "decode", timeout_s=30.0)
        schedules = {g: StreamSchedule(table, granularity=g) for g in ("region", "layer")}
        hooks = {g: ForwardHooks(s, "bench") for g, s in schedules.items()}
        poster = StreamPoster(ep, "bench")
        layers = forward_layers(preset)
        for rate in rates:
            for tokens in tokens_list:
                local, remote = request_ids(preset, tokens, 0), request_ids(preset, tokens, per_req + 1)
                whole = link.transfers(local, remote)
                nbytes = sum(prepared.transfer_bytes(t) for t in whole)
                staged = {g: link.staged_transfers(local, remote, s) for g, s in schedules.items()}
                last = {g: sum(prepared.transfer_bytes(t) for t in st[-1]) / nbytes for g, st in staged.items()}
                layer_s = tokens / rate / len(layers)
                tails: dict[str, list[float]] = {m: [] for m in MODES}
                for rep in range(repeats + 1):  # the first round warms up (UCX lanes, page tables)
                    for mode in MODES:
                        rid = f"{name}-{tokens}-{rate:g}-{mode}-{rep}-{secrets.token_hex(2)}"
                        here.send(rid)
                        assert here.recv() == "ready"
                        handle = None
                        if mode != "whole":
                            stages = staged[mode]
                            transfers = [t for st in stages for t in st]
                            order = [k for k, st in enumerate(stages) for _ in st]
                            handle = ep.post(rid, transfers, "WRITE", DEADLINE_S, stages=order)
                            stream = Stream(rid, rid, b"", local, handle)
                            hooks[mode].begin([stream])
                        for layer, has_hook in layers:
                            time.sleep(layer_s)  # the layer's compute, the CPU idle
                            if has_hook and mode != "whole":
                                n = hooks[mode].on_hook(layer)
                                if n is not None:
                                    poster.submit(None, [(stream, n)])
                        t_end = time.monotonic()
                        if mode == "whole":
                            handle = ep.post(rid, link.transfers(local, remote), "WRITE", DEADLINE_S)
                        else:
                            poster.submit(None, [(s, schedules[mode].num_stages) for s in hooks[mode].end()])
                        assert handle is not None
                        while handle.state not in (RequestState.DONE, RequestState.FAILED):
                            ep.poll()
                            time.sleep(0.0002)
                        t_done, ok, err = here.recv()
                        if not ok or handle.state is not RequestState.DONE:
                            raise RuntimeError(f"{rid}: {err or handle.error}")
                        if rep:
                            tails[mode].append(t_done - t_end)
                med = {m: statistics.median(v) for m, v in tails.items()}
                rows.append(
                    {
                        "model": name,
                        "tokens": tokens,
                        "prefill_tok_s": rate,
                        "compute_s": tokens / rate,
                        "layer_ms": layer_s * 1e3,
                        "mib": nbytes / 2**20,
                        "stages": {g: schedules[g].num_stages for g in schedules},
                        "last_stage_share": last,
                        "tail_ms": {m: v * 1e3 for m, v in med.items()},
                        "hidden": {m: 1.0 - med[m] / med["whole"] for m in ("region", "layer")},
                        "gbps_whole": nbytes / med["whole"] / 1e9,
                    }
                )
                r = rows[-1]
                print(
                    f"{name:20} {tokens:6d} tok {rate:8.0f} tok/s  {r['mib']:7.1f} MiB  layer {r['layer_ms']:6.2f} ms  "
                    f"tail whole {r['tail_ms']['whole']:7.1f} ms  region {r['tail_ms']['region']:7.1f} ms "
                    f"({r['hidden']['region']:5.1%} hidden)  layer {r['tail_ms']['layer']:7.1f} ms "
                    f"({r['hidden']['layer']:5.1%} hidden)",
                    flush=True,
                )
        poster.close()
        link.close()
        ep.close()
    finally:
        here.send(None)
        child.join(30)
        if child.is_alive():
            child.kill()
        del pools
    return rows


def table_md(rows: list[dict[str, Any]]) -> str:
    out = [
        "| model | tokens | prefill tok/s | compute / layer | KV moved | whole push: tail | per-tensor stream: tail "
        "(hidden) | per-layer stream: tail (hidden) | last stage (tensor / layer) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t, h, s = r["tail_ms"], r["hidden"], r["last_stage_share"]
        out.append(
            f"| {r['model']} | {r['tokens']} | {r['prefill_tok_s']:,.0f} | {r['layer_ms']:.2f} ms "
            f"| {r['mib']:.0f} MiB | {t['whole']:.1f} ms | {t['region']:.1f} ms ({h['region']:.0%}) "
            f"| {t['layer']:.1f} ms ({h['layer']:.0%}) | {s['region']:.0%} / {s['layer']:.0%} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default="4096,8192,16384,32768")
    ap.add_argument("--prefill-tok-s", default="20000,200000", help="assumed prefill throughput (whole model)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    os.environ.setdefault("HYBRID_KV_SECRET", secrets.token_hex(32))
    rows = []
    for name in args.models.split(","):
        rows += run_model(
            name,
            [int(t) for t in args.tokens.split(",")],
            [float(r) for r in args.prefill_tok_s.split(",")],
            args.repeats,
        )
    print()
    print(table_md(rows))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
