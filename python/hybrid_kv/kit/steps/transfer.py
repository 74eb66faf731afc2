"""Step ``transfer``: pull and push between rank processes on the one device, every byte checked on the device.

For each preset and each case (pull and push, prefill TP 2 -> decode TP 1 and TP 1 -> 2) three rank processes
take the roles, allocate their pools on the device (``VRAM`` on a GPU) with their byte patterns, handshake
through their side channels and NIXL, and the posting ranks move a batch of requests (the demo's request
shapes: ``tokens`` down to half of it). Measured, all in this one run:

* the batch posted at once and the longest request alone, against one torch copy of the same bytes on the device;
* descriptors NIXL posted (its telemetry, after merging consecutive ids) per second;
* the batch again with ``verify=all`` (digests on the device: ``wsum`` for ``VRAM``), and what it added;
* every byte of every decode rank compared on its device with what the plans say it must hold, every byte of
  every prefill rank with what it held (unchanged);
* the UCX transports of each rank's endpoints (``ucx``).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from ..._core import handshake_target_ranks
from ...demo.run import DemoConfig, make_requests
from ...errors import RankError
from ..config import KitConfig
from ..pattern import MAX_SEED
from ..procs import RankProcs
from ..rank import RankSpec
from ..step import Report

__all__ = ["CASES", "run"]

CASES = (("pull", 2, 1), ("pull", 1, 2), ("push", 2, 1), ("push", 1, 2))
"""``(mode, prefill TP, decode TP)`` of every preset's cases."""
LANDED_S = 120.0
"""How long a push pass may take to land on the decode ranks after the prefill ranks saw it done."""


def run(cfg: KitConfig, report: Report) -> None:
    procs = RankProcs(3, os.path.join(cfg.log_dir, "transfer-rank"))
    try:
        n = 0
        for preset in cfg.presets:
            for mode, p_tp, d_tp in CASES:
                key = f"{preset} {mode} P{p_tp}->D{d_tp}"
                t0 = time.perf_counter()
                case = Case(procs, cfg, n, preset, mode, p_tp, d_tp)
                try:
                    figures = case.run()
                    for p in figures["problems"]:
                        report.problem(f"{key}: {p}")
                except Exception as exc:  # noqa: BLE001 - every case runs; the failure is recorded
                    figures = {"ok": False, "problems": [f"{type(exc).__name__}: {exc}"]}
                    report.problem(f"{key}: {type(exc).__name__}: {exc}", getattr(exc, "detail", ""))
                    case.close()
                figures["case_s"] = time.perf_counter() - t0
                report.put(key, figures)
                n += 1
    finally:
        procs.close()


