"""Signed transfer tickets, the decode's checks of ``kv_transfer_params``, typed control messages and the prefill's
lease book: each attack on them reproduced on the real objects the connector uses, with the answer each must get
(a refusal naming why, never an exception). The connector core imports no vLLM: these run in the main venv."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import msgspec
import pytest
from tickets_helper import raw_ticket, ticket_fields

from hybrid_kv.claims import ClaimResult
from hybrid_kv.connector_core import control
from hybrid_kv.connector_core.config import ConnectorConfig
from hybrid_kv.connector_core.early import EARLY_TTL_S, MAX_EARLY
from hybrid_kv.connector_core.leases import LeaseBook, renewal_until
from hybrid_kv.connector_core.params import TransferParams, parse_networks
from hybrid_kv.connector_core.requests import SendLease
from hybrid_kv.connector_core.tickets import (
    MAX_TICKET_CHARS,
    TICKET_FIELD,
    SpentTickets,
    Ticket,
    TicketKey,
)
from hybrid_kv.errors import ConfigError, TicketError

SECRET = b"tickets-test-secret-of-32-bytes!!"
GRANT = bytes(range(16))


def _ticket(**changes: Any) -> Ticket:
    now = time.time()
    fields: dict[str, Any] = dict(
        version=1,
        engine_id="prefill",
        request_id="p-0",
        grant=GRANT,
        block_ids=[[3, 4, 5]],
        host="127.0.0.1",
        port=5600,
        tp_size=1,
        num_tokens=40,
        expires_at=now + 30,
        max_expires_at=now + 90,
        mode="pull",
    )
    fields.update(changes)
    return Ticket(**fields)


def _params(text: str, **extra: Any) -> dict[str, Any]:
    return {"do_remote_prefill": True, TICKET_FIELD: text, **extra}


def _checker(key: TicketKey | None = None, **kw: Any) -> TransferParams:
    return TransferParams(key or TicketKey(SECRET), kw.pop("mode", "pull"), kw.pop("num_groups", 1), **kw)


# ---------------------------------------------------------------------------------------------- tickets


def test_ticket_round_trip_and_size() -> None:
    key = TicketKey(SECRET)
    t = _ticket()
    text = key.issue(t)
    assert key.open(text) == t
    assert len(text) < 200  # a 3-block ticket: fields + 32-byte tag, base64
    assert text.isascii() and "=" not in text


@pytest.mark.parametrize(
    "tamper",
    [
        "other_key",  # another deployment's secret
        "unsigned",  # an insecure engine's ticket, or an attacker's without the key
        "flip_body",  # one bit of the signed fields changed
        "flip_tag",
    ],
)
def test_forged_or_altered_tickets_are_refused(tamper: str) -> None:
    key = TicketKey(SECRET)
    t = _ticket()
    if tamper == "other_key":
        text = TicketKey(b"another-deployment-secret-32-byte").issue(t)
    elif tamper == "unsigned":
        text = TicketKey(None).issue(t)
    else:
        body, tag = msgspec.msgpack.decode(_b64(key.issue(t)))
        if tamper == "flip_body":
            body = body[:-3] + bytes([body[-3] ^ 1]) + body[-2:]
        else:
            tag = bytes([tag[0] ^ 1]) + tag[1:]
        text = _enc([body, tag])
    with pytest.raises(TicketError, match="unsigned|does not verify"):
        key.open(text)


def _b64(text: str) -> bytes:
    import base64

    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _enc(value: Any) -> str:
    import base64

    return base64.urlsafe_b64encode(msgspec.msgpack.encode(value)).rstrip(b"=").decode()


def test_victims_blocks_in_an_attackers_ticket_do_not_verify() -> None:
    """The attacker's own ticket with the victim's block ids (or its request id) re-encoded
    without the key fails the signature; the same with the key (a prefill's own ticket) verifies."""
    key = TicketKey(SECRET)
    mine = key.open(key.issue(_ticket(request_id="attacker", block_ids=[[9]])))
    for changes in ({"block_ids": [[3, 4, 5]]}, {"request_id": "victim", "block_ids": [[]]}):
        forged = msgspec.structs.replace(mine, **changes)
        body = msgspec.msgpack.encode(forged)
        tag = _b64(key.issue(mine))[-32:]  # the attacker's real tag, over other fields
        with pytest.raises(TicketError, match="does not verify"):
            key.open(_enc([body, tag]))


@pytest.mark.parametrize(
    ("index", "value"),
    [
        (6, "abc"),  # port
        (6, "9" * 4301),  # a 4301-digit port string
        (6, 0),
        (6, 70000),
        (7, 1e400),  # tp_size JSON infinity
        (7, None),
        (7, 0),
        (4, 5),  # block_ids not a list
        (4, [["x"]]),
        (4, [[1e400]]),
        (4, [[-1]]),
        (4, [[2**31]]),
        (4, [[1.0]]),
        (9, float("nan")),  # expires_at
        (9, float("inf")),
        (10, float("nan")),
        (11, "both"),  # mode
        (3, b"short"),  # grant
        (1, ""),  # engine id
        (1, "e" * 257),
        (0, 2),  # version
    ],
)
def test_insecure_tickets_with_hostile_fields_are_refused(index: int, value: Any) -> None:
    """Without a secret a ticket is unsigned, so its fields are the client's: each is typed and range-checked
    (the hostile plain parameters' values, as ticket fields)."""
    fields = ticket_fields(_ticket())
    fields[index] = value
    with pytest.raises(TicketError):
        TicketKey(None).open(raw_ticket(fields))


def test_ticket_text_is_bounded_before_decoding() -> None:
    key = TicketKey(SECRET)
    for text in (5, None, ["a"], "!!!", "A" * (MAX_TICKET_CHARS + 1), "", "AAAA"):
        with pytest.raises(TicketError):
            key.open(text)


def test_a_ticket_is_used_once_and_the_memory_is_bounded() -> None:
    spent = SpentTickets(limit=3)
    now = time.time()
    t = _ticket()
    spent.spend(t, now)
    with pytest.raises(TicketError, match="already used"):
        spent.spend(t, now)
    for i in range(2):
        spent.spend(_ticket(grant=bytes([i + 1]) * 16), now)
    with pytest.raises(TicketError, match="too many live tickets"):
        spent.spend(_ticket(grant=b"\xff" * 16), now)
    # expired tickets are forgotten (they are refused as expired anyway)
    spent.spend(_ticket(grant=b"\xfe" * 16), now + 100)
    assert len(spent) == 1


# ---------------------------------------------------------------------------------------------- params


HOSTILE_PLAIN_FIELDS = [
    {"remote_port": "abc"},
    {"tp_size": math.inf},
    {"tp_size": None},
    {"remote_block_ids": 5},
    {"remote_block_ids": [["x"]]},
    {"remote_block_ids": [[math.inf]]},
    {"remote_port": "9" * 4301},
]


@pytest.mark.parametrize("fields", HOSTILE_PLAIN_FIELDS)
def test_plain_fields_are_never_acted_on(fields: dict[str, Any]) -> None:
    """Hostile plain parameters: without a ticket the request is refused (no exception); beside a valid ticket
    they are ignored and the ticket's values are used."""
    checker = _checker()
    base = {"do_remote_prefill": True, "remote_engine_id": "prefill", "remote_request_id": "p-0", **fields}
    assert "carry no 'hkv_ticket'" in str(checker.check(base, [100], time.time()))
    t = _ticket()
    got = checker.check(dict(base, **{TICKET_FIELD: TicketKey(SECRET).issue(t)}), [100], time.time())
    assert got == t


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ("not a dict", "must be a mapping"),
        ({"do_remote_prefill": True, TICKET_FIELD: 5}, "malformed"),
        ({"do_remote_prefill": "yes", TICKET_FIELD: "x"}, "malformed"),
        ({"do_remote_prefill": True, TICKET_FIELD: "x" * (MAX_TICKET_CHARS + 1)}, "malformed"),
    ],
)
def test_malformed_params_are_refused(params: Any, reason: str) -> None:
    assert reason in str(_checker().check(params, [100], time.time()))


