"""A prefill/decode engine pair for one model and one connector, and what the tests compare its output with.

``PdPair.start`` starts the decode and the prefill engine together (``vllm serve`` each, own side-channel port,
``kv_load_failure_policy: fail`` so a request whose KV did not arrive fails instead of being recomputed: a
delivered request is one whose KV was transferred). ``reference`` runs a prompt on the prefill engine itself
*without* ``kv_transfer_params``: the connector then takes no part (its scheduler hooks match no external
tokens, nothing is saved or leased), so that is the single engine's computation. It serves the prompt twice:
``fresh`` (the whole prompt in one prefill) and ``cached`` (the same prompt again, its full blocks from the
prefix cache and the rest computed over them). With prompts one token longer than a multiple of the block size,
``cached`` computes exactly what a decode engine computes after a transfer (the last prompt token over the
prompt's cached KV), so it is the reference a correct transfer must reproduce exactly.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import (
    DEVICE,
    HKV_CONNECTOR,
    NIXL_CONNECTOR,
    Engine,
    EngineError,
    core_partition,
    logprobs,
    tokens,
)
from free_ports import listen_ports

START_TIMEOUT_S = float(os.environ.get("HYBRID_KV_ENGINE_START_TIMEOUT_S", "1500"))
WARMUP_TIMEOUT_S = 900.0

LEASE_S = 600.0
"""The prefill's lease in these deployments (as long as vLLM's NixlConnector waits, 480 s, and more): on a
loaded 2-core machine a decode worker's first request after warm-up was seen to wait over 120 s before its
read (its worker busy in the previous step), and these tests are about tokens, not lease expiry (the
in-process tests cover that). The transfer deadlines are as long: the same stalled worker does not poll NIXL,
whose transfers progress only when polled, so a 60 s deadline failed a READ that had not been polled."""

CONNECTORS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name -> (kv_transfer_config, kv_connector_extra_config); hybrid-kv verifies every transfer end to end
    "hybrid-kv-pull": (
        HKV_CONNECTOR,
        {"mode": "pull", "lease_s": LEASE_S, "transfer_timeout_s": LEASE_S, "verify": "all"},
    ),
    "hybrid-kv-push": (
        HKV_CONNECTOR,
        {
            "mode": "push",
            "lease_s": LEASE_S,
            "transfer_timeout_s": LEASE_S,
            "push_registration_timeout_s": LEASE_S,
            "verify": "all",
        },
    ),
    # concurrent push with streaming; its prefill loads the connector with one injected fault for requests
    # marked "fail-early" (tests/engines/faulty_connector.py: NIXL fails their first stage), the same otherwise
    "hybrid-kv-push-stream": (
        HKV_CONNECTOR,
        {"mode": "push", "lease_s": LEASE_S, "transfer_timeout_s": LEASE_S, "push_registration_timeout_s": LEASE_S},
    ),
    # the same concurrent routing without streaming: every request pushed whole after its prefill
    "hybrid-kv-push-nostream": (
        HKV_CONNECTOR,
        {
            "mode": "push",
            "lease_s": LEASE_S,
            "transfer_timeout_s": LEASE_S,
            "push_registration_timeout_s": LEASE_S,
            "stream": False,
        },
    ),
    "nixl": (NIXL_CONNECTOR, {}),
    # hybrid-kv inside vLLM's MultiConnector beside vLLM's ExampleConnector, as operators combine P/D with KV
    # offloading: MultiConnector finds its sub-connectors' classes and stats by name in vLLM's registry
    "hybrid-kv-multi": (
        {"kv_connector": "MultiConnector", "kv_role": "kv_both"},
        {
            "connectors": [
                {
                    **HKV_CONNECTOR,
                    "kv_connector_extra_config": {"mode": "pull", "lease_s": LEASE_S, "transfer_timeout_s": LEASE_S},
                },
                {"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
            ]
        },
    ),
}
FAULTY_PREFILL = {"kv_connector": "FaultyHybridKvConnector", "kv_connector_module_path": "faulty_connector"}
"""The prefill of ``hybrid-kv-push-stream`` loads this class (``tests/engines`` on its ``PYTHONPATH``)."""


CONTROLS_ENV = "HYBRID_KV_ENGINE_CONTROLS"
"""Set to ``1`` to also start the control pairs (``CONTROLS``), which the closing notes compare against: vLLM's own
NixlConnector, and hybrid-kv's concurrent push without streaming (the baseline of the streaming pair's time to
first token, which on 2 CPU cores is noise, not a gain). Each pair costs minutes of engine start-up on 2 cores,
so the README's test command (and CI) starts only the pairs the assertions need; ``bash
scripts/test-engines.sh`` with the variable set runs both side by side."""
CONTROLS = ("nixl", "hybrid-kv-push-nostream")


def connectors(*names: str) -> list[str]:
    """The pairs a module starts: the controls (``CONTROLS``) only with ``HYBRID_KV_ENGINE_CONTROLS=1``."""
    with_controls = os.environ.get(CONTROLS_ENV, "") == "1"
    return [n for n in names if with_controls or n not in CONTROLS]


def prompt(seed: int, n: int, vocab: int = 512) -> list[int]:
    """A deterministic prompt of ``n`` token ids (no tokenizer: ids only)."""
    state = (seed * 2654435761 + 12345) & 0xFFFFFFFF
    out = []
    for _ in range(n):
        state = (state * 1103515245 + 12345) & 0x7FFFFFFF
        out.append(1 + state % (vocab - 1))
    return out


@dataclass
class Reference:
    fresh_tokens: list[int]
    fresh_logprobs: list[float]
    cached_tokens: list[int]
    cached_logprobs: list[float]


@dataclass
class PdPair:
    model_name: str
    connector: str
    prefill: Engine
    decode: Engine
    decode_tp: int = 1
    results: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        model_name: str,
        model: Path,
        connector: str,
        log_dir: Path,
        running: list[Any],
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        decode_tp: int = 1,
        prefill_args: list[str] | None = None,
        decode_args: list[str] | None = None,
    ) -> PdPair:
        ktc, extra = CONNECTORS[connector]
        engines = []
        binds = core_partition(2, [decode_tp, 1])
        # each engine: side channels on base + rank (rank < 8), its HTTP server on base + 9
        ports = dict(zip(("decode", "prefill"), listen_ports(2, ranks=10), strict=True))
        for role, bind in zip(("decode", "prefill"), binds, strict=True):
            tp = decode_tp if role == "decode" else 1
            port = ports[role]
            cfg = dict(ktc, engine_id=f"{model_name}-{connector}-{role}", kv_load_failure_policy="fail")
            if extra:
                cfg["kv_connector_extra_config"] = dict(extra)
                if role == "decode" and extra.get("mode") == "push":  # a concurrent push names a known engine
                    known = f"{model_name}-{connector}-prefill@127.0.0.1:{ports['prefill']}"
                    cfg["kv_connector_extra_config"]["peer_engines"] = known
            if connector == "hybrid-kv-multi":  # the example connector's own folder per engine
                storage = str(log_dir / f"{model_name}-{role}-example-connector")
                cfg["kv_connector_extra_config"] = dict(
                    extra,
                    connectors=[
                        extra["connectors"][0],
                        dict(extra["connectors"][1], kv_connector_extra_config={"shared_storage_path": storage}),
                    ],
                )
            e_env = {"HYBRID_KV_SIDE_CHANNEL_PORT": str(port), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}
            if DEVICE == "cpu":
                e_env["VLLM_CPU_OMP_THREADS_BIND"] = bind
                if bind == "nobind":
                    e_env["OMP_NUM_THREADS"] = "1"
            if connector == "hybrid-kv-push-stream" and role == "prefill":
                cfg.update(FAULTY_PREFILL)
                here = str(Path(__file__).parent)
                e_env["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
            e_env.update(env or {})
            args = list(extra_args or [])
            args += list((prefill_args if role == "prefill" else decode_args) or [])
            if tp > 1:
                args += ["--tensor-parallel-size", str(tp)]
            e = Engine(f"{model_name}-{connector}-{role}", model, log_dir, cfg, args, e_env, port=port + 9)
            engines.append(e)
        decode, prefill = engines
        for e in engines:
            running.append(e)
            e.start()
            if DEVICE == "cuda":  # one GPU: the next engine's memory profile must not see this one allocating
                e.wait_ready(START_TIMEOUT_S)
        for e in engines:
            e.wait_ready(START_TIMEOUT_S)
        # the first sampled step with logprobs compiles vLLM's gather_logprobs (minutes on a loaded machine):
        # done here, bounded, so the tests' requests are timed by their own bounds
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda e: e.complete(prompt(0, 8), 2, timeout_s=WARMUP_TIMEOUT_S), engines))
        pair = cls(model_name, connector, prefill, decode, decode_tp)
        from conftest import RESULTS

        for e in engines:
            RESULTS.setdefault("startup", []).append({"engine": e.name, "ready_s": round(e.startup_s, 1)})
        return pair

    def stop(self, running: list[Any]) -> None:
        for e in (self.prefill, self.decode):
            e.stop()
            if e in running:
                running.remove(e)

    def reference(self, p: list[int], max_tokens: int) -> Reference:
        a = self.prefill.complete(p, max_tokens)
        b = self.prefill.complete(p, max_tokens)
        return Reference(tokens(a), logprobs(a), tokens(b), logprobs(b))


def max_delta(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


@contextlib.contextmanager
def cpu_load(procs_per_core: int = 2) -> Iterator[int]:
    """Busy processes on every core (``procs_per_core`` per core), started and killed here; yields their count."""
    import subprocess
    import sys

    n = (os.cpu_count() or 1) * procs_per_core
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], process_group=0) for _ in range(n)]
    try:
        time.sleep(1.0)
        yield n
    finally:
        for b in busy:
            b.kill()
        for b in busy:
            b.wait(timeout=10)


def wait_all(threads: list[threading.Thread], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise EngineError(f"requests still running after {timeout_s:.0f} s")


def pair_fixture_body(
    model_name: str, connector: str, models_root: Path, logs_root: Path, running: list[Any], **kw: Any
) -> Iterator[PdPair]:
    """Start a pair (module-scoped fixtures yield from this), always stopping every engine it started."""
    from models import ENGINE_ENV, write_model

    model = write_model(model_name, models_root)
    kw["env"] = {**ENGINE_ENV.get(model_name, {}), **(kw.get("env") or {})}
    before = list(running)
    p = None
    try:
        p = PdPair.start(model_name, model, connector, logs_root, running, **kw)
        yield p
    finally:
        for e in [e for e in running if e not in before]:
            e.stop()
            running.remove(e)


def compare_tokens(
    pair: PdPair,
    results: dict[str, list[dict[str, Any]]],
    lengths: list[int],
    max_tokens: int,
    seed: int = 10,
) -> list[tuple[int, Any, Reference]]:
    """Route each prompt (lengths ``lengths``) through the pair and compute its single-engine references;
    records one row per prompt in ``results["tokens"]``."""
    from proxy import route

    verified = VerifiedCount(pair)
    rows = []
    for i, n in enumerate(lengths):
        p = prompt(seed + i, n)
        ref = pair.reference(p, max_tokens)
        out = route(pair.prefill, pair.decode, p, max_tokens)
        rows.append((n, out, ref))
        results.setdefault("tokens", []).append(
            {
                "model": pair.model_name,
                "connector": pair.connector,
                "decode_tp": pair.decode_tp,
                "prompt_len": n,
                "decode_tokens": out.tokens,
                "fresh_ref_tokens": ref.fresh_tokens,
                "cached_ref_tokens": ref.cached_tokens,
                "equal_cached_ref": out.tokens == ref.cached_tokens,
                "equal_fresh_ref": out.tokens == ref.fresh_tokens,
                "max_logprob_delta_cached": max_delta(out.logprobs, ref.cached_logprobs)
                if len(out.logprobs) == len(ref.cached_logprobs)
                else None,
                "max_logprob_delta_fresh": max_delta(out.logprobs, ref.fresh_logprobs)
                if len(out.logprobs) == len(ref.fresh_logprobs)
                else None,
            }
        )
    verified.expect(len(lengths))
    return rows


VERIFIED = "vllm:hybrid_kv_num_verified_transfers_total"  # Prometheus counters end in _total
MISMATCHES = "vllm:hybrid_kv_num_digest_mismatches_total"


class VerifiedCount:
    """The decode's count of digest-verified transfers (``verify: all`` in ``CONNECTORS``) from when it is made."""

    def __init__(self, pair: PdPair) -> None:
        self.pair = pair
        self.hybrid_kv = pair.connector.startswith("hybrid-kv")
        self.before = pair.decode.metric(VERIFIED) if self.hybrid_kv else 0.0

    def expect(self, requests: int, wait_s: float = 30.0) -> None:
        """Assert ``requests`` more requests were verified by every decode worker (each counts its own) and none
        mismatched (hybrid-kv pairs; metrics reach the API server with the engine's stats, so they are polled for
        up to ``wait_s``)."""
        if not self.hybrid_kv:
            return
        n = requests * self.pair.decode_tp
        deadline = time.monotonic() + wait_s
        while True:
            got = self.pair.decode.metric(VERIFIED) - self.before
            if got >= n or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert got == n, f"{got:g} of {n} transfers verified by the decode's workers"
        assert self.pair.decode.metric(MISMATCHES) == 0


def delivered_under_load(
    pair: PdPair,
    prompts: list[list[int]],
    max_tokens: int,
    expected: list[list[int]],
    serial_prefill: bool = False,
) -> tuple[int, list[str]]:
    """Route ``prompts`` concurrently while busy processes saturate every core; records the row in
    ``RESULTS["load"]`` and returns ``(delivered, errors)``, delivered meaning answered with ``expected``'s
    tokens."""
    from conftest import RESULTS
    from proxy import route_all

    verified = VerifiedCount(pair)
    with cpu_load() as n_busy:
        outs = route_all(pair.prefill, pair.decode, prompts, max_tokens, 240.0, serial_prefill)
    delivered = sum(1 for o, want in zip(outs, expected, strict=True) if o.error is None and o.tokens == want)
    errors = [o.error for o in outs if o.error]
    RESULTS.setdefault("load", []).append(
        {
            "model": pair.model_name,
            "connector": pair.connector,
            "delivered": delivered,
            "total": len(prompts),
            "busy_procs": n_busy,
            "errors": errors,
        }
    )
    if delivered == len(prompts):
        verified.expect(len(prompts))
    return delivered, errors
