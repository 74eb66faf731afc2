"""Drive hybrid-kv's vLLM connector with vLLM's own objects: a real ``Scheduler`` per engine (in the test
process) and one process per TP worker (vLLM's ``init_distributed_environment`` over gloo, the connector built
by vLLM's ``KVConnectorFactory`` role WORKER, KV caches allocated by vLLM's ``allocate_kv_cache`` from the
``KVCacheConfig`` vLLM's planner made). CPU workers fork from a server that imported vLLM once (``PRELOAD``);
CUDA workers are spawned.

Each engine step: ``Scheduler.schedule()`` -> every worker binds the connector metadata, ``start_load_kv``,
``wait_for_save``, ``get_transfer_results`` -> results aggregated like vLLM's ``KVOutputAggregator`` (a
request is finished once every worker reported it) -> ``Scheduler.update_from_output``. Prefill workers
"compute" a request by writing its KV shares into the blocks the scheduler gave it (``Content``); decode
workers compare every byte of their KV memory with what it must hold.

With ``EngineSpec.layerwise`` a prefill step is a forward as vLLM runs it: the workers bind the metadata, then
write each layer's KV in forward order (layer number order) for the requests the step computes and call
``save_kv_layer`` after each attention layer (SSM layers get no hook), optionally sleeping ``layer_s`` per
layer (compute time, the CPU idle as under a GPU kernel), then ``start_load_kv`` and ``wait_for_save``. A
request's attention pages get the tokens computed so far, its SSM states an intermediate value until the
step of its last chunk: bytes posted before their layer ran, or an intermediate state, reach the decode and
fail its byte check. ``route_concurrent`` sends requests to the decode and the prefill at once with a
stream capability, as a router doing concurrent push does.

The harness is four modules: ``harness_models`` (engine specs, model directories, vLLM's configs),
``harness_memory`` (request content and KV memory), ``harness_worker`` (the worker processes) and this one
(engines: a real scheduler each, stepped with its workers; a P -> D run).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from free_ports import listen_ports as side_channel_ports  # noqa: F401  (the name the tests import from here)
from harness_memory import CONTENT_TOKENS
from harness_models import EngineSpec, build, write_model_dirs  # noqa: F401  (EngineSpec, write_model_dirs: for the tests)
from harness_worker import Workers

# ---------------------------------------------------------------------------------------------- engines


@dataclass
class Engine:
    """A real vLLM ``Scheduler`` with the connector's scheduler half, and its workers."""

    spec: EngineSpec
    workers: Workers
    vc: Any
    kv_cfg: Any
    scheduler: Any
    pending: dict[str, dict[str, int]] = field(default_factory=lambda: {"send": {}, "recv": {}})
    outputs: dict[str, Any] = field(default_factory=dict)
    finish_reasons: dict[str, Any] = field(default_factory=dict)  # request -> vLLM's FinishReason, once finished
    metas: list[Any] = field(default_factory=list)
    stats: list[dict[str, Any]] = field(default_factory=list)
    worker_step_s: float = 0.0
    fills: dict[str, tuple[int, int]] = field(default_factory=dict)  # request -> (content index, tokens)
    released: list[Any] = field(default_factory=list)  # layerwise forwards: (stages released by hooks, stages)
    fail: set[str] = field(default_factory=set)  # endpoint request ids whose first posted transfer NIXL fails

    @classmethod
    def start(cls, spec: EngineSpec) -> Engine:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        workers = Workers(spec)
        vc, kv_cfg, _ = build(spec)
        vc.cache_config.num_gpu_blocks = kv_cfg.num_blocks
        sched = Scheduler(
            vllm_config=vc,
            kv_cache_config=kv_cfg,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=spec.logical_block_size,
        )
        return cls(spec, workers, vc, kv_cfg, sched)

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def add(self, request_id: str, tokens: list[int], params: dict[str, Any] | None, index: int) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=1 if params and params.get("do_remote_decode") else 2)
        sp.update_from_generation_config({}, 50256)
        req = Request(request_id=request_id, prompt_token_ids=list(tokens), sampling_params=sp, pooling_params=None)
        req.kv_transfer_params = params
        self.scheduler.add_request(req)
        self.fills[request_id] = (index, len(tokens))
        return req

    def step(self) -> dict[str, Any]:
        """One engine step; returns the finished requests' ``kv_transfer_params`` by request id."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        self.metas.append(meta)
        work = self._forward_work(so) if self.spec.layerwise else []
        if work:
            fail, self.fail = sorted(self.fail), set()
            results = self.workers.call("forward", meta, work, fail)
        else:
            if self.spec.mode and so.scheduled_new_reqs and not self.spec.layerwise:  # the prefill "forward"
                fills = []
                for new in so.scheduled_new_reqs:
                    if new.req_id in self.fills and self._is_prefill(new.req_id):
                        index, tokens = self.fills[new.req_id]
                        ids = self.connector.scheduler.clip(self.scheduler.kv_cache_manager.get_block_ids(new.req_id))
                        fills.append((ids, index, tokens))
                if fills:
                    self.workers.call("fill", fills)
            results = self.workers.call("step", meta)
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        invalid: set[int] = set()
        for s, r, f, inv, stats, dt, released in results:
            self.worker_step_s += dt
            if released is not None:
                self.released.append(released)
            for kind, ids, done in (("send", s, sending), ("recv", r, recving)):
                for rid in ids:
                    n = self.pending[kind].get(rid, 0) + 1
                    if n == self.spec.tp:
                        self.pending[kind].pop(rid, None)
                        done.add(rid)
                    else:
                        self.pending[kind][rid] = n
            failed |= f
            invalid |= inv
            if stats:
                self.stats.append(stats)
        req_ids = list(so.num_scheduled_tokens)
        kv_out = KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            failed_recving=failed,
            invalid_block_ids=invalid,
        )
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[self._sampled(r) for r in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kv_out,
        )
        finished: dict[str, Any] = {}
        for eco in self.scheduler.update_from_output(so, mro).values():
            for out in eco.outputs:
                if out.finish_reason is not None:
                    finished[out.request_id] = out.kv_transfer_params
                    self.finish_reasons[out.request_id] = out.finish_reason
        self.outputs.update(finished)
        return finished

    def _sampled(self, rid: str) -> list[int]:
        """What the model runner samples for ``rid`` this step: nothing for a prefill chunk that is not the last
        (vLLM discards it), else one token."""
        req = self.scheduler.requests.get(rid)
        return [] if req is not None and req.num_computed_tokens < req.num_tokens else [7]

    def _forward_work(self, so: Any) -> list[tuple[list[list[int]], int, int, bool]]:
        """This step's prefill computation: ``(blocks, content index, tokens computed after it, last chunk)`` per
        prefill request it schedules."""
        computed = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        work = []
        for rid, n in so.num_scheduled_tokens.items():
            if rid not in self.fills or not self._is_prefill(rid):
                continue
            covered = computed[rid] + n
            last = covered >= self.scheduler.requests[rid].num_prompt_tokens
            ids = self.connector.scheduler.clip(self.scheduler.kv_cache_manager.get_block_ids(rid))
            work.append((ids, self.fills[rid][0], covered, last))
        return work

    def _is_prefill(self, rid: str) -> bool:
        req = self.scheduler.requests.get(rid)
        return bool(req is not None and req.kv_transfer_params and req.kv_transfer_params.get("do_remote_decode"))

    def idle(self) -> bool:
        return not self.scheduler.requests and not any(self.pending.values())

    def counter(self, key: str) -> int:
        """Counter ``key`` of the connector's stats (``stats.COUNTERS``), summed over every step and worker."""
        return sum(int(s.get(key, 0)) for s in self.stats)

    def close(self) -> None:
        self.workers.close()


