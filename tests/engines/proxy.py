"""The router between a prefill and a decode engine, as vLLM's disaggregated-serving example proxy does it.

``route``: the prompt goes to the prefill engine with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true, ...}``; the ``kv_transfer_params`` of its response go, with the
original request, to the decode engine, whose response is the answer. Both requests carry the same
``X-Request-Id`` (the example proxy's header), so each engine's request id is derived from it.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from engine import Engine, EngineError, logprobs, tokens

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class Routed:
    """One disaggregated request: the prefill's params, and the decode's tokens and logprobs (or the error)."""

    prompt: list[int]
    params: dict[str, Any] | None
    tokens: list[int]
    logprobs: list[float]
    error: str | None = None


def route(
    prefill: Engine,
    decode: Engine,
    prompt: list[int],
    max_tokens: int,
    timeout_s: float = 180.0,
    prefill_lock: AbstractContextManager[Any] | None = None,
) -> Routed:
    """One request through prefill then decode (the prefill step inside ``prefill_lock`` when given); raises
    ``EngineError`` when an engine refuses it."""
    rid = f"pd-{uuid.uuid4().hex[:12]}"
    with prefill_lock or contextlib.nullcontext():
        first = prefill.complete(prompt, 1, dict(PREFILL_PARAMS), timeout_s=timeout_s, request_id=rid)
    params = first.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise EngineError(f"prefill {prefill.name} returned no kv_transfer_params: {first}")
    out = decode.complete(prompt, max_tokens, params, timeout_s=timeout_s, request_id=rid)
    return Routed(prompt, params, tokens(out), logprobs(out))


def route_all(
    prefill: Engine,
    decode: Engine,
    prompts: list[list[int]],
    max_tokens: int,
    timeout_s: float = 180.0,
    serial_prefill: bool = False,
) -> list[Routed]:
    """Every prompt routed concurrently (one client thread per request, as concurrent users); errors kept.
    ``serial_prefill``: the prefill requests go one at a time (the decodes stay concurrent), so each prompt's
    prefill is split into chunks as it would be alone (what a single-engine reference of an SSM model needs)."""
    lock = threading.Lock() if serial_prefill else None

    def one(p: list[int]) -> Routed:
        try:
            return route(prefill, decode, p, max_tokens, timeout_s, lock)
        except (EngineError, OSError) as e:
            return Routed(p, None, [], [], error=f"{type(e).__name__}: {e}"[:600])

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(one, prompts))
