"""What the side channel's security costs per call: hkv-sc/2 (HMAC tags, clock window, nonce memory; loaded
from git) against hkv-sc/3 (ZeroMQ CURVE, keys derived from the secret) and hkv-sc/3 without a secret
(``insecure``, the NULL mechanism), side by side in one run, interleaved call by call.

Each call is what the transport does: a fresh DEALER connection, one request, its reply. ``meta`` is the
handshake's fetch (a payload and NIXL metadata of the given sizes), ``ctrl`` one control message. Usage::

    python benches/side_channel_cost.py --calls 300 --old-commit c070be9
"""

from __future__ import annotations

import argparse
import importlib
import os
import secrets
import statistics
import subprocess
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

import zmq
from other_build import import_package

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_old(commit: str) -> Any:
    """hkv-sc/2's ``auth`` and ``side_channel`` from ``commit``, as the package ``hkv_sc2``."""
    pkg = os.path.join(tempfile.mkdtemp(prefix="hkv-sc2-"), "hkv_sc2")
    os.mkdir(pkg)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    for name in ("auth", "side_channel"):
        src = subprocess.run(
            ["git", "-C", ROOT, "show", f"{commit}:python/hybrid_kv/transport/{name}.py"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        with open(os.path.join(pkg, f"{name}.py"), "w") as f:
            f.write(src)
    import_package(os.path.dirname(pkg), "hkv_sc2")
    return importlib.import_module("hkv_sc2.side_channel")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300, help="calls per protocol and kind")
    ap.add_argument("--old-commit", default="c070be9", help="a commit with hkv-sc/2")
    ap.add_argument("--payload", type=int, default=600, help="handshake payload bytes")
    ap.add_argument("--nixl-md", type=int, default=3000, help="NIXL metadata bytes")
    args = ap.parse_args()

    from hybrid_kv.transport import channel_client, channel_server

    new = types.SimpleNamespace(
        SideChannelServer=channel_server.SideChannelServer,
        fetch_named_meta=channel_client.fetch_named_meta,
        send_control=channel_client.send_control,
    )

    old = load_old(args.old_commit)
    secret = secrets.token_hex(32).encode()
    payload, md = os.urandom(args.payload), os.urandom(args.nixl_md)
    ctx: Any = zmq.Context()

    def meta(rank: int) -> tuple[bytes, bytes]:
        return payload, md

    def control(sender: str, body: bytes) -> None:
        pass

    servers = {
        "hkv-sc/2 HMAC": old.SideChannelServer(ctx, "tcp://127.0.0.1:0", meta, control, name="P", key=secret),
        "hkv-sc/3 CURVE": new.SideChannelServer("tcp://127.0.0.1:0", meta, control, name="P", key=secret),
        "hkv-sc/3 insecure": new.SideChannelServer("tcp://127.0.0.1:0", meta, control, name="P", key=None),
    }
    calls: dict[tuple[str, str], Callable[[], object]] = {}
    for label, srv in servers.items():
        mod = old if label.startswith("hkv-sc/2") else new
        key = None if label.endswith("insecure") else secret
        addr = srv.address
        calls[(label, "meta")] = lambda mod=mod, addr=addr, key=key: mod.fetch_named_meta(
            ctx, addr, 0, "D", 5.0, key=key
        )
        calls[(label, "ctrl")] = lambda mod=mod, addr=addr, key=key: mod.send_control(
            ctx, addr, b"release r1", "D", 5.0, key=key
        )
    times: dict[tuple[str, str], list[float]] = {k: [] for k in calls}
    for fn in calls.values():  # warm-up: imports, key derivation, first connections
        fn()
    for _ in range(args.calls):
        for k, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    for srv in servers.values():
        srv.close()
    ctx.destroy(linger=0)

    print(f"{args.calls} calls each, interleaved; payload {args.payload} B, NIXL metadata {args.nixl_md} B")
    print(f"{'protocol':<20}{'kind':<6}{'median ms':>11}{'p90 ms':>9}{'vs hkv-sc/2':>13}")
    for (label, kind), ts in times.items():
        med = statistics.median(ts)
        base = statistics.median(times[("hkv-sc/2 HMAC", kind)])
        p90 = statistics.quantiles(ts, n=10)[-1]
        print(f"{label:<20}{kind:<6}{med * 1e3:>11.3f}{p90 * 1e3:>9.3f}{med / base:>12.2f}x")


if __name__ == "__main__":
    main()
