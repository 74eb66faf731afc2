"""Fuzz every decoder of peer or client bytes: each must accept, or refuse with its own error type, any input.

Decoders (what an untrusted party sends, and the one error type each may raise):

- ``control``: a control message from a peer (``connector_core.control.decode`` -> ``ControlError``), seeds of
  every kind (releases, renewals, registrations, plans, claims and their answers), plus nesting bombs;
- ``ticket``: a ticket from an API client (``TicketKey.open`` -> ``TicketError``), signed and unsigned seeds;
- ``params``: a decode request's ``kv_transfer_params`` (``TransferParams.check``: never raises, a string reason);
- ``notification``: a NIXL notification from a peer (``transport.notifications.parse`` -> ``None`` when not one);
- ``payload``: a handshake payload from a peer (``decode_meta`` -> ``HandshakeError``);
- ``frames``: a side-channel request's frames (``SideChannelServer._handle``: always a reply, never raises).

Inputs are mutations of valid seeds (bytes flipped, cut, grown, spliced with another seed, containers nested
deep, lengths claimed huge), for ``params`` mutations of JSON values. Anything else raised is a defect: the
script prints it and exits 1. ``--iterations`` per decoder (default 10^6); ``--json`` writes the counts.

    python benches/fuzz_decoders.py --iterations 1000000
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from hybrid_kv import HandshakeError, build_region_table, decode_meta
from hybrid_kv.claims import ClaimEntry, ClaimResult
from hybrid_kv.connector_core import control
from hybrid_kv.connector_core.params import TransferParams
from hybrid_kv.connector_core.tickets import SpentTickets, Ticket, TicketError, TicketKey
from hybrid_kv.presets import get_preset
from hybrid_kv.transport import notifications

SECRET = b"fuzz-decoders-secret-of-32-bytes!!"
GRANT = bytes(range(16))


def _control_seeds() -> list[bytes]:
    reg = dict(d_req="d-0", ids=[[1, 2, 3]], engine="decode", host="10.0.0.2", port=5700, tp=2, until=1.7e9)
    msgs: list[control.Control] = [
        control.Release(req="p-0", grant=GRANT, consumers=2),
        control.Renew(req="p-0", grant=GRANT, until=1.7e9),
        control.PushReg(p_req="p-0", grant=GRANT, verify=True, instance="ab" * 8, **reg),  # type: ignore[arg-type]
        control.StreamReg(cap=GRANT, **reg),  # type: ignore[arg-type]
        control.PushPlan(d_req="d-0", writes=True, payload=b"p" * 64, ids=[[4, 5]]),
        control.Claim([ClaimEntry("p-0", GRANT, "d-0", [[1, 2]], True)], "decode", "10.0.0.2", 5700, b"x" * 64),
        control.ClaimAnswers([ClaimResult("d-0", True, "", 1.7e9, "0123456789abcdef", 10, 2)], "cd" * 8),
    ]
    return [control.encode(m) for m in msgs]


def _ticket_seeds(key: TicketKey) -> list[str]:
    t = Ticket(1, "prefill", "p-0", GRANT, [[3, 4, 5], [9]], "10.0.0.1", 5600, 2, 40, 1.7e9, 1.7e9 + 60, "pull")
    return [key.issue(t), TicketKey(None).issue(t)]


def _payload_seeds() -> list[bytes]:
    p = get_preset("tiny-kimi-linear")
    table = build_region_table(p.rank_layout(tp=2, rank=0, num_blocks=8))
    return [table.handshake_payload(p.engine_info("prefill", "pull"))]


def mutate(rng: random.Random, seed: bytes, seeds: list[bytes]) -> bytes:
    """One random mutation of ``seed`` (a few edits of the kinds a fuzzer or an attacker makes)."""
    raw = bytearray(seed)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        at = rng.randrange(len(raw) + 1)
        if op == 0 and raw:
            raw[min(at, len(raw) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and raw:
            raw[min(at, len(raw) - 1)] = rng.choice((0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xDC, 0xDD, 0xDF, 0xDB, 0xFF))
        elif op == 2:
            del raw[at:]
        elif op == 3:
            raw[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 32)))
        elif op == 4:
            other = rng.choice(seeds)
            raw[at:] = other[rng.randrange(len(other) + 1) :]
        elif op == 5:  # a container nested deep (the bomb that raised RecursionError)
            raw[at:at] = (b"\x91" if rng.random() < 0.5 else b"\x81\xa1k") * rng.randint(10, 3000) + b"\xc0"
        elif op == 6:  # a huge claimed length
            raw[at:at] = rng.choice((b"\xdd\xff\xff\xff\xff", b"\xdb\x7f\xff\xff\xff", b"\xc6\xff\xff\xff\xff"))
        else:
            del raw[at : at + rng.randint(1, 16)]
    return bytes(raw)


def _json_mutation(rng: random.Random, base: dict[str, Any]) -> Any:
    hostile: list[Any] = [
        None,
        True,
        -1,
        0,
        2**64,
        math.inf,
        math.nan,
        "",
        "x" * 5000,
        "9" * 4301,
        [],
        {},
        [[1e400]],
        [[-1]],
        {"a": {"b": {"c": []}}},
        "A" * 12,
    ]
    out: Any = dict(base)
    for _ in range(rng.randint(1, 3)):
        key = rng.choice([*base, "hkv_ticket", "hkv_stream", "remote_port", "extra"])
        out[key] = rng.choice(hostile)
    if rng.random() < 0.05:
        nested: Any = 0
        for _ in range(rng.randint(50, 2000)):
            nested = [nested] if rng.random() < 0.5 else {"k": nested}
        out["remote_block_ids"] = nested
    if rng.random() < 0.02:
        out = rng.choice(hostile)
    return out


def run(iterations: int, seed: int) -> dict[str, dict[str, int]]:
    rng = random.Random(seed)
    key = TicketKey(SECRET)
    counts: dict[str, dict[str, int]] = {}
    defects: list[str] = []

    def fuzz(name: str, one: Callable[[], str]) -> None:
        c = counts.setdefault(name, {"accepted": 0, "refused": 0, "defects": 0})
        t0 = time.perf_counter()
        for _ in range(iterations):
            try:
                c[one()] += 1
            except Exception:  # noqa: BLE001 - what the fuzzer looks for
                c["defects"] += 1
                if len(defects) < 10:
                    defects.append(f"{name}: {traceback.format_exc(limit=3)}")
        c["seconds"] = round(time.perf_counter() - t0, 1)  # type: ignore[assignment]
        print(
            f"{name:>13}: {iterations:>9,} inputs, {c['accepted']:>8,} accepted, {c['refused']:>9,} refused, "
            f"{c['defects']} defects ({c['seconds']} s)",
            flush=True,
        )

    seeds = _control_seeds()

    def control_one() -> str:
        try:
            control.decode(mutate(rng, rng.choice(seeds), seeds))
        except control.ControlError:
            return "refused"
        return "accepted"

    tickets = _ticket_seeds(key)

    def ticket_one() -> str:
        raw = [t.encode() for t in tickets]
        text = mutate(rng, rng.choice(raw), raw).decode("ascii", "replace")
        try:
            key.open(text)
        except TicketError:
            return "refused"
        return "accepted"

    params = TransferParams(key, "pull", 2, engines=frozenset({("prefill", "10.0.0.1", 5600)}))
    base = {
        "do_remote_prefill": True,
        "hkv_ticket": tickets[0],
        "remote_engine_id": "prefill",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 2,
    }

    def params_one() -> str:
        params.spent = SpentTickets()  # every input judged on its own (not refused as a replay of an earlier one)
        got = params.check(_json_mutation(rng, base), [64, 4], 1.7e9 - 10)
        return "refused" if isinstance(got, str) else "accepted"

    notes = [
        notifications.done_message("r-1", 0, 3),
        notifications.done_message("r-1", 2, 3, 0x1234),
        notifications.fail_message("r-1", "boom"),
    ]

    def notification_one() -> str:
        return "refused" if notifications.parse(mutate(rng, rng.choice(notes), notes)) is None else "accepted"

    payloads = _payload_seeds()

    def payload_one() -> str:
        try:
            decode_meta(mutate(rng, rng.choice(payloads), payloads))
        except HandshakeError:
            return "refused"
        return "accepted"

    fuzz("control", control_one)
    fuzz("ticket", ticket_one)
    fuzz("params", params_one)
    fuzz("notification", notification_one)
    fuzz("payload", payload_one)
    fuzz("frames", _frames_fuzzer(rng))
    for d in defects:
        print(d, file=sys.stderr)
    return counts


def _frames_fuzzer(rng: random.Random) -> Callable[[], str]:
    """A side-channel server's handling of one request's frames (its thread is not started: ``_handle`` alone)."""
    from hybrid_kv.transport.channel_server import SideChannelServer
    from hybrid_kv.transport.side_channel import PROTOCOL

    server = SideChannelServer.__new__(SideChannelServer)  # the request handling alone, no socket
    server._name, server._logged, server._bound = b"P", set(), "tcp://fuzz"  # type: ignore[attr-defined]
    server._meta = lambda rank: (b"payload", b"md")  # type: ignore[attr-defined]
    server._on_control = lambda sender, payload: None  # type: ignore[attr-defined]
    good = [PROTOCOL, b"ctrl", b"r" * 16, b"P", b"D", b"payload"]
    seeds = [b"".join(good)]

    def one() -> str:
        frames = [mutate(rng, f, seeds) if rng.random() < 0.3 else f for f in good]
        frames = frames[: rng.randint(0, 7)] if rng.random() < 0.2 else frames
        reply = server._handle(frames, "fuzz")
        return "accepted" if reply[2] == b"ok" else "refused"

    return one


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=1_000_000, help="inputs per decoder (default 10^6)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args()
    counts = run(args.iterations, args.seed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(counts, f, indent=1)
    return 1 if any(c["defects"] for c in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
