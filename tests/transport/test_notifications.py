"""Hostile NIXL notifications, sent by real NIXL agents in one process: a writer ``P``, a passive
endpoint ``D`` and ``X``, another agent that loaded D's metadata (so NIXL delivers its notices to D). Malformed
notices never raise out of ``poll()``; a request awaited from named writers completes or fails only by their
notices; partial done-sets are capped per sender and in total."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _peers import pattern, pump, registration, tables

from hybrid_kv.transport import Endpoint, RequestState, notifications
from hybrid_kv.transport import inbox as inbox_mod


@pytest.fixture
def trio() -> Iterator[tuple[Endpoint, Endpoint, Endpoint]]:
    bufs = [pattern(i) for i in (1, 2, 3)]
    eps = [Endpoint(n, registration(b.ctypes.data), tables(b.ctypes.data)) for n, b in zip("PDX", bufs, strict=True)]
    p, d, x = eps
    try:
        for ep in (p, x):  # both can notify D (they loaded its metadata); D connects to neither
            ep.connect(0, d.address, lambda payload: {}, timeout_s=5.0)
        yield p, d, x
    finally:
        for ep in eps:
            ep.close()
        del bufs


def _send(ep: Endpoint, msg: bytes) -> None:
    ep._agent.nixl.send_notif("D", msg)


def _settle(d: Endpoint, others: list[Endpoint], rounds: int = 50) -> list[tuple[str, bytes]]:
    """Poll ``d`` until quiet; returns the unknown (non-hybrid-kv) notifications it passed on."""
    out: list[tuple[str, bytes]] = []
    for _ in range(rounds):
        for o in others:
            o.poll()
        out += d.poll().notifs
    return out


@pytest.mark.parametrize(
    "msg",
    [
        "hkv:done:²:1:r".encode(),
        "hkv:done:0:²:r".encode(),
        "hkv:done:٣:4:r".encode(),  # an Arabic-Indic digit passes str.isdigit()
        b"hkv:done:" + b"9" * 5000 + b":1:r",
        b"hkv:done:0:" + b"9" * 5000 + b":r",
        b"hkv:done:00:2:r",
        b"hkv:done:2:2:r",  # index not below count
        b"hkv:done:0:0:r",
        b"hkv:done:0:4097:r",  # more transfers than one request may post to one peer
        b"hkv:done:0:1:",
        b"hkv:done:-1:2:r",
        b"hkv:done:0:1:" + b"r" * 5000,
        b"hkv:fail:" + b"r" * 5000 + b":x",
        b"hkv:fail:norest",
        b"hkv:fail::reason",
        b"hkv:done:0:1:\xff",
        b"hkv:dgst:0:1:0123456789abcdef",  # no request id
        b"hkv:dgst:0:1:0123456789ABCDEF:r",  # upper-case hex
        b"hkv:dgst:0:1:0123456789abcde:r",  # 15 digits
        b"hkv:dgst:0:1:0123456789abcdef0:r",  # 17 digits
        b"hkv:dgst:1:1:0123456789abcdef:r",
    ],
)
def test_malformed_notices_are_not_notices(msg: bytes) -> None:
    assert notifications.parse(msg) is None


def test_notices_still_round_trip_and_reasons_are_cut() -> None:
    assert notifications.parse(notifications.done_message("a:b", 4095, 4096)) == notifications.Notice(
        "done", "a:b", index=4095, count=4096
    )
    assert notifications.parse(notifications.done_message("a:b", 0, 2, 2**64 - 1)) == notifications.Notice(
        "done", "a:b", index=0, count=2, digest=2**64 - 1
    )
    assert notifications.done_message("r", 0, 1, 0xAB) == b"hkv:dgst:0:1:00000000000000ab:r"
    n = notifications.parse(notifications.fail_message("r", "x" * 10_000))
    assert n is not None and len(n.reason) == notifications.MAX_REASON_CHARS


def test_hostile_notices_never_raise_out_of_poll(trio: tuple[Endpoint, Endpoint, Endpoint]) -> None:
    """A done-notice with "²" or a 5000-digit index made ``poll()`` raise."""
    p, d, x = trio
    h = d.expect("push-1", 5.0, writers=["P"])
    hostile = ["hkv:done:²:1:push-1".encode(), b"hkv:done:" + b"9" * 5000 + b":1:push-1", b"hkv:done:0:1:\xff"]
    for m in hostile:
        _send(x, m)
    passed_on = _settle(d, [p, x])
    assert sorted(m for _, m in passed_on) == sorted(hostile)  # passed on as someone else's notifications
    assert h.state is RequestState.POSTED
    _send(p, notifications.done_message("push-1", 0, 1))
    ev = pump(d, lambda e: e.done, 3.0, others=[p, x])
    assert ev.done == ["push-1"]


def test_a_passive_request_completes_only_from_its_writers(trio: tuple[Endpoint, Endpoint, Endpoint]) -> None:
    """A forged done-notice from an agent that is not the request's writer completed a push
    request with 0 bytes landed; one that arrived before ``expect`` counts neither."""
    p, d, x = trio
    _send(x, notifications.done_message("early", 0, 1))  # X "lands" a request before D awaits it
    _settle(d, [p, x])
    early = d.expect("early", 5.0, writers=["P"])
    h = d.expect("push-1", 5.0, writers=["P"])
    _send(x, notifications.done_message("push-1", 0, 1))
    _settle(d, [p, x])
    assert h.state is RequestState.POSTED and early.state is RequestState.POSTED
    _send(p, notifications.done_message("push-1", 0, 1))
    _send(p, notifications.done_message("early", 0, 1))
    ev = pump(d, lambda e: len(e.done) == 2, 3.0, others=[p, x])
    assert sorted(ev.done) == ["early", "push-1"]


def test_a_fail_notice_that_overtakes_expect_fails_the_request_at_once(
    trio: tuple[Endpoint, Endpoint, Endpoint],
) -> None:
    """A push sender's fail-notice can arrive before the side-channel message that makes the decode await the
    request (seen in real engines: the decode then waited for its whole deadline). It is remembered: the later
    ``expect`` fails at once, from the request's writer only, and a forged early notice fails nothing."""
    p, d, x = trio
    _send(p, notifications.fail_message("push-1", "posting returned ERR"))
    _send(x, notifications.fail_message("push-2", "forged"))
    _settle(d, [p, x])
    h = d.expect("push-1", 30.0, writers=["P"])
    other = d.expect("push-2", 30.0, writers=["P"])
    ev = pump(d, lambda e: e.failed, 3.0, others=[p, x])
    assert h.state is RequestState.FAILED and "posting returned ERR" in str(ev.failed[0])
    assert [e.request_id for e in ev.failed] == ["push-1"] and other.state is RequestState.POSTED


