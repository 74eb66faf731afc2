"""One NIXL agent per worker, one peer link, bounded handshakes.

A decode endpoint links to several prefill engines (real endpoints, real NIXL agents, real READs of Kimi-like
ranks whose bytes are checked against the logical model): it holds one agent and one registration whatever the
number of engines, each link adds only its scope of local tables and its peers, and unlinking one releases
exactly its handles. Handshakes with different engines never wait behind each other.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from pd_helpers import KimiRank  # noqa: E402

from hybrid_kv.demo.content import Content, expect_decode, fill_prefill  # noqa: E402
from hybrid_kv.demo.run import DemoConfig, make_requests  # noqa: E402
from hybrid_kv.link_pool import LinkPool  # noqa: E402
from hybrid_kv.peer_link import PeerLink, attach_link, fetch_replies, link_peer, prepare_link  # noqa: E402
from hybrid_kv.transport import Endpoint, HandshakeError, TransferError  # noqa: E402

ENGINES = 8


class Prefill:
    """One prefill engine (TP 1) in this process: a Kimi-like rank filled with the requests' content."""

    def __init__(self, i: int, reqs: list[Any], num_blocks: int) -> None:
        self.seed = 100 + i
        self.rank = KimiRank("prefill", num_blocks, self.seed)
        for r in reqs:
            c = Content(self.rank.side.preset, self.seed, r.index, r.content_tokens)
            fill_prefill(self.rank.pools, self.rank.side, 0, r, c, self.seed)
        self.ep = Endpoint(
            f"P{i}",
            self.rank.table.registration(),
            {"whole": self.rank.table.local_rows()},
            metadata_provider=lambda rank: self.rank.payload,
        )


@pytest.fixture
def world() -> Iterator[tuple[KimiRank, list[Prefill], list[Any]]]:
    cfg = DemoConfig(prefill_tp=1, decode_tp=1, requests=ENGINES, tokens=100)
    p_side, d_side = cfg.validate()
    reqs = make_requests(cfg, p_side, d_side)
    decode = KimiRank("decode", d_side.num_blocks, 3)
    prefills = [Prefill(i, reqs, p_side.num_blocks) for i in range(ENGINES)]
    try:
        yield decode, prefills, reqs
    finally:
        for p in prefills:
            p.ep.close()


def _pump(d: Endpoint, prefills: list[Prefill], n: int, timeout_s: float = 10.0) -> tuple[list[str], list[Any]]:
    done: list[str] = []
    failed: list[Any] = []
    end = time.monotonic() + timeout_s
    while len(done) + len(failed) < n:
        ev = d.poll()
        done += ev.done
        failed += ev.failed
        for p in prefills:
            p.ep.poll()
        assert time.monotonic() < end, f"timed out: done {done}, failed {failed}"
        time.sleep(0.0005)
    return done, failed


