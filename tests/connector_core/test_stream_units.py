"""Units of streaming push without engines: the prefill's book of concurrent-push registrations (bound to the
first decode engine presenting a capability, bounded in count and bytes with a fair share per engine, expiring
early), and the forward hooks' stage releases (forward order, a hook out of order stops early releases)."""

from __future__ import annotations

import msgspec
import pytest

from hybrid_kv import StreamSchedule, build_region_table
from hybrid_kv.connector_core import control
from hybrid_kv.connector_core.leases import LEASE_MARGIN_S, MIN_PUSH_S, LeaseBook, push_deadline
from hybrid_kv.connector_core.requests import SendLease
from hybrid_kv.connector_core.stream_regs import StreamRegs
from hybrid_kv.presets import get_preset
from hybrid_kv.streaming import ForwardHooks, Stream

GRANT = b"g" * 16
CAP = b"c" * 16


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def mono(self) -> float:
        return self.t

    def wall(self) -> float:
        return 1.7e9 + self.t


def _book(ttl: float = 60.0) -> tuple[LeaseBook, Clock]:
    clock = Clock()
    return LeaseBook("prefill-tp0", clock=clock.mono, wall=clock.wall, stream_ttl_s=ttl), clock


def reg(
    engine: str = "decode", cap: bytes = CAP, d_req: str = "d-0", tp: int = 2, ids: int = 2, until: float = 4e9
) -> control.StreamReg:
    return control.StreamReg(
        cap=cap, d_req=d_req, ids=[list(range(ids))], engine=engine, host="127.0.0.1", port=5700, tp=tp, until=until
    )


def say(book: LeaseBook, sender: str, msg: control.Control) -> str | None:
    return book.on_message(sender, msg, control.encode(msg))


def test_a_registration_waits_for_its_request_and_binds_the_first_engine() -> None:
    book, _ = _book()
    assert "comes from 'decode-tp5'" in str(say(book, "decode-tp5", reg()))  # rank 5 of a TP-2 engine
    assert say(book, "decode-tp0", reg()) is None
    assert say(book, "decode-tp1", reg(d_req="d-other")) is None  # the same engine's other rank: ignored
    assert "'decode' was first" in str(say(book, "thief-tp0", reg("thief")))
    assert book.stream_reg_count() == 1 and book.stream_reg(CAP) is not None
    assert book.stream_reg(CAP).d_req == "d-0"  # type: ignore[union-attr]
    # the request's lease (it finished before streaming) adopts it as its push registration
    assert book.add("p-0", SendLease([[7, 8]], 30, GRANT, 60, cap=CAP)) == []
    [(rid, lease, push)] = book.registered()
    assert (rid, push.p_req, push.grant, push.d_req, push.engine) == ("p-0", "p-0", GRANT, "d-0", "decode")
    assert lease.holder == "decode" and book.stream_reg_count() == 0
    assert lease.push_until == 4e9  # the whole push must end before the decode stops waiting
    assert "held by 'decode'" in str(say(book, "thief-tp0", reg("thief")))


def test_a_registration_after_the_lease_registers_the_push() -> None:
    book, _ = _book()
    book.add("p-0", SendLease([[7, 8]], 30, GRANT, 60, cap=CAP))
    assert book.registered() == []
    assert say(book, "decode-tp0", reg(cap=b"x" * 16)) is None  # another request's: kept aside
    assert book.registered() == []
    assert say(book, "decode-tp0", reg()) is None
    [(rid, _, push)] = book.registered()
    assert rid == "p-0" and push.d_req == "d-0"
    book.drop("p-0")
    assert say(book, "decode-tp0", reg()) is None  # no lease any more: kept (and expires) like any early one
    assert book.stream_reg_count() == 2


def test_streaming_takes_the_registration_and_holds_the_capability_until_it_ends() -> None:
    book, _ = _book()
    say(book, "decode-tp0", reg())
    taken = book.take_stream(CAP)
    assert taken is not None and taken.d_req == "d-0" and book.stream_reg_count() == 0
    assert book.take_stream(CAP) is None
    assert "it streams to 'decode'" in str(say(book, "thief-tp0", reg("thief")))
    assert say(book, "decode-tp1", reg()) is None and book.stream_reg_count() == 0
    book.end_stream(CAP)
    assert say(book, "thief-tp0", reg("thief")) is None  # a later request may use it: kept, bounded


def _regs(max_regs: int = 8, max_bytes: int = 1 << 20, ttl: float = 10.0) -> tuple[StreamRegs, Clock]:
    clock = Clock()
    return StreamRegs("prefill-tp0", clock.mono, clock.wall, ttl, 2.0, max_regs, max_bytes), clock


def offer(regs: StreamRegs, msg: control.StreamReg) -> str | None:
    return regs.offer(msg, control.encode(msg))


