"""Type stubs for the native module ``hybrid_kv._core`` (checked by ``mypy.stubtest`` in CI)."""

from collections.abc import Mapping, Sequence
from typing import Any, final

import numpy as np
import numpy.typing as npt

from hybrid_kv.inputs import EngineInfo, ModelFactors

__version__: str

MAX_TP_SIZE: int
"""Largest TP size accepted from anyone (``MAX_TP_SIZE`` in ``rust/core/tp.rs``; TP mappings allocate per rank)."""
MAX_NUM_BLOCKS: int
"""Most logical blocks in a pool: descriptor ids are int32."""
MAX_BLOCK_TOKENS: int
"""Largest logical or kernel block in tokens."""
MAX_GROUPS: int
"""Most KV-cache groups a peer may advertise: a ticket, a registration or a claim naming more is refused."""

class HybridKvError(Exception):
    """Base class of every hybrid-kv error."""

class LayoutError(HybridKvError, ValueError):
    """A rank's layout cannot be turned into a region table (also a ``ValueError``: the layout is an argument).
    The message names the value and, for a malformed layout, the layer and the key."""

class PlanError(HybridKvError, ValueError):
    """A transfer cannot be planned for the given geometry, ids or mode (a bad ``mode`` is a ``PlanError``
    wherever it is given; also a ``ValueError``)."""

class HandshakeError(HybridKvError):
    """A peer's metadata is malformed or incompatible."""

    findings: Sequence[tuple[str, str, str, str]]
    """The failed checks ``(check, local, remote, detail)`` where ``validate_handshake``,
    ``PeerPlan(..., own_payload=...)`` or the transport's ``Endpoint.connect`` after a validation raised the
    error; empty for every other handshake error."""

@final
class RegionTable:
    """The region table of one rank: one region per distinct base address, MLA flags OR-merged."""

    @staticmethod
    def from_json(layout_json: str) -> RegionTable:
        """Build a region table from a rank layout (``hybrid_kv.inputs.RankLayout``) given as JSON; an unknown,
        misspelled, missing or mistyped key is a ``LayoutError`` naming the layer and the key."""

    def to_json(self) -> str:
        """The whole table as JSON."""

    @property
    def num_regions(self) -> int:
        """Number of regions."""

    @property
    def region_is_mla(self) -> list[bool]:
        """REPLICATE (MLA) flag of every region."""

    @property
    def base_addrs(self) -> list[int]:
        """Base address of every region."""

    @property
    def block_lens(self) -> list[int]:
        """Kernel page bytes of every region."""

    @property
    def mem_type(self) -> str:
        """NIXL memory type of the regions: ``"DRAM"`` (host) or ``"VRAM"`` (device)."""

    @property
    def ppl(self) -> int:
        """Kernel blocks per logical block."""

    @property
    def num_kernel_blocks(self) -> int:
        """Kernel blocks per region."""

    @property
    def ssm_sizes(self) -> tuple[int, int]:
        """``(conv_bytes, ssm_bytes)`` of one state on this rank."""

    def num_fa_descs(self, bsr: int = 1) -> int:
        """Flat count of attention descriptors at block-size ratio ``bsr``; ``LayoutError`` for a ``bsr``
        ``local_descs`` refuses (0, or not dividing a kernel page) or a count over 64 bits."""

    def registration(self) -> npt.NDArray[np.uint64]:
        """Registration descriptors ``(addr, bytes, device)``, shape ``(R, 3)``."""

    def local_descs(self, bsr: int = 1, *, coalesce: bool = False) -> npt.NDArray[np.uint64]:
        """Local descriptor table ``(addr, len, device)``, shape ``(N, 3)``."""

    def local_rows(self, bsr: int = 1, *, coalesce: bool = False) -> npt.NDArray[np.uint64]:
        """Local descriptor table as strided rows ``(addr, len, device, stride, count)``, shape ``(rows, 5)``."""

    def digest(self, moves: npt.NDArray[np.uint64], side: str = "local") -> int:
        """Digest of this table's side (``"local"``: column 0, ``"remote"``: column 1) of ``(M, 3)`` moves, their
        bytes concatenated in move order (XXH3-64 of each 256 KiB segment, hashed on several threads, then XXH3-64
        of the stream's length and the segment digests, little-endian u64s); reads the memory (this process's live
        host memory only). Raises ``ValueError`` for a range outside the regions, a bad shape or side, or regions
        that are not host memory."""

    def handshake_payload(self, engine_info: EngineInfo | Mapping[str, Any]) -> bytes:
        """This rank's handshake payload (metadata as wire bytes) with the engine facts ``engine_info``
        (``hybrid_kv.inputs.EngineInfo``: ``engine_id``, ``attn_backend``, ``transfer_mode``, ``compat_hash``;
        optionally ``agent_metadata``, ``kv_layout``, ``prefix_caching``). Raises ``PlanError`` (bad
        ``transfer_mode``), ``TypeError`` (a value of the wrong type) or ``ValueError`` (an unknown or missing
        key, an unknown ``kv_layout`` or one the table's page order contradicts, a malformed ``compat_hash``),
        each naming ``engine_info[...]``."""

