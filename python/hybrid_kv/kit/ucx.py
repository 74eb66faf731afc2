"""Which UCX transports NIXL used, read from UCX's own protocol-selection report.

With ``UCX_PROTO_INFO=y`` UCX prints a table each time it selects protocols for an operation on an endpoint
configuration: the worker (the NIXL agent's name), the peer kind (``self``, ``intra-node``, ``inter-node``), the
operation and memory types (``remote memory read by ucp_get*(multi) into cuda memory from cuda``) and, per
message-size range, the protocol and the transport/device it runs on (``cuda_ipc/cuda``, ``cuda_copy/cuda``,
``cma/memory``, ``tcp/lo``, ``rc_mlx5/mlx5_0:1``...). Each kit rank process writes its stdout and stderr to its own
log file with that variable set; ``transports`` parses one log. The tables are UCX's selection for the endpoints
and memory types the ranks used, not a list of what the machine offers: a READ of device memory that UCX serves
through ``cuda_copy`` and host bounce buffers shows as such.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
from collections.abc import Iterable
from typing import Any

__all__ = ["PROTO_ENV", "summarize", "tables", "transports", "ucx_version"]

PROTO_ENV = {"UCX_PROTO_INFO": "y"}
"""What the kit sets in every rank process so that UCX reports its protocol choices."""

_PREFIX = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*")
_TITLE = re.compile(r"^\|\s*(\S+)\s+(self|intra-node|inter-node|[\w-]+)\s+cfg#(\d+)\s*\|$")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/([A-Za-z0-9_:.\-]+)")


def tables(lines: Iterable[str]) -> list[dict[str, Any]]:
    """Every protocol table in ``lines``: ``{"worker", "peer", "operation", "transports"}`` (transports as
    ``tl/device`` strings in the order the table's ranges name them, each once)."""
    out: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    want_op = False
    for raw in lines:
        line = _PREFIX.sub("", raw.rstrip("\n")).strip()
        if not line.startswith(("|", "+")):
            continue
        m = _TITLE.match(line)
        if m:
            cur = {"worker": m.group(1), "peer": m.group(2), "operation": "", "transports": []}
            out.append(cur)
            want_op = True
            continue
        if cur is None or line.startswith("+"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if want_op:
            cur["operation"] = " ".join(cells)
            want_op = False
        elif len(cells) >= 3 and cells[0] != "Range":
            for tl, dev in _TRANSPORT.findall(cells[-1]):
                name = f"{tl}/{dev}"
                if name not in cur["transports"]:
                    cur["transports"].append(name)
    return out


def summarize(found: list[dict[str, Any]]) -> dict[str, Any]:
    """Transports per operation towards other processes (``self`` tables left out): ``rma`` (remote memory
    reads and writes, what moves KV), ``other`` (active messages: notifications, wire-up), and ``rma_kinds``: the
    transport names behind the RMA operations on each memory type (``{"cuda": ["cuda_ipc"], "host": ["cma"]}``;
    an operation naming cuda memory on either side counts as ``cuda``)."""
    rma: dict[str, list[str]] = {}
    other: dict[str, list[str]] = {}
    kinds: dict[str, set[str]] = {}
    for t in found:
        if t["peer"] == "self":
            continue
        is_rma = t["operation"].startswith("remote memory")
        into = rma if is_rma else other
        seen = into.setdefault(t["operation"], [])
        seen += [x for x in t["transports"] if x not in seen]
        if is_rma:
            mem = "cuda" if "cuda" in t["operation"] else "host"
            kinds.setdefault(mem, set()).update(x.split("/")[0] for x in t["transports"])
    return {"rma": rma, "other": other, "rma_kinds": {m: sorted(k) for m, k in sorted(kinds.items())}}


def transports(path: str) -> dict[str, Any]:
    """``summarize`` of the log file at ``path`` (empty when it has no tables)."""
    try:
        with open(path, errors="replace") as f:
            return summarize(tables(f))
    except OSError:
        return summarize([])


def ucx_version() -> str:
    """The version string of the UCX library NIXL loaded (its ``libucp``), or why it is unknown."""
    try:
        import nixl._api as api

        here = os.path.dirname(os.path.dirname(os.path.abspath(api.__file__)))
        found = []
        for pkg in ("nixl_cu13", "nixl_cu12", "nixl"):
            found += glob.glob(os.path.join(here, f"{pkg}.libs", "libucp*.so*"))
        if not found:
            return "unknown: no libucp beside the nixl package"
        lib = ctypes.CDLL(found[0])
        lib.ucp_get_version_string.restype = ctypes.c_char_p
        return str(lib.ucp_get_version_string().decode())
    except (ImportError, OSError, AttributeError) as exc:
        return f"unknown: {type(exc).__name__}: {exc}"
