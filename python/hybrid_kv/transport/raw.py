"""The NIXL floor: the same transfers posted with bare NIXL calls, for measurement only.

``post_raw`` makes one xfer per transfer on the handles the endpoint already prepped (its local table scope's
dlists and the peer's remote dlists: the same registration and the same UCX connection), posts it with a
notification of a done-notice's length (one the peer's inbox does not take for a hybrid-kv notice), then
checks every handle until all are done and releases them. No id checks, no request bookkeeping, no polling
cadence: what is left is what NIXL itself costs for these descriptors. The demo and ``benches/nixl_floor.py``
report hybrid-kv's transfers against it. It moves real bytes: run it only where writing the same bytes
again is harmless (after a transfer's bytes were checked).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import TransferError
from .agent import CALL_ERRORS, Agent
from .requests import Op

__all__ = ["RawResult", "post_raw"]

RAW_NOTICE = b"hkv:raw:"
"""Prefix of the floor's notifications (not a hybrid-kv notice: the peer's inbox hands them on as foreign)."""


@dataclass(frozen=True)
class RawResult:
    """One floor pass: wall time from the first ``make_prepped_xfer`` to the last ``DONE``, and what NIXL
    reported (descriptors after its merge, bytes)."""

    seconds: float
    descriptors: int
    bytes: int


def post_raw(agent: Agent, items: Sequence[tuple[Any, Any, Any, Any, bytes]], op: Op, timeout_s: float) -> RawResult:
    """Post ``items`` ``(local dlist, local ids, remote dlist, remote ids, notice tag)`` with bare NIXL calls
    on ``agent`` and wait (spinning on ``check_xfer_state``) until every one is done.

    Raises:
        TransferError: NIXL refused a call, a transfer reported ``ERR``, or not all were done within
            ``timeout_s`` (handles still in flight are released as far as NIXL lets go of them).
    """
    nixl = agent.nixl
    handles: list[Any] = []
    try:
        t0 = time.perf_counter()
        for i, (lh, lids, rh, rids, tag) in enumerate(items):
            h = nixl.make_prepped_xfer(op, lh, lids, rh, rids, notif_msg=RAW_NOTICE + b"%d:" % i + tag)
            handles.append(h)
            if nixl.transfer(h) == "ERR":
                raise TransferError(f"raw transfer {i} reported ERR when posted")
        pending = list(handles)
        end = time.monotonic() + timeout_s
        while pending:
            rest = []
            for h in pending:
                state = nixl.check_xfer_state(h)
                if state == "ERR":
                    raise TransferError("a raw transfer reported ERR")
                if state != "DONE":
                    rest.append(h)
            pending = rest
            if pending and time.monotonic() > end:
                raise TransferError(f"{len(pending)} raw transfers not done within {timeout_s:g} s")
        seconds = time.perf_counter() - t0
        telemetry = [nixl.get_xfer_telemetry(h) for h in handles]
        return RawResult(seconds, sum(int(t.descCount) for t in telemetry), sum(int(t.totalBytes) for t in telemetry))
    except CALL_ERRORS as exc:
        raise TransferError(f"raw transfer failed: {type(exc).__name__}: {exc}") from exc
    finally:
        for h in handles:
            agent.release_xfer(h)  # one still in flight becomes a zombie, retried by the endpoint's progress
