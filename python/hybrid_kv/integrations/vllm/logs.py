"""hybrid-kv's log records in vLLM's log stream: the ``hybrid_kv`` logger forwards to vLLM's handlers.

vLLM configures only its own ``vllm`` logger (its handler, format ``(EngineCore pid=..) INFO 12-01 23:40:00
[file.py:12] ...`` and level, ``VLLM_LOGGING_LEVEL``), with ``propagate`` off, and leaves the root logger alone:
a library logger such as ``hybrid_kv`` then falls back to Python's last-resort handler (WARNING and above,
bare messages) and every INFO line is lost. ``attach_to_vllm`` gives ``hybrid_kv`` vLLM's level and a handler
that hands each record to the handlers the ``vllm`` logger has *when the record is emitted*, so a later
reconfiguration by vLLM (``configure_logging`` in each engine process) is followed. Nothing is attached when
vLLM's logging is off (``VLLM_CONFIGURE_LOGGING=0``: the application configures logging itself) or when the
application already gave ``hybrid_kv`` handlers of its own.
"""

from __future__ import annotations

import logging

__all__ = ["attach_to_vllm"]

LOGGER = "hybrid_kv"
VLLM_LOGGER = "vllm"


class _ToVllm(logging.Handler):
    """Hands records to the ``vllm`` logger's current handlers (each applies its own level)."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger(VLLM_LOGGER).handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def attach_to_vllm() -> bool:
    """Route ``hybrid_kv`` records to vLLM's log stream at vLLM's level; idempotent.

    Returns whether ``hybrid_kv`` is (now) attached.
    """
    hkv = logging.getLogger(LOGGER)
    vllm_logger = logging.getLogger(VLLM_LOGGER)
    ours = [h for h in hkv.handlers if isinstance(h, _ToVllm)]
    if hkv.handlers and not ours:
        return False  # the application configured hybrid_kv's logging itself
    if not vllm_logger.handlers:
        return False  # vLLM does not configure logging (VLLM_CONFIGURE_LOGGING=0)
    if not ours:
        hkv.addHandler(_ToVllm())
    hkv.setLevel(vllm_logger.getEffectiveLevel())
    hkv.propagate = False
    return True
