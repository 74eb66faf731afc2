"""The kit's steps, one module each, each with ``run(cfg, report)``: ``environment``, ``registration``,
``transfer``, ``streaming`` and ``planner`` (``hybrid_kv.kit.config.STEPS`` has their order)."""

__all__: list[str] = []
