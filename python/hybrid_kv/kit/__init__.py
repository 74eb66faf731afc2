"""The GPU kit: hybrid-kv's whole transport below vLLM on one device, as ``hybrid-kv gpu-kit`` (and
``scripts/gpu-kit.sh`` on a bare accelerator image) runs it.

Steps (``config.STEPS``), each in its own process group with a time bound (``runner``), each writing its figures
as it goes (``step.Report``): ``environment``; ``registration`` (NIXL registration of preset pools); ``transfer``
(pull and push between rank processes on the one device, ``rank`` / ``procs``, every byte checked on the device:
``pattern``; UCX transports: ``ucx``); ``streaming`` (per-layer compute, stages released after CUDA events);
``planner``. ``--device cpu`` runs the same steps on host memory: the dry run the tests keep passing.
"""

__all__: list[str] = []
