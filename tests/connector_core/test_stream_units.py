"""Units of streaming push (#21) without engines: the prefill's book of concurrent-push registrations (bound to
the first decode engine presenting a capability, bounded per engine and in total, expiring), and the forward
hooks' stage releases (forward order, a hook out of order stops early releases)."""

from __future__ import annotations

import msgspec
import pytest

from hybrid_kv import StreamSchedule, build_region_table
from hybrid_kv.integrations.vllm import control, leases
from hybrid_kv.integrations.vllm.leases import LeaseBook
from hybrid_kv.integrations.vllm.metadata import SendLease
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


def reg(engine: str = "decode", cap: bytes = CAP, d_req: str = "d-0", tp: int = 2) -> control.StreamReg:
    return control.StreamReg(
        cap=cap, d_req=d_req, ids=[[1, 2]], engine=engine, host="127.0.0.1", port=5700, tp=tp, until=4e9
    )


def test_a_registration_waits_for_its_request_and_binds_the_first_engine() -> None:
    book, _ = _book()
    assert "comes from 'decode-tp5'" in str(book.on_message("decode-tp5", reg()))  # rank 5 of a TP-2 engine
    assert book.on_message("decode-tp0", reg()) is None
    assert book.on_message("decode-tp1", reg(d_req="d-other")) is None  # the same engine's other rank: ignored
    assert "'decode' was first" in str(book.on_message("thief-tp0", reg("thief")))
    assert book.stream_reg_count() == 1 and book.stream_reg(CAP) is not None
    assert book.stream_reg(CAP).d_req == "d-0"  # type: ignore[union-attr]
    # the request's lease (it finished before streaming) adopts it as its push registration
    book.add("p-0", SendLease([[7, 8]], 30, GRANT, 60, cap=CAP))
    [(rid, lease, push)] = book.registered()
    assert (rid, push.p_req, push.grant, push.d_req, push.engine) == ("p-0", "p-0", GRANT, "d-0", "decode")
    assert lease.holder == "decode" and book.stream_reg_count() == 0
    assert lease.push_until == 4e9  # the whole push must end before the decode stops waiting
    assert "held by 'decode'" in str(book.on_message("thief-tp0", reg("thief")))


def test_a_registration_after_the_lease_registers_the_push() -> None:
    book, _ = _book()
    book.add("p-0", SendLease([[7, 8]], 30, GRANT, 60, cap=CAP))
    assert book.registered() == []
    assert book.on_message("decode-tp0", reg(cap=b"x" * 16)) is None  # another request's: kept aside
    assert book.registered() == []
    assert book.on_message("decode-tp0", reg()) is None
    [(rid, _, push)] = book.registered()
    assert rid == "p-0" and push.d_req == "d-0"
    book.drop("p-0")
    assert book.on_message("decode-tp0", reg()) is None  # no lease any more: kept (and expires) like any early one
    assert book.stream_reg_count() == 2


def test_streaming_takes_the_registration_and_holds_the_capability_until_it_ends() -> None:
    book, _ = _book()
    book.on_message("decode-tp0", reg())
    taken = book.take_stream(CAP)
    assert taken is not None and taken.d_req == "d-0" and book.stream_reg_count() == 0
    assert book.take_stream(CAP) is None
    assert "it streams to 'decode'" in str(book.on_message("thief-tp0", reg("thief")))
    assert book.on_message("decode-tp1", reg()) is None and book.stream_reg_count() == 0
    book.end_stream(CAP)
    assert book.on_message("thief-tp0", reg("thief")) is None  # a later request may use it: kept, bounded


def test_registrations_are_bounded_per_engine_and_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leases, "MAX_STREAM_REGS", 8)
    monkeypatch.setattr(leases, "MAX_STREAM_REGS_PER_ENGINE", 3)
    book, clock = _book(ttl=10.0)
    for i in range(3):
        assert book.on_message("flood-tp0", reg("flood", bytes([i]) * 16)) is None
    assert "at most 8, 3 per engine" in str(book.on_message("flood-tp0", reg("flood", b"\x09" * 16)))
    for i in range(5):  # other engines still register
        engine = "decode" if i < 3 else "other"
        assert book.on_message(f"{engine}-tp0", reg(engine, bytes([100 + i]) * 16, tp=1)) is None
    assert "at most 8" in str(book.on_message("late-tp0", reg("late", b"\x77" * 16)))
    assert book.stream_reg_count() == 8
    clock.t += 10.5
    assert book.stream_reg(bytes([100]) * 16) is None  # expired
    assert book.on_message("late-tp0", reg("late", b"\x77" * 16)) is None
    assert book.stream_reg_count() == 1


def test_nothing_is_written_for_a_decode_that_stopped_waiting() -> None:
    """A push (streamed or whole) ends ``LEASE_MARGIN_S`` before the decode's ``until``; with less than
    ``MIN_PUSH_S`` of that left, nothing is written (the decode may reuse its blocks after ``until``)."""
    import time

    from hybrid_kv.integrations.vllm.worker import LEASE_MARGIN_S, MIN_PUSH_S, _push_deadline

    now = time.time()
    assert _push_deadline(None, 60.0) == 60.0  # a ticket's push: its own deadline
    assert _push_deadline(now + 1000, 60.0) == 60.0
    left = _push_deadline(now + 20, 60.0)
    assert left is not None and 20 - LEASE_MARGIN_S - 1 < left <= 20 - LEASE_MARGIN_S
    assert _push_deadline(now + LEASE_MARGIN_S + MIN_PUSH_S / 2, 60.0) is None
    assert _push_deadline(now - 5, 60.0) is None


def test_the_control_message_is_typed_and_bounded() -> None:
    msg = reg()
    assert control.decode(control.encode(msg)) == msg
    short = msgspec.msgpack.encode({"hkv_vllm": "stream_reg", **msgspec.structs.asdict(msg), "cap": b"c" * 15})
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
