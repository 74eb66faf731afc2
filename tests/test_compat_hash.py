"""The handshake's compatibility hash covers the wire-format version and the model factors, never the package
version: two patch releases speaking the same wire format keep handshaking during a rolling upgrade."""

from __future__ import annotations

import hashlib
import json

import hybrid_kv

WIRE_VERSION = 1
"""``META_VERSION`` in ``rust/core/meta.rs``: bump both (and the pinned hash below) when the format changes."""

FACTORS = {
    "model": "moonshotai/Kimi-Linear-48B-A3B-Instruct",
    "dtype": "bfloat16",
    "cache_dtype": "auto",
    "total_num_kv_heads": 1,
    "head_size": 576,
    "num_hidden_layers": 27,
    "attn_backend": "FLASHMLA",
    "hma": True,
    "speculative": [],
    "transfer_mode": "pull",
}


def expected(wire_version: int, factors: dict[str, object]) -> str:
    """The hash recomputed from its definition: domain, NUL, body length, body = JSON ``[wire_version, factors]``."""
    body = json.dumps([wire_version, factors], separators=(",", ":")).encode()
    return hashlib.sha256(b"hybrid-kv/compat\0" + len(body).to_bytes(8, "big") + body).hexdigest()


def test_hash_is_wire_version_and_factors_only() -> None:
    assert hybrid_kv.compat_hash(json.dumps(FACTORS)) == expected(WIRE_VERSION, FACTORS)


def test_package_version_is_not_hashed() -> None:
    h = hybrid_kv.compat_hash(json.dumps(FACTORS))
    for version in (hybrid_kv.__version__, "0.1.1", "0.2.0"):  # any release of this wire format
        for with_version in ([version, WIRE_VERSION, FACTORS], [WIRE_VERSION, version, FACTORS]):
            body = json.dumps(with_version, separators=(",", ":")).encode()
            other = hashlib.sha256(b"hybrid-kv/compat\0" + len(body).to_bytes(8, "big") + body).hexdigest()
            assert other != h


def test_pinned_hash_of_default_factors() -> None:
    """Changes only with the wire format: a release that changes it without bumping META_VERSION fails here."""
    defaults = dict.fromkeys(FACTORS, "") | {
        "total_num_kv_heads": 0, "head_size": 0, "num_hidden_layers": 0, "hma": False, "speculative": [],
        "transfer_mode": "pull",
    }  # fmt: skip
    h = hybrid_kv.compat_hash(json.dumps(defaults))
    assert h == "b112e127cca17d5c5ae90539cbd3f0ccd1d331492ba746221afb12286cb7f1a5"


def test_model_factors_still_matter() -> None:
    other = FACTORS | {"cache_dtype": "fp8_e4m3"}
    assert hybrid_kv.compat_hash(json.dumps(other)) != hybrid_kv.compat_hash(json.dumps(FACTORS))
