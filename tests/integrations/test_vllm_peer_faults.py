"""One peer, one client or one message cannot corrupt, stall or crash anyone else: through vLLM 0.33's real Scheduler
and workers, real NIXL.

- A control message nested 1,000 deep under an unknown key (3.3 KB) raised ``RecursionError`` out of
  ``get_finished()`` and killed the engine; with it, fuzzed messages of every kind go to each worker's side
  channel, and the engine steps on and serves the next request byte-exact.
- A client replays a ticket at a second decode engine after the first decode read and released it: the second
  decode claims the lease before any READ and the prefill refuses (it ended), so nothing is read (the second
  decode's pool is compared whole) where before the victim's prompt KV was loaded byte for byte.
- A prefill engine killed and restarted on the same host, ports and engine id: the decode drops its dead link and
  links again, and the next requests land byte-exact (before, every request failed on the dead link forever).
"""

from __future__ import annotations

import os
import random

import numpy as np
from tickets_helper import ticket_of
from vllm_harness import (
    CONTENT_TOKENS,
    Engine,
    EngineSpec,
    move,
    prompt,
    run_until,
    side_channel_ports,
    verify_moved,
)

from hybrid_kv.claims import ClaimEntry
from hybrid_kv.connector_core import control

os.environ.setdefault("HYBRID_KV_SECRET", "hybrid-kv-vllm-connector-tests-secret")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def _hostile_messages(seed: int, n: int) -> list[bytes]:
    """The nesting bomb, and ``n`` mutations of every control message kind (bytes flipped, cut, or grown)."""
    rng = random.Random(seed)
    grant = bytes(16)
    valid = [
        control.encode(m)
        for m in (
            control.Release(req="p-x", grant=grant, consumers=1),
            control.Renew(req="p-x", grant=grant, until=1e9),
            control.PushPlan(d_req="d-x", writes=True, payload=b"p" * 64),
            control.Claim([ClaimEntry("p-x", grant, "d-x", [[1, 2]], True)], "decode", "127.0.0.1", 1, b"x" * 64),
        )
    ]
    out = [b"\x82\xa3hkv\xa7release\xa1x" + b"\x81\xa1k" * 1000 + b"\xc0"]
    for _ in range(n):
        raw = bytearray(rng.choice(valid))
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(3)
            if op == 0 and raw:
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            elif op == 1 and raw:
                del raw[rng.randrange(len(raw)) :]
            else:
                raw[rng.randrange(len(raw) + 1) : 0] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
        out.append(bytes(raw))
    return out


def test_hostile_control_messages_never_leave_a_worker_step(model_dirs: dict[str, str]) -> None:
    from hybrid_kv.transport import Endpoint
    from hybrid_kv.transport.side_channel import MAX_CONTROL_BYTES

    p_port, d_port = side_channel_ports(2)
    p = Engine.start(EngineSpec("prefill", "gqa", model_dirs["gqa"], 1, "pull", p_port))
    d = Engine.start(EngineSpec("decode", "gqa", model_dirs["gqa"], 1, "pull", d_port))
    buf = np.zeros(4096, np.uint8)
    attacker = Endpoint("decode-tp0", np.array([[buf.ctypes.data, 4096, 0]], np.uint64), {}, listen=None)
    try:
        sent = 0
        for msg in _hostile_messages(7, 300):
            if len(msg) <= MAX_CONTROL_BYTES:
                for e in (p, d):
                    to = f"{e.spec.engine_id}-tp0"
                    attacker.send_control(f"tcp://127.0.0.1:{e.spec.port}", msg, 10.0, expected_name=to)
                    sent += 1
            if sent % 60 == 0:
                p.step()
                d.step()
        for _ in range(5):  # every message reaches a real worker step: none may raise out of it
            p.step()
            d.step()
        reqs = move(p, d, [300])
        verify_moved(p, d, reqs)
    finally:
        attacker.close()
        p.close()
        d.close()


def test_a_ticket_replayed_at_a_second_decode_reads_nothing(model_dirs: dict[str, str]) -> None:
    from vllm.v1.engine import FinishReason

    p_port, d_port, e_port = side_channel_ports(3)
    p = Engine.start(EngineSpec("prefill", "gqa", model_dirs["gqa"], 1, "pull", p_port))
    d = Engine.start(EngineSpec("decode", "gqa", model_dirs["gqa"], 1, "pull", d_port))
    e = Engine.start(EngineSpec("decode2", "gqa", model_dirs["gqa"], 1, "pull", e_port))
    try:
        reqs = move(p, d, [300])  # the attacker's own request: read and released by the first decode
        _, params = reqs[0]
        ticket = ticket_of(params)
        # the victim's prompt is prefilled next (its KV may land in the blocks the ticket names)
        p.add("p-victim", prompt(5, 300), {"do_remote_decode": True}, 5)
        p.fills["p-victim"] = (5, CONTENT_TOKENS)
        run_until([p], lambda: "p-victim" in p.outputs)
        e.workers.call("mark")
        e.add("e-0", prompt(0, 300), dict(params), 0)  # the replay, at another decode engine
        run_until([p, e], lambda: "e-0" in e.finish_reasons)
        assert e.finish_reasons["e-0"] == FinishReason.ERROR
        assert e.counter("num_refused_claims") == 1
        for problem, _ in e.workers.call("verify", []):
            assert problem is None, f"the second decode read something: {problem}"
        assert ticket.block_ids  # it named blocks, and they were never read
    finally:
        p.close()
        d.close()
        e.close()


def test_a_restarted_prefill_is_linked_again(model_dirs: dict[str, str]) -> None:
    p_port, d_port = side_channel_ports(2)
    spec = EngineSpec("prefill", "gqa", model_dirs["gqa"], 1, "pull", p_port)
    p = Engine.start(spec)
    d = Engine.start(EngineSpec("decode", "gqa", model_dirs["gqa"], 1, "pull", d_port))
    try:
        verify_moved(p, d, move(p, d, [300]))
        d.workers.call("mark")  # what landed so far is the baseline
        p.close()  # killed (its workers and their side channels gone), then started again: same id, host, ports
        p = Engine.start(spec)
        reqs = move(p, d, [517, 200], first=1)
        verify_moved(p, d, reqs)
        assert d.counter("num_dropped_links") >= 1
    finally:
        p.close()
        d.close()