# Handshake (rust/py/handshake.rs). Metadata is wire bytes (msgpack); a dict only for inspection and tests. A
# finding is ``(check, local, remote, detail)``.

def encode_meta(meta: Mapping[str, Any]) -> bytes:
    """Encode a metadata dict (as ``decode_meta`` returns it) into wire bytes, unchecked (tests build hostile
    payloads with it); raises ``HandshakeError`` naming a missing or mistyped field."""

def decode_meta(data: bytes) -> dict[str, Any]:
    """Decode a peer's untrusted wire bytes into a metadata dict; raises ``HandshakeError``."""

def msgpack_prescan(data: bytes, *, max_bytes: int, max_len: int, max_str: int, max_depth: int) -> None:
    """Check that untrusted ``data`` is exactly one msgpack value within the bounds (no recursion, no allocation
    beyond ``max_depth``); raises ``HandshakeError`` naming the byte offset and the bound."""

def meta_fingerprint(data: bytes) -> str:
    """Hex SHA-256 of the TP-invariant region geometry of wire bytes."""

def compat_hash(factors: ModelFactors | Mapping[str, Any] | str) -> str:
    """Hex SHA-256 over the model factors (``hybrid_kv.inputs.ModelFactors``, every field documented there), given
    as a dict or as JSON text. Raises ``ValueError`` naming every unknown and missing key at once (or text that is
    not JSON), ``TypeError`` naming a value of the wrong type (``factors["key"]``)."""

def handshake_findings(
    local: bytes,
    remote: bytes,
    *,
    expected_engine_id: str | None = None,
    expected_tp_size: int | None = None,
    expected_num_blocks: int | None = None,
) -> list[tuple[str, str, str, str]]:
    """Every failed handshake check as ``(check, local, remote, detail)``; empty when compatible."""

def validate_handshake(
    local: bytes,
    remote: bytes,
    *,
    expected_engine_id: str | None = None,
    expected_tp_size: int | None = None,
    expected_num_blocks: int | None = None,
) -> None:
    """Raise ``HandshakeError`` (one line per finding, ``findings`` attribute) unless compatible."""

@final
class RankTransfer:
    """One NIXL transfer: int32 descriptor ids into a local table and a remote rank's table."""

    @property
    def remote_rank(self) -> int: ...
    @property
    def local_table(self) -> str:
        """Local table key: ``"whole"``, ``"bsr:N"`` or ``"split:I"``."""
    @property
    def local_ids(self) -> npt.NDArray[np.int32]: ...
    @property
    def remote_ids(self) -> npt.NDArray[np.int32]: ...
    @property
    def num_descriptors(self) -> int:
        """Descriptor pairs (the length of ``local_ids``)."""
    @property
    def bytes(self) -> int:
        """Bytes the transfer moves (its local descriptors' lengths, summed in Rust); raises ``PlanError`` if an
        id no longer indexes the table."""

@final
class Plan:
    """The transfers of one request between one local rank and one peer engine."""

    @property
    def transfers(self) -> list[RankTransfer]: ...
    @property
    def notify_ranks(self) -> list[int]: ...
    def __len__(self) -> int: ...
    def moves(self, i: int) -> npt.NDArray[np.uint64]:
        """``(M, 3)`` uint64 ``(local_addr, remote_addr, len)`` of transfer ``i``; raises ``PlanError``."""

