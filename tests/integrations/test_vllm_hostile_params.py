"""Hostile ``kv_transfer_params`` (an API client of the decode server writes them) through vLLM 0.33's real
Scheduler and, for the end-to-end proof, real workers and NIXL transfers.

- Scheduler only (no workers, fast): every value that used to raise inside ``Scheduler.schedule()``
  (``update_state_after_alloc``) or the abort path (``finish_requests``) now leaves the scheduler running and
  hands the workers a refusal instead of a load; with a secret and in ``insecure`` mode (unsigned tickets
  whose fields are the client's).
- Engines: a prefill and a decode (GQA, TP 1, pull). In the same decode steps as three legitimate requests,
  hostile ones arrive: item 1's params, a ticket naming a victim's blocks (item 2) or a victim's request id
  with no blocks (item 3) without the key, one with the tag of another ticket, another deployment's ticket,
  and a ticket used twice. Each hostile request fails alone (vLLM's default ``kv_load_failure_policy``:
  finished with an error, never computed), the engine keeps serving, the victim's blocks are not freed by
  anything a hostile request did, and every byte of the decode's KV memory is what the legitimate requests
  landed and nothing else.
"""

from __future__ import annotations

import base64
import math
import os
from typing import Any

import msgspec
import pytest
from tickets_helper import raw_ticket, reissue, ticket_fields, ticket_of
from vllm_harness import CONTENT_TOKENS, Engine, EngineSpec, build, prompt, run_until, side_channel_ports

from hybrid_kv.connector_core.tickets import TICKET_FIELD, TicketKey

os.environ.setdefault("HYBRID_KV_SECRET", "hybrid-kv-vllm-connector-tests-secret")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

# Each of these raised out of Scheduler.schedule() or finish_requests() before they were checked
PLAIN = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill",
    "remote_request_id": "p-0",
    "remote_block_ids": [[1, 2]],
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}
ITEM1 = {
    "port_abc": {"remote_port": "abc"},
    "tp_inf": {"tp_size": math.inf},
    "tp_null": {"tp_size": None},
    "ids_5": {"remote_block_ids": 5},
    "ids_x": {"remote_block_ids": [["x"]]},
    "ids_inf": {"remote_block_ids": [[math.inf]]},
    "port_4301_digits": {"remote_port": "9" * 4301},
}


class Finishes:
    """Finish reasons of a decode engine's requests (the engine's), and the requests vLLM scheduled (a spy on
    ``schedule``)."""

    def __init__(self, engine: Engine) -> None:
        self.reason = engine.finish_reasons
        self.scheduled: set[str] = set()
        orig_schedule = engine.scheduler.schedule

        def schedule() -> Any:
            so = orig_schedule()
            self.scheduled |= {r for r, n in so.num_scheduled_tokens.items() if n}
            return so

        engine.scheduler.schedule = schedule


def _scheduler(model_dirs: dict[str, str], extra: tuple[tuple[str, Any], ...]) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    spec = EngineSpec("decode", "gqa", model_dirs["gqa"], 1, "pull", 5700, extra=extra)
    vc, kv_cfg, _ = build(spec)
    vc.cache_config.num_gpu_blocks = kv_cfg.num_blocks
    return Scheduler(
        vllm_config=vc,
        kv_cache_config=kv_cfg,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=spec.logical_block_size,
    )


def _request(rid: str, params: Any) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=2)
    sp.update_from_generation_config({}, 50256)
    req = Request(request_id=rid, prompt_token_ids=prompt(1, 100), sampling_params=sp, pooling_params=None)
    req.kv_transfer_params = params
    return req


