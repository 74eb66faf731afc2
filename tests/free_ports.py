"""Ports a test listens on, chosen below the kernel's ephemeral range and never twice at once on this machine.

A port found free by binding port 0 lies in the ephemeral range, free only at that instant: any outgoing connection
(ZeroMQ, UCX, HTTP) may take it as its local port before the listener binds (seen beside two busy processes: an
engine's side channel failed with "Address already in use"). Ports below the range are never handed out that way.

Another test run on the same machine (a second clone's suite, a CI job) picks from the same range, and a port is
free only until its engine binds it: two runs once started engines on the same port. So each pick takes a lock
file per 100-port cell it spans (``flock``, in the system's temporary directory), held by this process until it
exits or until it has made ``MAX_HELD`` newer picks; a cell another live process holds is never picked.
"""

from __future__ import annotations

import collections
import fcntl
import os
import random
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["listen_port", "listen_ports", "port_free"]

LOWEST = 10000
CELL = 100
"""Ports per lock (a pick's bases are multiples of it)."""
MAX_HELD = 64
"""Cells one process keeps locked at most: the oldest is let go first (its test long over)."""
LOCK_DIR = Path(tempfile.gettempdir()) / "hybrid-kv-test-ports"

_held: collections.OrderedDict[int, int] = collections.OrderedDict()  # cell -> lock file descriptor


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's own default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_free(port: int) -> bool:
    """Whether ``port`` can be bound on 127.0.0.1 now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _lock(cell: int) -> bool:
    """Take ``cell``'s lock unless another process holds it (or this one does already)."""
    if cell in _held:
        return False
    try:
        if not LOCK_DIR.is_dir():
            LOCK_DIR.mkdir(exist_ok=True)
            os.chmod(LOCK_DIR, 0o1777)  # every user's runs share it, as /tmp itself
        fd = os.open(LOCK_DIR / f"{cell}.lock", os.O_CREAT | os.O_RDONLY | os.O_CLOEXEC, 0o644)
    except OSError:
        return True  # no shared lock here (another user's directory): the free-port check alone decides
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _held[cell] = fd
    return True


def _unlock(cell: int) -> None:
    fd = _held.pop(cell, None)
    if fd is not None:
        os.close(fd)


def _candidates(top: int) -> Iterator[int]:
    """Base ports to try, in random order."""
    rng = random.Random()
    for _ in range(200):
        yield rng.randrange(LOWEST, top, CELL)


def listen_ports(n: int, ranks: int = 8, spacing: int = 50) -> list[int]:
    """``n`` base ports, ``spacing`` apart (engine i listens on base_i + r, r < ``ranks``), every one free now, below
    the ephemeral range, and in cells no other process holds (held by this one from now on)."""
    top = min(32000, _ephemeral_start()) - spacing * n
    for base in _candidates(top):
        cells = range(base // CELL, (base + spacing * (n - 1) + ranks - 1) // CELL + 1)
        taken = []
        for cell in cells:
            if not _lock(cell):
                break
            taken.append(cell)
        if len(taken) == len(cells) and all(port_free(base + spacing * i + r) for i in range(n) for r in range(ranks)):
            while len(_held) > MAX_HELD:
                _unlock(next(iter(_held)))
            return [base + spacing * i for i in range(n)]
        for cell in taken:
            _unlock(cell)
    raise RuntimeError(f"no {n} x {ranks} free ports between {LOWEST} and {top + spacing * n}")


def listen_port() -> int:
    """One port, free now and below the ephemeral range."""
    return listen_ports(1, ranks=1)[0]
