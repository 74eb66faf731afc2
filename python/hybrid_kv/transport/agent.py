"""``Agent``: one endpoint's NIXL agent and the handles it owns.

It holds the registration, the local tables and their prepped dlists, and the xfer handles NIXL
refused to release yet ("zombies", retried on every progress). It also wraps the NIXL calls whose
failure is harmless during cleanup. Every method runs on the endpoint's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import numpy as np
import numpy.typing as npt
from nixl._api import nixl_agent, nixl_agent_config

from .._core import expand_rows
from ..hugepages import HugePageReport, advise_huge_pages
from .netif import ucx_restricted_to
from .shared_preps import SharedPreps
from .tables import CheckedTable, registration_array

__all__ = ["CALL_ERRORS", "DISCONNECT", "LOCAL", "NIXL_ERRORS", "Agent"]

LOCAL = "NIXL_INIT_AGENT"  # the agent name NIXL uses for this agent's own dlists


def _nixl_errors() -> tuple[type[BaseException], ...]:
    """Every exception type the NIXL bindings raise (they share no base class)."""
    import nixl._bindings as bindings

    found = [
        obj
        for name in dir(bindings)
        if name.startswith("nixl") and isinstance(obj := getattr(bindings, name), type) and issubclass(obj, Exception)
    ]
    return tuple(found)


NIXL_ERRORS = _nixl_errors()
# NIXL also reports bad arguments through ValueError / TypeError / KeyError / IndexError
CALL_ERRORS: tuple[type[BaseException], ...] = (*NIXL_ERRORS, ValueError, TypeError, KeyError, IndexError)
DISCONNECT = tuple(t for t in NIXL_ERRORS if t.__name__ == "nixlRemoteDisconnectError")

_strided_ok: bool | None = None  # whether this NIXL accepts (N, 5) tables; detected once per process
_warned_expansion = False  # the large-expansion warning is logged once per process

LARGE_EXPANSION = 1 << 20
"""Expanding a strided table to at least this many ``(N, 3)`` descriptors logs a warning (once)."""

log = logging.getLogger("hybrid_kv.transport")


def quiet(fn: Callable[[], object]) -> None:
    """Call ``fn``, ignoring NIXL errors (for cleanup, where nothing better can be done)."""
    try:
        fn()
    except CALL_ERRORS:
        pass


class Agent:
    """A NIXL agent without a progress thread, plus its registered memory and prepped local tables.

    Args:
        name: the NIXL agent name.
        mem_type: NIXL memory type of the registration and of every prepped table.

    Local tables live in scopes: the default scope (``None``: the tables given to ``open``) and named scopes
    added later (``add_scope``: e.g. one per peer engine, its ``PeerPlan``'s local tables), each released as a
    whole (``remove_scope``). A peer connected with a scope resolves its transfers' local keys there. A read-only
    array given to several scopes (``PeerPlan.local_rows``' shared base table) is checked and prepped once
    (``shared``) and released with the last scope holding it.

    Attributes:
        nixl: the underlying ``nixl_agent`` (for posting, checking and notifications).
        tables: the default scope's local descriptor tables by key.
        local: their prepped dlists by key.
        scopes: each named scope's ``(tables, prepped dlists)`` by key.
        shared: the scopes' tables prepped once for several scopes.
        zombies: xfer handles NIXL refused to release (still in progress); retried by ``reap_zombies``.
        metadata: this agent's NIXL metadata, served to peers by the side channel.
    """

    def __init__(self, name: str, mem_type: str) -> None:
        self.mem_type = mem_type
        # Telemetry: each completed transfer's bytes, descriptors (after NIXL's merge) and post/transfer time.
        config = nixl_agent_config(enable_prog_thread=False, backends=[], capture_telemetry=True)
        self.nixl: Any = nixl_agent(name, config)
        self.tables: dict[str, CheckedTable] = {}
        self.local: dict[str, Any] = {}
        self.scopes: dict[str, tuple[dict[str, CheckedTable], dict[str, Any]]] = {}
        self.shared = SharedPreps()
        self.zombies: list[Any] = []
        self.metadata = b""
        self.huge_pages: HugePageReport | None = None
        self._reg: Any = None
        self._reg_rows = np.zeros((0, 3), dtype=np.uint64)

    def open(
        self,
        registration: npt.ArrayLike,
        local_tables: Mapping[str, npt.ArrayLike],
        backend: str,
        ucx_error_handling_mode: str,
        net_device: str | None = None,
        huge_pages: str = "off",
    ) -> None:
        """Create the backend, register ``registration`` once and prep every local table once.

        ``net_device`` is the one network interface UCX may use and listen on (``None``: any); see ``netif``.
        ``huge_pages`` (``"off"``, ``"advise"``, ``"collapse"``) advises ``DRAM`` regions to transparent huge
        pages first, and with ``"collapse"`` moves their faulted-in pages onto huge pages (``hybrid_kv.hugepages``).
        """
        params = {"ucx_error_handling_mode": ucx_error_handling_mode} if backend == "UCX" else {}
        with ucx_restricted_to(net_device):
            self.nixl.create_backend(backend, params)
        self._reg_rows = registration_array(registration)
        if huge_pages != "off" and self.mem_type == "DRAM":
            self.huge_pages = advise_huge_pages(self._reg_rows, collapse=huge_pages == "collapse")
        self._reg = self.nixl.register_memory(self._reg_rows, self.mem_type)
        self.tables = {key: CheckedTable(key, np.asarray(rows)) for key, rows in local_tables.items()}
        for key, table in self.tables.items():
            self.local[key] = self.prep(LOCAL, table)
        self.metadata = self.nixl.get_agent_metadata()

    @property
    def registered(self) -> bool:
        """Whether memory is still registered (until ``close()``)."""
        return self._reg is not None

    def close(self) -> None:
        """Release the local dlists of every scope, deregister memory and forget the zombies (idempotent).

        NIXL frees the zombie handles itself when the agent is destroyed.
        """
        self.release_dlists(self.local)
        for scope in list(self.scopes):
            self.remove_scope(scope)
        if self._reg is not None:
            reg = self._reg
            quiet(lambda: self.nixl.deregister_memory(reg))
            self._reg = None
        self.zombies.clear()

    # ------------------------------------------------------------------ local table scopes

    def add_scope(self, scope: str, tables: Mapping[str, npt.ArrayLike]) -> None:
        """Check and prep ``tables`` as the named scope ``scope`` (all or nothing: a failure releases what was
        prepped and raises)."""
        if scope in self.scopes:
            raise ValueError(f"local table scope {scope!r} already exists")
        checked: dict[str, CheckedTable] = {}
        dlists: dict[str, Any] = {}
        try:
            for key, rows in tables.items():
                if (hit := self.shared.acquire(rows)) is not None:
                    checked[key], dlists[key] = hit
                    continue
                table = CheckedTable(key, np.asarray(rows))
                dlists[key] = self.prep(LOCAL, table)
                checked[key] = table
                self.shared.add(rows, table, dlists[key])
        except BaseException:
            self._release_scope(checked, dlists)
            raise
        self.scopes[scope] = (checked, dlists)

    def remove_scope(self, scope: str) -> None:
        """Release the named scope's prepped dlists (a shared one with the last scope holding it) and forget its
        tables (unknown scopes are ignored)."""
        entry = self.scopes.pop(scope, None)
        if entry is not None:
            self._release_scope(*entry)

    def _release_scope(self, checked: dict[str, CheckedTable], dlists: dict[str, Any]) -> None:
        for key in list(dlists):
            table = checked.get(key)
            if table is not None and self.shared.shared(table) and self.shared.release(table) is None:
                del dlists[key]  # other scopes still post from it
        self.release_dlists(dlists)

    def table(self, scope: str | None, key: str) -> CheckedTable | None:
        """Local table ``key`` of ``scope`` (``None``: the default scope), if any."""
        if scope is None:
            return self.tables.get(key)
        entry = self.scopes.get(scope)
        return None if entry is None else entry[0].get(key)

    def table_keys(self, scope: str | None) -> list[str]:
        """The local table keys of ``scope``, sorted (for error messages)."""
        if scope is None:
            return sorted(self.tables)
        entry = self.scopes.get(scope)
        return [] if entry is None else sorted(entry[0])

    def dlist(self, scope: str | None, key: str) -> Any:
        """The prepped dlist of local table ``key`` of ``scope`` (``KeyError`` if none)."""
        return self.local[key] if scope is None else self.scopes[scope][1][key]

    def local_dlist_count(self) -> int:
        """Prepped local dlists of every scope (a dlist several scopes share counts once)."""
        handles = {id(d) for _, dlists in self.scopes.values() for d in dlists.values()}
        return len(self.local) + len(handles)

    # ------------------------------------------------------------------ dlists and remote agents

    def prep(self, agent_name: str, table: CheckedTable) -> Any:
        """Prep ``table`` against ``agent_name`` (``LOCAL`` for our own), expanding ``(N, 5)`` rows if needed."""
        if table.strided and self.strided_supported():
            return self.nixl.prep_xfer_dlist(agent_name, table.rows, self.mem_type)
        rows = expand_rows(table.rows) if table.strided else table.rows
        if table.strided:
            _warn_if_large(table, rows.shape[0])
        return self.nixl.prep_xfer_dlist(agent_name, rows, self.mem_type)

    def release_dlists(self, dlists: MutableMapping[str, Any]) -> None:
        """Release every prepped dlist in ``dlists`` and empty it."""
        for dlist in dlists.values():
            quiet(dlist.release)
        dlists.clear()

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's NIXL metadata and start connecting to it; returns its agent name.

        ``make_connection`` only starts UCX's wire-up (it does not wait); the wire-up then completes while both
        agents are progressed (``poll()`` here, the peer's own polling there). Without it the first transfer
        to the peer waits for the whole wire-up, in which the peer's UCX selects its protocols: 25-40 ms on
        a 2-core host (``benches/nixl_floor.py``, first round). A failure here is left for the first transfer
        to report, as it would be without it.
        """
        name = self.nixl.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        quiet(lambda: self.nixl.make_connection(name))
        return name

    def remove_remote(self, agent_name: str) -> None:
        """Forget a peer's agent (errors ignored)."""
        quiet(lambda: self.nixl.remove_remote_agent(agent_name))

    def send_notif_quietly(self, agent_name: str, msg: bytes) -> None:
        """Best-effort notification to ``agent_name`` (errors ignored)."""
        quiet(lambda: self.nixl.send_notif(agent_name, msg))

    # ------------------------------------------------------------------ xfer handles

    def release_xfer(self, xfer: Any) -> None:
        """Release an xfer handle; one NIXL refuses (still in progress) becomes a zombie."""
        self.zombies.extend(self._release_all([xfer]))

    def reap_zombies(self) -> None:
        """Retry releasing every zombie handle."""
        self.zombies = self._release_all(self.zombies)

    def _release_all(self, xfers: list[Any]) -> list[Any]:
        alive = []
        for xfer in xfers:
            try:
                self.nixl.release_xfer_handle(xfer)
            except CALL_ERRORS:
                alive.append(xfer)
        return alive

    def strided_supported(self) -> bool:
        """Detect once whether ``prep_xfer_dlist`` takes ``(N, 5)`` strided rows (nixl >= 1.5)."""
        global _strided_ok
        if _strided_ok is None:
            addr, _, dev = (int(v) for v in self._reg_rows[0])
            probe = np.array([[addr, 1, dev, 1, 1]], dtype=np.uint64)
            try:
                self.nixl.prep_xfer_dlist(LOCAL, probe, self.mem_type).release()
                _strided_ok = True
            except (ValueError, TypeError):
                _strided_ok = False
            except NIXL_ERRORS:
                _strided_ok = True  # the form was parsed; only the probe address was unknown
        return _strided_ok


def _warn_if_large(table: CheckedTable, descriptors: int) -> None:
    """Log once per process that a large strided table had to be expanded (NIXL without the ``(N, 5)`` form)."""
    global _warned_expansion
    if descriptors < LARGE_EXPANSION or _warned_expansion:
        return
    _warned_expansion = True
    mib = descriptors * 24 / 2**20
    log.warning(
        "this NIXL takes no (N, 5) strided rows (nixl < 1.5): table %r was expanded from %d rows to %d "
        "descriptors (%.0f MiB) before prepping. Plans built with PeerPlan(..., coalesce=True) append chunk "
        "rows that make expanded tables about 7x larger; on this NIXL build them with coalesce=False "
        "(Endpoint.strided_rows_supported tells which applies).",
        table.key,
        table.rows.shape[0],
        descriptors,
        mib,
    )
