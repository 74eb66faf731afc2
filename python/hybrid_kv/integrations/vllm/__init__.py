"""hybrid-kv as a vLLM 0.33 KV connector (``--kv-transfer-config '{"kv_connector":"HybridKvConnector",
"kv_connector_module_path":"hybrid_kv.integrations.vllm", ...}'``)."""

from .connector import HybridKvConnector

__all__ = ["HybridKvConnector"]
