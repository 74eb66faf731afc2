"""The connector core's stores under attack: what API clients and peers can fill, and what they cannot.

- used capabilities live apart from signed tickets and evict rather than refuse: 131,072 client-chosen
  capabilities made a decode refuse every genuine ticket ("too many live tickets") before;
- both stores forget in expiry order: an expired ticket queued behind a longer-lived capability still counted;
- early control messages are bounded in bytes as well as in count (kept in wire form);
- lease claims: confirmed only for the lease's grant, for the first engine, while it has time left; refused at
  once for a lease that ended; answered with the lease's end.
"""

from __future__ import annotations

import time
import tracemalloc

import pytest

from hybrid_kv.claims import ClaimEntry
from hybrid_kv.connector_core import control
from hybrid_kv.connector_core.early import MAX_EARLY_BYTES, EarlyBox
from hybrid_kv.connector_core.leases import LEASE_MARGIN_S, LeaseBook
from hybrid_kv.connector_core.params import TransferParams
from hybrid_kv.connector_core.requests import SendLease
from hybrid_kv.connector_core.tickets import MAX_LIVE_CAPS, SpentCaps, SpentTickets, Ticket, TicketError, TicketKey

SECRET = b"bounded-stores-test-secret-32-bytes!"
GRANT = bytes(range(16))


def _ticket(grant: bytes, expires: float, max_expires: float) -> Ticket:
    return Ticket(1, "prefill", "p-0", grant, [[1]], "127.0.0.1", 5600, 1, 16, expires, max_expires, "push")


def test_client_capabilities_never_crowd_out_signed_tickets() -> None:
    """131,072 one-token concurrent-push requests, each with its own capability, filled the store signed tickets
    are spent into, and every genuine ticket was refused for 240 s."""
    key = TicketKey(SECRET)
    params = TransferParams(key, "push", 1, engines=frozenset({("prefill", "10.0.0.1", 5600)}))
    now = time.time()
    for i in range(MAX_LIVE_CAPS + 5000):
        got = params.check(
            {
                "do_remote_prefill": True,
                "hkv_stream": f"{i:032x}",
                "remote_engine_id": "prefill",
                "remote_host": "10.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
            },
            [8],
            now,
        )
        assert not isinstance(got, str), got
    assert len(params.spent_caps) == MAX_LIVE_CAPS and params.spent_caps.evicted == 5000
    ticket = _ticket(GRANT, now + 30, now + 90)
    got = params.check({"do_remote_prefill": True, "hkv_ticket": key.issue(ticket)}, [8], now)
    assert got == ticket
    assert "already used" in str(params.check({"do_remote_prefill": True, "hkv_ticket": key.issue(ticket)}, [8], now))


def test_spent_stores_forget_in_expiry_order() -> None:
    """An expired entry queued behind a longer-lived one is forgotten (it counted against the bound before)."""
    tickets = SpentTickets(limit=2)
    now = 1.7e9
    tickets.spend(_ticket(b"\x01" * 16, now + 10, now + 1000), now)  # lives long
    tickets.spend(_ticket(b"\x02" * 16, now + 1, now + 5), now)  # expires first, queued behind it
    with pytest.raises(TicketError, match="too many live tickets"):
        tickets.spend(_ticket(b"\x03" * 16, now + 1, now + 5), now + 1)
    tickets.spend(_ticket(b"\x03" * 16, now + 7, now + 50), now + 6)  # the second has expired: room again
    assert len(tickets) == 2
    caps = SpentCaps(limit=2)
    caps.spend(b"a" * 16, now + 1000, now, "cap a")
    caps.spend(b"b" * 16, now + 5, now, "cap b")
    caps.spend(b"c" * 16, now + 500, now, "cap c")  # full: the one expiring first (b) goes, not the oldest (a)
    with pytest.raises(TicketError, match="already used"):
        caps.spend(b"a" * 16, now + 1000, now, "cap a")
    caps.spend(b"b" * 16, now + 5, now, "cap b")  # b was forgotten: accepted (a prefill ignores a second pairing)
    assert caps.evicted == 2


def test_early_messages_are_bounded_in_bytes() -> None:
    """256 push registrations of 32 K ids were 1.27 MiB each as Python objects (5.1 GiB at the 4,096 cap); kept as
    their wire bytes under ``MAX_EARLY_BYTES``, the oldest dropped first."""
    reg = control.PushReg(
        p_req="p-x", grant=GRANT, d_req="d", ids=[list(range(32 * 1024))], engine="d", host="h", port=1, tp=1, until=1e9
    )
    raw = control.encode(reg)
    box = EarlyBox("prefill-tp0", time.monotonic)
    tracemalloc.start()
    for i in range(4096):
        box.keep("decode-tp0", raw, {f"p-{i}"})
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    kept = len(box)
    assert 0 < kept < 4096 and box.bytes <= MAX_EARLY_BYTES < box.bytes + len(raw) + 1024
    assert box.dropped == 4096 - kept
    assert peak < 2 * MAX_EARLY_BYTES, f"peak {peak} bytes while keeping them"
    assert box.take("p-0") == [] and [m.payload for m in box.take("p-4095")] == [raw]


