"""``Links``: a worker's links to peer engines: handshakes in the background, requests parked until theirs ends,
and links to a restarted or dead peer dropped and made again.

Each peer engine a worker posts to (pull: the decode READs from prefill engines; push: the prefill WRITEs into
decode engines) has one ``PeerLink`` (``hybrid_kv.peer_link``): that engine's ``PeerPlan`` local tables as a scope
of the worker's endpoint, and its ranks as peers. Handshakes run in the background (``hybrid_kv.link_pool``): at
most one per engine, at most ``max_concurrent_handshakes`` engines at once, each fetch retried within the waiting
requests' ``transfer_timeout_s``. A request that needs a link that is not there is parked with callbacks run when
the handshake ends (``on_ready(link)`` or ``on_failed(reason)``), or when it waited ``transfer_timeout_s``.

A link is dropped (its peers disconnected, its scope released) when one of its peers is down (NIXL reported the
peer disconnected, e.g. the engine was killed), and when a peer rank turns out to be another instance than the one
linked (``claims.instance_of`` of its NIXL metadata: an engine restarted behind the same id and ports); the next
request naming that engine handshakes again, so a restarted engine is used again without restarting this one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..._core import handshake_target_ranks
from ...claims import instance_of
from ...connector_core.control import worker_name
from ...link_pool import LinkPool
from ...peer_link import PeerLink, PreparedLink, attach_link, prepare_link, target_addresses
from ...verify import algorithm, payload_mem_type
from .state import Registered

__all__ = ["Links", "Parked"]

log = logging.getLogger("hybrid_kv.integrations.vllm.worker")


@dataclass
class Parked:
    """A request waiting for a handshake: ``key`` (its request id) and what to run when it ends."""

    key: str
    deadline: float  # monotonic
    on_ready: Callable[[PeerLink], None]
    on_failed: Callable[[str], None]
    extra: Any = None  # the request itself, for its owner (a pull request's lease renewals)


class Links:
    """The links of one registered worker ``reg``."""

    def __init__(self, reg: Registered) -> None:
        self.reg = reg
        self.links: dict[str, PeerLink] = {}
        self.algos: dict[str, str] = {}  # engine -> digest algorithm for its transfers
        self.instances: dict[str, dict[int, str]] = {}  # engine -> rank -> the instance linked
        self._pool: LinkPool[PreparedLink] = LinkPool(reg.name, reg.cfg.max_concurrent_handshakes)
        self._parked: dict[str, list[Parked]] = {}  # engine -> requests waiting for its handshake

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self.links

    def __iter__(self) -> Iterator[str]:
        """The engines linked now."""
        return iter(self.links)

    def get(self, engine_id: str) -> PeerLink | None:
        """The link to ``engine_id`` if it is there and none of its peers is down (else it is dropped)."""
        link = self.links.get(engine_id)
        if link is None:
            return None
        for key in link.peer_keys():
            state, reason = self.reg.ep.peer_state(key)
            if state == "down":
                self.drop(engine_id, f"peer {key} is down: {reason}")
                return None
        return link

    def link(
        self,
        engine_id: str,
        host: str,
        port: int,
        tp_size: int,
        parked: Parked | None = None,
    ) -> PeerLink | None:
        """The live link to ``engine_id``; else start its handshake (once) and park ``parked`` until it ends."""
        link = self.get(engine_id)
        if link is not None:
            return link
        if engine_id not in self._pool:
            log.info(
                "hybrid-kv %s: handshake with %s (%s:%d, TP %d) started", self.reg.name, engine_id, host, port, tp_size
            )
            deadline = time.monotonic() + self.reg.cfg.transfer_timeout_s
            self._pool.submit(engine_id, self._handshake, engine_id, host, port, tp_size, deadline)
        if parked is not None:
            waiting = self._parked.setdefault(engine_id, [])
            if all(p.key != parked.key for p in waiting):
                waiting.append(parked)
        return None

    def parked(self) -> list[Parked]:
        return [p for waiting in self._parked.values() for p in waiting]

    def drop(self, engine_id: str, reason: str) -> None:
        """Close the link to ``engine_id`` (its requests in flight fail); the next request links again."""
        link = self.links.pop(engine_id, None)
        self.instances.pop(engine_id, None)
        if link is None:
            return
        log.warning("hybrid-kv %s: link to %s dropped: %s", self.reg.name, engine_id, reason)
        self.reg.stats.count("num_dropped_links")
        try:
            link.close()
        except Exception as exc:  # noqa: BLE001 - a closed endpoint released it already
            log.debug("hybrid-kv %s: closing the link to %s: %s", self.reg.name, engine_id, exc)

    def stale(self, engine_id: str, rank: int, instance: str) -> bool:
        """Whether ``instance``, as rank ``rank`` of ``engine_id`` says it is now, is not the one linked."""
        linked = self.instances.get(engine_id, {}).get(rank)
        return bool(instance) and linked is not None and linked != instance

    def poll(self) -> None:
        """Adopt finished handshakes and run the requests parked on them; a failed handshake fails exactly those
        requests (the next request to that engine starts a new one); a request parked longer than
        ``transfer_timeout_s`` fails too."""
        for engine_id, fut in self._pool.take_done():
            waiting = self._parked.pop(engine_id, [])
            try:
                link = self._attach(fut.result())
            except Exception as exc:  # noqa: BLE001 - a failed handshake fails its requests, never the step
                self.reg.stats.count("num_failed_handshakes")
                log.error("hybrid-kv %s: handshake with %s failed: %s", self.reg.name, engine_id, exc)
                for p in waiting:
                    p.on_failed(f"handshake with {engine_id} failed: {exc}")
                continue
            self.links[engine_id] = link
            for p in waiting:
                p.on_ready(link)
        now = time.monotonic()
        for engine_id, waiting in list(self._parked.items()):
            late = [p for p in waiting if now >= p.deadline]
            if late:
                self._parked[engine_id] = [p for p in waiting if now < p.deadline]
                for p in late:
                    p.on_failed(f"handshake with {engine_id} not done within {self.reg.cfg.transfer_timeout_s} s")

    def close(self) -> None:
        """Wait for handshakes still running (they have deadlines) and forget every link (the endpoint closes
        their handles)."""
        self._pool.shutdown()
        self.links.clear()

    def _handshake(self, engine_id: str, host: str, port: int, tp_size: int, deadline: float) -> PreparedLink:
        """Fetch and plan a link to ``engine_id`` (a handshake thread; no NIXL, no shared state)."""
        reg = self.reg
        return prepare_link(
            reg.table,
            reg.payload,
            target_addresses(host, port, reg.tp_rank, reg.tp_size, tp_size),
            reg.cfg.mode,
            sender=reg.name,
            timeout_s=reg.cfg.handshake_timeout_s,
            deadline=deadline,
            coalesce=reg.cfg.coalesce,
            engine_id=engine_id,
            expected_tp_size=tp_size,
            names={r: worker_name(engine_id, r) for r in handshake_target_ranks(reg.tp_rank, reg.tp_size, tp_size)},
        )

    def _attach(self, prepared: PreparedLink) -> PeerLink:
        """Connect a prepared link on the worker's endpoint (its thread): the engine's tables become its own scope."""
        reg = self.reg
        t0 = time.perf_counter()
        old = self.links.pop(prepared.engine_id, None)
        if old is not None:  # a second handshake ended while the first link lived (dropped meanwhile): replace it
            old.close()
        link = attach_link(reg.ep, prepared, prepared.engine_id, timeout_s=reg.cfg.handshake_timeout_s)
        peer_mem = [payload_mem_type(r.payload) for r in prepared.replies.values()]
        self.algos[prepared.engine_id] = algorithm(reg.table.mem_type, *peer_mem)
        self.instances[prepared.engine_id] = {r: instance_of(reply.nixl_md) for r, reply in prepared.replies.items()}
        log.info(
            "hybrid-kv %s: connected to %s ranks %s (tp ratio %d) in %.1f ms",
            reg.name,
            link.engine_id,
            link.targets,
            link.plan.tp_ratio,
            (time.perf_counter() - t0) * 1e3,
        )
        return link