class Case:
    """One preset, mode and TP pair on the three rank processes (see the module doc)."""

    def __init__(self, procs: RankProcs, cfg: KitConfig, index: int, preset: str, mode: str, p_tp: int, d_tp: int):
        self.procs, self.cfg, self.mode = procs, cfg, mode
        self.demo = DemoConfig(preset, p_tp, d_tp, mode, requests=cfg.requests, tokens=cfg.tokens)
        sides = self.demo.validate()
        self.requests = make_requests(self.demo, *sides)
        self.slots = [("prefill", r) for r in range(p_tp)] + [("decode", r) for r in range(d_tp)]
        self.tp = {"prefill": p_tp, "decode": d_tp}
        self.active = "decode" if mode == "pull" else "prefill"
        self.specs = {}
        for i, (role, r) in enumerate(self.slots):
            other = "decode" if role == "prefill" else "prefill"
            side = sides[0] if role == "prefill" else sides[1]
            seed = 1 + (index * 8 + (role == "decode") * 4 + r) % (MAX_SEED - 1)
            self.specs[i] = RankSpec(
                f"kit{index}-{role}-{r}", role, r, self.tp[role], self.tp[other], mode, preset, side.num_blocks, seed,
                cfg.device, cfg.chunk, ucx_error_mode=cfg.ucx_error_mode,
            )  # fmt: skip
        self.started: list[int] = []
        self.problems: list[str] = []
        self.expected: dict[int, set[str]] = {}  # push: posted ids each decode rank process awaits

    def procs_of(self, role: str) -> list[int]:
        return [i for i, (ro, _) in enumerate(self.slots) if ro == role]

    def run(self) -> dict[str, Any]:
        cfg, procs = self.cfg, self.procs
        procs.forget_events()
        info = procs.call_each({i: ("setup", {"spec": s}) for i, s in self.specs.items()})
        self.started = list(info)
        procs.call_each({i: ("take_requests", {"requests": self.requests}) for i in info})
        passive = "prefill" if self.active == "decode" else "decode"
        peers_of = {self.slots[i][1]: (info[i]["address"], info[i]["name"]) for i in self.procs_of(passive)}
        actives = self.procs_of(self.active)
        links = procs.call_each(
            {i: ("connect", {"peers": {r: peers_of[r] for r in self._targets(i)}}) for i in actives}
        )
        names = [r.rid for r in self.requests]
        plans = procs.call_each({i: ("plan", {"names": names}) for i in actives})
        nbytes = sum(p["bytes"] for p in plans.values())
        longest = self.requests[0].rid
        passes = [("warm", names, False)]
        passes += [(f"b{k}", names, False) for k in range(cfg.repeats)]
        passes += [(f"s{k}", [longest], False) for k in range(cfg.repeats)]
        passes += [("vwarm", names, True)] + [(f"v{k}", names, True) for k in range(cfg.repeats)]
        if self.mode == "push":
            self._expect(passes, plans, info)
        before = procs.call_each({i: ("stats", {}) for i in self.procs_of(passive)})
        walls: dict[str, float] = {}
        runs: dict[str, dict[int, Any]] = {}
        for tag, rids, verify in passes:
            runs[tag] = procs.call_each({i: ("run", {"names": rids, "tag": tag, "verify": verify}) for i in actives})
            walls[tag] = max(r["seconds"] for r in runs[tag].values())
            for i, r in runs[tag].items():
                self.problems += [f"{self.specs[i].name}: {f}" for f in r["failed"]]
            if self.mode == "push":
                self._landed(tag, rids)
        after = procs.call_each({i: ("stats", {}) for i in self.procs_of(passive)})
        for i in info:  # a passive rank that could not progress its endpoint (an answer it could not send)
            self.problems += [
                f"{self.specs[i].name}: {str(e).strip().splitlines()[-1]}" for e in procs.take_events(i, "error")
            ]
        single = self._single_bytes(actives, longest)
        copy_s = procs.call(actives[0], "copy_seconds", nbytes=nbytes, repeats=cfg.repeats)
        if cfg.corrupt:
            self._corrupt(plans)
        checks = procs.call_each({i: ("check", {"overlays": self._overlays(i, plans, info)}) for i in info})
        transports = procs.call_each({i: ("transports", {}) for i in info})
        counts = procs.call_each({i: ("close", {}) for i in info})
        self.started = []
        return self._figures(info, links, plans, runs, walls, nbytes, single, copy_s, before, after, checks,
                             transports, counts)  # fmt: skip

    def _targets(self, i: int) -> list[int]:
        role, r = self.slots[i]
        other = "decode" if role == "prefill" else "prefill"
        return [int(t) for t in handshake_target_ranks(r, self.tp[role], self.tp[other])]

    def _expect(self, passes: list[tuple[str, list[str], bool]], plans: dict[int, Any], info: dict[int, Any]) -> None:
        """Push: every decode rank awaits each pass's requests from the prefill ranks whose plans write to it."""
        prefills = {self.slots[i][1]: i for i in self.procs_of("prefill")}
        payloads = {r: info[i]["payload"] for r, i in prefills.items()}
        for i in self.procs_of("decode"):
            d = self.slots[i][1]
            peers = {r: (info[j]["address"], info[j]["name"]) for r, j in prefills.items()}
            for verify in (False, True):
                posted = {
                    f"{rid}@{tag}": [info[j]["name"] for r, j in prefills.items() if d in plans[j]["targets"][rid]]
                    for tag, rids, v in passes
                    if v == verify
                    for rid in rids
                }
                posted = {k: w for k, w in posted.items() if w}
                self.expected.setdefault(i, set()).update(posted)
                self.procs.call(i, "expect_from", peers=peers, posted=posted, payloads=payloads, verify=verify)

    def _landed(self, tag: str, rids: list[str]) -> None:
        """Push: wait until every decode rank reported this pass's requests it awaited (done or failed)."""
        end = time.monotonic() + LANDED_S
        for i in self.procs_of("decode"):
            want = {f"{rid}@{tag}" for rid in rids} & self.expected.get(i, set())
            while True:
                self.procs.pump(i)
                for e in self.procs.take_events(i, "landed"):
                    want.discard(e["id"])
                    if not e["ok"]:
                        self.problems.append(f"{self.specs[i].name}: {e['id']}: {e['error']}")
                for e in self.procs.take_events(i, "error"):
                    self.problems.append(f"{self.specs[i].name}: {str(e).splitlines()[-1]}")
                if not want:
                    break
                if time.monotonic() > end:
                    self.problems.append(f"{self.specs[i].name}: {sorted(want)[:3]} never landed")
                    break
                time.sleep(0.001)

    def _single_bytes(self, actives: list[int], rid: str) -> int:
        return sum(self.procs.call(i, "request_bytes", name=rid) for i in actives)

    def _overlays(self, i: int, plans: dict[int, Any], info: dict[int, Any]) -> list[tuple[int, Any]]:
        """What rank process ``i`` must have received: ``(source seed, (src, dst, len))`` per posting peer."""
        role, r = self.slots[i]
        if role == "prefill":
            return []  # a prefill rank's bytes never change
        if self.mode == "pull":  # this decode rank posted: (local = dst, remote = src)
            return [(self.specs[self._proc("prefill", p)].seed, m[:, [1, 0, 2]]) for p, m in plans[i]["moves"].items()]
        return [(self.specs[j].seed, plans[j]["moves"][r]) for j in self.procs_of("prefill") if r in plans[j]["moves"]]

    def _proc(self, role: str, r: int) -> int:
        return self.slots.index((role, r))

    def _corrupt(self, plans: dict[int, Any]) -> None:
        """Fault injection: flip the first byte the first posting rank moved into a decode rank."""
        i = self.procs_of(self.active)[0]
        peer, moves = next(iter(sorted(plans[i]["moves"].items())))
        target = i if self.mode == "pull" else self._proc("decode", peer)
        addr = int(moves[0, 0] if self.mode == "pull" else moves[0, 1])
        self.procs.call(target, "flip", address=addr)

    def _figures(
        self,
        info: dict[int, Any],
        links: dict[int, Any],
        plans: dict[int, Any],
        runs: dict[str, dict[int, Any]],
        walls: dict[str, float],
        nbytes: int,
        single: int,
        copy_s: float,
        before: dict[int, Any],
        after: dict[int, Any],
        checks: dict[int, Any],
        transports: dict[int, Any],
        counts: dict[int, Any],
    ) -> dict[str, Any]:
        def med(prefix: str) -> float:
            return statistics.median(w for t, w in walls.items() if t[0] == prefix and t[1:].isdigit())

        batch_s, single_s, verified_s = med("b"), med("s"), med("v")
        descriptors = sum(r["descriptors"] for r in runs["b0"].values())
        telemetry = sum(r["bytes"] for r in runs["b0"].values())
        v_runs = [r for t, rs in runs.items() if t[0] == "v" and t[1:].isdigit() for r in rs.values()]
        initiator_digest_s = statistics.median(r["digest_s"] for r in v_runs) if v_runs else 0.0
        ask_s = statistics.median(r["ask_s"] for r in v_runs) if v_runs else 0.0
        passive_digest = sum(after[i]["digest_s"] - before[i]["digest_s"] for i in after)
        passive_n = sum(after[i]["digested"] - before[i]["digested"] for i in after)
        verified_passes = self.cfg.repeats + 1
        if telemetry != nbytes:
            self.problems.append(f"NIXL moved {telemetry} bytes per batch, the plans {nbytes}")
        for i, c in checks.items():
            if c["bytes_mismatched"] or c["first_mismatch"]:
                self.problems.append(
                    f"{self.specs[i].name}: {c['bytes_mismatched']} bytes differ; {c['first_mismatch']}"
                )
        for i, c in counts.items():
            if any(c.values()):
                self.problems.append(f"{self.specs[i].name}: NIXL handles left after close: {c}")
        kinds: dict[str, set[str]] = {}
        rma: dict[str, list[str]] = {}
        for t in transports.values():
            for mem, ks in t["rma_kinds"].items():
                kinds.setdefault(mem, set()).update(ks)
            for op, ts in t["rma"].items():
                rma.setdefault(op, [])
                rma[op] += [x for x in ts if x not in rma[op]]
        moved_in = sum(c["bytes_from_peers"] for c in checks.values())
        return {
            "ok": not self.problems,
            "problems": self.problems,
            "mem_types": sorted({v["mem_type"] for v in info.values()}),
            "ucx_error_mode": self.cfg.ucx_error_mode,
            "requests": len(self.requests),
            "tokens": [r.tokens for r in self.requests],
            "bytes": nbytes,
            "descriptor_ids": sum(p["ids"] for p in plans.values()),
            "descriptors_posted": descriptors,
            "batch_s": batch_s,
            "batch_gbps": nbytes / batch_s / 1e9,
            "single_bytes": single,
            "single_s": single_s,
            "single_gbps": single / single_s / 1e9,
            "copy_gbps": nbytes / copy_s / 1e9,
            "batch_vs_copy": copy_s / batch_s,
            "descriptors_per_s": descriptors / batch_s,
            "verified_s": verified_s,
            "verify_added_s": verified_s - batch_s,
            "verify_added_ratio": (verified_s - batch_s) / batch_s,
            "digest_algorithm": next(iter(runs["v0"].values()))["algorithm"],
            "digest_initiator_s": initiator_digest_s,
            "digest_ask_s": ask_s,
            "digest_passive_s": passive_digest / max(1, verified_passes),
            "digests_passive": passive_n,
            "digest_gbps": nbytes / initiator_digest_s / 1e9 if initiator_digest_s else None,
            "checked_bytes": sum(c["bytes_checked"] for c in checks.values()),
            "checked_from_peers": moved_in,
            "bytes_mismatched": sum(c["bytes_mismatched"] for c in checks.values()),
            "check_s": max(c["seconds"] for c in checks.values()),
            "transports": {"rma_kinds": {m: sorted(k) for m, k in sorted(kinds.items())}, "rma": rma},
            "pool_bytes": {self.specs[i].name: v["pool_bytes"] for i, v in info.items()},
            "setup_s": max(v["alloc_fill_s"] + v["endpoint_s"] for v in info.values()),
            "connect_s": max(v["connect_s"] for v in links.values()),
            "plan_s": max(p["plan_s"] for p in plans.values()),
        }

    def close(self) -> None:
        """After a failure: close whatever ranks were set up (errors ignored)."""
        for i in self.started:
            try:
                self.procs.call(i, "close")
            except RankError:
                pass
        self.started = []