def test_ticket_checks_against_this_engine() -> None:
    key = TicketKey(SECRET)
    now = time.time()

    def check(t: Ticket, **kw: Any) -> Ticket | str:
        return _checker(**kw).check(_params(key.issue(t)), [100] * kw.get("num_groups", 1), now)

    assert "push mode" in str(check(_ticket(mode="push")))
    assert "names 1 groups; this engine has 2" in str(check(_ticket(), num_groups=2))
    assert "lease ended" in str(check(_ticket(expires_at=now - 1, max_expires_at=now + 50)))
    assert "outside the allowed peer networks" in str(check(_ticket(), networks=parse_networks("10.0.0.0/8")))
    assert isinstance(check(_ticket(host="10.1.2.3"), networks=parse_networks("10.0.0.0/8, fd00::/8")), Ticket)
    assert "outside" in str(check(_ticket(host="prefill.local"), networks=parse_networks("10.0.0.0/8")))
    many = _checker().check(_params(key.issue(_ticket(block_ids=[list(range(101))]))), [100], now)
    assert "names 101 blocks in group 0; this request holds at most 100" in str(many)
    checker = _checker()
    text = key.issue(_ticket())
    assert isinstance(checker.check(_params(text), [100], now), Ticket)
    assert "already used" in str(checker.check(_params(text), [100], now))


