"""The ``verify`` setting (``VerifyPolicy``): which requests get an end-to-end transfer digest (``verify``).

Its own module, with nothing but the standard library, so the CLI and the connector's settings can parse the
setting where the transport's extras (msgspec, NIXL) are not installed.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_SAMPLE_EVERY", "VerifyPolicy"]

MAX_SAMPLE_EVERY = 1 << 20
"""The largest N of ``sampled:N``."""


@dataclass(frozen=True)
class VerifyPolicy:
    """The ``verify`` setting: ``every`` is 0 (off), 1 (all) or N (``sampled:N``: requests 0, N, 2N, ...)."""

    every: int = 0

    @classmethod
    def parse(cls, text: str | VerifyPolicy) -> VerifyPolicy:
        """``off``, ``all`` or ``sampled:N`` (1 <= N <= ``MAX_SAMPLE_EVERY``); raises ``ValueError`` naming the
        value and the limit."""
        if isinstance(text, VerifyPolicy):
            return text
        t = str(text).strip().lower()
        if t == "off":
            return cls(0)
        if t == "all":
            return cls(1)
        head, sep, n = t.partition(":")
        if head == "sampled" and sep and n.isascii() and n.isdigit() and len(n) <= 8:
            every = int(n)
            if 1 <= every <= MAX_SAMPLE_EVERY:
                return cls(every)
        raise ValueError(
            f"verify must be 'off', 'all' or 'sampled:N' with 1 <= N <= {MAX_SAMPLE_EVERY} (every Nth request), "
            f"got {text!r}"
        )

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def selects(self, index: int) -> bool:
        """Whether the request numbered ``index`` (0, 1, 2, ... in the order the deciding side sees them) is
        verified."""
        return self.every > 0 and index % self.every == 0

    def __str__(self) -> str:
        return "off" if self.every == 0 else "all" if self.every == 1 else f"sampled:{self.every}"