def _insecure_hostile() -> dict[str, dict[str, Any]]:
    """Unsigned tickets (what an insecure engine accepts) whose fields carry item 1's values."""
    from hybrid_kv.connector_core.tickets import Ticket

    t = Ticket(1, "prefill", "p-0", b"g" * 16, [[1, 2]], "127.0.0.1", 5600, 1, 64, 4e9, 4e9 + 60, "pull")
    out = {}
    for name, (index, value) in {
        "port_abc": (6, "abc"),
        "tp_inf": (7, math.inf),
        "tp_null": (7, None),
        "ids_5": (4, 5),
        "ids_x": (4, [["x"]]),
        "ids_inf": (4, [[math.inf]]),
        "port_4301_digits": (6, "9" * 4301),
        "groups_2": (4, [[1], [2]]),
        "ids_too_many": (4, [list(range(200))]),
    }.items():
        fields = ticket_fields(t)
        fields[index] = value
        out[name] = dict(PLAIN, **{TICKET_FIELD: raw_ticket(fields)})
    return out


@pytest.mark.parametrize("insecure", [False, True])
def test_hostile_params_never_raise_out_of_the_scheduler(model_dirs: dict[str, str], insecure: bool) -> None:
    """Hostile plain parameters through vLLM's real Scheduler: ``schedule()`` and the abort path
    (``finish_requests``) with every value that raised before; each request is handed to the workers as a refusal
    naming why."""
    from vllm.v1.request import RequestStatus

    sched = _scheduler(model_dirs, (("insecure", True),) if insecure else ())  # insecure ignores the secret
    assert sched.connector.scheduler.tickets.signed is not insecure
    hostile = {name: dict(PLAIN, **fields) for name, fields in ITEM1.items()}
    if insecure:
        hostile.update({f"ticket_{k}": v for k, v in _insecure_hostile().items()})
    for name, params in hostile.items():
        sched.add_request(_request(name, dict(params)))
    so = sched.schedule()
    recv = so.kv_connector_metadata.recv
    assert set(recv) == set(hostile)
    for name, req in recv.items():
        assert req.refused, name
        assert req.remote_block_ids == [] and req.remote_engine_id == ""
    assert "carry no 'hkv_ticket'" in recv["port_abc"].refused
    if insecure:
        assert "groups" in recv["ticket_groups_2"].refused
        assert "holds at most 101" in recv["ticket_ids_too_many"].refused
    # the abort path: a request aborted before its blocks were allocated
    aborted = {name: dict(params) for name, params in hostile.items()}
    for name, params in aborted.items():
        sched.add_request(_request(f"abort-{name}", params))
    sched.finish_requests([f"abort-{n}" for n in aborted], RequestStatus.FINISHED_ABORTED)
    meta = sched.schedule().kv_connector_metadata
    assert not any(r.startswith("abort-") for r in meta.recv)  # nothing to release for a refused ticket


def _prefill(p: Engine, names: list[str], lengths: list[int], first: int) -> dict[str, dict[str, Any]]:
    for k, (name, n) in enumerate(zip(names, lengths, strict=True)):
        p.add(name, prompt(first + k, n), {"do_remote_decode": True}, first + k)
        p.fills[name] = (first + k, CONTENT_TOKENS)
    run_until([p], lambda: all(n in p.outputs for n in names))
    return {n: dict(p.outputs[n]) for n in names}


def _checks(p: Engine, d: Engine, index: dict[str, int]) -> list[Any]:
    from hybrid_kv.integrations.vllm.layout import transfer_group_kinds

    recv = {rid: r for meta in d.metas for rid, r in meta.recv.items()}
    kinds = transfer_group_kinds(d.kv_cfg)
    out = []
    for rid, i in index.items():
        r = recv[rid]
        moved = None
        for g, kind in enumerate(kinds):
            if kind != "ssm":
                moved = min(
                    len(r.remote_block_ids[g]) * p.spec.logical_block_size,
                    len(r.local_block_ids[g]) * d.spec.logical_block_size,
                )
        out.append((r.local_block_ids, i, CONTENT_TOKENS, moved))
    return out


