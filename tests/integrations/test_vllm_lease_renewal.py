"""A first request to a new prefill engine whose handshake outlasts the prefill's lease: the decode
renews the lease while it connects (``control.Renew``, carrying the ticket's grant, bounded by the ticket's
``max_expires_at``), so the request lands byte-exact instead of failing on the expired lease.

vLLM 0.33's real Scheduler and workers, GQA, TP 1, pull, every engine with a 4 s lease. The decode reaches each
prefill's side channel through a TCP relay in this process that holds the first connection (the handshake's
metadata fetch) for 8 s, within the 10 s handshake timeout, and passes every later one (the renewals) at once:
a slow first handshake, as on a loaded machine. The ticket names the relay (re-issued with the deployment's key,
as the prefill engine would if it advertised that address). The control: a second prefill engine whose tickets
allow no extension (``lease_max_extension_s`` 0), in the same decode steps: its request fails on the expired
lease, as every first request did before.
"""

from __future__ import annotations

import os
import time
from typing import Any

from tcp_relay import TcpRelay
from tickets_helper import reissue
from vllm_harness import CONTENT_TOKENS, Engine, EngineSpec, prompt, run_until, side_channel_ports

os.environ.setdefault("HYBRID_KV_SECRET", "hybrid-kv-vllm-connector-tests-secret")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

HOLD_S = 8.0
LEASE_S = 4.0


def _moved(d: Engine, rid: str) -> Any:
    from hybrid_kv.integrations.vllm.layout import transfer_group_kinds

    (r,) = [meta.recv[rid] for meta in d.metas if rid in meta.recv]
    moved = None
    for g, kind in enumerate(transfer_group_kinds(d.kv_cfg)):
        if kind != "ssm":
            moved = min(len(r.remote_block_ids[g]), len(r.local_block_ids[g])) * d.spec.logical_block_size
    return (r.local_block_ids, 0, CONTENT_TOKENS, moved)


def test_lease_renewed_while_the_first_handshake_runs(model_dirs: dict[str, str]) -> None:
    from vllm.v1.engine import FinishReason

    a_port, b_port, d_port = side_channel_ports(3)
    lease = (("lease_s", LEASE_S),)
    gqa = model_dirs["gqa"]
    a = Engine.start(EngineSpec("prefill-a", "gqa", gqa, 1, "pull", a_port, extra=lease))
    b = Engine.start(
        EngineSpec("prefill-b", "gqa", gqa, 1, "pull", b_port, extra=(*lease, ("lease_max_extension_s", 0.0)))
    )
    d = Engine.start(EngineSpec("decode", "gqa", gqa, 1, "pull", d_port, extra=lease))
    # the first connection (the handshake's metadata fetch) is held; every later one passes at once
    relays = [TcpRelay(("127.0.0.1", port), lambda n: HOLD_S if n == 1 else 0.0) for port in (a_port, b_port)]
    finish = d.finish_reasons
    try:
        tickets = {}
        for p, relay in zip((a, b), relays, strict=True):
            p.add("p-0", prompt(0, 300), {"do_remote_decode": True}, 0)
            p.fills["p-0"] = (0, CONTENT_TOKENS)
            run_until([p], lambda p=p: "p-0" in p.outputs)
            tickets[p.spec.engine_id] = reissue(dict(p.outputs["p-0"]), port=relay.port)
        t0 = time.monotonic()
        d.add("d-a", prompt(0, 300), tickets["prefill-a"], 0)
        d.add("d-b", prompt(0, 300), tickets["prefill-b"], 0)
        run_until([a, b, d], lambda: {"d-a", "d-b"} <= set(finish) and a.idle() and b.idle(), timeout_s=90)
        assert time.monotonic() - t0 > HOLD_S > LEASE_S  # the handshakes really outlasted the original lease
        assert finish["d-a"] != FinishReason.ERROR
        assert finish["d-b"] == FinishReason.ERROR  # the control: no extension allowed, the lease ran out
        assert d.counter("num_lease_renewals") >= 2  # d-a's, more than once (a heartbeat); none for d-b
        assert a.counter("num_expired_leases") == 0 and b.counter("num_expired_leases") == 1
        assert d.counter("num_failed_transfers") == 1
        for problem, nbytes in d.workers.call("verify", [_moved(d, "d-a")]):  # d-a landed; nothing else changed
            assert problem is None, problem
            assert nbytes > 0
        for p in (a, b):
            assert p.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == p.kv_cfg.num_blocks - 1
    finally:
        for relay in relays:
            relay.close()
        for e in (a, b, d):
            e.close()