@final
class PeerPlan:
    """TP mapping and descriptor tables of one local rank against one peer engine."""

    def __new__(
        cls,
        local: RegionTable,
        payloads: Sequence[bytes | Mapping[str, Any]],
        mode: str = "pull",
        *,
        coalesce: bool = True,
        own_payload: bytes | None = None,
        expected_engine_id: str | None = None,
        expected_tp_size: int | None = None,
        expected_num_blocks: int | None = None,
    ) -> PeerPlan:
        """``payloads``: every remote rank's payload bytes, decoded here once as untrusted input (a metadata
        dict as ``decode_meta`` returns it is accepted for tests and tools). With ``own_payload`` every peer is
        first validated against it as ``validate_handshake`` does (``HandshakeError`` starting ``peer rank N:``,
        with ``findings``). Raises ``HandshakeError`` / ``PlanError`` (also a bad ``mode``) / ``TypeError``.

        ``coalesce``: chunk rows for dense attention regions and one id per power-of-two run of consecutive
        blocks (nixl >= 1.5 strided tables); ``False`` gives the reference tables, one id per unit.
        """
    @property
    def mode(self) -> str: ...
    @property
    def coalesced(self) -> bool: ...
    @property
    def tp_ratio(self) -> int: ...
    @property
    def attn_ranks(self) -> list[int]: ...
    @property
    def ssm_ranks(self) -> list[int]: ...
    @property
    def remote_ranks(self) -> list[int]: ...
    @property
    def table_keys(self) -> list[str]: ...
    def local_descs(self, key: str) -> npt.NDArray[np.uint64]: ...
    def local_rows(self, key: str) -> npt.NDArray[np.uint64]: ...
    def remote_descs(self, rank: int) -> npt.NDArray[np.uint64]: ...
    def remote_rows(self, rank: int) -> npt.NDArray[np.uint64]:
        """Remote rank ``rank``'s strided ``(rows, 5)`` rows: a read-only view of the plan's own rows (no copy)."""
    def table_descriptors(self, key: str) -> int:
        """Descriptors of local table ``key`` once expanded; raises ``PlanError`` for no such table."""
    def resolve(
        self, key: str, remote_rank: int, local_ids: npt.NDArray[np.int32], remote_ids: npt.NDArray[np.int32]
    ) -> npt.NDArray[np.uint64]:
        """``(M, 3)`` uint64 ``(local_addr, remote_addr, len)`` byte moves of descriptor-id pairs into local table
        ``key`` and remote rank ``remote_rank``'s table; raises ``PlanError``."""
    def remote_table_descriptors(self, rank: int) -> int:
        """Descriptors of remote rank ``rank``'s table once expanded; raises ``PlanError`` if not handshaked."""
    def local_bytes(self, key: str, ids: npt.NDArray[np.int32]) -> int:
        """Bytes of local descriptors ``ids`` of table ``key`` (what a transfer with these local ids moves);
        raises ``PlanError`` for no such table or an id outside it."""
    def failed_blocks(self, key: str, ids: npt.NDArray[np.int32]) -> list[npt.NDArray[np.uint64]]:
        """The local logical block ids, one uint64 array per group (ascending, unique), whose bytes local
        descriptors ``ids`` of table ``key`` move: the blocks a failed transfer with these local ids leaves
        unknown. A region several groups share lists its blocks under each of them (a request names each block in
        one group only: intersect group by group with the request's ids). Raises ``PlanError`` for no such table
        or an id outside it."""
    def plan(self, local_ids: Sequence[Sequence[int]], remote_ids: Sequence[Sequence[int]]) -> Plan:
        """Plan one request from each side's logical block ids per group (lists are read fastest; numpy
        integer arrays work too); raises ``PlanError``."""
    def plan_staged(
        self, local_ids: Sequence[Sequence[int]], remote_ids: Sequence[Sequence[int]], schedule: StreamSchedule
    ) -> list[Plan]:
        """One request's plan cut into ``schedule``'s stages: one ``Plan`` per stage, together exactly the whole
        plan (every id pair once), with the whole plan's tables and ids. Raises ``PlanError`` (as ``plan``, or a
        schedule made for another region table)."""