def test_hostile_tickets_fail_alone_and_every_other_byte_is_exact(model_dirs: dict[str, str]) -> None:
    """Hostile tickets through vLLM's real Scheduler and workers: each fails alone, every other byte is exact (see the
    module doc)."""
    from vllm.v1.engine import FinishReason

    p_port, d_port = side_channel_ports(2)
    p = Engine.start(EngineSpec("prefill", "gqa", model_dirs["gqa"], 1, "pull", p_port))
    d = Engine.start(EngineSpec("decode", "gqa", model_dirs["gqa"], 1, "pull", d_port))
    fin = Finishes(d)
    try:
        lengths = {"p-0": 300, "p-victim": 517, "p-attacker": 200}
        params = _prefill(p, list(lengths), list(lengths.values()), 0)
        victim, mine = ticket_of(params["p-victim"]), ticket_of(params["p-attacker"])
        no_key = TicketKey(None)  # an attacker without the secret can only make unsigned tickets
        other = TicketKey(b"another-deployment-secret-of-32-bytes")
        # the attacker's ticket, victim's block ids, re-encoded keeping the attacker's real tag
        tag = msgspec.msgpack.decode(base64.urlsafe_b64decode(params["p-attacker"][TICKET_FIELD] + "=="))[1]
        body = msgspec.structs.replace(mine, block_ids=victim.block_ids)
        spliced = base64.urlsafe_b64encode(msgspec.msgpack.encode([msgspec.msgpack.encode(body), tag])).decode()
        hostile = {
            **{f"d-{name}": dict(PLAIN, **fields) for name, fields in ITEM1.items()},
            # item 2: read the victim's KV
            "d-read-victim-unsigned": reissue(params["p-attacker"], no_key, block_ids=victim.block_ids),
            "d-read-victim-spliced": dict(params["p-attacker"], **{TICKET_FIELD: spliced.rstrip("=")}),
            "d-read-victim-other-key": reissue(params["p-attacker"], other, block_ids=victim.block_ids),
            # item 3: make the decode release the victim's blocks
            "d-release-victim": reissue(params["p-attacker"], no_key, request_id="p-victim", block_ids=[[]]),
            # plain fields naming the victim beside the attacker's valid ticket are ignored (d-attacker reads its own)
        }
        # phase 1: the hostile requests (and the attacker's own, with the victim's fields in plain sight)
        attacker_params = dict(params["p-attacker"], remote_block_ids=victim.block_ids, remote_request_id="p-victim")
        d.add("d-attacker", prompt(2, lengths["p-attacker"]), attacker_params, 2)
        d.add("d-replay", prompt(2, lengths["p-attacker"]), dict(params["p-attacker"]), 2)  # the same ticket again
        for rid, prm in hostile.items():
            d.add(rid, prompt(9, 100), prm, 9)
        all_hostile = [*hostile, "d-replay"]
        run_until([p, d], lambda: {*all_hostile, "d-attacker"} <= set(fin.reason))
        for rid in all_hostile:
            assert fin.reason[rid] == FinishReason.ERROR, rid
            assert rid not in fin.scheduled, f"{rid} was computed"
        assert fin.reason["d-attacker"] != FinishReason.ERROR
        assert "p-victim" in p.scheduler.requests  # nothing the attacker sent freed the victim's blocks
        # phase 2: the engine keeps serving: the victim's and another request's KV land exactly
        d.add("d-victim", prompt(1, lengths["p-victim"]), params["p-victim"], 1)
        d.add("d-0", prompt(0, lengths["p-0"]), params["p-0"], 0)
        run_until([p, d], lambda: {"d-victim", "d-0"} <= set(fin.reason) and p.idle())
        assert fin.reason["d-victim"] != FinishReason.ERROR and fin.reason["d-0"] != FinishReason.ERROR
        checks = _checks(p, d, {"d-attacker": 2, "d-victim": 1, "d-0": 0})
        for problem, nbytes in d.workers.call("verify", checks):
            assert problem is None, problem  # what landed, and that no other byte changed
            assert nbytes > 0
        wrong = [(checks[1][0], 5, CONTENT_TOKENS, checks[1][3])]
        assert all(problem is not None for problem, _ in d.workers.call("verify", wrong)), "the byte check is blind"
        for problem, _ in p.workers.call("verify", []):
            assert problem is None, f"prefill memory changed: {problem}"
        assert p.idle() and d.idle()
        assert p.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == p.kv_cfg.num_blocks - 1
        assert sum(s["num_failed_transfers"] for s in d.stats) == len(all_hostile)
    finally:
        p.close()
        d.close()
