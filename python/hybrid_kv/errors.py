"""Every exception hybrid-kv raises, in one hierarchy rooted at ``HybridKvError``.

The first four are made by the native module (``hybrid_kv._core``), which raises them; the rest are raised by the
Python layers. Errors about a bad argument (a layout, ids, a mode, a setting, a message or ticket handed in) are
also ``ValueError``s, so a caller that knows nothing of hybrid-kv catches them as bad arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._core import HandshakeError, HybridKvError, LayoutError, PlanError

__all__ = [
    "ArgumentError",
    "ChannelError",
    "ChannelTimeout",
    "ClaimError",
    "CliError",
    "ConfigError",
    "ControlError",
    "HandshakeError",
    "HybridKvError",
    "LayoutError",
    "PlanError",
    "RankError",
    "TicketError",
    "TransferError",
]


class TransferError(HybridKvError):
    """A transfer request was rejected before posting, or failed while in flight (raised by the transport).

    Attributes:
        request_id: the request this error belongs to (``None`` when not tied to one request).
        failed: the transfers (``hybrid_kv.transport.Transfer``) whose bytes are not known to have
            landed, with their local and remote descriptor ids, so an engine can recompute them.
        settled: whether no byte of the request can land any more. For a posted request: every transfer of it
            ended or was cancelled (``False``: NIXL would not cancel one). For an awaited (push) request: every
            writer either landed everything or said it failed (a fail-notice is sent only once nothing of the
            writer's is in flight); ``False``: a writer may still be writing into its blocks until its deadline.
    """

    def __init__(
        self, message: str, *, request_id: str | None = None, failed: Sequence[Any] = (), settled: bool = False
    ) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.failed = tuple(failed)
        self.settled = settled

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), self.request_id, self.failed, self.settled))


def _rebuild(
    cls: type[TransferError], message: str, request_id: str | None, failed: tuple[Any, ...], settled: bool = False
) -> TransferError:
    return cls(message, request_id=request_id, failed=failed, settled=settled)


class ChannelError(HybridKvError):
    """A side-channel call failed (timeout, protocol mismatch, authentication, a limit, or an error from the peer)."""


class ChannelTimeout(ChannelError):
    """No reply within the call's timeout: the request may or may not have reached the server."""


class ControlError(HybridKvError, ValueError):
    """A control payload that is not one of the connector's messages (the message says why)."""


class ClaimError(HybridKvError, ValueError):
    """Bytes that are not a claim message (the message says why)."""


class TicketError(HybridKvError, ValueError):
    """A ticket that is malformed, forged, expired, reused or not meant for this engine (the message says which)."""


class ConfigError(HybridKvError, ValueError):
    """A connector setting is missing, malformed or unsafe (e.g. advertising ``0.0.0.0`` to peers)."""


class RankError(HybridKvError, RuntimeError):
    """A GPU-kit rank answered a command with an error (or died); ``detail`` holds its traceback."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


class CliError(HybridKvError):
    """A user-facing command-line error: printed as one line, exit status 2."""


class ArgumentError(HybridKvError, ValueError):
    """A bad command line: printed as one line (``PROG: error: MESSAGE``), exit status 2."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog
