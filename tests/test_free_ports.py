"""``free_ports``: two test runs on one machine never pick the same ports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import free_ports
import pytest

TESTS = Path(__file__).resolve().parent

HOLDER = """
import sys
sys.path.insert(0, {tests!r})
import free_ports
print(free_ports.listen_ports(2)[0], flush=True)
sys.stdin.readline()
"""


def test_a_base_another_run_holds_is_never_picked_and_is_free_again_once_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code = HOLDER.format(tests=str(TESTS))
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        theirs = int(holder.stdout.readline())
        # the other run's base comes first: its ports are free (nothing binds them yet), so only its lock says no
        monkeypatch.setattr(free_ports, "_candidates", lambda top: iter([theirs, *range(11000, 31000, 100)]))
        mine = free_ports.listen_ports(2)
        assert mine[0] != theirs and {mine[0] // 100, mine[1] // 100}.isdisjoint({theirs // 100, (theirs + 57) // 100})
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(10)
    # the holder exited: its cells are free to take again
    monkeypatch.setattr(free_ports, "_candidates", lambda top: iter([theirs]))
    assert free_ports.listen_ports(2)[0] == theirs


def test_a_process_keeps_at_most_max_held_cells(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(free_ports, "MAX_HELD", 3)
    picks = [free_ports.listen_port() for _ in range(6)]
    assert len(set(picks)) == 6 and len(free_ports._held) <= 3
