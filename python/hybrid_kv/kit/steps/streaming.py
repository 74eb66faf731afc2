"""Step ``streaming``: streaming push with real compute per layer on the device, stages released after CUDA events.

This process is a prefill rank (TP 1), a rank process the decode (TP 1). For each preset one request's last
prefill forward runs layer by layer on the device: each layer is one matrix product with the FLOPs of the
model's layer (its activated parameters / layers, times 2 per token: the attention's quadratic part is left out,
so compute is on the short side) and then writes its KV pages (each layer's pages of the request, with the
pattern of "final" bytes, over pages holding "stale" ones); at each attention layer the save hook
(``hybrid_kv.streaming.ForwardHooks``) records a CUDA event and the poster thread (``StreamPoster``) releases
the stages that hook made final once the event completed, as the connector does. Two pushes, alternating:

* ``whole``: after the forward finished, post the request whole;
* ``layer``: streamed, stages posted during the forward.

Measured: the tail from the forward's end (its kernels done) to the decode holding every byte (its NIXL
done-notices all arrived), and the fraction of the whole push's tail streaming hid under compute
(``1 - layer tail / whole tail``). After every push the decode's every byte is checked on the device: a stage
posted before its layer's kernels wrote it would land stale bytes, which the check finds.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

import numpy as np

from ..config import KitConfig
from ..pattern import rows_pattern
from ..procs import RankProcs
from ..rank import Rank, RankSpec
from ..step import Report

__all__ = ["ACTIVATED_PARAMS", "run"]

ACTIVATED_PARAMS = {"kimi-linear-48b-a3b": 3e9, "qwen3-next-80b-a3b": 3e9, "deepseek-v3": 37e9}
"""Activated parameters per token of each model (the "A3B" of the names; DeepSeek-V3's 37B): a layer's matrix
product has ``activated / layers`` parameters."""
DEADLINE_S = 120.0


def run(cfg: KitConfig, report: Report) -> None:
    procs = RankProcs(1, os.path.join(cfg.log_dir, "streaming-rank"))
    try:
        for idx, name in enumerate(cfg.presets):
            try:
                figures = Forward(procs, cfg, idx, name).run()
                for p in figures["problems"]:
                    report.problem(f"{name}: {p}")
                report.put(name, figures)
            except Exception as exc:  # noqa: BLE001 - the next preset still runs
                import traceback

                report.problem(f"{name}: {type(exc).__name__}: {exc}", getattr(exc, "detail", traceback.format_exc()))
                try:
                    procs.call(0, "close")
                except Exception:  # noqa: BLE001 - the rank may not have been set up
                    pass
    finally:
        procs.close()


class Forward:
    """One preset's prefill (here) and decode (rank process 0) and the pushes between them."""

    def __init__(self, procs: RankProcs, cfg: KitConfig, idx: int, name: str) -> None:
        from ...demo.run import DemoConfig, make_requests

        self.procs, self.cfg, self.name = procs, cfg, name
        demo = DemoConfig(name, 1, 1, "push", requests=1, tokens=cfg.stream_tokens)
        ps, ds = demo.validate()
        (self.req,) = make_requests(demo, ps, ds)
        base = 100 + 4 * idx
        self.stale, self.final, self.dseed = base, base + 1, base + 2
        self.pspec = RankSpec(f"kit-s{idx}-prefill", "prefill", 0, 1, 1, "push", name, ps.num_blocks, self.stale,
                              cfg.device, cfg.chunk, DEADLINE_S, cfg.ucx_error_mode)  # fmt: skip
        self.dspec = RankSpec(f"kit-s{idx}-decode", "decode", 0, 1, 1, "push", name, ds.num_blocks, self.dseed,
                              cfg.device, cfg.chunk, DEADLINE_S, cfg.ucx_error_mode)  # fmt: skip
        self.problems: list[str] = []

    def run(self) -> dict[str, Any]:
        from ..._core import StreamSchedule

        self.procs.forget_events()
        info = self.procs.call(0, "setup", spec=self.dspec)
        self.procs.call(0, "take_requests", requests=[self.req])
        self.p = Rank(self.pspec)
        self.p.setup()
        try:
            self.p.connect({0: (info["address"], info["name"])})
            self.p.take_requests([self.req])
            self.dev = self.p.device
            self.schedule = StreamSchedule(self.p.table, granularity="layer")
            return self._measure(info)
        finally:
            self.p.close()
            self.procs.call(0, "close")

    def _measure(self, info: dict[str, Any]) -> dict[str, Any]:
        from ...streaming import ForwardHooks, StreamPoster

        link, r = self.p.link, self.req
        self.whole = link.transfers(r.prefill_ids, r.decode_ids)
        self.staged = link.staged_transfers(r.prefill_ids, r.decode_ids, self.schedule)
        nbytes = sum(link.transfer_bytes(t) for t in self.whole)
        last = sum(link.transfer_bytes(t) for t in self.staged[-1]) / nbytes if nbytes else 0.0
        moves = np.concatenate([link.plan.resolve(t.local_key, 0, t.local_ids, t.remote_ids) for t in self.whole])
        self.layers, self.writes, page_moves = self._layer_writes()
        self.compute = self._compute()
        self.hooks = ForwardHooks(self.schedule, "kit")
        self.poster = StreamPoster(self.p.ep, "kit")
        self.peer = {0: (self.p.ep.address, self.pspec.name)}
        self.payloads = {0: self.p.payload}
        tails: dict[str, list[float]] = {"whole": [], "layer": []}
        forward: list[float] = []
        try:
            for rep in range(self.cfg.stream_repeats + 1):  # the first round warms up
                for mode in ("whole", "layer"):
                    tail, fwd = self._push(mode, f"{mode}{rep}", moves, page_moves)
                    if rep:
                        tails[mode].append(tail)
                        forward.append(fwd)
        finally:
            self.poster.close()
        med = {m: statistics.median(v) for m, v in tails.items()}
        delays = sorted(self.poster.delays)
        return {
            "ok": not self.problems,
            "problems": self.problems,
            "tokens": r.tokens,
            "bytes": nbytes,
            "stages": self.schedule.num_stages,
            "last_stage_share": last,
            "compute": self.compute_figures,
            "forward_s": statistics.median(forward),
            "tail_whole_s": med["whole"],
            "tail_layer_s": med["layer"],
            "hidden_fraction": 1.0 - med["layer"] / med["whole"] if med["whole"] > 0 else None,
            "whole_push_gbps": nbytes / med["whole"] / 1e9 if med["whole"] > 0 else None,
            "release_delay_p50_s": delays[len(delays) // 2] if delays else None,
            "release_delay_max_s": delays[-1] if delays else None,
            "decode_mem_type": info["mem_type"],
        }

    def _layer_writes(self) -> tuple[list[tuple[str, bool]], dict[str, list[tuple[Any, Any, Any]]], Any]:
        """Layers in forward order (with whether vLLM gives each a save hook), each layer's page writes
        ``(pool, rows, final bytes)``, and those pages as ``(addr, addr, len)`` moves (for the prefill's check)."""
        import torch

        p, r = self.p, self.req
        slots = sorted(p.preset.slots(), key=lambda s: int(s.name.split(".")[2]))
        writes: dict[str, list[tuple[Any, Any, Any]]] = {}
        pages = []
        for s in slots:
            pool = p.pools[s.tensor]
            rows = torch.as_tensor(r.prefill_ids[s.group], dtype=torch.int64, device=pool.device)
            writes[s.name] = [(pool, rows, rows_pattern(pool, rows, self.final))]
            page = pool.shape[1]
            addr = pool.data_ptr() + np.asarray(r.prefill_ids[s.group], dtype=np.int64) * page
            pages.append(np.stack([addr, addr, np.full_like(addr, page)], axis=1))
        layers = [(s.name, s.kind == "attention") for s in slots]
        return layers, writes, np.concatenate(pages).astype(np.uint64)

    def _compute(self) -> tuple[Any, Any, Any]:
        """``(x, w, out)`` of the per-layer product: ``tokens x k`` times ``k x k`` with ``k`` from the layer's
        activated parameters (``compute_dim`` when set)."""
        import torch

        layers = len(self.p.preset.layer_order())
        if self.cfg.compute_dim:
            k = self.cfg.compute_dim
        else:
            params = ACTIVATED_PARAMS.get(self.name, 3e9) / layers
            k = max(128, int(round(math.sqrt(params) / 128)) * 128)
        dtype = torch.bfloat16 if self.dev.is_cuda else torch.float32
        t = self.req.tokens
        x = torch.randn(t, k, device=self.dev.name).to(dtype)
        w = (torch.randn(k, k, device=self.dev.name) / math.sqrt(k)).to(dtype)
        self.compute_figures = {"k": k, "dtype": str(dtype), "layer_tflop": 2 * t * k * k / 1e12, "layers": layers}
        return x, w, torch.empty_like(x)

    def _push(self, mode: str, tag: str, moves: Any, page_moves: Any) -> tuple[float, float]:
        """One forward and push; returns ``(tail, forward seconds)`` and checks both ranks' bytes."""
        import torch

        from ...streaming import Stream
        from ...transport import RequestState

        rid = self.req.rid
        pid = f"{rid}@{tag}"
        self.p.refill(self.stale)
        self.procs.call(0, "refill", seed=self.dseed)
        self.procs.call(0, "expect_from", peers=self.peer, posted={pid: [self.pspec.name]}, payloads=self.payloads,
                        verify=False)  # fmt: skip
        handle = None
        if mode == "layer":
            transfers = [t for st in self.staged for t in st]
            order = [k for k, st in enumerate(self.staged) for _ in st]
            handle = self.p.ep.post(pid, transfers, "WRITE", DEADLINE_S, stages=order)
            stream = Stream(rid, pid, b"", self.req.prefill_ids, handle)
            self.hooks.begin([stream])
        x, w, out = self.compute
        self.dev.sync()
        t0 = time.perf_counter()
        for layer, has_hook in self.layers:
            torch.matmul(x, w, out=out)  # each layer's input is the layer before's output
            x, out = out, x
            for pool, rows, values in self.writes[layer]:
                pool.index_copy_(0, rows, values)
            if has_hook and mode == "layer":
                n = self.hooks.on_hook(layer)
                if n is not None:
                    self.poster.submit(self.dev.event(), [(stream, n)])
        if mode == "layer":
            self.poster.submit(self.dev.event(), [(s, self.schedule.num_stages) for s in self.hooks.end()])
        self.dev.sync()
        t_end, fwd = time.monotonic(), time.perf_counter() - t0
        if mode == "whole":
            handle = self.p.ep.post(pid, self.whole, "WRITE", DEADLINE_S)
        assert handle is not None
        while not handle.finished:
            self.p.ep.poll()
            time.sleep(0.0002)
        if handle.state is not RequestState.DONE:
            self.problems.append(f"{tag}: prefill: {handle.error}")
        landed = self._landed(pid)
        self.compute = (x, w, out)
        tail = landed - t_end
        d = self.procs.call(0, "check", overlays=[(self.final, moves)])
        if d["bytes_mismatched"] or d["first_mismatch"]:
            self.problems.append(f"{tag}: decode: {d['bytes_mismatched']} bytes differ; {d['first_mismatch']}")
        p = self.p.check([(self.final, page_moves)])
        if p["bytes_mismatched"] or p["first_mismatch"]:
            self.problems.append(f"{tag}: prefill: {p['bytes_mismatched']} bytes differ; {p['first_mismatch']}")
        return tail, fwd

    def _landed(self, pid: str) -> float:
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            self.procs.pump(0)
            for e in self.procs.take_events(0, "landed"):
                if e["id"] == pid:
                    if not e["ok"]:
                        self.problems.append(f"{pid}: decode: {e['error']}")
                    return float(e["t"])
            time.sleep(0.0005)
        self.problems.append(f"{pid}: never landed on the decode")
        return float("nan")
