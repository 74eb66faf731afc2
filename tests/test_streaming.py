"""``hybrid_kv.streaming``'s poster thread against a stand-in endpoint: a stage is released only after its
layer's CUDA event completed (an event standing in for one), in submission order; an event that fails cancels
the request instead of posting bytes not known to be written; the thread progresses the endpoint only while
streamed transfers are in flight."""

from __future__ import annotations

import threading
import time
from typing import Any

from hybrid_kv.streaming import PROGRESS_S, Stream, StreamPoster


class Handle:
    def __init__(self) -> None:
        self.finished = False


class Ep:
    """Records what the poster asks of the endpoint."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def release(self, key: str, n: int) -> bool:
        self.calls.append(("release", key, n))
        return True

    def progress(self) -> None:
        self.calls.append(("progress",))

    def cancel(self, key: str, reason: str) -> bool:
        self.calls.append(("cancel", key, reason))
        return True


class Event:
    """A CUDA event stand-in: ``synchronize`` waits until the test completes it (or raises)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.done = threading.Event()
        self.error = error

    def synchronize(self) -> None:
        assert self.done.wait(10)
        if self.error is not None:
            raise self.error


def _until(cond: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def test_a_stage_is_released_only_once_its_layer_event_completed() -> None:
    ep = Ep()
    poster = StreamPoster(ep, "test")  # type: ignore[arg-type]
    try:
        handle = Handle()
        stream = Stream("p-0", "d-0", b"c" * 16, [[1]], handle)  # type: ignore[arg-type]
        first, second = Event(), Event()
        poster.submit(first, [(stream, 1)])
        poster.submit(second, [(stream, 3)])
        time.sleep(0.05)
        assert not [c for c in ep.calls if c[0] == "release"], "released before the layer's kernels finished"
        second.done.set()  # a later layer's event completing first changes nothing: jobs run in order
        time.sleep(0.02)
        assert not [c for c in ep.calls if c[0] == "release"]
        first.done.set()
        _until(lambda: [c for c in ep.calls if c[0] == "release"] == [("release", "d-0", 1), ("release", "d-0", 3)])
        # transfers in flight: the poster progresses the endpoint until the request finished
        _until(lambda: ("progress",) in ep.calls)
        handle.finished = True
        time.sleep(5 * PROGRESS_S)
        n = len(ep.calls)
        time.sleep(10 * PROGRESS_S)
        assert len(ep.calls) == n, "it keeps progressing with nothing in flight"
        assert len(poster.delays) == 2
    finally:
        poster.close()


def test_a_failed_event_cancels_the_request_and_posts_nothing() -> None:
    ep = Ep()
    poster = StreamPoster(ep, "test")  # type: ignore[arg-type]
    try:
        stream = Stream("p-0", "d-0", b"c" * 16, [[1]], Handle())  # type: ignore[arg-type]
        bad = Event(RuntimeError("CUDA error: an illegal memory access"))
        bad.done.set()
        poster.submit(bad, [(stream, 2)])
        _until(lambda: any(c[0] == "cancel" for c in ep.calls))
        poster.submit(None, [(stream, 5)])  # a later hook: the stream failed, nothing more is released
        time.sleep(0.05)
        assert not [c for c in ep.calls if c[0] == "release"]
        assert stream.failed is not None and "illegal memory access" in stream.failed
    finally:
        poster.close()