def test_settings_peer_networks_and_lease_extension() -> None:
    cfg = ConnectorConfig.resolve({"peer_networks": "10.0.0.0/8,192.168.1.0/24", "lease_max_extension_s": 5}, env={})
    assert parse_networks(cfg.peer_networks) is not None and cfg.lease_max_extension_s == 5.0
    with pytest.raises(ConfigError, match="not a CIDR"):
        ConnectorConfig.resolve({"peer_networks": "10.0.0.0/8,nonsense"}, env={})
    with pytest.raises(ConfigError, match="lease_max_extension_s"):
        ConnectorConfig.resolve({"lease_max_extension_s": -1}, env={})
    with pytest.raises(ConfigError, match="lease_s"):
        ConnectorConfig.resolve({"lease_s": "inf"}, env={})


# ---------------------------------------------------------------------------------------------- control messages


CLAIM = {
    "hkv": "claim",
    "entries": [{"req": "p-0", "grant": GRANT, "d_req": "d-0", "ids": [[1, 2]], "digest": True}],
    "engine": "decode",
    "host": "127.0.0.1",
    "port": 5700,
    "payload": b"payload",
    "coalesce": True,
    "algo": "xxh3",
}


@pytest.mark.parametrize(
    "payload",
    [
        # hostile values, as they were sent (JSON) and as msgpack with the same values
        json.dumps({"hkv": "release", "req": "p-0", "consumers": "abc"}).encode(),
        b'{"hkv":"release","req":"p-0","consumers":Infinity}',
        b'{"hkv":"release","req":"p-0","consumers":NaN}',
        json.dumps({"hkv": "release", "req": "p-0", "consumers": [1]}).encode(),
        b'{"hkv":"release","req":"p-0","consumers":' + b"9" * 5000 + b"}",
        json.dumps({"hkv": "push_reg", "p_req": "p-0", "ids": [[1]]}).encode(),
        *[
            msgspec.msgpack.encode({"hkv": "release", "req": "p-0", "grant": GRANT, "consumers": c})
            for c in ("abc", math.inf, math.nan, [1], 0, 1025, 2**64 - 1)
        ],
        msgspec.msgpack.encode({"hkv": "push_reg", "p_req": "p-0", "grant": GRANT, "ids": [[1]]}),  # no d_req
        msgspec.msgpack.encode({"hkv": "release", "req": "p-0", "grant": b"x", "consumers": 1}),
        msgspec.msgpack.encode({"hkv": "release", "req": "p-0", "grant": GRANT, "consumers": 1, "x": 1}),
        msgspec.msgpack.encode({"hkv": "renew", "req": "p-0", "grant": GRANT, "until": math.nan}),
        msgspec.msgpack.encode({"hkv": "push_plan", "d_req": "d-0", "writes": "yes"}),
        msgspec.msgpack.encode({"hkv": "nope"}),
        b"",
        b"\xc1",
        # claims (with digests) and their answers
        *[
            msgspec.msgpack.encode({**CLAIM, **change})
            for change in (
                {"algo": "md5"},
                {"payload": b"x" * (512 * 1024 + 1)},
                {"port": 0},
                {"entries": []},
                {"entries": [{**CLAIM["entries"][0], "ids": [[-1]]}]},  # type: ignore[index]
                {"entries": [{**CLAIM["entries"][0], "grant": b"x" * 17}]},  # type: ignore[index]
                {"extra": 1},
            )
        ],
        *[
            msgspec.msgpack.encode({"hkv": "claim_answers", "results": [{"d_req": "d-0", "ok": True, **change}]})
            for change in ({"digest": "A" * 16}, {"digest": "0" * 17}, {"digest": 5}, {"bytes": -1}, {"ok": "yes"})
        ],
        # a map nested a thousand deep under an unknown key (3.3 KB): refused by the pre-scan, no RecursionError
        b"\x82\xa3hkv\xa7release\xa1x" + b"\x81\xa1k" * 1000 + b"\xc0",
    ],
)
def test_hostile_control_messages_are_refused(payload: bytes) -> None:
    with pytest.raises(control.ControlError):
        control.decode(payload)


