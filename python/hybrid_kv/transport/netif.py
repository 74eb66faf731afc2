"""Where an endpoint listens: one host for the side channel and for UCX.

The side channel binds the host of ``Endpoint(listen=...)``; UCX's TCP transport would otherwise open a
listening socket on every network interface. ``ucx_restricted_to`` sets ``UCX_NET_DEVICES`` to the
interface owning that host while the UCX backend is created (UCX reads it then), so UCX listens on that
interface only (measured: 127.0.0.1 and 192.0.2.2 without it, 127.0.0.1 only with it, on a host whose
``lo`` is 127.0.0.1 and ``eth0`` 192.0.2.2).

UCX names RDMA devices by port (``mlx5_0:1``), not by interface, so naming the interface alone would leave
UCX only TCP on InfiniBand and RoCE. ``ucx_devices`` therefore adds the RDMA ports of the same NIC, read from
sysfs (``rdma_devices_of``): the InfiniBand devices of the interface's PCI device
(``/sys/class/net/IF/device/infiniband/*``), and of their ports (``/sys/class/infiniband/DEV/ports/*``)
those whose GID table names the interface (RoCE: ``gid_attrs/ndevs/*``), or, where no GID names a network
interface (InfiniBand), the port the interface sits on (IPoIB: ``/sys/class/net/IF/dev_port``, 0-based).
RDMA transports open no IP listener, so this restricts exactly what listens. An interface sysfs does not tie
to a NIC (a bond, a VLAN, a bridge) gets no RDMA ports: set ``UCX_NET_DEVICES`` yourself there.

Environment variables are process-wide: the variable is set only for the duration of the backend's
creation and restored afterwards, so endpoints must not be created concurrently from several threads
(nor other UCX contexts meanwhile). A ``UCX_NET_DEVICES`` the caller already set is left as it is.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import re
import socket
import struct
from collections.abc import Iterator

__all__ = [
    "DEFAULT_HOST",
    "SYSFS",
    "UCX_DEVICES_ENV",
    "interface_of",
    "listen_host",
    "rdma_devices_of",
    "ucx_devices",
    "ucx_restricted_to",
]

log = logging.getLogger("hybrid_kv.transport")

DEFAULT_HOST = "127.0.0.1"
"""The host an endpoint without a side channel (``listen=None``) restricts UCX to."""

UCX_DEVICES_ENV = "UCX_NET_DEVICES"
"""The UCX variable naming the network devices UCX may use (and listen on)."""

SYSFS = "/sys"
"""Where sysfs is mounted (tests pass a fake tree instead)."""

_SIOCGIFADDR = 0x8915
_MAX_SYSFS_ENTRIES = 4096  # GID table entries or ports read per device, at most
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


def rdma_devices_of(interface: str, sysfs: str = SYSFS) -> list[str]:
    """The UCX names (``DEV:PORT``) of the RDMA ports on the NIC of network interface ``interface``, sorted; empty
    when sysfs ties no RDMA device to it (plain Ethernet, loopback, bonds...)."""
    try:
        devices = sorted(os.listdir(os.path.join(sysfs, "class", "net", interface, "device", "infiniband")))
    except OSError:
        return []
    dev_port = _read_int(os.path.join(sysfs, "class", "net", interface, "dev_port"))
    found = []
    for dev in devices[:_MAX_SYSFS_ENTRIES]:
        ports_dir = os.path.join(sysfs, "class", "infiniband", dev, "ports")
        try:
            ports = sorted((p for p in os.listdir(ports_dir) if p.isdigit()), key=int)[:_MAX_SYSFS_ENTRIES]
        except OSError:
            continue
        netdevs = {p: _gid_netdevs(os.path.join(ports_dir, p)) for p in ports}
        if any(netdevs.values()):  # RoCE: a port's GIDs name the interfaces they belong to
            mine = [p for p in ports if interface in netdevs[p]]
        else:  # InfiniBand: no GID names an interface; IPoIB's dev_port tells the port (0-based), if any
            mine = [p for p in ports if dev_port is None or int(p) == dev_port + 1]
        found += [f"{dev}:{p}" for p in mine]
    return found


def ucx_devices(interface: str, sysfs: str = SYSFS) -> str:
    """The ``UCX_NET_DEVICES`` value restricting UCX to ``interface``: it and its NIC's RDMA ports."""
    return ",".join([interface, *rdma_devices_of(interface, sysfs)])


def _gid_netdevs(port_dir: str) -> set[str]:
    """The network interfaces a port's GID table names (unused entries cannot be read)."""
    ndevs = os.path.join(port_dir, "gid_attrs", "ndevs")
    try:
        entries = os.listdir(ndevs)[:_MAX_SYSFS_ENTRIES]
    except OSError:
        return set()
    names = set()
    for entry in entries:
        try:
            with open(os.path.join(ndevs, entry)) as f:
                name = f.read(64).strip()
        except OSError:
            continue
        if name:
            names.add(name)
    return names


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read(32).strip(), 0)
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def ucx_restricted_to(device: str | None, sysfs: str = SYSFS) -> Iterator[None]:
    """Within the block, ``UCX_NET_DEVICES`` names ``device`` and its NIC's RDMA ports (``ucx_devices``), unless
    ``device`` is ``None`` or the caller set the variable."""
    if device is None or UCX_DEVICES_ENV in os.environ:
        yield
        return
    os.environ[UCX_DEVICES_ENV] = devices = ucx_devices(device, sysfs)
    log.debug("UCX restricted to %s (%s=%s)", device, UCX_DEVICES_ENV, devices)
    try:
        yield
    finally:
        os.environ.pop(UCX_DEVICES_ENV, None)
