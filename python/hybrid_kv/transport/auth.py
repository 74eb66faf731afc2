"""Shared-secret authentication of side-channel frames: HMAC-SHA256 tags and replay protection.

Every endpoint of one deployment holds the same secret (``Endpoint(secret=...)`` or the environment
variable ``HYBRID_KV_SECRET``). Each side-channel message, request or reply, carries
``HMAC-SHA256(secret, label || len(f0) || f0 || len(f1) || f1 ...)`` over all its other frames, so no
frame can be changed, dropped, moved or reflected (requests and replies use different labels) without
the tag failing. Requests carry a fresh random nonce and a timestamp: a server accepts a nonce once,
and only within ``MAX_CLOCK_SKEW_S`` of its own clock (``ReplayGuard``). A reply echoes its request's
nonce, so a client never accepts an old reply. Tags are compared with ``hmac.compare_digest``.

The secret authenticates membership of the deployment, not an individual endpoint: whoever holds it
may claim any endpoint name. See ARCHITECTURE.md, "Threat model / trust boundary".
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
from collections.abc import Sequence

__all__ = [
    "MAC_BYTES",
    "MAX_CLOCK_SKEW_S",
    "MAX_REMEMBERED_NONCES",
    "MIN_SECRET_BYTES",
    "NONCE_BYTES",
    "REPLY",
    "REQUEST",
    "SECRET_ENV",
    "ReplayGuard",
    "resolve_secret",
    "tag",
    "verify",
]

SECRET_ENV = "HYBRID_KV_SECRET"
"""The environment variable holding the deployment's shared side-channel secret (read when no
``secret`` argument is given; process-wide like every environment variable)."""

MIN_SECRET_BYTES = 16
"""The shortest secret accepted, in bytes (UTF-8 for a ``str``); e.g. ``secrets.token_hex(32)`` gives 64."""

MAC_BYTES = 32
"""Length of an HMAC-SHA256 tag."""

NONCE_BYTES = 16
"""Length of a request's random nonce (also the id its reply echoes)."""

MAX_CLOCK_SKEW_S = 30.0
"""A request whose timestamp differs from the server's clock by more than this is refused (replay window)."""

MAX_REMEMBERED_NONCES = 1 << 16
"""Nonces a server remembers within the replay window; past that, new requests are refused until old
ones expire (only authenticated requests are remembered, so only secret holders can fill it)."""

REQUEST = b"hkv-sc/2 request"
"""Label of request tags."""
REPLY = b"hkv-sc/2 reply"
"""Label of reply tags (a request can never pass as a reply, nor the reverse)."""


def resolve_secret(secret: bytes | str | None, *, insecure: bool, required: bool, what: str) -> bytes | None:
    """The side-channel key: ``secret`` if given, else ``$HYBRID_KV_SECRET``; ``None`` means unauthenticated.

    Args:
        secret: the shared secret, or ``None`` to read ``HYBRID_KV_SECRET``.
        insecure: the caller's explicit opt-out: no authentication at all (``secret`` must then be ``None``;
            the environment variable is ignored).
        required: whether having no secret is an error (a side-channel server must have one).
        what: who needs it, for the error message (e.g. ``"endpoint 'P'"``).

    Raises:
        ValueError: a secret together with ``insecure``, a secret shorter than ``MIN_SECRET_BYTES``, or
            none at all where ``required``.
    """
    if insecure:
        if secret is not None:
            raise ValueError(f"{what}: pass either secret=... or insecure=True, not both")
        return None
    source = "secret argument"
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
        source = SECRET_ENV
    if secret is None:
        if required:
            raise ValueError(
                f"{what} has a side channel but no secret: pass secret=... or set {SECRET_ENV} "
                "(or insecure=True to run it unauthenticated)"
            )
        return None
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(f"{what}: the {source} is {len(key)} bytes; at least {MIN_SECRET_BYTES} are required")
    return key


def tag(key: bytes, label: bytes, frames: Sequence[bytes]) -> bytes:
    """HMAC-SHA256 of ``label`` and the length-prefixed ``frames``."""
    mac = hmac.new(key, label, hashlib.sha256)
    for frame in frames:
        mac.update(len(frame).to_bytes(8, "big"))
        mac.update(frame)
    return mac.digest()


def verify(key: bytes, label: bytes, frames: Sequence[bytes], received: bytes) -> bool:
    """Whether ``received`` is the tag of ``label`` and ``frames`` (constant-time comparison)."""
    return hmac.compare_digest(tag(key, label, frames), received)


class ReplayGuard:
    """Accepts each request nonce once, and only with a timestamp within ``MAX_CLOCK_SKEW_S`` of now.

    Remembers at most ``MAX_REMEMBERED_NONCES`` nonces, each until its timestamp leaves the window. Used from
    the server thread only.
    """

    def __init__(self) -> None:
        self._seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # nonce -> expiry

    def check(self, nonce: bytes, sent_at: float, now: float) -> str | None:
        """Record ``nonce`` sent at ``sent_at`` (wall-clock s); the reason to refuse it, or ``None``."""
        skew = sent_at - now
        if not abs(skew) <= MAX_CLOCK_SKEW_S:  # also refuses NaN
            return f"request timestamp is {skew:+.1f} s from the server's clock (window ±{MAX_CLOCK_SKEW_S:g} s)"
        self._expire(now)
        if nonce in self._seen:
            return "replayed request (nonce already seen)"
        if len(self._seen) >= MAX_REMEMBERED_NONCES:
            return f"too many requests: {MAX_REMEMBERED_NONCES} nonces within the replay window"
        self._seen[nonce] = max(now, sent_at) + MAX_CLOCK_SKEW_S
        return None

    def _expire(self, now: float) -> None:
        # expiries are nearly in insertion order; stop at the first live one (a few may linger briefly)
        while self._seen:
            nonce, expiry = next(iter(self._seen.items()))
            if expiry > now:
                return
            del self._seen[nonce]
