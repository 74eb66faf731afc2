"""The engine-neutral core of hybrid-kv's connectors: settings, signed tickets, ``kv_transfer_params`` checks,
typed control messages, leases and their bounded state. No serving engine is imported here (the vLLM connector,
``hybrid_kv.integrations.vllm``, is built on it), so all of it is tested in the main environment."""

__all__: list[str] = []
