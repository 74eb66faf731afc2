"""Where an endpoint listens: one host for the side channel and for UCX.

The side channel binds the host of ``Endpoint(listen=...)``; UCX's TCP transport would otherwise open a
listening socket on every network interface. ``ucx_restricted_to`` sets ``UCX_NET_DEVICES`` to the
interface owning that host while the UCX backend is created (UCX reads it then), so UCX listens on that
interface only (measured: 127.0.0.1 and 192.0.2.2 without it, 127.0.0.1 only with it, on a host whose
``lo`` is 127.0.0.1 and ``eth0`` 192.0.2.2).

Environment variables are process-wide: the variable is set only for the duration of the backend's
creation and restored afterwards, so endpoints must not be created concurrently from several threads
(nor other UCX contexts meanwhile). A ``UCX_NET_DEVICES`` the caller already set is left as it is.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import socket
import struct
from collections.abc import Iterator

__all__ = ["DEFAULT_HOST", "UCX_DEVICES_ENV", "interface_of", "listen_host", "ucx_restricted_to"]

DEFAULT_HOST = "127.0.0.1"
"""The host an endpoint without a side channel (``listen=None``) restricts UCX to."""

UCX_DEVICES_ENV = "UCX_NET_DEVICES"
"""The UCX variable naming the network devices UCX may use (and listen on)."""

_SIOCGIFADDR = 0x8915
_LISTEN = re.compile(r"tcp://(?P<host>[^:/\[\]]+):(?P<port>\d+|\*)")


def listen_host(listen: str | None) -> str:
    """The host of a side-channel address ``tcp://HOST:PORT`` (``DEFAULT_HOST`` for ``None``).

    Raises:
        ValueError: not of the form ``tcp://IPV4:PORT`` or ``tcp://*:PORT``.
    """
    if listen is None:
        return DEFAULT_HOST
    m = _LISTEN.fullmatch(listen)
    if m is None:
        raise ValueError(f"listen address {listen!r} is not of the form tcp://IPV4:PORT (or tcp://*:PORT)")
    host = m.group("host")
    if host != "*":
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"listen address {listen!r}: host {host!r} is not an IPv4 address or '*'") from None
    return host


def interface_of(host: str) -> str | None:
    """The network interface owning IPv4 ``host`` (any 127.x.y.z: the loopback one); ``None`` for ``*``/``0.0.0.0``.

    Raises:
        ValueError: no interface of this machine has that address.
    """
    if host == "*" or ipaddress.IPv4Address(host).is_unspecified:
        return None
    wanted = ipaddress.IPv4Address(host)
    for _, name in socket.if_nameindex():
        addr = _ipv4_of(name)
        if addr is not None and (addr == wanted or (wanted.is_loopback and addr.is_loopback)):
            return name
    raise ValueError(f"no network interface of this machine has the address {host}")


def _ipv4_of(name: str) -> ipaddress.IPv4Address | None:
    """The primary IPv4 address of interface ``name``, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return ipaddress.IPv4Address(raw[20:24])


@contextlib.contextmanager
def ucx_restricted_to(device: str | None) -> Iterator[None]:
    """Within the block, ``UCX_NET_DEVICES=device`` (unless ``device`` is ``None`` or the caller set it)."""
    if device is None or UCX_DEVICES_ENV in os.environ:
        yield
        return
    os.environ[UCX_DEVICES_ENV] = device
    try:
        yield
    finally:
        os.environ.pop(UCX_DEVICES_ENV, None)
