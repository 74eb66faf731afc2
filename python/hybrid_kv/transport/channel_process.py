"""The side channel served from its own process, so a worker that spins cannot starve it.

A vLLM CPU worker waiting for work spins on its main thread (``shm_broadcast``: look at a flag, yield, again)
with the GIL, bound to one core next to its OpenMP threads; a side-channel thread in that process (and its
ZAP handler) must win the GIL and that core for every step of every request. ``SideChannelProcess`` runs
the same ``SideChannelServer`` in a child process instead (its own GIL, allowed on every core of the worker's
cpuset), answering ``meta`` requests from a reply fixed at start (each served rank's payload and the
agent's NIXL metadata: with one registration per endpoint neither changes), and forwarding authenticated
control messages to the owner over a local ZeroMQ ``PUSH``/``PULL`` pipe, which the owner drains in
``poll()`` without a thread of its own. ``benches/side_channel_starvation.py`` measures the difference.

The child gets its configuration, the deployment secret included, on its stdin (never in its arguments or
environment) and exits when that pipe closes, i.e. when the owner closes it or dies. A child that dies on its own
(killed, out of memory) is noticed by the owner's next ``poll()`` (``restarted``): it is logged and a new child is
started in the background on the same address and pipe, tried again every ``RESTART_PAUSE_S`` until one binds.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

import zmq

from ..errors import ChannelError

__all__ = ["SideChannelProcess"]

log = logging.getLogger("hybrid_kv.transport")

START_TIMEOUT_S = 60.0
"""How long the child may take to start and bind (a Python start-up on a loaded machine)."""
RESTART_PAUSE_S = 1.0
"""Least time between two attempts to restart a dead child."""


class SideChannelProcess:
    """A ``SideChannelServer`` in a child process serving fixed replies; control messages come back here.

    Args:
        address: the ZeroMQ address to bind (``tcp://HOST:PORT``; port 0 = any free port).
        payloads: the handshake payload of each rank served; a request for another rank gets an error.
        nixl_md: the NIXL agent metadata sent with every payload.
        name: the serving endpoint's name.
        key: the deployment secret (``None``: unauthenticated, as ``SideChannelServer``).
        max_queued: control messages buffered for the owner; past that, senders are refused (queue full).

    Raises:
        ChannelError: the child did not start or could not bind ``address`` (its reason).
    """

    def __init__(
        self,
        address: str,
        payloads: Mapping[int, bytes],
        nixl_md: bytes,
        *,
        name: str,
        key: bytes | None,
        max_queued: int,
    ) -> None:
        self._dir = tempfile.mkdtemp(prefix="hkv-sc-")  # 0700: only this user reaches the control pipe
        pipe = f"ipc://{os.path.join(self._dir, 'controls')}"
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, max(1, max_queued // 2))
        self._pull.bind(pipe)
        self._config = {
            "address": address,
            "name": name,
            "key": key.hex() if key is not None else None,
            "payloads": {str(r): p.hex() for r, p in payloads.items()},
            "nixl_md": bytes(nixl_md).hex(),
            "pipe": pipe,
            "max_queued": max(1, max_queued - max_queued // 2),
        }
        self.name = name
        self._closed = False
        self._lock = threading.Lock()
        self._restarter: threading.Thread | None = None
        self._next_try = 0.0
        self._restarts = 0  # children started after the first, not yet reported by ``restarted``
        try:
            self._proc, self.address = self._spawn()
            self._config["address"] = self.address  # a restarted child binds the same port
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _spawn(self) -> tuple[subprocess.Popen[bytes], str]:
        """Start a child with this server's configuration; ``(process, bound address)``."""
        env = {k: v for k, v in os.environ.items() if k != "HYBRID_KV_SECRET"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "hybrid_kv.transport.channel_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write((json.dumps(self._config) + "\n").encode())
            proc.stdin.flush()
            line = _read_line(proc.stdout, START_TIMEOUT_S)
            if line is None:
                raise ChannelError(f"side-channel process for {self.name!r} did not start within {START_TIMEOUT_S:g} s")
            status = json.loads(line)
            if "error" in status:
                raise ChannelError(f"side-channel process for {self.name!r}: {status['error']}")
            return proc, str(status["address"])
        except BaseException:
            _stop(proc, 2.0)
            raise

    def restarted(self) -> int:
        """Check the child (never blocks): a dead one is logged and restarted in the background. Returns how many
        children were started since the last call to replace dead ones."""
        with self._lock:
            if self._closed:
                return 0
            done, self._restarts = self._restarts, 0
            busy = self._restarter is not None and self._restarter.is_alive()
            if busy or self._proc.poll() is None or time.monotonic() < self._next_try:
                return done
            log.error(
                "side channel %s of %r: its process (pid %d) died with status %s; starting a new one",
                self.address,
                self.name,
                self._proc.pid,
                self._proc.returncode,
            )
            self._next_try = time.monotonic() + RESTART_PAUSE_S
            self._restarter = threading.Thread(target=self._restart, name="hkv-sc-restart", daemon=True)
            self._restarter.start()
            return done

    def _restart(self) -> None:
        try:
            proc, _ = self._spawn()
        except Exception as exc:  # noqa: BLE001 - tried again at the next check (the port may still be held)
            log.error("side channel %s of %r: restarting its process failed: %s", self.address, self.name, exc)
            return
        with self._lock:
            if self._closed:
                _stop(proc, 2.0)
                return
            old, self._proc = self._proc, proc
            self._restarts += 1
        _stop(old, 0.1)
        log.warning("side channel %s of %r: serving again (pid %d)", self.address, self.name, proc.pid)

    def take_controls(self, limit: int) -> list[tuple[str, bytes]]:
        """Up to ``limit`` control messages ``(sender, payload)`` forwarded since the last call (never blocks)."""
        out: list[tuple[str, bytes]] = []
        while len(out) < limit:
            try:
                sender, payload = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except ValueError:  # not two frames: only our child writes here, so nothing to deliver
                continue
            out.append((sender.decode("utf-8", "replace"), payload))
        return out

    def has_controls(self) -> bool:
        """Whether a control message waits to be taken (never blocks; a few microseconds)."""
        return bool(self._pull.poll(0, zmq.POLLIN))

    def alive(self) -> bool:
        """Whether the child still runs."""
        return self._proc.poll() is None

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the child (closing its stdin ends it; killed if it does not) and the pipe (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            restarter = self._restarter
        if restarter is not None:
            restarter.join(START_TIMEOUT_S)
        proc = getattr(self, "_proc", None)
        if proc is not None:
            _stop(proc, timeout_s)
        self._ctx.destroy(linger=0)
        try:
            os.unlink(os.path.join(self._dir, "controls"))
        except OSError:
            pass
        try:
            os.rmdir(self._dir)
        except OSError:
            pass


def _stop(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """End a child: close its stdin (it exits), kill it if it does not within ``timeout_s``."""
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait(timeout_s)
    if proc.stdout is not None:
        proc.stdout.close()


def _read_line(stream: Any, timeout_s: float) -> bytes | None:
    """One line from ``stream`` within ``timeout_s`` (``None`` on timeout or EOF)."""
    box: list[bytes] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return box[0] if box and box[0] else None


# ---------------------------------------------------------------------------------------------- the child


def _child() -> None:
    """The child: serve the fixed replies until stdin closes."""
    config = json.loads(sys.stdin.buffer.readline())
    try:  # every core of the cpuset (the kernel keeps it inside it), not just the core of the thread that started us
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    except OSError:
        pass
    from .channel_server import SideChannelServer

    payloads = {int(r): bytes.fromhex(p) for r, p in config["payloads"].items()}
    nixl_md = bytes.fromhex(config["nixl_md"])
    served = sorted(payloads)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    local = threading.local()

    def meta(rank: int) -> tuple[bytes, bytes]:
        if rank not in payloads:
            raise ValueError(f"this side channel serves TP rank(s) {served}, not {rank}")
        return payloads[rank], nixl_md

    def on_control(sender: str, payload: bytes) -> None:
        push = getattr(local, "push", None)
        if push is None:  # created on the server thread, the only one that calls this
            push = local.push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, int(config["max_queued"]))
            push.connect(config["pipe"])
        try:
            push.send_multipart([sender.encode(), payload], zmq.NOBLOCK)
        except zmq.Again:
            raise OverflowError(f"control queue of {config['name']!r} is full (messages not yet polled)") from None

    key = bytes.fromhex(config["key"]) if config["key"] is not None else None
    try:
        server = SideChannelServer(config["address"], meta, on_control, name=config["name"], key=key)
    except Exception as exc:  # the reason goes to the owner, which raises it
        sys.stdout.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        sys.stdout.flush()
        return
    sys.stdout.write(json.dumps({"address": server.address}) + "\n")
    sys.stdout.flush()
    sys.stdin.buffer.read()  # until the owner closes the pipe or dies
    server.close()
    ctx.destroy(linger=0)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s [side channel] %(message)s")
    _child()