def test_a_passive_request_fails_only_from_its_writers(trio: tuple[Endpoint, Endpoint, Endpoint]) -> None:
    """A fail-notice from any agent failed another's request."""
    p, d, x = trio
    h = d.expect("push-1", 5.0, writers=["P"])
    _send(x, notifications.fail_message("push-1", "forged"))
    _settle(d, [p, x])
    assert h.state is RequestState.POSTED
    _send(p, notifications.fail_message("push-1", "real"))
    ev = pump(d, lambda e: e.failed, 3.0, others=[p, x])
    assert h.state is RequestState.FAILED and "real" in str(ev.failed[0])


def test_a_fail_notice_settles_the_request_only_when_no_other_writer_may_still_write(
    trio: tuple[Endpoint, Endpoint, Endpoint],
) -> None:
    """A decode that gave up on a push held its blocks until the registration's end (600 s in the real-engine
    streaming test, whose decode then never answered) even when its only writer said it failed. A fail-notice is
    its writer's last word, so the request is ``settled`` (its blocks may be freed at once) when every writer
    landed everything or failed; a writer that has said nothing may still be writing."""
    p, d, x = trio
    alone = d.expect("alone", 30.0, writers=["P"])
    both = d.expect("both", 30.0, writers=["P", "X"])
    after_landed = d.expect("after-landed", 30.0, writers=["P", "X"])
    _send(x, notifications.done_message("after-landed", 0, 1))
    _settle(d, [p, x])
    for rid in ("alone", "both", "after-landed"):
        _send(p, notifications.fail_message(rid, "posting returned ERR"))
    ev = pump(d, lambda e: len(e.failed) == 3, 3.0, others=[p, x])
    settled = {e.request_id: e.settled for e in ev.failed}
    assert settled == {"alone": True, "both": False, "after-landed": True}
    assert {alone.state, both.state, after_landed.state} == {RequestState.FAILED}
    deadline = d.expect("deadline", 0.1, writers=["P"])
    ev = pump(d, lambda e: e.failed, 3.0, others=[p, x])
    assert deadline.state is RequestState.FAILED and ev.failed[0].settled is False  # P may still be writing