def test_control_messages_round_trip() -> None:
    msgs = [
        control.Release(req="p-0", grant=GRANT, consumers=2),
        control.Renew(req="p-0", grant=GRANT, until=time.time() + 5),
        control.PushReg(
            p_req="p-0",
            grant=GRANT,
            d_req="d-0",
            ids=[[1, 2]],
            engine="decode",
            host="127.0.0.1",
            port=5700,
            tp=2,
            until=time.time() + 30,
            instance="0123456789abcdef",
        ),
        control.PushPlan(d_req="d-0", writes=True),
        control.PushPlan(d_req="d-0", writes=True, payload=b"p" * 100, coalesce=False, ids=[[4]]),
        control.decode(msgspec.msgpack.encode(CLAIM)),
        control.ClaimAnswers([ClaimResult("d-0", True, expires_at=time.time(), digest="0123456789abcdef")], "ab12"),
        control.ClaimAnswers([ClaimResult("d-0", False, "no lease")]),
    ]
    for m in msgs:
        assert control.decode(control.encode(m)) == m


def test_rank_of() -> None:
    assert control.rank_of("decode-tp1", "decode", 2) == 1
    for bad in ("decode-tp2", "decode-tp01", "decode-tp", "decode-tp²", "other-tp0", "decode-tp" + "1" * 5000):
        assert control.rank_of(bad, "decode", 2) is None


# ---------------------------------------------------------------------------------------------- lease book


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0
        self.wall = 1.7e9

    def mono(self) -> float:
        return self.t

    def now(self) -> float:
        return self.wall

    def advance(self, s: float) -> None:
        self.t += s
        self.wall += s


def _book() -> tuple[LeaseBook, Clock]:
    clock = Clock()
    return LeaseBook("prefill-tp0", clock=clock.mono, wall=clock.now), clock


def say(book: LeaseBook, sender: str, msg: control.Control) -> str | None:
    """What the worker does with a lease message: ``on_message`` with its wire bytes (kept if it is early)."""
    return book.on_message(sender, msg, control.encode(msg))


def _lease(book: LeaseBook, rid: str = "p-0", grant: bytes = GRANT, lease_s: float = 30, ext: float = 60) -> None:
    """Lease ``rid``, then apply what came early for it, as the worker does."""
    for early in book.add(rid, SendLease([[1, 2, 3]], lease_s, grant, ext)):
        say(book, early.sender, control.decode(early.payload))


def test_release_frees_only_with_the_tickets_grant() -> None:
    """A release naming a victim's request without its ticket's grant frees nothing."""
    book, _ = _book()
    _lease(book)
    reason = say(book, "decode-tp0", control.Release(req="p-0", grant=b"\x00" * 16, consumers=1))
    assert reason is not None and "another grant" in reason
    assert book.take_due() == []
    assert say(book, "decode-tp0", control.Release(req="p-0", grant=GRANT, consumers=1)) is None
    assert book.take_due() == [("p-0", False)]


