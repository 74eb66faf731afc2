"""The per-request cost of a signed transfer ticket beside that request's planning, in one run.

For each request size the three calls the connector makes per request are interleaved, call by call:
``TicketKey.issue`` (the prefill signs the ticket: msgpack + HMAC-SHA256 + base64), ``TransferParams.check``
(the decode parses ``kv_transfer_params``, verifies the tag, decodes and range-checks every field, checks mode,
groups, lengths, lease and single use) and ``PeerPlan.plan`` (the decode plans the request's READs).
DeepSeek-V3, decode TP 16 rank 0 pulling from prefill TP 8, contiguous requests of 64, 512 and 2048 blocks
(4K, 32K and 128K tokens at 64-token blocks), default (coalesced) plans. Medians of 2000 rounds after 100
warm-up rounds. Run in the vLLM venv (the connector package imports vLLM):
``~/.venvs/hybrid-kv-vllm/bin/python benches/ticket_cost.py``.
"""

from __future__ import annotations

import os
import statistics
import time

import hybrid_kv
from hybrid_kv.connector_core.params import TransferParams
from hybrid_kv.connector_core.tickets import TICKET_FIELD, Ticket, TicketKey
from hybrid_kv.presets import get_preset

ROUNDS = 2000
WARMUP = 100


def main() -> None:
    ds = get_preset("deepseek-v3")

    def table_and_meta(tp: int, rank: int, engine: str) -> tuple[hybrid_kv.RegionTable, bytes]:
        table = hybrid_kv.build_region_table(ds.rank_layout(tp=tp, rank=rank, num_blocks=4096))
        return table, table.handshake_payload(ds.engine_info(engine, "pull"))

    decode, _ = table_and_meta(16, 0, "decode")
    remotes = [table_and_meta(8, r, "prefill")[1] for r in hybrid_kv.handshake_target_ranks(0, 16, 8)]
    peer = hybrid_kv.PeerPlan(decode, remotes, "pull")
    key = TicketKey(os.urandom(32))
    print(f"{'blocks':>6s} {'ticket B':>8s} {'sign us':>8s} {'verify us':>9s} {'plan us':>8s} {'(s+v)/plan':>10s}")
    for n in (64, 512, 2048):
        local, remote = [list(range(100, 100 + n))], [list(range(7, 7 + n))]
        checker = TransferParams(key, "pull", 1)
        sign, verify, plan = [], [], []
        size = 0
        for i in range(WARMUP + ROUNDS):
            now = time.time()
            ticket = Ticket(1, "prefill", f"req-{i}", os.urandom(16), remote, "10.0.0.1", 5600, 8, n * 64, now + 30,
                            now + 90, "pull")  # fmt: skip
            t0 = time.perf_counter()
            text = key.issue(ticket)
            t1 = time.perf_counter()
            got = checker.check({"do_remote_prefill": True, TICKET_FIELD: text}, [n + 1], now)
            t2 = time.perf_counter()
            peer.plan(local, got.block_ids if isinstance(got, Ticket) else remote)
            t3 = time.perf_counter()
            assert isinstance(got, Ticket), got
            if i >= WARMUP:
                sign.append(t1 - t0)
                verify.append(t2 - t1)
                plan.append(t3 - t2)
                size = len(text)
        s, v, p = (statistics.median(x) * 1e6 for x in (sign, verify, plan))
        print(f"{n:6d} {size:8d} {s:8.2f} {v:9.2f} {p:8.2f} {(s + v) / p:10.2f}")


if __name__ == "__main__":
    main()
