"""SGLang-shaped KV pools (``tests/sglang_pools.py``: exactly the shapes and strides its MHA and MLA token-to-KV
pools allocate, K and V in separate tensors, token-major pages) moved between two engines over real NIXL between
processes, P TP 2 -> D TP 1 and P TP 1 -> D TP 2, pull and push, each request sent in two chunks as SGLang's
chunked prefill sends it, page indices as its disaggregation code hands them; every byte of every decode rank
checked in SGLang's semantics (token ``t`` of the request at slot ``page[t // page_size] * page_size + t %
page_size``, head ``h`` on the rank holding it), and every byte no request names left untouched.

Hybrid models (Qwen3-Next's GDN; Kimi-Linear's KDA as SGLang 0.5.23 and as earlier SGLang store it) add SGLang's
``MambaPool`` state tensors (conv apart from temporal, one conv tensor or three, ds or sd; ``sglang_pools.py``),
indexed by the request's mamba slot, a pool of its own size: the state moves with the request's last chunk, as
SGLang sends it, and every decode slot but the request's must stay zero while the prefill's other slots hold decoy
states.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")

from sglang_pools import (  # noqa: E402
    KIMI_LINEAR,
    KIMI_LINEAR_3,
    MLA,
    QWEN3_NEXT,
    QWEN3_NEXT_ATTN,
    Model,
    Pool,
    serve,
    value,
)

from hybrid_kv import handshake_target_ranks  # noqa: E402
from hybrid_kv.peer_link import link_peer  # noqa: E402
from hybrid_kv.transport import Endpoint  # noqa: E402

PAGES, PAGE_SIZE = 10, 4
P_PAGES, D_PAGES = [5, 2, 7], [3, 9, 1]  # page 0 is SGLang's padding page: never transferred
CHUNKS = [(0, 2), (2, 3)]  # the request's pages in two sends
P_SLOT, D_SLOT = 4, 2  # the request's mamba slots (the state goes with the last chunk)


def expected_decode(model: Model, tp: int, rank: int) -> list[bytes]:
    """What every buffer of a decode rank must hold after the request: its tokens' cells, zeros elsewhere."""
    pool = Pool(model, "decode", tp, rank, PAGES, PAGE_SIZE, "pull")
    pool.fill(D_PAGES)
    if model.linear is not None:
        pool.fill_state(D_SLOT, 0)
    return pool.bytes()


def wait(out: Any, kind: str, timeout_s: float = 60.0) -> tuple[Any, ...]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        msg = out.get(timeout=max(0.01, end - time.monotonic()))
        if msg[0] == "failed":
            raise AssertionError(f"passive side: {msg}")
        if msg[0] == kind:
            return tuple(msg)
    raise AssertionError(f"no {kind!r} from the passive side within {timeout_s} s")


@pytest.mark.parametrize(
    "model",
    [QWEN3_NEXT_ATTN, MLA, QWEN3_NEXT, KIMI_LINEAR, KIMI_LINEAR_3],
    ids=lambda m: m.kind if m.linear is None else m.linear.kind,
)
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)], ids=["p2d1", "p1d2"])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_sglang_pools_move_byte_exact(model: Model, p_tp: int, d_tp: int, mode: str) -> None:
    pull = mode == "pull"
    local_engine, local_tp, remote_tp = ("decode", d_tp, p_tp) if pull else ("prefill", p_tp, d_tp)
    senders = 1 if model.kind == "mla" else max(1, p_tp // d_tp)
    rids = [f"req-1.{c}" for c in range(len(CHUNKS))]
    ctx = mp.get_context("spawn")
    out, cmds = ctx.Queue(), ctx.Queue()
    passive = ctx.Process(
        target=serve,
        args=(
            model,
            "prefill" if pull else "decode",
            remote_tp,
            PAGES,
            PAGE_SIZE,
            mode,
            P_PAGES if pull else None,
            [] if pull else [(rid, senders) for rid in rids],
            out,
            cmds,
            P_SLOT if pull and model.linear is not None else None,
        ),
    )
    passive.start()
    try:
        addresses = wait(out, "ready")[1]
        pools = [Pool(model, local_engine, local_tp, r, PAGES, PAGE_SIZE, mode) for r in range(local_tp)]
        if not pull:
            for p in pools:
                p.fill(P_PAGES)
                if model.linear is not None:
                    for s in range(len(p.temporal[0])):
                        p.fill_state(s, 0 if s == P_SLOT else 1)
        for pool in pools:
            with Endpoint(f"{local_engine}-{pool.rank}", pool.table.registration(), {}, listen=None) as ep:
                targets = handshake_target_ranks(pool.rank, local_tp, remote_tp)
                link = link_peer(
                    ep,
                    pool.table,
                    pool.payload,
                    {t: addresses[t] for t in targets},
                    mode,
                    scope="peer",
                    sender=ep.name,
                    timeout_s=15.0,
                    engine_id="prefill" if pull else "decode",
                    insecure=True,
                )
                for rid, (a, b) in zip(rids, CHUNKS, strict=True):
                    mine, theirs = (D_PAGES, P_PAGES) if pull else (P_PAGES, D_PAGES)
                    ids, remote_ids = [mine[a:b]], [theirs[a:b]]
                    if model.linear is not None:  # the state with the last chunk
                        last = b == CHUNKS[-1][1]
                        ids.append([D_SLOT if pull else P_SLOT] if last else [])
                        remote_ids.append([P_SLOT if pull else D_SLOT] if last else [])
                    transfers = link.transfers(ids, remote_ids)
                    if not transfers:  # replicated MLA pages: only the first prefill rank writes them
                        assert (model.kind, mode, pool.rank > 0) == ("mla", "push", True), (rid, pool.rank)
                        continue
                    ep.post(rid, transfers, "READ" if pull else "WRITE", 30.0)
                    end = time.monotonic() + 30.0
                    while True:
                        ev = ep.poll()
                        assert not ev.failed, ev.failed
                        if rid in ev.done:
                            break
                        assert time.monotonic() < end, f"{rid} not done"
                        time.sleep(0.001)
                link.close()
        if not pull:
            for _ in range(d_tp * len(rids)):
                wait(out, "done")
        cmds.put("stop")
        remote_bytes = wait(out, "bytes")[1]
    finally:
        cmds.put("stop")
        passive.join(timeout=60)
        if passive.is_alive():
            passive.kill()
    decode_bytes = [p.bytes() for p in pools] if pull else remote_bytes
    for r in range(d_tp):
        want = expected_decode(model, d_tp, r)
        for i, (got, exp) in enumerate(zip(decode_bytes[r], want, strict=True)):
            if got != exp:
                differ = sum(a != b for a, b in zip(got, exp, strict=True))
                raise AssertionError(f"decode rank {r} buffer {i}: {differ} of {len(exp)} bytes differ")
    # the cells are what they mean: spot-check one against the definition, not against another pool
    first = torch.frombuffer(bytearray(decode_bytes[0][0]), dtype=torch.bfloat16).view(
        PAGES * PAGE_SIZE, -1, model.head_dim
    )
    assert torch.equal(
        first[D_PAGES[0] * PAGE_SIZE, 0], value(0, "kv" if model.kind == "mla" else "k", 0, 0, model.head_dim)
    )