def _book() -> tuple[LeaseBook, list[float]]:
    t = [1000.0]
    book = LeaseBook("prefill-tp0", clock=lambda: t[0], wall=lambda: 1.7e9 + t[0])
    book.add("p-0", SendLease([[1, 2]], 30.0, GRANT, 60.0))
    return book, t


def test_a_claim_is_confirmed_for_the_first_engine_while_the_lease_holds() -> None:
    book, t = _book()
    entry = ClaimEntry("p-0", GRANT, "d-0")
    assert "another grant" in str(book.claim("decode", ClaimEntry("p-0", b"\x00" * 16, "d-0")))
    lease = book.claim("decode", entry)
    assert not isinstance(lease, str) and lease is not None and lease.holder == "decode"
    assert book.expires_at(lease) == pytest.approx(1.7e9 + t[0] + 30.0)
    assert book.claim("decode", entry) is lease  # a repeat from the same engine: the same answer
    assert "held by 'decode'" in str(book.claim("replayer", entry))  # a second decode engine: refused
    t[0] += 30.0 - LEASE_MARGIN_S  # too little left to read before the blocks may be reused
    assert "too soon to read" in str(book.claim("decode", entry))


def test_a_claim_for_an_ended_lease_is_refused_at_once() -> None:
    """A ticket replayed after its lease ended (the blocks maybe another request's now) gets a refusal at once,
    not silence; a claim for a lease not here yet waits (the caller keeps it early)."""
    book, _ = _book()
    assert book.claim("decode", ClaimEntry("p-1", GRANT, "d-1")) is None  # not leased yet: kept early
    book.drop("p-0")
    assert "it ended" in str(book.claim("decode", ClaimEntry("p-0", GRANT, "d-0")))


def test_a_claim_ahead_of_its_lease_is_confirmed_from_its_ticket() -> None:
    """The decode may claim before the prefill worker was told of the lease (its scheduler finished the request a
    step ago): the claim's ticket, signed by this engine's scheduler, confirms it at once, for the first engine,
    which becomes the lease's holder when it comes."""
    key = TicketKey(SECRET)
    t = [1000.0]
    book = LeaseBook("prefill-tp0", clock=lambda: t[0], wall=lambda: 1.7e9 + t[0], tickets=key, engine_id="prefill")
    wall = 1.7e9 + t[0]
    ticket = Ticket(1, "prefill", "p-0", GRANT, [[4, 5]], "127.0.0.1", 5600, 1, 16, wall + 30, wall + 90, "pull")
    text = key.issue(ticket)
    assert book.ahead_count() == 0
    lease = book.claim("decode", ClaimEntry("p-0", GRANT, "d-0", ticket=text))
    assert not isinstance(lease, str) and lease is not None and lease.block_ids == [[4, 5]]
    assert book.ahead_count() == 1  # the decode may read it now: the worker progresses until the lease comes
    assert book.expires_at(lease) == pytest.approx(wall + 30)
    assert "held by 'decode'" in str(book.claim("replayer", ClaimEntry("p-0", GRANT, "e-0", ticket=text)))
    assert "another request's ticket" in str(book.claim("decode", ClaimEntry("p-1", GRANT, "d-1", ticket=text)))
    assert "another request's ticket" in str(book.claim("decode", ClaimEntry("p-0", b"\0" * 16, "d-0", ticket=text)))
    other = key.issue(Ticket(1, "other", "p-2", GRANT, [[1]], "h", 1, 1, 1, wall + 30, wall + 90, "pull"))
    assert "engine 'other'" in str(book.claim("decode", ClaimEntry("p-2", GRANT, "d-2", ticket=other)))
    forged = TicketKey(b"another-deployment-secret-32-bytes!!").issue(ticket)
    assert "does not verify" in str(book.claim("decode", ClaimEntry("p-0", GRANT, "d-0", ticket=forged)))
    book.add("p-0", SendLease([[4, 5]], 30.0, GRANT, 60.0))
    assert book.leases["p-0"].holder == "decode" and book.ahead_count() == 0
    book.claim(
        "decode",
        ClaimEntry(
            "p-3",
            GRANT,
            "d-3",
            ticket=key.issue(
                Ticket(1, "prefill", "p-3", GRANT, [[7]], "127.0.0.1", 5600, 1, 16, wall + 30, wall + 90, "pull")
            ),
        ),
    )
    assert book.ahead_count() == 1
    t[0] += 91  # its lease never came (the request was aborted): forgotten after its ticket's latest end
    assert book.ahead_count() == 0
    unkeyed = LeaseBook("prefill-tp0", tickets=TicketKey(None), engine_id="prefill")  # insecure: no ticket trusted
    assert unkeyed.claim("decode", ClaimEntry("p-0", GRANT, "d-0", ticket=text)) is None