def test_partial_done_sets_are_capped_per_sender(
    trio: tuple[Endpoint, Endpoint, Endpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Partial done-sets were unbounded (50,000 kept, +147 MiB). A flooding sender fills only its
    own share; another sender's requests still complete."""
    monkeypatch.setattr(inbox_mod, "MAX_PARTIAL_PER_SENDER", 64)
    monkeypatch.setattr(inbox_mod, "MAX_PARTIAL", 100)
    p, d, x = trio
    for i in range(200):
        _send(x, notifications.done_message(f"flood-{i}", 0, 2))
    _settle(d, [p, x], rounds=100)
    assert len(d._inbox.partial()) == 64
    h = d.expect("push-1", 5.0, writers=["P"])
    for i in (1, 0):
        _send(p, notifications.done_message("push-1", i, 2))
    ev = pump(d, lambda e: e.done, 3.0, others=[p, x])
    assert ev.done == ["push-1"] and h.state is RequestState.DONE
    # a count that changes within one set is dropped, not merged
    _send(p, notifications.done_message("push-2", 0, 2))
    _send(p, notifications.done_message("push-2", 1, 3))
    _settle(d, [p, x])
    assert ("P", "push-2") in d._inbox.partial()


def test_a_passive_check_gets_each_writers_digest(trio: tuple[Endpoint, Endpoint, Endpoint]) -> None:
    """The digest a writer's done-notices carry reaches the passive request's check, which decides; notices
    of one set that disagree give ``INCONSISTENT``; a landed request remembered for a later ``expect`` keeps its
    digest."""
    p, d, x = trio
    got: list[dict[str, int | None]] = []

    def check(digests: dict[str, int | None]) -> str | None:
        got.append(digests)
        return None if digests.get("P") == 7 else "digest mismatch: test"

    good = d.expect("v-1", 5.0, writers=["P"], check=check)
    bad = d.expect("v-2", 5.0, writers=["P"], check=check)
    for i in (1, 0):
        _send(p, notifications.done_message("v-1", i, 2, 7))
    _send(p, notifications.done_message("v-2", 0, 2, 7))
    _send(p, notifications.done_message("v-2", 1, 2, 8))
    _send(p, notifications.done_message("v-3", 0, 1, 9))  # lands before anyone awaits it
    ev = pump(d, lambda e: e.done and e.failed, 3.0, others=[p, x])
    assert ev.done == ["v-1"] and good.state is RequestState.DONE
    assert bad.state is RequestState.FAILED and "digest mismatch: test" in str(ev.failed[0])
    assert {"P": 7} in got and {"P": inbox_mod.INCONSISTENT} in got
    late = d.expect("v-3", 5.0, writers=["P"], check=check)
    assert late.state is RequestState.FAILED and got[-1] == {"P": 9}


def test_a_check_that_raises_fails_its_request_only(trio: tuple[Endpoint, Endpoint, Endpoint]) -> None:
    p, d, x = trio

    def broken(digests: dict[str, int | None]) -> str | None:
        raise RuntimeError("boom")

    h = d.expect("v-1", 5.0, writers=["P"], check=broken)
    ok = d.expect("v-2", 5.0, writers=["P"])
    _send(p, notifications.done_message("v-1", 0, 1, 1))
    _send(p, notifications.done_message("v-2", 0, 1))
    ev = pump(d, lambda e: e.done and e.failed, 3.0, others=[p, x])
    assert ev.done == ["v-2"] and ok.state is RequestState.DONE
    assert h.state is RequestState.FAILED and "verification failed: RuntimeError: boom" in str(ev.failed[0])