def test_eight_engines_share_one_agent_and_one_registration(
    world: tuple[KimiRank, list[Prefill], list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import hybrid_kv.transport.agent as agent_mod

    decode, prefills, reqs = world
    agents: list[str] = []
    registrations: list[int] = []
    real_agent = agent_mod.nixl_agent

    def counting_agent(name: str, config: Any) -> Any:
        agents.append(name)
        nixl = real_agent(name, config)
        real_register = nixl.register_memory

        def register(*a: Any, **kw: Any) -> Any:
            registrations.append(1)
            return real_register(*a, **kw)

        nixl.register_memory = register
        return nixl

    monkeypatch.setattr(agent_mod, "nixl_agent", counting_agent)
    d = Endpoint("D", decode.table.registration(), {})
    links: list[PeerLink] = []
    with d:
        for i, p in enumerate(prefills):
            links.append(
                link_peer(
                    d, decode.table, decode.payload, {0: p.ep.address}, "pull", scope=f"p{i}", sender="D", timeout_s=5.0
                )
            )
            assert agents == ["D"] and len(registrations) == 1  # no agent and no registration per engine
        counts = d.handle_counts()
        # every link's plan holds the rank's one base table (one read-only array), prepped once for all
        assert all(list(lk.local_tables) == ["whole"] for lk in links)
        assert all(lk.local_tables["whole"] is links[0].local_tables["whole"] for lk in links)
        assert not links[0].local_tables["whole"].flags.writeable
        assert counts == {
            "xfer": 0,
            "zombie_xfer": 0,
            "local_dlists": 1,
            "remote_dlists": ENGINES,
            "remote_agents": ENGINES,
            "registrations": 1,
        }
        assert d.local_scopes() == sorted(f"p{i}" for i in range(ENGINES))

        # every engine's request READ through the one agent, every byte checked
        before = decode.snapshot()
        for i, lk in enumerate(links):
            d.post(reqs[i].rid, lk.transfers(reqs[i].decode_ids, reqs[i].prefill_ids), "READ", 10.0)
        done, failed = _pump(d, prefills, ENGINES)
        assert sorted(done) == sorted(r.rid for r in reqs) and not failed
        want = before
        for i, p in enumerate(prefills):
            c = Content(p.rank.side.preset, p.seed, reqs[i].index, reqs[i].content_tokens)
            want = expect_decode(want, decode.side, p.rank.side, 0, [reqs[i]], [c])
        for got, w in zip(decode.pools, want, strict=True):
            assert np.array_equal(got, w)

        # unlinking one engine releases exactly its handles; the others keep serving
        gone = links.pop(3)
        gone.close()
        after = d.handle_counts()
        assert after["local_dlists"] == 1  # still held by the other links
        assert (after["remote_dlists"], after["remote_agents"], after["registrations"]) == (ENGINES - 1, ENGINES - 1, 1)
        assert "p3" not in d.local_scopes()
        with pytest.raises(TransferError, match=r"peer \('p3', 0\) is not connected"):
            d.post("late", gone.transfers(reqs[3].decode_ids, reqs[3].prefill_ids), "READ", 5.0)
        d.post("again", links[0].transfers(reqs[0].decode_ids, reqs[0].prefill_ids), "READ", 10.0)
        assert _pump(d, prefills, 1)[0] == ["again"]
        for lk in links[:-1]:
            lk.close()
        assert d.handle_counts()["local_dlists"] == 1  # the last link still posts from it
        d.post("last", links[-1].transfers(reqs[7].decode_ids, reqs[7].prefill_ids), "READ", 10.0)
        assert _pump(d, prefills, 1)[0] == ["last"]
        links[-1].close()
        assert d.handle_counts()["local_dlists"] == 0 and len(d._agent.shared) == 0
    assert d.handle_counts() == {k: 0 for k in counts}
    assert agents == ["D"] and len(registrations) == 1


def test_a_scope_in_use_is_not_removed_and_a_failed_link_leaves_nothing(
    world: tuple[KimiRank, list[Prefill], list[Any]],
) -> None:
    decode, prefills, _ = world
    with Endpoint("D", decode.table.registration(), {}) as d:
        lk = link_peer(
            d, decode.table, decode.payload, {0: prefills[0].ep.address}, "pull", scope="a", sender="D", timeout_s=5.0
        )
        with pytest.raises(
            TransferError, match=r"scope 'a' is still used by peer\(s\) \('a', 0\); disconnect them first"
        ):
            d.remove_local_tables("a")
        with pytest.raises(ValueError, match="local table scope 'a' already exists"):
            d.add_local_tables("a", lk.local_tables)
        empty = d.handle_counts()
        lk.close()
        lk.close()  # idempotent
        assert d.handle_counts()["local_dlists"] == empty["local_dlists"] - len(lk.local_tables)
        # a link whose connect fails (the peer's NIXL agent is not the one it claims) releases its scope again
        prepared = prepare_link(
            decode.table, decode.payload, {0: prefills[1].ep.address}, "pull", sender="D", timeout_s=5.0
        )
        bad = prepared.replies[0]._replace(name="someone-else")
        prepared.replies[0] = bad
        before = d.handle_counts()
        with pytest.raises(HandshakeError, match="refused: it is 'someone-else'|answered as 'someone-else'"):
            attach_link(d, prepared, "b", timeout_s=5.0)
        assert d.handle_counts() == before and d.local_scopes() == []


def test_a_silent_peer_is_retried_within_the_deadline() -> None:
    """A first fetch that times out is tried again while the deadline allows: the peer process is
    stopped (SIGSTOP) through the first attempt and resumed before the second."""
    from _peers import Peer, payload_for

    with Peer("PS", seed=5) as peer:
        want = len(payload_for(peer.data))  # its buffer's address in the peer process
        peer.signal(signal.SIGSTOP)
        resume = threading.Timer(0.8, peer.signal, args=(signal.SIGCONT,))
        try:
            with pytest.raises(HandshakeError, match="attempt 1"):  # no deadline: one attempt only
                fetch_replies({0: peer.address}, "D", 0.5)
            t0 = time.monotonic()
            resume.start()
            replies = fetch_replies({0: peer.address}, "D", 0.6, deadline=time.monotonic() + 6.0)
            assert len(replies[0].payload) == want and replies[0].name == "PS"
            assert 0.6 <= time.monotonic() - t0 < 6.5  # a second attempt (the first timed out), within the deadline
            peer.signal(signal.SIGSTOP)
            with pytest.raises(HandshakeError, match="attempt 1"):  # a deadline with no room for a second attempt
                fetch_replies({0: peer.address}, "D", 0.6, deadline=time.monotonic() + 0.9)
            t0 = time.monotonic()
            with pytest.raises(HandshakeError, match="attempt 3"):  # never answering: given up after 3 attempts
                fetch_replies({0: peer.address}, "D", 0.3, deadline=time.monotonic() + 60.0)
            assert time.monotonic() - t0 < 10.0
        finally:
            resume.cancel()
            peer.signal(signal.SIGCONT)


@pytest.mark.slow
def test_an_unreachable_engine_does_not_delay_another(
    world: tuple[KimiRank, list[Prefill], list[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """A ticket naming a host that never answers holds one handshake slot for its timeout; another
    engine's handshake runs beside it. With the bound at 1 the second waits, and the log says why."""
    decode, prefills, _ = world
    mute = socket.socket()  # a host that accepts the TCP connection and then never says a word
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    dead = {0: f"tcp://127.0.0.1:{mute.getsockname()[1]}"}
    live = {0: prefills[0].ep.address}

    def handshake(addresses: dict[int, str]) -> Any:
        return prepare_link(decode.table, decode.payload, addresses, "pull", sender="D", timeout_s=3.0)

    try:
        for bound in (2, 1):
            pool: LinkPool[Any] = LinkPool("D", bound)
            t0 = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="hybrid_kv.link_pool"):
                assert pool.submit("dead", handshake, dead)
                assert not pool.submit("dead", handshake, dead)  # one handshake per engine
                assert pool.submit("live", handshake, live)
            ended: dict[str, float] = {}
            while len(ended) < 2:
                for engine, fut in pool.take_done():
                    ended[engine] = time.monotonic() - t0
                    if engine == "live":
                        assert fut.result().replies[0].payload == prefills[0].rank.payload
                    else:
                        with pytest.raises(HandshakeError, match="fetching rank 0's metadata .* failed"):
                            fut.result()
                time.sleep(0.01)
            pool.shutdown()
            if bound == 2:
                assert ended["live"] < 1.5 < 3.0 <= ended["dead"], ended
                assert "handshakes in flight" not in caplog.text
            else:
                assert ended["live"] >= 3.0, ended  # the bound makes it wait, as one thread did for every engine
                assert "1 handshakes in flight (max_concurrent_handshakes = 1); the handshake with live waits" in (
                    caplog.text
                )
    finally:
        mute.close()