def run_until(engines: list[Engine], done: Any, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > end:
            raise TimeoutError("engines did not reach the expected state in time")
        for e in engines:
            e.step()


def prompt(index: int, n: int) -> list[int]:
    return [(index * 131 + i * 7) % 1000 + 1 for i in range(n)]


def cpu_count_ok() -> bool:
    return (os.cpu_count() or 1) >= 1


# ---------------------------------------------------------------------------------------------- one P -> D run


def move(p: Engine, d: Engine, lengths: list[int], *, first: int = 0) -> list[tuple[int, dict[str, Any]]]:
    """Prefill request ``first + i`` (a prompt of ``lengths[i]`` tokens, KV content ``first + i``) on ``p``, hand its
    ``kv_transfer_params`` to ``d`` as a router does, and run both engines until every decode request finished
    and ``p`` is idle. Returns ``(content index, kv_transfer_params as the prefill returned them)`` per request."""
    ids = [first + k for k in range(len(lengths))]
    for i, n in zip(ids, lengths, strict=True):
        p.add(f"p-{i}", prompt(i, n), {"do_remote_decode": True}, i)
        p.fills[f"p-{i}"] = (i, CONTENT_TOKENS)
    run_until([p], lambda: all(f"p-{i}" in p.outputs for i in ids))
    reqs = []
    for i, n in zip(ids, lengths, strict=True):
        params = dict(p.outputs[f"p-{i}"])
        reqs.append((i, dict(params)))  # as the prefill returned them (the decode's connector consumes its copy)
        d.add(f"d-{i}", prompt(i, n), params, i)
    run_until([p, d], lambda: all(f"d-{i}" in d.outputs for i in ids) and p.idle())
    return reqs


def stream_params(p: Engine, cap: str) -> dict[str, Any]:
    """A decode request's ``kv_transfer_params`` for a concurrent push from ``p``, as a router writes them."""
    return {
        "do_remote_prefill": True,
        "hkv_stream": cap,
        "remote_engine_id": p.spec.engine_id,
        "remote_host": p.spec.host,
        "remote_port": p.spec.port,
        "tp_size": p.spec.tp,
    }


def route_concurrent(
    p: Engine, d: Engine, lengths: list[int], *, first: int = 0, wait: bool = True
) -> list[tuple[int, dict[str, Any]]]:
    """Send request ``first + i`` (a prompt of ``lengths[i]`` tokens, KV content ``first + i``) to ``d`` and ``p``
    at once with one fresh capability, as a router doing concurrent push does: the decode requests first, then
    (``wait``) both engines step until every prefill worker holds the registrations and is connected to ``d``,
    so the prefill streams; then the prefill requests. Runs until every decode request finished and ``p`` is
    idle. Returns ``(content index, the prefill's returned kv_transfer_params)`` per request."""
    caps = {}
    for k, n in enumerate(lengths):
        i = first + k
        caps[i] = os.urandom(16).hex()
        d.add(f"d-{i}", prompt(i, n), stream_params(p, caps[i]), i)
    if wait:
        n, engine = len(lengths), d.spec.engine_id
        run_until([d, p], lambda: all(k >= n and engine in links for k, links in p.workers.call("stream_state")))
    for k, n in enumerate(lengths):
        i = first + k
        p.add(f"p-{i}", prompt(i, n), {"do_remote_decode": True, "hkv_stream": caps[i]}, i)
        p.fills[f"p-{i}"] = (i, CONTENT_TOKENS)
    ids = [first + k for k in range(len(lengths))]
    run_until([p, d], lambda: all(f"d-{i}" in d.outputs for i in ids) and p.idle())
    return [(i, dict(p.outputs[f"p-{i}"])) for i in ids]


def verify_moved(p: Engine, d: Engine, reqs: list[tuple[int, dict[str, Any]]]) -> int:
    """Check every byte of ``d``'s workers after ``move`` (or ``route_concurrent``): each request's blocks hold its
    content (attention cells for the tokens the transfer covers, whole SSM states) and no other byte changed;
    the check reports a wrong content; ``p``'s memory is unchanged; both engines are idle and ``p`` freed every
    block. Returns the number of decode bytes checked."""
    from hybrid_kv.integrations.vllm.layout import transfer_group_kinds

    recv = {rid: r for meta in d.metas for rid, r in meta.recv.items()}
    kinds = transfer_group_kinds(d.kv_cfg)
    checks = []
    for i, params in reqs:
        r = recv[f"d-{i}"]
        remote = params["remote_block_ids"]  # the prefill's blocks, as its output names them
        if not r.cap:
            assert r.remote_block_ids == remote
        moved = None
        for g, kind in enumerate(kinds):
            if kind != "ssm":
                moved = min(
                    len(remote[g]) * p.spec.logical_block_size,
                    len(r.local_block_ids[g]) * d.spec.logical_block_size,
                )
        checks.append((r.local_block_ids, i, CONTENT_TOKENS, moved))
    checked = 0
    for problem, nbytes in d.workers.call("verify", checks):
        assert problem is None, problem
        assert nbytes > 0
        checked += nbytes
    wrong = [(checks[0][0], checks[0][1] + 1000, CONTENT_TOKENS, checks[0][3])]
    assert all(problem is not None for problem, _ in d.workers.call("verify", wrong)), "the byte check is blind"
    for problem, _ in p.workers.call("verify", []):
        assert problem is None, f"prefill memory changed: {problem}"
    assert p.idle() and d.idle()
    assert p.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == p.kv_cfg.num_blocks - 1
    return checked
