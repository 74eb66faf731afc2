"""Integrations of hybrid-kv into serving engines (each an optional extra: ``hybrid-kv[vllm]``)."""

__all__: list[str] = []
