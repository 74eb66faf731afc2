"""The router between a prefill and a decode engine, as vLLM's disaggregated-serving example proxy does it.

``route``: the prompt goes to the prefill engine with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true, ...}``; the ``kv_transfer_params`` of its response go, with the
original request, to the decode engine, whose response is the answer. Both requests carry the same
``X-Request-Id`` (the example proxy's header), so each engine's request id is derived from it.

``route_concurrent``: concurrent push (hybrid-kv streaming), as Dynamo sends a push request to both
engines at once: one fresh random capability ``hkv_stream`` in both requests, the prefill engine's side channel
in the decode's; the decode's response is the answer.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
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


def stream_params(prefill: Engine, cap: str) -> dict[str, Any]:
    """The decode's ``kv_transfer_params`` of a concurrent push from ``prefill`` (its side channel, its TP 1)."""
    assert prefill.kv_transfer_config is not None
    return {
        "do_remote_prefill": True,
        "hkv_stream": cap,
        "remote_engine_id": prefill.kv_transfer_config["engine_id"],
        "remote_host": "127.0.0.1",
        "remote_port": int(prefill.env["HYBRID_KV_SIDE_CHANNEL_PORT"]),
        "tp_size": 1,
    }


@dataclass
class Concurrent(Routed):
    """A concurrent push: also when the decode answered, from sending the prefill's request (``decode_s``: the
    decode's time to its answer as the prefill's work is concerned; with ``max_tokens=1``, its time to first
    token)."""

    decode_s: float = 0.0


def route_concurrent(
    prefill: Engine,
    decode: Engine,
    prompt: list[int],
    max_tokens: int,
    timeout_s: float = 180.0,
    head_start_s: float = 0.0,
    rid: str | None = None,
) -> Concurrent:
    """One request to both engines at once with a fresh capability; the decode's answer. ``head_start_s``: the
    decode request is sent that long before the prefill's (0: both at once). Raises ``EngineError`` when an
    engine refuses its request (the prefill's error first)."""
    rid = rid or f"pd-{secrets.token_hex(6)}"
    cap = secrets.token_hex(16)
    errors: list[BaseException] = []
    sent: list[float] = []

    def prefill_side() -> None:
        try:
            time.sleep(head_start_s)
            sent.append(time.monotonic())
            prefill.complete(prompt, 1, {"do_remote_decode": True, "hkv_stream": cap}, timeout_s, request_id=rid)
        except BaseException as exc:  # reported after the decode's answer
            errors.append(exc)

    t = threading.Thread(target=prefill_side)
    t.start()
    try:
        out = decode.complete(prompt, max_tokens, stream_params(prefill, cap), timeout_s, request_id=rid)
    finally:
        t.join(timeout_s)
    decode_s = time.monotonic() - sent[0] if sent else 0.0
    if errors:
        raise EngineError(f"prefill {prefill.name} refused the request: {errors[0]}")
    return Concurrent(prompt, None, tokens(out), logprobs(out), decode_s=decode_s)
