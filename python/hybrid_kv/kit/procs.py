"""The kit's rank processes: started once per step (spawned: each its own CUDA context and NIXL agent), driven
by commands over pipes, each writing its own log (``rank.serve``).

A step gives its ranks roles configuration after configuration (prefill TP 2 -> decode TP 1 in one, 1 -> 2 in the
next) without paying process start-up (torch, CUDA) again.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

from ..errors import RankError
from . import rank as rank_mod
from .ucx import PROTO_ENV

__all__ = ["RankProcs"]


class RankProcs:
    """``n`` rank processes, logs ``{log_prefix}-{i}.log``.

    Args:
        n: processes to start.
        log_prefix: path prefix of each process's log (its stdout and stderr, UCX's protocol tables included).
        env: extra environment of the processes (UCX's protocol report is always switched on).
        timeout_s: the longest one command may take.
    """

    def __init__(self, n: int, log_prefix: str, env: dict[str, str] | None = None, timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self.logs = [f"{log_prefix}-{i}.log" for i in range(n)]
        self.events: list[list[tuple[str, Any]]] = [[] for _ in range(n)]
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        full_env = {**PROTO_ENV, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"), **(env or {})}
        for i in range(n):
            here, there = ctx.Pipe()
            p = ctx.Process(target=rank_mod.serve, args=(there, self.logs[i], full_env), daemon=True)
            p.start()
            there.close()
            self.conns.append(here)
            self.procs.append(p)

    def send(self, i: int, cmd: str, **kwargs: Any) -> None:
        self.conns[i].send((cmd, kwargs))

    def wait(self, i: int, cmd: str) -> Any:
        """The answer of process ``i`` to ``cmd`` (events that come first are kept in ``events[i]``)."""
        end = time.monotonic() + self.timeout_s
        conn = self.conns[i]
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise RankError(f"rank process {i}: no answer to {cmd!r} within {self.timeout_s:g} s")
            if not conn.poll(min(left, 1.0)):
                if not self.procs[i].is_alive():
                    raise RankError(f"rank process {i} died (exit code {self.procs[i].exitcode}) during {cmd!r}")
                continue
            try:
                kind, what, payload = conn.recv()
            except EOFError:
                raise RankError(f"rank process {i} closed its pipe during {cmd!r}") from None
            if kind == "event":
                self.events[i].append((what, payload))
                continue
            if kind == "error":
                head = str(payload).splitlines()[0] if payload else "unknown error"
                raise RankError(f"rank process {i}: {cmd}: {head}", str(payload))
            return payload

    def call(self, i: int, cmd: str, **kwargs: Any) -> Any:
        self.send(i, cmd, **kwargs)
        return self.wait(i, cmd)

    def call_each(self, cmds: dict[int, tuple[str, dict[str, Any]]]) -> dict[int, Any]:
        """Send every process its command first, then collect the answers (they run at the same time)."""
        for i, (cmd, kwargs) in cmds.items():
            self.send(i, cmd, **kwargs)
        return {i: self.wait(i, cmd) for i, (cmd, _) in cmds.items()}

    def take_events(self, i: int, what: str) -> list[Any]:
        """Events ``what`` process ``i`` reported so far (removed from ``events[i]``)."""
        keep: list[tuple[str, Any]] = []
        out: list[Any] = []
        for e in self.events[i]:
            (out if e[0] == what else keep).append(e[1])
        self.events[i] = keep
        return out

    def forget_events(self) -> None:
        """Drop every event reported so far (a new case starts: request names repeat from case to case)."""
        for i in range(len(self.conns)):
            self.pump(i)
            self.events[i] = []

    def pump(self, i: int) -> None:
        """Read the events process ``i`` has sent so far (without waiting)."""
        conn = self.conns[i]
        while conn.poll(0):
            kind, what, payload = conn.recv()
            if kind != "event":
                raise RankError(f"rank process {i}: unexpected answer {kind!r} to {what!r}")
            self.events[i].append((what, payload))

    def close(self) -> None:
        """Ask every process to exit; kill those that do not within a few seconds."""
        for i, conn in enumerate(self.conns):
            try:
                if self.procs[i].is_alive():
                    conn.send(("exit", {}))
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(10.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