@final
class StreamSchedule:
    """When each (region, group) pair of a rank is final during a request's last prefill forward: stage ``k`` is
    final once the save hook of ``stage_hooks[k]`` fired (``None``: at the end of the forward)."""

    def __new__(
        cls, table: RegionTable, hooks: Sequence[str] | None = None, *, granularity: str = "layer"
    ) -> StreamSchedule:
        """The schedule of ``table``; ``hooks``: the layers vLLM calls ``save_kv_layer`` for (default: every
        attention and MLA layer); ``granularity``: ``"layer"`` or ``"region"``. Raises ``LayoutError`` for a hook
        that is not a layer of the table, ``ValueError`` for another granularity."""
    @property
    def num_stages(self) -> int: ...
    @property
    def granularity(self) -> str: ...
    @property
    def hooks(self) -> list[tuple[str, int]]:
        """Every hook layer in forward order with the number of stages final once its hook fired."""
    @property
    def stage_hooks(self) -> list[str | None]: ...
    @property
    def stage_units(self) -> list[list[tuple[int, int]]]:
        """The (region, group) pairs of each stage that some layer writes."""

@final
class MirrorPlan:
    """A passive rank's copy of one initiator rank's plan, restricted to this rank (transfer digests)."""

    def __new__(cls, own_payload: bytes, initiator_payload: bytes, *, coalesce: bool = True) -> MirrorPlan:
        """Rebuild the plan of the rank that sent ``initiator_payload`` (untrusted: validated against
        ``own_payload``, bounded) against this rank, coalescing as the initiator does. Raises
        ``HandshakeError`` / ``PlanError``."""
    @property
    def rank(self) -> int: ...
    @property
    def initiator_rank(self) -> int: ...
    def moves(self, initiator_ids: Sequence[Sequence[int]], own_ids: Sequence[Sequence[int]]) -> npt.NDArray[np.uint64]:
        """``(M, 3)`` uint64 ``(initiator_addr, own_addr, len)`` of one request between the initiator and this rank,
        in the initiator's move order; raises ``PlanError``."""

def plan_scenario(scenario_json: str, *, moves: bool = True, coalesce: bool = True) -> dict[str, Any]:
    """Build and plan a whole scenario; returns the report as a dict (what its JSON holds). Raises ``PlanError``
    / ``LayoutError``."""

def check_scenario(scenario_json: str, *, coalesce: bool = True, ranks: bool = False) -> dict[str, Any]:
    """Handshake-check every rank pair of a scenario and plan its requests on every rank whose pairs pass; returns
    the verdict report as a dict (``pairs`` with findings, ``summary``; with ``ranks`` every rank's regions, tables,
    peers and request costs). ``coalesce=False`` checks the reference plans. Raises ``PlanError`` /
    ``LayoutError`` when the scenario is malformed or an engine cannot be built."""

def expand_rows(rows: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """``(N, 5)`` strided (or ``(N, 3)``) uint64 descriptor rows expanded to ``(M, 3)`` ``(addr, len, device)`` in
    descriptor-id order; raises ``ValueError`` naming the bad row and the limit."""

def check_transfer_ids(
    local_ends: npt.NDArray[np.uint64],
    local_lens: npt.NDArray[np.uint64],
    local_ids: npt.NDArray[np.int32],
    remote: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.int32]] | None = None,
) -> tuple[str, int] | None:
    """The first problem with a transfer's int32 descriptor ids against tables given as their rows' exclusive ends
    in flat ids and their rows' descriptor lengths: ``None``, or ``("local" | "remote", position)`` (an id out of
    range), ``("count", 0)`` or ``("length", position)`` (a pair of different lengths; with ``remote`` only).
    Raises ``ValueError`` for a non-contiguous array or a table whose ends and lengths differ in length."""

def handshake_target_ranks(tp_rank: int, tp_size: int, remote_tp: int) -> list[int]:
    """The remote ranks ``tp_rank`` of ``tp_size`` exchanges data with (one when the local TP is the larger, else
    the ``remote_tp / tp_size`` ranks its shard spans); ``PeerPlan`` expects exactly these. Raises ``PlanError``."""
