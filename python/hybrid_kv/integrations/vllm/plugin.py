"""vLLM general plugin (entry point ``vllm.general_plugins``): registers ``HybridKvConnector`` by name in every vLLM
process, before any connector is built, without importing the connector module (and vLLM's KV-cache code) until
a registry lookup needs it."""

from __future__ import annotations

__all__ = ["register"]

NAME = "HybridKvConnector"
MODULE = "hybrid_kv.integrations.vllm.connector"


def register() -> None:
    """Register the connector lazily with vLLM's ``KVConnectorFactory`` (idempotent; never raises into vLLM)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
    except Exception:  # noqa: BLE001 - already registered, or a vLLM without this factory: nothing to do
        pass
