"""Type stubs for the native module ``hybrid_kv._core`` (checked by ``mypy.stubtest`` in CI)."""

from typing import final

import numpy as np
import numpy.typing as npt

__version__: str

class HybridKvError(Exception):
    """Base class of every hybrid-kv error."""

class LayoutError(HybridKvError):
    """A rank's layout cannot be turned into a region table."""

class PlanError(HybridKvError):
    """A transfer cannot be planned for the given geometry or ids."""

class HandshakeError(HybridKvError):
    """A peer's metadata is malformed or incompatible."""

class TransferError(HybridKvError):
    """A NIXL transfer failed, timed out or was refused."""

@final
class RegionTable:
    """The region table of one rank: one region per distinct base address, MLA flags OR-merged."""

    @staticmethod
    def from_json(layout_json: str) -> RegionTable:
        """Build a region table from a rank layout given as JSON."""

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
    def ppl(self) -> int:
        """Kernel blocks per logical block."""

    @property
    def num_kernel_blocks(self) -> int:
        """Kernel blocks per region."""

    @property
    def ssm_sizes(self) -> tuple[int, int]:
        """``(conv_bytes, ssm_bytes)`` of one state on this rank."""

    def num_fa_descs(self, bsr: int = 1) -> int:
        """Flat count of attention descriptors at block-size ratio ``bsr``."""

    def registration(self) -> npt.NDArray[np.uint64]:
        """Registration descriptors ``(addr, bytes, device)``, shape ``(R, 3)``."""

    def local_descs(self, bsr: int = 1) -> npt.NDArray[np.uint64]:
        """Local descriptor table ``(addr, len, device)``, shape ``(N, 3)``."""

    def local_rows(self, bsr: int = 1) -> npt.NDArray[np.uint64]:
        """Local descriptor table as strided rows ``(addr, len, device, stride, count)``, shape ``(rows, 5)``."""

    def agent_meta_json(self, engine_info_json: str) -> str:
        """Handshake metadata of this rank as JSON."""

# Handshake (rust/py/handshake.rs). Metadata is wire bytes (msgpack) or JSON; a finding is
# ``(check, local, remote, detail)``.

def encode_meta(meta_json: str) -> bytes:
    """Encode metadata JSON (as ``RegionTable.agent_meta_json`` returns it) into wire bytes."""

def decode_meta(data: bytes) -> str:
    """Decode a peer's untrusted wire bytes into metadata JSON; raises ``HandshakeError``."""

def meta_fingerprint(data: bytes) -> str:
    """Hex SHA-256 of the TP-invariant region geometry of wire bytes."""

def compat_hash(factors_json: str) -> str:
    """Hex SHA-256 over the model factors (E.2), given as JSON."""

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
