"""The scheduler half: which requests load KV from a prefill engine, which keep their blocks for a decode
engine (with a lease), and the ``kv_transfer_params`` the two engines (through a router) exchange.

``kv_transfer_params`` use vLLM's NixlConnector fields: ``do_remote_prefill``/``do_remote_decode``,
``remote_engine_id``, ``remote_request_id``, ``remote_block_ids`` (one list per transfer group, HMA),
``remote_host``/``remote_port`` (the side channel of TP rank 0 of that engine; rank ``r`` listens on
``port + r``), ``tp_size``, ``remote_num_tokens`` and ``transfer_mode``; plus ``lease_expires_at`` (the
wall-clock time after which the prefill engine may free the blocks: a decode read ending later is a failure).
Those fields are for routers only: the decode acts on nothing but ``hkv_ticket``, the prefill's signed ticket
(``tickets``), checked once by ``params.TransferParams``. No hook raises for any ``kv_transfer_params``: a
request whose params are refused fails alone, through the worker's failed-load path (so vLLM's
``kv_load_failure_policy`` applies), with the reason logged in one line.

Concurrent push (streaming): a router may send a request to the prefill and the decode engine at once, with
one fresh random capability ``hkv_stream`` in both (``params``). The decode then registers its blocks with the
prefill engine the router named, before the prefill's forward ends; the prefill scheduler tells its workers,
in the step that runs a request's last prefill chunk, that the request may stream (``StreamSend``: its
capability and blocks), and the workers post each layer's KV as the forward produces it. Such a request's
blocks are held until its workers report what they posted as ended, whatever way it ends (``stream_ended``
for an abort).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

from ...connector_core.config import ConnectorConfig
from ...connector_core.params import StreamGrant, TransferParams, parse_engines, parse_networks, stream_cap
from ...connector_core.tickets import (
    ALREADY_USED,
    TICKET_FIELD,
    TICKET_VERSION,
    Ticket,
    TicketError,
    TicketKey,
)
from ...transport.auth import resolve_secret
from ...verify_policy import VerifyPolicy
from ...wire import GRANT_BYTES
from .metadata import BlockIds, HybridKvMetadata, RecvReq, SendLease, StreamSend
from .stats import HybridKvStats

__all__ = ["SchedulerHalf"]

log = logging.getLogger("hybrid_kv.integrations.vllm.scheduler")


def _wants_remote(params: Any, key: str) -> bool:
    """Whether untrusted ``kv_transfer_params`` ask for ``key`` (``do_remote_prefill``/``do_remote_decode``)."""
    return isinstance(params, dict) and params.get(key) is True


class SchedulerHalf:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, engine_id: str, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.kv_cache_config = kv_cache_config
        pc = vllm_config.parallel_config
        self.tp_size = int(pc.tensor_parallel_size)
        self.host = cfg.advertise_host
        self.port = cfg.worker_port(int(getattr(pc, "data_parallel_index", 0) or 0), self.tp_size, 0)
        self.hma = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        groups = list(kv_cache_config.transfer_groups)
        self.has_mamba = any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups)
        # per transfer group: blocks a sliding window keeps (+1 for misalignment), SSM speculative slots
        self._window = [
            -(-g.kv_cache_spec.sliding_window // g.kv_cache_spec.block_size) + 1
            if isinstance(g.kv_cache_spec, SlidingWindowSpec)
            else 0
            for g in groups
        ]
        self._ssm_spec = [
            g.kv_cache_spec.num_speculative_blocks if isinstance(g.kv_cache_spec, MambaSpec) else None for g in groups
        ]
        self._recv: dict[str, RecvReq] = {}
        self._send: dict[str, SendLease] = {}
        self.tickets = TicketKey(
            resolve_secret(None, insecure=cfg.insecure, required=True, what=f"engine {engine_id!r}")
        )
        self.params = TransferParams(
            self.tickets,
            cfg.mode,
            len(groups),
            parse_networks(cfg.peer_networks),
            stream_ttl_s=cfg.push_registration_timeout_s + cfg.lease_s + cfg.lease_max_extension_s,
            engines=parse_engines(cfg.peer_engines),
        )
        self._aborted: set[str] = set()
        self._verify = VerifyPolicy.parse(cfg.verify)
        self._loads = 0  # requests loaded from a prefill engine so far (``verify=sampled:N`` counts them)
        # prefill side, concurrent push: requests with a capability (request, capability), the capabilities live
        # here, the requests whose last prefill step was handed to the workers to stream, and those that ended
        # aborted after it (their blocks held until the workers report them)
        self._caps: dict[str, tuple[Any, bytes]] = {}
        self._live_caps: set[bytes] = set()
        self._streamed: set[str] = set()
        self._stream: dict[str, StreamSend] = {}
        self._stream_ended: set[str] = set()
        self.stats = HybridKvStats()
        log.info(
            "hybrid-kv scheduler %s: mode %s, side channel %s:%d (TP %d), HMA %s",
            engine_id,
            cfg.mode,
            self.host,
            self.port,
            self.tp_size,
            self.hma,
        )

    # ------------------------------------------------------------------ helpers

    def clip(self, block_ids: Any) -> BlockIds:
        """A request's transferable blocks per transfer group: sliding windows keep their tail, SSM groups the
        running-state slot (vLLM's own clipping)."""
        if not block_ids:
            return []
        ids = list(self.kv_cache_config.select_transfer_block_ids(list(block_ids)))
        out = []
        for g, blocks in enumerate(ids):
            blocks = list(blocks)
            if self._window[g]:
                blocks = blocks[-self._window[g] :]
            elif blocks and self._ssm_spec[g] is not None:
                blocks = clip_ssm_state_blocks(blocks, self._ssm_spec[g])
            out.append([int(b) for b in blocks])
        return out

    def max_blocks(self, request: Any) -> list[int]:
        """Per transfer group, the most remote blocks a ticket may name for ``request``: one per prompt token
        (a block holds at least one), and for SSM groups the running state plus its speculative slots."""
        prompt = int(request.num_prompt_tokens) + 1
        return [prompt if spec is None else spec + 2 for spec in self._ssm_spec]

    def backoff(self) -> int:
        """Trailing prompt tokens the prefill leaves to the decode (SSM models: the decode recomputes the
        last token from the state after N-1 tokens)."""
        return 1 if self.has_mamba else 0

    # ------------------------------------------------------------------ KVConnectorBase_V1 scheduler hooks

    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        if not _wants_remote(params, "do_remote_decode") or params.get("_hkv_truncated"):
            return
        if self.cfg.mode == "push":
            self._note_cap(request, params)
        n = self.backoff()
        if n and request.num_prompt_tokens > n and request.prompt_token_ids is not None:
            del request.prompt_token_ids[-n:]
            del request._all_token_ids[-n:]
            request.num_prompt_tokens -= n
            params["_hkv_truncated"] = True
        request.max_tokens = 1

    def _note_cap(self, request: Any, params: dict[str, Any]) -> None:
        """Remember a prefill request's concurrent-push capability (untrusted: a malformed or duplicate one is
        ignored with a warning, and the request is pushed whole once it finished, as without one)."""
        try:
            cap = stream_cap(params)
        except TicketError as exc:
            log.warning("hybrid-kv: request %s: %s; it will not stream", request.request_id, exc)
            return
        except Exception as exc:  # noqa: BLE001 - never raise into vLLM's add_request
            log.warning("hybrid-kv: request %s: capability unreadable: %s", request.request_id, type(exc).__name__)
            return
        if cap is None:
            return
        if cap in self._live_caps:
            log.warning("hybrid-kv: request %s: its capability is in use by another request here", request.request_id)
            return
        self._live_caps.add(cap)
        self._caps[request.request_id] = (request, cap)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        t0 = time.perf_counter()
        params = request.kv_transfer_params
        count = 0
        if _wants_remote(params, "do_remote_prefill"):
            prompt = len(request.prompt_token_ids or [])
            n = self.backoff()
            count = max(0, (prompt - n if n and prompt > n else prompt) - num_computed_tokens)
        self.stats.add_time("scheduler_s", time.perf_counter() - t0)
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        t0 = time.perf_counter()
        params = request.kv_transfer_params
        if _wants_remote(params, "do_remote_prefill"):
            try:
                local = self.clip(blocks.get_unhashed_block_ids_all_groups()) if num_external_tokens > 0 else []
            except Exception as exc:  # noqa: BLE001 - never raise into vLLM's schedule()
                log.error("hybrid-kv: request %s: its blocks could not be read: %s", request.request_id, exc)
                local = []
            req = self._recv_req(request, local, params)
            if req.refused is None or any(local):  # a refused request with blocks to fill fails in the worker
                self._recv[request.request_id] = req
            params["do_remote_prefill"] = False
        self.stats.add_time("scheduler_s", time.perf_counter() - t0)

    def _recv_req(
        self,
        request: Any,
        local: BlockIds,
        params: dict[str, Any],
        max_blocks: list[int] | None = None,
        releasing: bool = False,
    ) -> RecvReq:
        """The request to load from ``params`` (untrusted): from its verified ticket only, or a refusal.
        ``max_blocks``: per group, the most remote blocks the ticket may name (default: what ``request`` can
        hold). ``releasing``: only to release the prefill's blocks; a ticket already used then is no news (the
        request that used it released them), so it is not logged as a refusal."""
        try:
            ticket = self.params.check(params, max_blocks or self.max_blocks(request), time.time())
        except Exception as exc:  # noqa: BLE001 - defence in depth: check() never raises; this hook must not
            ticket = f"kv_transfer_params could not be checked: {type(exc).__name__}"
        if isinstance(ticket, str):
            if releasing and ticket.endswith(ALREADY_USED):
                log.debug("hybrid-kv: request %s: nothing to release: %s", request.request_id, ticket)
                return RecvReq.refusal(request.request_id, local, ticket)
            self.stats.count("num_refused_tickets")
            log.warning("hybrid-kv: request %s refused: %s", request.request_id, ticket)
            return RecvReq.refusal(request.request_id, local, ticket)
        if isinstance(ticket, StreamGrant):
            return RecvReq(
                request_id=request.request_id,
                local_block_ids=local,
                remote_engine_id=ticket.engine_id,
                remote_request_id="",
                remote_block_ids=[],
                remote_host=ticket.host,
                remote_port=ticket.port,
                remote_tp_size=ticket.tp_size,
                cap=ticket.cap,
                verify=self._verify_next(),
            )
        return RecvReq(
            request_id=request.request_id,
            local_block_ids=local,
            remote_engine_id=ticket.engine_id,
            remote_request_id=ticket.request_id,
            remote_block_ids=ticket.block_ids,
            remote_host=ticket.host,
            remote_port=ticket.port,
            remote_tp_size=ticket.tp_size,
            ticket=str(params[TICKET_FIELD]),
            lease_expires_at=ticket.expires_at,
            max_lease_expires_at=ticket.max_expires_at,
            grant=ticket.grant,
            verify=self._verify_next(),
        )

    def _verify_next(self) -> bool:
        """Whether the next request loaded from a prefill engine is verified (``verify``: every one, every Nth, or
        none; decided here so every worker of the request agrees)."""
        chosen = self._verify.selects(self._loads)
        self._loads += 1
        return chosen

    def build_connector_meta(self, scheduler_output: Any) -> HybridKvMetadata:
        t0 = time.perf_counter()
        if self._caps and self.cfg.stream:
            try:
                self._find_last_prefill_steps(scheduler_output)
            except Exception as exc:  # noqa: BLE001 - never raise into vLLM's schedule(): those push whole
                log.error("hybrid-kv: finding this step's streaming requests failed: %s", exc)
        meta = HybridKvMetadata(
            recv=self._recv,
            send=self._send,
            aborted=self._aborted,
            stream=self._stream,
            stream_ended=self._stream_ended,
        )
        self._recv, self._send, self._aborted, self._stream, self._stream_ended = {}, {}, set(), {}, set()
        self.stats.add_time("scheduler_s", time.perf_counter() - t0)
        return meta

    def _find_last_prefill_steps(self, so: Any) -> None:
        """The requests with a capability whose last prefill chunk this step computes, with their blocks (vLLM's
        ``kv_connector_block_state``; without it, none streams). Called before vLLM advances the requests'
        ``num_computed_tokens`` past this step."""
        state = getattr(so, "kv_connector_block_state", None)
        if state is None:
            return
        for rid, n in so.num_scheduled_tokens.items():
            entry = self._caps.get(rid)
            if entry is None or rid in self._streamed:
                continue
            request, cap = entry
            if int(request.num_computed_tokens) + int(n) < int(request.num_prompt_tokens):
                continue  # an earlier chunk: SSM state is final only after the last one
            ids = state.get_block_ids(rid)
            if ids is None:
                continue
            self._streamed.add(rid)
            self._stream[rid] = StreamSend(cap, self.clip(ids))

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        t0 = time.perf_counter()
        try:
            entry = self._caps.pop(request.request_id, None)
            cap = b"" if entry is None else entry[1]
            self._live_caps.discard(cap)
            streamed = request.request_id in self._streamed
            self._streamed.discard(request.request_id)
            params = request.kv_transfer_params
            if _wants_remote(params, "do_remote_prefill"):
                # never loaded here: aborted before its blocks were allocated, or rejected by vLLM's API server before
                # it reached the engine (vLLM then finishes a stand-in with a one-token prompt). Tell the prefill
                # engine to free its blocks. Its ids are bounded by what this engine could hold, not by this
                # request's prompt (a release sizes nothing by them).
                most = [int(self.kv_cache_config.num_blocks)] * len(self._ssm_spec)
                req = self._recv_req(request, [], params, most, releasing=True)
                if req.refused is None:
                    req.release_only = True
                    self._recv[request.request_id] = req
                params["do_remote_prefill"] = False
                return False, None
            if not _wants_remote(params, "do_remote_decode"):
                return False, None
            if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
                if streamed:  # its workers may have posted some of its KV: held until that ended
                    self._stream_ended.add(request.request_id)
                    return True, None
                self._aborted.add(request.request_id)
                return False, None
            ids = self.clip(block_ids)
            delay = any(ids) or streamed
            grant = os.urandom(GRANT_BYTES)
            # the workers' leases start when they receive this step's metadata, i.e. no earlier
            expires = time.time() + self.cfg.lease_s
            if delay:
                self._send[request.request_id] = SendLease(
                    ids, self.cfg.lease_s, grant, self.cfg.lease_max_extension_s, cap=cap
                )
            ticket = Ticket(
                version=TICKET_VERSION,
                engine_id=self.engine_id,
                request_id=request.request_id,
                grant=grant,
                block_ids=ids,
                host=self.host,
                port=self.port,
                tp_size=self.tp_size,
                num_tokens=int(request.num_computed_tokens),
                expires_at=expires,
                max_expires_at=expires + self.cfg.lease_max_extension_s,
                mode=self.cfg.mode,  # type: ignore[arg-type]  # checked by ConnectorConfig
            )
            return delay, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.engine_id,
                "remote_request_id": request.request_id,
                "remote_block_ids": ids,
                "remote_host": self.host,
                "remote_port": self.port,
                "tp_size": self.tp_size,
                "remote_num_tokens": int(request.num_computed_tokens),
                "lease_expires_at": expires if delay else None,
                "transfer_mode": self.cfg.mode,
                TICKET_FIELD: self.tickets.issue(ticket),
            }
        finally:
            self.stats.add_time("scheduler_s", time.perf_counter() - t0)