def test_release_counts_distinct_consumers_of_one_engine() -> None:
    book, _ = _book()
    _lease(book)
    rel = control.Release(req="p-0", grant=GRANT, consumers=2)
    say(book, "decode-tp0", rel)
    say(book, "decode-tp0", rel)  # the same rank twice counts once
    assert book.take_due() == []
    assert "held by 'decode'" in str(say(book, "other-tp1", rel))  # another engine: refused
    assert book.take_due() == []
    say(book, "decode-tp1", rel)
    assert book.take_due() == [("p-0", False)]


def test_messages_for_ids_never_leased_are_bounded_and_expire() -> None:
    """20,000 releases and push registrations for ids never leased were kept forever."""
    book, clock = _book()
    for i in range(10_000):
        say(book, "decode-tp0", control.Release(req=f"x-{i}", grant=GRANT, consumers=1))
        reg = control.PushReg(
            p_req=f"y-{i}", grant=GRANT, d_req="d", ids=[[1]], engine="decode", host="h", port=1, tp=1, until=1e9
        )
        say(book, "decode-tp0", reg)
    assert book.early_count() == MAX_EARLY and len(book) == 0
    clock.advance(EARLY_TTL_S + 1)
    assert len(book.early.expire()) == MAX_EARLY
    assert book.early_count() == 0


def test_an_early_message_applies_once_its_lease_arrives_and_only_with_its_grant() -> None:
    book, _ = _book()
    say(book, "decode-tp0", control.Release(req="p-0", grant=b"\x01" * 16, consumers=1))  # forged, early
    say(book, "decode-tp0", control.Release(req="p-1", grant=GRANT, consumers=1))  # real, early
    _lease(book, "p-0")
    _lease(book, "p-1")
    assert book.take_due() == [("p-1", False)]
    assert book.early_count() == 0


def test_push_registration_bound_to_its_sender_and_engine() -> None:
    """The first push registration won without being checked against its sender."""
    book, _ = _book()
    _lease(book)

    def reg(engine: str, d_req: str = "d-0") -> control.PushReg:
        return control.PushReg(
            p_req="p-0",
            grant=GRANT,
            d_req=d_req,
            ids=[[1]],
            engine=engine,
            host="127.0.0.1",
            port=5700,
            tp=2,
            until=time.time() + 30,
        )

    assert "comes from 'attacker-tp0'" in str(say(book, "attacker-tp0", reg("decode")))
    assert "another grant" in str(say(book, "decode-tp0", msgspec.structs.replace(reg("decode"), grant=b"\0" * 16)))
    assert say(book, "decode-tp0", reg("decode")) is None
    assert "held by 'decode'" in str(say(book, "other-tp0", reg("other", "x")))
    assert say(book, "decode-tp1", reg("decode", "d-other")) is None  # same engine: the first stays
    [(rid, _, r)] = book.registered()
    assert rid == "p-0" and r.d_req == "d-0"


def test_renewal_extends_a_lease_up_to_its_maximum_only_for_the_grant() -> None:
    """A decode still connecting renews the lease; bounded by ``max_extension_s``."""
    book, clock = _book()
    _lease(book, lease_s=10, ext=15)
    clock.advance(8)
    assert "another grant" in str(
        say(book, "decode-tp0", control.Renew(req="p-0", grant=b"\0" * 16, until=clock.wall + 10))
    )
    assert say(book, "decode-tp0", control.Renew(req="p-0", grant=GRANT, until=clock.wall + 10)) is None
    clock.advance(9)  # 17 s in: past the original 10 s
    assert book.take_due() == []
    say(book, "decode-tp0", control.Renew(req="p-0", grant=GRANT, until=clock.wall + 1000))
    clock.advance(7.5)  # 24.5 s: inside the 25 s maximum
    assert book.take_due() == []
    clock.advance(1)
    assert book.take_due() == [("p-0", True)]


def test_renewal_is_due_only_near_the_end_of_a_live_renewable_lease() -> None:
    now = 1000.0
    assert renewal_until(now + 20, now + 100, now, 30) is None  # more than half left
    assert renewal_until(now + 10, now + 100, now, 30) == now + 30
    assert renewal_until(now + 10, now + 20, now, 30) == now + 20  # capped by the ticket
    assert renewal_until(now + 20, now + 20, now, 30) is None  # at the maximum
    assert renewal_until(now - 1, now + 20, now, 30) is None  # over: the prefill may have freed the blocks
    assert renewal_until(None, None, now, 30) is None
