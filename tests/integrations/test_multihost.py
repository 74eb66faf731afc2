"""The vLLM connector across two "hosts": the prefill engine's workers in one network namespace, the decode
engine's in another, joined only by a veth pair that this test creates (and always removes), with UCX over
TCP (``ucx_tls: tcp``) and each side channel bound to its namespace's veth address.

A real Kimi-Linear-shaped request (hybrid MLA + KDA, prefill TP 1 -> decode TP 2) moves in pull and in push
mode through vLLM's real Scheduler (in this process, which stays in its own namespace and talks to the
workers over multiprocessing pipes), and every byte of the decode workers' KV memory is checked as in
``test_vllm_connector.py``. That the bytes crossed the veth is asserted twice: the ``kv_transfer_params`` the
decode engine dials carry the prefill's veth address (no other route between the namespaces exists), and the
veth's byte counters grew by at least the KV bytes the connector reports moved.

Skipped, with the reason, only where network namespaces cannot be created (not root, no ``ip``, EPERM).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from vllm_harness import Engine, EngineSpec, move, verify_moved

os.environ.setdefault("HYBRID_KV_SECRET", "hybrid-kv-vllm-connector-tests-secret")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

P_PORT, D_PORT = 5600, 5700  # fresh namespaces: nothing else listens there
_NO_PERMISSION = ("Operation not permitted", "Permission denied")


@dataclass(frozen=True)
class Host:
    """One end of the veth pair: a network namespace, its veth device and that device's IPv4 address."""

    netns: str
    dev: str
    ip: str

    def counters(self) -> dict[str, int]:
        """``{"rx": bytes, "tx": bytes}`` of this end's veth, as ``ip -s link show`` reports them."""
        (link,) = json.loads(_ip("-n", self.netns, "-s", "-j", "link", "show", "dev", self.dev))
        stats = link["stats64"]
        return {"rx": int(stats["rx"]["bytes"]), "tx": int(stats["tx"]["bytes"])}


def _ip(*args: str) -> str:
    """Run ``ip ARGS``; raises ``subprocess.CalledProcessError`` with ip's message on failure."""
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def hosts() -> Iterator[tuple[Host, Host]]:
    """Two network namespaces joined by a veth pair (``lo`` up in both), unique names per run; removed after
    the test whatever happened (deleting a namespace destroys its end of the pair, and so the pair)."""
    if shutil.which("ip") is None:
        pytest.skip("network namespaces cannot be created: the `ip` command (iproute2) is not installed")
    tag = f"{os.getpid() % 100000:05d}{random.randrange(16**3):03x}"
    a, b = f"hkv-p-{tag}", f"hkv-d-{tag}"
    net = f"10.{random.randrange(64, 250)}.{random.randrange(1, 250)}"
    p = Host(a, f"hkvp{tag}", f"{net}.1")
    d = Host(b, f"hkvd{tag}", f"{net}.2")
    made: list[str] = []
    try:
        try:
            _ip("netns", "add", a)
        except subprocess.CalledProcessError as exc:
            if any(s in exc.stderr for s in _NO_PERMISSION):
                pytest.skip(f"network namespaces cannot be created here: `ip netns add` said {exc.stderr.strip()!r}")
            raise
        made.append(a)
        _ip("netns", "add", b)
        made.append(b)
        _ip("link", "add", p.dev, "netns", a, "type", "veth", "peer", "name", d.dev, "netns", b)
        for h in (p, d):
            _ip("-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", h.dev)
            _ip("-n", h.netns, "link", "set", h.dev, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
        yield p, d
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        left = [ns for ns in (a, b) if ns in _ip("netns", "list").split()]
        assert not left, f"network namespaces {left} survived the clean-up"


def _stats_bytes(engine: Engine) -> int:
    return sum(sum(s["bytes"]) for s in engine.stats)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_kimi_linear_across_namespaces(hosts: tuple[Host, Host], model_dirs: dict[str, str], mode: str) -> None:
    """Kimi-Linear, prefill TP 1 in one namespace -> decode TP 2 in the other, over the veth with UCX TCP."""
    ph, dh = hosts
    ucx = (("ucx_tls", "tcp"),)
    p_spec = EngineSpec("prefill", "kimi", model_dirs["kimi"], 1, mode, P_PORT, host=ph.ip, extra=ucx, netns=ph.netns)
    d_spec = EngineSpec("decode", "kimi", model_dirs["kimi"], 2, mode, D_PORT, host=dh.ip, extra=ucx, netns=dh.netns)
    p = Engine.start(p_spec)
    try:
        d = Engine.start(d_spec)
    except BaseException:
        p.close()
        raise
    try:
        before = {"p": ph.counters(), "d": dh.counters()}
        reqs = move(p, d, [300, 517, 64])
        for _, params in reqs:
            # the decode engine dialled the prefill's veth address: the one route between the namespaces
            assert params["remote_host"] == ph.ip and params["remote_port"] == P_PORT
            assert params["do_remote_prefill"] and params["tp_size"] == 1 and params["transfer_mode"] == mode
        assert verify_moved(p, d, reqs) > 0

        # the KV bytes crossed the veth: prefill -> decode on both ends of the pair
        moved_bytes = _stats_bytes(d if mode == "pull" else p)
        assert moved_bytes > 0
        after = {"p": ph.counters(), "d": dh.counters()}
        sent = after["p"]["tx"] - before["p"]["tx"]
        received = after["d"]["rx"] - before["d"]["rx"]
        assert sent >= moved_bytes and received >= moved_bytes, (
            f"veth moved {sent} bytes out of the prefill namespace and {received} into the decode one, "
            f"fewer than the {moved_bytes} KV bytes the connector reports"
        )
    finally:
        p.close()
        d.close()
