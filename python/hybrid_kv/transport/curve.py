"""ZeroMQ CURVE for the side channel: keys derived from the deployment secret, and the server's ZAP handler.

Why CURVE, not an application-level MAC or AEAD: ZeroMQ buffers a whole multipart message before the
application sees its first frame (``MAXMSGSIZE`` bounds one frame, the high-water mark counts whole messages),
so no check made on a received message can bound what an unauthenticated peer makes the receiver buffer.
CURVE (CurveZMQ: Curve25519 key exchange, then XSalsa20-Poly1305 boxes) authenticates both ends inside the
ZMTP handshake, before any application frame is accepted: a peer without the secret is disconnected after a
handshake command of bounded size, in either direction. Every frame after it is encrypted and authenticated
under short-term keys fresh for each connection, with strictly increasing nonces, so a captured frame can be
neither read nor replayed, into its own connection or any other (to the same server, another one, or a
restarted one): no replay window, no clock and no nonce memory are needed.

Keys. Every endpoint of one deployment derives the same two Curve25519 key pairs from the secret
(HKDF-SHA256, RFC 5869, on the standard library's HMAC: ``hkdf_sha256``), one for servers and one for clients,
each under its own label:

* a server socket uses the server secret key; its ZAP handler (``zap_reply``, run by the server's own thread)
  admits a client only if it proved it holds the client secret key;
* a client socket uses the client key pair and pins the server public key: a server that does not hold the
  server secret key cannot complete the handshake.

The keys prove membership of the deployment, as the secret does; they do not tell one member from another.
What a request is meant for (the server's name) travels inside the authenticated request (``side_channel``).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from typing import NamedTuple

import zmq
from zmq.utils import z85

__all__ = [
    "CLIENT_KEY_INFO",
    "SERVER_KEY_INFO",
    "ZAP_DOMAIN",
    "ZAP_ENDPOINT",
    "CurveKeys",
    "derive_keys",
    "hkdf_sha256",
    "make_client",
    "make_server",
    "zap_reply",
]

SERVER_KEY_INFO = b"hybrid-kv side channel hkv-sc/3: CURVE server secret key"
"""HKDF ``info`` label of the servers' Curve25519 secret key."""
CLIENT_KEY_INFO = b"hybrid-kv side channel hkv-sc/3: CURVE client secret key"
"""HKDF ``info`` label of the clients' Curve25519 secret key."""

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq asks a context's ZAP handler to admit each connecting peer (RFC 27)."""
ZAP_DOMAIN = b"hybrid-kv"
"""The ZAP domain of side-channel servers."""

_ZAP_VERSION = b"1.0"


class CurveKeys(NamedTuple):
    """The deployment's CURVE keys (Z85-encoded, as ZeroMQ's socket options take them)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def hkdf_sha256(secret: bytes, info: bytes) -> bytes:
    """32 bytes of HKDF-SHA256 (RFC 5869) of ``secret`` under ``info``, without salt (the RFC's default: a
    zero salt of the hash's length). One HMAC to extract, one to expand: 32 bytes are a single expand block."""
    prk = hmac.new(b"\x00" * 32, secret, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


@functools.lru_cache(maxsize=8)
def derive_keys(secret: bytes) -> CurveKeys:
    """The CURVE key pairs of the deployment holding ``secret`` (derived once per secret and process).

    Raises:
        ValueError: this libzmq was built without CURVE (``zmq.has("curve")`` is false).
    """
    if not zmq.has("curve"):
        raise ValueError(
            f"the side channel needs ZeroMQ CURVE, but libzmq {zmq.zmq_version()} (pyzmq {zmq.pyzmq_version()}) was "
            "built without it; install a pyzmq wheel (they bundle libzmq with CURVE) or run insecure=True"
        )

    def secret_key(info: bytes) -> bytes:
        return z85.encode(hkdf_sha256(secret, info))

    server, client = secret_key(SERVER_KEY_INFO), secret_key(CLIENT_KEY_INFO)
    return CurveKeys(zmq.curve_public(server), server, zmq.curve_public(client), client)


def make_server(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make ``sock`` (before it binds) a CURVE server whose clients the ZAP handler of its context admits."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler bound: refuse everyone rather than admit everyone


def make_client(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the deployment's servers (their key pinned)."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


def zap_reply(request: list[bytes], keys: CurveKeys) -> tuple[list[bytes], str | None]:
    """The ZAP handler's answer to one request: admit (``200``) only a CURVE client holding the deployment's
    client key. Returns ``(reply frames, refusal)``: ``refusal`` is ``"peer address: reason"`` when refused."""
    if len(request) < 6 or request[0] != _ZAP_VERSION:
        request_id = request[1] if len(request) > 1 else b""
        return [_ZAP_VERSION, request_id, b"500", b"malformed ZAP request", b"", b""], "malformed ZAP request"
    _, request_id, _domain, address, _identity, mechanism, *credentials = request
    peer = address.decode("ascii", "replace")[:64]
    if mechanism != b"CURVE":
        why = f"mechanism {mechanism[:16].decode('ascii', 'replace')} instead of CURVE"
    elif len(credentials) != 1 or not hmac.compare_digest(credentials[0], z85.decode(keys.client_public)):
        why = "its CURVE client key is not the deployment's (check HYBRID_KV_SECRET)"
    else:
        return [_ZAP_VERSION, request_id, b"200", b"OK", b"", b""], None
    return [_ZAP_VERSION, request_id, b"400", b"not a member of this deployment", b"", b""], f"{peer}: {why}"
