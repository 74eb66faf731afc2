"""Timing: implementations interleaved round-robin, GC off inside each timed call, medians; and the
markdown tables every section prints.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timings:
    """Samples in seconds per implementation name."""

    samples: dict[str, list[float]] = field(default_factory=dict)

    def median(self, name: str) -> float:
        """Median sample of ``name``."""
        return statistics.median(self.samples[name])

    def ratio(self, slow: str, fast: str) -> float:
        """Median of ``slow`` over median of ``fast``."""
        return self.median(slow) / self.median(fast)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """``(seconds, result)`` of one call of ``fn``, with the garbage collector off during it."""
    gc.collect()
    gc.disable()
    try:
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out
    finally:
        gc.enable()


def side_by_side(
    impls: dict[str, Callable[[], Any]],
    repeats: int,
    *,
    repeats_for: dict[str, int] | None = None,
    inner: dict[str, int] | None = None,
    sample_s: float | None = None,
) -> Timings:
    """Time every implementation ``repeats`` times, one sample of each per round, after a warm-up.

    ``repeats_for`` caps the rounds of slow implementations. ``inner`` times a batch of calls per sample
    (for microsecond work) and divides; ``sample_s`` instead sizes each implementation's batch so that one
    sample lasts about that long, so fast and slow implementations are timed over equally long stretches
    (a 50-call batch of a 2 us call is over before caches and branch predictors settle, one of a 25 us call
    is not). Each call's result is dropped before the next call, as a connector drops ids once posted. The
    warm-up is one batch (one call left the first case's NumPy baseline up to 1.6x slower than later ones).
    """
    caps = repeats_for or {}
    inner = dict(inner or {})
    res = Timings({k: [] for k in impls})

    def batch(fn: Callable[[], Any], n: int) -> None:
        for _ in range(n):
            fn()

    for name, fn in impls.items():
        if sample_s is not None:
            one, _ = timed(lambda fn=fn: batch(fn, 10))  # type: ignore[misc]
            inner[name] = max(1, round(sample_s / max(one / 10, 1e-9)))
        batch(fn, inner.get(name, 1))  # warm-up: page in code and allocator arenas
    for rnd in range(repeats):
        for name, fn in impls.items():
            if rnd >= caps.get(name, repeats):
                continue
            n = inner.get(name, 1)
            if n == 1:
                dt, out = timed(fn)
                del out
            else:
                dt, _ = timed(lambda fn=fn, n=n: batch(fn, n))  # type: ignore[misc]
                dt /= n
            res.samples[name].append(dt)
    return res


def fmt_t(s: float) -> str:
    """A duration in s, ms or us."""
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_r(x: float) -> str:
    """A ratio with as many decimals as it needs."""
    return f"{x:,.0f}x" if x >= 100 else f"{x:.1f}x" if x >= 10 else f"{x:.2f}x"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """Print a markdown table under a ``###`` title."""
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    sys.stdout.flush()
