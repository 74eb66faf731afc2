"""``ClaimServer``: the prefill side of pull: answers decode ranks' lease claims (``claims``), with digests.

A claim entry is answered ``ok`` only for a lease this worker holds, carrying the claim's grant, not held by
another decode engine and with more than ``LEASE_MARGIN_S`` left (``LeaseBook.claim``); its answer says when the
lease ends; a verified request's answer says its digest follows, and the digest (this rank's of its side of the
moves, rebuilt from the claim's payload and ids and the lease's own ids, ``verify``) is taken once the step's
answers are on their way, so the decode's READ runs meanwhile; the lease holds the blocks until the decode
releases them, after its check. A claim for
a request not leased here yet waits with the early messages (in wire form, bounded) and is answered when its lease
comes, or refused when it expires; one for a lease that ended is refused at once. Answers go to the claiming
rank's side channel, which must be inside ``peer_networks``, one ``ClaimAnswers`` per decode rank per step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ...claims import (
    Claim,
    ClaimEntry,
    ClaimResult,
    DigestDue,
    answer_claim,
    answer_messages,
    decode_claim_message,
    take_digests,
)
from ...connector_core.early import EARLY_TTL_S
from ...connector_core.leases import LeaseBook, engine_of
from ...connector_core.params import host_allowed
from .metadata import BlockIds
from .state import Registered

__all__ = ["ClaimServer"]

log = logging.getLogger("hybrid_kv.integrations.vllm.worker")


class ClaimServer:
    """Claims on the leases of one registered prefill worker ``reg`` (its step thread only)."""

    def __init__(self, reg: Registered, leases: LeaseBook) -> None:
        self.reg = reg
        self.leases = leases
        self._answers: dict[tuple[str, str], list[ClaimResult]] = {}
        self._due: dict[tuple[str, str], list[DigestDue]] = {}  # digests owed, taken after the answers went
        self.after_digest: Callable[[str, BlockIds], None] | None = None  # tests: fault injection after a digest

    def on_claim(self, sender: str, msg: Claim, raw: bytes, only: str | None = None) -> None:
        """Answer the entries of ``msg`` from authenticated ``sender`` (``only``: just that request's, its lease
        having come since the claim was kept early)."""
        reg = self.reg
        if engine_of(sender) != msg.engine:
            reg.refused(sender, f"claim for engine {msg.engine!r} from {sender!r}")
            return
        if not host_allowed(msg.host, reg.networks):
            reg.refused(sender, f"claim answers to {msg.host!r}, outside the peer networks")
            return
        leases = self.leases

        def lookup(entry: ClaimEntry) -> tuple[BlockIds, float] | str | None:
            got = leases.claim(msg.engine, entry)
            return got if got is None or isinstance(got, str) else (got.block_ids, leases.expires_at(got))

        results, early, due = answer_claim(msg, lookup, True, only=only)
        dest = (f"tcp://{msg.host}:{msg.port}", sender)
        self._answers.setdefault(dest, []).extend(results)
        if due:
            self._due.setdefault(dest, []).extend(due)
        if early:
            self.leases.early.keep(sender, raw, early)

    def on_expired(self, sender: str, raw: bytes, waiting: set[str]) -> None:
        """A claim kept early whose leases never came: refuse its entries still waiting."""
        try:
            msg = decode_claim_message(raw)
        except ValueError:
            return
        if not isinstance(msg, Claim):
            return
        answers = self._answers.setdefault((f"tcp://{msg.host}:{msg.port}", sender), [])
        for entry in msg.entries:
            if entry.req in waiting:
                answers.append(ClaimResult(entry.d_req, False, f"no lease of {entry.req!r} within {EARLY_TTL_S:g} s"))

    def flush(self) -> None:
        """Send the answers of this step: one message per decode rank (more if they would not fit one); then take
        the digests owed and send them the same way (the decode ranks READ meanwhile)."""
        answers, self._answers = self._answers, {}
        for (address, to), results in answers.items():
            if results:
                self.reg.outbox.send((address, m, to) for m in answer_messages(results, self.reg.instance))
        owed, self._due = self._due, {}
        hook = self.after_digest
        after = None if hook is None else lambda e, ids: hook(e.req, [list(g) for g in ids])
        for (address, to), due in owed.items():
            digests = take_digests(due, self.reg.mirrors, self.reg.digester, after)
            self.reg.outbox.send((address, m, to) for m in answer_messages(digests, self.reg.instance))
