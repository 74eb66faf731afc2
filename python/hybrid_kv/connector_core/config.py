"""The connector's settings: ``kv_connector_extra_config`` first, then ``HYBRID_KV_*`` env vars, then defaults.

Every setting is listed in ``SETTINGS`` (the README's table is this list). Nothing here imports vLLM.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

__all__ = ["SETTINGS", "ConnectorConfig"]


# key -> (env var, default, meaning)
SETTINGS: dict[str, tuple[str, Any, str]] = {
    "mode": ("HYBRID_KV_MODE", "pull", "`pull` (decode READs from prefill) or `push` (prefill WRITEs into decode)"),
    "side_channel_host": (
        "HYBRID_KV_SIDE_CHANNEL_HOST",
        "127.0.0.1",
        "IPv4 address each worker's side channel binds (UCX is restricted to the interface owning it)",
    ),
    "side_channel_port": (
        "HYBRID_KV_SIDE_CHANNEL_PORT",
        5600,
        "base port; worker `tp_rank` of data-parallel rank `dp` listens on `port + dp * tp_size + tp_rank`",
    ),
    "advertise_host": (
        "HYBRID_KV_ADVERTISE_HOST",
        None,
        "address handed to peers in `kv_transfer_params` (default: the side-channel host; required when that is "
        "`0.0.0.0`, which is never advertised)",
    ),
    "handshake_timeout_s": ("HYBRID_KV_HANDSHAKE_TIMEOUT_S", 10.0, "deadline of one handshake with a peer rank"),
    "side_channel_process": (
        "HYBRID_KV_SIDE_CHANNEL_PROCESS",
        True,
        "serve each worker's side channel from a child process (its own GIL), so handshakes are answered while "
        "the worker's main thread spins; `false` serves it from a thread of the worker",
    ),
    "max_concurrent_handshakes": (
        "HYBRID_KV_MAX_CONCURRENT_HANDSHAKES",
        8,
        "peer engines a worker handshakes with at once (one handshake per engine; more wait, with a warning)",
    ),
    "transfer_timeout_s": ("HYBRID_KV_TRANSFER_TIMEOUT_S", 60.0, "deadline of one request's transfers"),
    "lease_s": (
        "HYBRID_KV_LEASE_S",
        120.0,
        "how long a prefill engine keeps a finished request's blocks for its decode engine before freeing them "
        "(a release frees them at once; the lease must outlast the decode's queueing: vLLM's NixlConnector "
        "waits 480 s)",
    ),
    "lease_max_extension_s": (
        "HYBRID_KV_LEASE_MAX_EXTENSION_S",
        60.0,
        "how much longer than `lease_s` a decode still connecting to the prefill engine may renew a lease",
    ),
    "peer_networks": (
        "HYBRID_KV_PEER_NETWORKS",
        None,
        "comma-separated CIDRs (e.g. `10.0.0.0/8,fd00::/8`): a decode dials only ticket hosts inside them, a "
        "prefill pushes only to registered hosts inside them (default: any address)",
    ),
    "peer_engines": (
        "HYBRID_KV_PEER_ENGINES",
        None,
        "comma-separated `ENGINE_ID@HOST:PORT` (the engine id and the side channel of its TP rank 0): a decode "
        "acts on a concurrent push (`hkv_stream`) only for a prefill engine listed here or named by a signed ticket "
        "it verified before, so API clients cannot make it dial other addresses",
    ),
    "push_registration_timeout_s": (
        "HYBRID_KV_PUSH_REGISTRATION_TIMEOUT_S",
        60.0,
        "push mode: how long a decode request waits for the prefill engine's WRITEs",
    ),
    "stream": (
        "HYBRID_KV_STREAM",
        True,
        "push mode: post each layer's KV while the request's last prefill forward still runs, for requests whose "
        "decode registered during the prefill (the router sent both with one `hkv_stream` capability); `false` "
        "pushes every request after it finished",
    ),
    "ucx_tls": ("HYBRID_KV_UCX_TLS", None, "sets `UCX_TLS` for the NIXL agent (e.g. `tcp`, `rc,cuda_copy`)"),
    "insecure": (
        "HYBRID_KV_INSECURE",
        False,
        "run the side channel without the shared secret (`HYBRID_KV_SECRET`); only on trusted networks",
    ),
    "coalesce": ("HYBRID_KV_COALESCE", True, "post runs of consecutive blocks as chunk descriptors (nixl >= 1.5)"),
    "verify": (
        "HYBRID_KV_VERIFY",
        "off",
        "end-to-end transfer digests, decided by the decode engine: `off`, `all`, or `sampled:N` (every Nth "
        "request it loads, 1 <= N <= 1048576); both sides digest their side of the request's byte moves and a "
        "mismatch fails the request like any failed transfer (`kv_load_failure_policy`)",
    ),
}


def _parse(key: str, raw: Any, default: Any) -> Any:
    if raw is None:
        return None
    if isinstance(default, bool):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"hybrid-kv setting {key!r}: expected a boolean, got {raw!r}")
    try:
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"hybrid-kv setting {key!r}: expected a number, got {raw!r}") from None
    return str(raw)


@dataclass(frozen=True)
class ConnectorConfig:
    """Resolved connector settings (see ``SETTINGS``)."""

    mode: str
    side_channel_host: str
    side_channel_port: int
    advertise_host: str
    handshake_timeout_s: float
    side_channel_process: bool
    max_concurrent_handshakes: int
    transfer_timeout_s: float
    lease_s: float
    lease_max_extension_s: float
    peer_networks: str | None
    peer_engines: str | None
    push_registration_timeout_s: float
    stream: bool
    ucx_tls: str | None
    insecure: bool
    coalesce: bool
    verify: str

    @classmethod
    def resolve(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ConnectorConfig:
        """Settings from ``kv_connector_extra_config`` (``extra``), then ``env`` (default ``os.environ``)."""
        extra = dict(extra or {})
        env = os.environ if env is None else env
        unknown = sorted(k for k in extra if k not in SETTINGS)
        if unknown:
            raise ConfigError(f"unknown hybrid-kv setting(s) in kv_connector_extra_config: {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for key, (var, default, _) in SETTINGS.items():
            raw = extra[key] if key in extra else env.get(var)
            value = _parse(key, raw, default)
            values[key] = default if value is None else value
        if values["mode"] not in ("pull", "push"):
            raise ConfigError(f"hybrid-kv setting 'mode' must be 'pull' or 'push', got {values['mode']!r}")
        host = values["side_channel_host"]
        try:
            listen_ip = ipaddress.IPv4Address(host)
        except ValueError:
            raise ConfigError(f"hybrid-kv setting 'side_channel_host' must be an IPv4 address, got {host!r}") from None
        advertise = values["advertise_host"] or (None if listen_ip.is_unspecified else host)
        if advertise is None:
            raise ConfigError(
                "hybrid-kv: side_channel_host is 0.0.0.0, which peers cannot reach; set advertise_host "
                "(HYBRID_KV_ADVERTISE_HOST) to this machine's address on the network the peers use"
            )
        try:
            if ipaddress.ip_address(advertise).is_unspecified:
                raise ConfigError(f"hybrid-kv setting 'advertise_host' must be reachable, got {advertise!r}")
        except ValueError:
            pass  # a host name: handed to peers as is
        if not 1 <= values["max_concurrent_handshakes"] <= 1024:
            raise ConfigError(
                "hybrid-kv setting 'max_concurrent_handshakes' must be within [1, 1024], "
                f"got {values['max_concurrent_handshakes']}"
            )
        if not 0 <= values["side_channel_port"] < 65536:
            raise ConfigError(f"hybrid-kv setting 'side_channel_port' out of range: {values['side_channel_port']}")
        for key in ("handshake_timeout_s", "transfer_timeout_s", "lease_s", "push_registration_timeout_s"):
            if not 0 < values[key] < float("inf"):
                raise ConfigError(f"hybrid-kv setting {key!r} must be positive, got {values[key]}")
        if not 0 <= values["lease_max_extension_s"] <= 3600:
            raise ConfigError(
                "hybrid-kv setting 'lease_max_extension_s' must be within [0, 3600], "
                f"got {values['lease_max_extension_s']}"
            )
        if values["peer_networks"] is not None:
            for item in str(values["peer_networks"]).split(","):
                try:
                    if item.strip():
                        ipaddress.ip_network(item.strip(), strict=False)
                except ValueError:
                    raise ConfigError(f"hybrid-kv setting 'peer_networks': {item.strip()!r} is not a CIDR") from None
        if values["peer_engines"] is not None:
            from .params import parse_engines

            try:
                parse_engines(str(values["peer_engines"]))
            except ValueError as exc:
                raise ConfigError(f"hybrid-kv setting 'peer_engines': {exc}") from None
        from ..verify_policy import VerifyPolicy

        try:
            values["verify"] = str(VerifyPolicy.parse(values["verify"]))
        except ValueError as exc:
            raise ConfigError(f"hybrid-kv setting 'verify': {exc}") from None
        values["advertise_host"] = advertise
        return cls(**values)

    def worker_port(self, dp_index: int, tp_size: int, tp_rank: int) -> int:
        """The side-channel port of one worker."""
        return self.side_channel_port + dp_index * tp_size + tp_rank
