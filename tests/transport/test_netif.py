"""Which devices ``listen`` restricts UCX to, on fake sysfs trees of Ethernet, RoCE and InfiniBand
hosts (the RDMA ports of the listening interface's NIC are kept, so UCX keeps its RDMA transports)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hybrid_kv.transport import netif


def nic(sysfs: Path, interface: str, pci: str, ib: dict[str, dict[int, list[str]]] | None, dev_port: int = 0) -> None:
    """Interface ``interface`` on PCI function ``pci``; ``ib``: its RDMA devices, each ``{port: GID netdevs}``
    (an empty list: GIDs naming no interface, as on InfiniBand)."""
    device = sysfs / "devices" / "pci0000:00" / pci
    device.mkdir(parents=True, exist_ok=True)
    net = sysfs / "class" / "net" / interface
    net.mkdir(parents=True)
    (net / "device").symlink_to(device)
    (net / "dev_port").write_text(f"{dev_port}\n")
    for dev, ports in (ib or {}).items():
        (device / "infiniband" / dev).mkdir(parents=True, exist_ok=True)
        for port, netdevs in ports.items():
            gids = sysfs / "class" / "infiniband" / dev / "ports" / str(port) / "gid_attrs" / "ndevs"
            gids.mkdir(parents=True, exist_ok=True)
            for i, name in enumerate(netdevs):
                (gids / str(i)).write_text(name + "\n")
            (gids / str(len(netdevs))).mkdir(exist_ok=True)  # an unused GID entry: reading it fails (EINVAL)


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    (root / "class" / "net" / "lo").mkdir(parents=True)  # loopback: no device link
    nic(root, "eth0", "0000:01:00.0", None)  # plain Ethernet
    nic(root, "eth2", "0000:3b:00.0", {"mlx5_1": {1: ["eth2", "eth2", "eth2.100"]}})  # RoCE, one port
    nic(root, "eth3", "0000:3b:00.1", {"mlx5_2": {1: ["eth3"]}})  # the NIC's other function
    nic(root, "ib0", "0000:5e:00.0", {"mlx4_0": {1: [], 2: []}}, dev_port=0)  # InfiniBand, dual-port function
    nic(root, "ib1", "0000:5e:00.0", {"mlx4_0": {1: [], 2: []}}, dev_port=1)
    nic(root, "enp1", "0000:af:00.0", {"mlx5_4": {1: ["enp2"]}, "mlx5_5": {1: ["enp1"]}})  # GIDs decide
    return root


@pytest.mark.parametrize(
    ("interface", "devices"),
    [
        ("lo", "lo"),
        ("eth0", "eth0"),
        ("eth2", "eth2,mlx5_1:1"),
        ("eth3", "eth3,mlx5_2:1"),
        ("ib0", "ib0,mlx4_0:1"),
        ("ib1", "ib1,mlx4_0:2"),
        ("enp1", "enp1,mlx5_5:1"),
        ("bond0", "bond0"),  # not in sysfs as a NIC: no RDMA ports guessed
    ],
)
def test_ucx_keeps_the_rdma_ports_of_the_listening_nic(sysfs: Path, interface: str, devices: str) -> None:
    assert netif.ucx_devices(interface, str(sysfs)) == devices


def test_the_restriction_holds_only_while_the_backend_is_created(sysfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(netif.UCX_DEVICES_ENV, raising=False)
    with netif.ucx_restricted_to("eth2", str(sysfs)):
        assert os.environ[netif.UCX_DEVICES_ENV] == "eth2,mlx5_1:1"
    assert netif.UCX_DEVICES_ENV not in os.environ
    with netif.ucx_restricted_to(None, str(sysfs)):  # listen on every interface: nothing restricted
        assert netif.UCX_DEVICES_ENV not in os.environ
    monkeypatch.setenv(netif.UCX_DEVICES_ENV, "mlx5_0:1")  # the operator's own choice wins
    with netif.ucx_restricted_to("eth2", str(sysfs)):
        assert os.environ[netif.UCX_DEVICES_ENV] == "mlx5_0:1"
    assert os.environ[netif.UCX_DEVICES_ENV] == "mlx5_0:1"


def test_this_hosts_sysfs_is_read_without_error() -> None:
    """On the real /sys: every interface gets itself first, and any RDMA port named exists in sysfs."""
    for _, name in __import__("socket").if_nameindex():
        devices = netif.ucx_devices(name).split(",")
        assert devices[0] == name
        for dev_port in devices[1:]:
            dev, port = dev_port.split(":")
            assert os.path.isdir(f"/sys/class/infiniband/{dev}/ports/{port}")
