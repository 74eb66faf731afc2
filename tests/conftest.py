"""Test-session settings shared by every test directory."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest

SECRET_ENV = "HYBRID_KV_SECRET"  # hybrid_kv.transport.auth.SECRET_ENV (not imported: the binding may be unbuilt)


@pytest.fixture(scope="session", autouse=True)
def side_channel_secret() -> Iterator[str]:
    """One fresh shared side-channel secret for the session, in ``HYBRID_KV_SECRET``.

    Endpoints read it, and so do the peer and rank processes tests start (they inherit the environment),
    so side channels are authenticated in every test unless a test opts out explicitly.
    """
    old = os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = secret = secrets.token_hex(32)
    yield secret
    if old is None:
        os.environ.pop(SECRET_ENV, None)
    else:
        os.environ[SECRET_ENV] = old
