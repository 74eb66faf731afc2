"""``Responder``: a worker's progress between vLLM's steps, while it has work a peer waits on.

vLLM calls a connector's worker once per step, and under load a step is a forward: hundreds of milliseconds on a
CPU. A prefill worker that answered lease claims and progressed NIXL only then made every decode wait for its
next step, twice per request (the claim, then the READ, which software transports move only while both sides
progress): in real engines under 16 concurrent requests the handover took 2.2 s against NixlConnector's 70 ms,
whose NIXL agent has a progress thread. So while a worker has leases, loads, pushes or messages in flight or arrived, a
thread runs the worker's progress (``work``) every ``PERIOD_S`` under the worker's lock (the same lock vLLM's
calls take, so the state is never touched by two threads at once); with nothing in flight it checks every ``IDLE_S`` (a
claim can come before its lease, which vLLM hands the worker only at its next step: 0.7 s later under load), woken
at once by ``kick`` when a step adds work.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["PERIOD_S", "Responder"]

log = logging.getLogger("hybrid_kv.integrations.vllm.worker")

PERIOD_S = 0.002
"""How often the worker progresses while it has work in flight (a few percent of a core)."""
IDLE_S = 0.005
"""How often an idle responder checks for work nobody kicked it for: a peer's control message (a claim that came
before its lease, which vLLM hands the worker only at its next step) or a lease; the check takes microseconds."""


class Responder:
    """Runs ``work`` every ``PERIOD_S`` under ``lock`` while ``busy()``; ``name`` names the thread."""

    def __init__(self, name: str, lock: threading.RLock, busy: Callable[[], bool], work: Callable[[], None]) -> None:
        self._lock = lock
        self._busy = busy
        self._work = work
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hkv-respond-{name}", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        """Work was added: start now rather than at the next idle check."""
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                busy = self._busy()
                if busy:
                    try:
                        self._work()
                    except Exception as exc:  # noqa: BLE001 - the next step (or round) tries again; never die
                        log.exception("hybrid-kv: progress between steps failed: %s", exc)
            self._wake.wait(PERIOD_S if busy else IDLE_S)
            self._wake.clear()
