"""The side channel's CURVE keys come from HKDF-SHA256 on the standard library (``curve.hkdf_sha256``): it must be
RFC 5869's HKDF, and the keys of a given secret must never change (endpoints of one deployment built at different
times derive them independently)."""

from __future__ import annotations

from hybrid_kv.transport import curve


def test_hkdf_sha256_is_rfc5869() -> None:
    # RFC 5869, test case 3 (SHA-256, zero-length salt and info): the first 32 bytes of its OKM
    okm = curve.hkdf_sha256(b"\x0b" * 22, b"")
    assert okm.hex() == "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d"


def test_deployment_keys_are_the_ones_derived_before() -> None:
    keys = curve.derive_keys(bytes(range(40)))
    # the values the cryptography package's HKDF gave for this secret when the keys were introduced
    assert keys.server_secret == b"K90=}s*r[5D0?fY8j%DFF5Xp0CC4wxL.Q1+rRlOa"
    assert keys.client_secret == b")H&D6p/.[nuacqZ}8Il//Cj^13?mZs:fpIl%lZ7I"
    assert keys.server_public == b"suK+Jm01lGR10XdAsdZDTA<Y{2go.9?C=a81u@kE"
    assert keys.client_public == b"@$ZB>C$U<)R/3ae.B8H>FDwIPurC8M}ZqP5lZ?1A"
