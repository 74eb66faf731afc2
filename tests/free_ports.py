"""Ports a test listens on, chosen below the kernel's ephemeral range.

A port found free by binding port 0 lies in the ephemeral range, free only at that instant: any outgoing connection
(ZeroMQ, UCX, HTTP) may take it as its local port before the listener binds (seen beside two busy processes: an
engine's side channel failed with "Address already in use"). Ports below the range are never handed out that way.
"""

from __future__ import annotations

import random
import socket

__all__ = ["listen_port", "listen_ports", "port_free"]

LOWEST = 10000


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


def listen_ports(n: int, ranks: int = 8, spacing: int = 50) -> list[int]:
    """``n`` base ports, ``spacing`` apart (engine i listens on base_i + r, r < ``ranks``), every one free now and
    below the ephemeral range."""
    top = min(32000, _ephemeral_start()) - spacing * n
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(LOWEST, top, 100)
        if all(port_free(base + spacing * i + r) for i in range(n) for r in range(ranks)):
            return [base + spacing * i for i in range(n)]
    raise RuntimeError(f"no {n} x {ranks} free ports between {LOWEST} and {top + spacing * n}")


def listen_port() -> int:
    """One port, free now and below the ephemeral range."""
    return listen_ports(1, ranks=1)[0]
