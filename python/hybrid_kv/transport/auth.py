"""The deployment's shared secret: where it comes from and what is accepted as one.

Every endpoint of one deployment holds the same secret (``Endpoint(secret=...)`` or the environment variable
``HYBRID_KV_SECRET``). The side channel derives its ZeroMQ CURVE keys from it (``curve``); the vLLM connector
derives its ticket key from it. Generate one with::

    python -c "import secrets; print(secrets.token_hex(32))"

A secret must be at least ``MIN_SECRET_BYTES`` bytes, and obviously degenerate ones are refused: fewer than
``MIN_DISTINCT_BYTES`` distinct byte values (16 zero bytes, ``"k" * 32``), or a short pattern repeated
(``"ab" * 16``). These checks catch mistakes, not weak passphrases: use a random secret.

The secret authenticates membership of the deployment, not an individual endpoint: whoever holds it may claim
any endpoint name. See ARCHITECTURE.md, "Threat model / trust boundary".
"""

from __future__ import annotations

import os

__all__ = ["MIN_DISTINCT_BYTES", "MIN_SECRET_BYTES", "SECRET_ENV", "check_secret", "resolve_secret"]

SECRET_ENV = "HYBRID_KV_SECRET"
"""The environment variable holding the deployment's shared side-channel secret (read when no
``secret`` argument is given; process-wide like every environment variable)."""

MIN_SECRET_BYTES = 32
"""The shortest secret accepted, in bytes (UTF-8 for a ``str``); ``secrets.token_hex(32)`` gives 64."""

MIN_DISTINCT_BYTES = 8
"""A secret with fewer distinct byte values is refused as degenerate (a random 32-byte hex string has about 14)."""

GENERATE = 'python -c "import secrets; print(secrets.token_hex(32))"'
"""The command the error messages suggest for making a secret."""


def check_secret(key: bytes, source: str) -> None:
    """Refuse a secret that is too short or obviously degenerate.

    Raises:
        ValueError: naming ``source``, the problem and how to generate a secret (never the secret itself).
    """
    fix = f"generate one with: {GENERATE}"
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(f"the {source} is {len(key)} bytes; at least {MIN_SECRET_BYTES} are required ({fix})")
    distinct = len(set(key))
    if distinct < MIN_DISTINCT_BYTES:
        raise ValueError(
            f"the {source} has only {distinct} distinct byte values (at least {MIN_DISTINCT_BYTES} are required): "
            f"it is not random ({fix})"
        )
    for period in range(1, len(key) // 2 + 1):
        if all(key[i] == key[i % period] for i in range(period, len(key))):
            raise ValueError(f"the {source} repeats its first {period} bytes: it is not random ({fix})")


def resolve_secret(secret: bytes | str | None, *, insecure: bool, required: bool, what: str) -> bytes | None:
    """The deployment secret: ``secret`` if given, else ``$HYBRID_KV_SECRET``; ``None`` means unauthenticated.

    Args:
        secret: the shared secret, or ``None`` to read ``HYBRID_KV_SECRET``.
        insecure: the caller's explicit opt-out: no authentication at all (``secret`` must then be ``None``;
            the environment variable is ignored).
        required: whether having no secret is an error (a side-channel server must have one).
        what: who needs it, for the error message (e.g. ``"endpoint 'P'"``).

    Raises:
        ValueError: a secret together with ``insecure``, a secret refused by ``check_secret``, or none at all
            where ``required``.
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
                f"(generate one with: {GENERATE}; or insecure=True to run it unauthenticated)"
            )
        return None
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    try:
        check_secret(key, source)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    return key