def test_registrations_keep_each_engines_share_whatever_the_number_of_engines() -> None:
    """Clients of a few decode engines filling the store (1,024 each of 4,096 before) lock no other engine out:
    a newcomer within its fair share evicts the earliest-expiring registration of the engine most over its share."""
    regs, _ = _regs(max_regs=8)
    for i in range(8):  # one engine's clients fill the whole store
        assert offer(regs, reg("flood", bytes([i]) * 16)) is None
    assert len(regs) == 8
    for k, engine in enumerate(("a", "b", "c")):  # each newcomer still gets in, at the flooder's expense
        assert offer(regs, reg(engine, bytes([100 + k]) * 16)) is None
    assert [regs.usage(e)[0] for e in ("flood", "a", "b", "c")] == [5, 1, 1, 1]
    assert regs.evicted == 3
    # the flooder, over its share (8 / 4 = 2), now only replaces its own registrations
    assert offer(regs, reg("flood", b"\x77" * 16)) is None
    assert [regs.usage(e)[0] for e in ("flood", "a", "b", "c")] == [5, 1, 1, 1]
    assert regs.get(bytes([0]) * 16) is None  # its earliest went first
    for i in range(3):  # engine "a" grows to its share (taken from the flooder), then replaces its own
        assert offer(regs, reg("a", bytes([200 + i]) * 16)) is None
    assert [regs.usage(e)[0] for e in ("flood", "a", "b", "c")] == [4, 2, 1, 1]
    assert len(regs) == 8


def test_registrations_are_bounded_in_bytes() -> None:
    """256 registrations of 32 K ids each were kept as Python lists (5.1 GiB at the old count cap): they are kept
    in wire form, bounded in bytes, shared like the count."""
    big = control.encode(reg("flood", ids=32 * 1024))
    regs, _ = _regs(max_regs=4096, max_bytes=4 * len(big))
    for i in range(50):
        offer(regs, reg("flood", bytes([i]) * 16, ids=32 * 1024))
    assert len(regs) <= 4 and regs.bytes <= 4 * len(big)
    assert offer(regs, reg("small", b"\x99" * 16)) is None  # another engine still gets in
    huge = reg("huge", b"\x98" * 16, ids=200 * 1024)  # more than a share on its own: refused
    assert "share" in str(offer(regs, huge))


def test_registrations_expire_early_when_their_decode_stops_waiting() -> None:
    regs, clock = _regs(ttl=100.0)
    wall = clock.wall()
    assert offer(regs, reg("d", b"\x01" * 16, until=wall + 10)) is None
    assert "too soon to push" in str(offer(regs, reg("d", b"\x02" * 16, until=wall + 1.5)))
    clock.t += 7.5
    assert regs.get(b"\x01" * 16) is not None
    clock.t += 1.0  # 8.5 s: within 2 s of its until (the margins): of no use any more, dropped
    assert regs.get(b"\x01" * 16) is None
    regs.expire()
    assert len(regs) == 0


def test_nothing_is_written_for_a_decode_that_stopped_waiting() -> None:
    """A push (streamed or whole) ends ``LEASE_MARGIN_S`` before the decode's ``until``; with less than
    ``MIN_PUSH_S`` of that left, nothing is written (the decode may reuse its blocks after ``until``)."""
    now = 1.7e9
    assert push_deadline(None, 60.0, now) is None  # every registration carries an until: none, no push
    assert push_deadline(now + 1000, 60.0, now) == 60.0
    assert push_deadline(now + 20, 60.0, now) == 20 - LEASE_MARGIN_S
    assert push_deadline(now + LEASE_MARGIN_S + MIN_PUSH_S / 2, 60.0, now) is None
    assert push_deadline(now - 5, 60.0, now) is None


def test_the_control_message_is_typed_and_bounded() -> None:
    msg = reg()
    assert control.decode(control.encode(msg)) == msg
    short = msgspec.msgpack.encode({"hkv": "stream_reg", **msgspec.structs.asdict(msg), "cap": b"c" * 15})
    with pytest.raises(control.ControlError, match="cap"):
        control.decode(short)


def _hooks() -> tuple[ForwardHooks, StreamSchedule]:
    table = build_region_table(get_preset("kimi-linear-48b-a3b").rank_layout(tp=1, rank=0, num_blocks=8))
    sched = StreamSchedule(table)
    return ForwardHooks(sched, "prefill-tp0"), sched


def _stream() -> Stream:
    return Stream("p-0", "d-0", CAP, [[1]], None)


def test_hooks_release_each_stage_once_in_forward_order() -> None:
    hooks, sched = _hooks()
    assert hooks.on_hook("model.layers.3.self_attn") is None, "no stream this forward"
    hooks.begin([_stream()])
    names = [name for name, _ in sched.hooks]
    assert hooks.on_hook("model.layers.0.linear_attn") is None  # not a hook layer
    got = [hooks.on_hook(n) for n in names]
    assert got == list(range(1, sched.num_stages + 1))
    assert hooks.on_hook(names[-1]) is None, "a repeated hook releases nothing more"
    assert len(hooks.end()) == 1 and not hooks.active


def test_a_hook_out_of_forward_order_stops_early_releases() -> None:
    hooks, sched = _hooks()
    names = [name for name, _ in sched.hooks]
    hooks.begin([_stream()])
    assert hooks.on_hook(names[2]) == 3
    assert hooks.on_hook(names[1]) is None  # earlier than a hook already seen: the order does not hold here
    assert hooks.on_hook(names[4]) is None and hooks.out_of_order == 1
    assert len(hooks.end()) == 1  # the rest goes at wait_for_save
    hooks.begin([_stream()])  # the next forward starts clean
    assert hooks.on_hook(names[0]) == 1
