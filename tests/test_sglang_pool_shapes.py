"""The pools of ``tests/sglang_pools.py`` are SGLang's own: where SGLang is installed (its own venv; it does not
install beside this one), ``MambaPool`` built by SGLang on the CPU from ``Mamba2CacheParams`` (Qwen3-Next) and
``KimiLinearCacheParams`` has the state tensors ``Pool`` allocates, shape for shape, stride for stride, dtype for
dtype. Skipped without SGLang; run it as ``SGLANG_MAMBA_SSM_DTYPE=float32 ~/.venvs/sglang/bin/python -m pytest
tests/test_sglang_pool_shapes.py`` (see ``tests/sglang_pools.py``)."""

from __future__ import annotations

import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")
os.environ.setdefault("SGLANG_MAMBA_SSM_DTYPE", "float32")
memory_pool = pytest.importorskip("sglang.srt.mem_cache.memory_pool")
mamba_utils = pytest.importorskip("sglang.srt.configs.mamba_utils")

from sglang_pools import KIMI_LINEAR, MAMBA_SIZE, QWEN3_NEXT, Model, Pool  # noqa: E402


def sglang_pool(model: Model, tp: int) -> Any:
    lin = model.linear
    assert lin is not None
    layers = list(range(lin.layers))
    params: Any
    if lin.kind == "gdn":
        shape = mamba_utils.Mamba2StateShape.create(
            tp_world_size=tp,
            intermediate_size=lin.v_heads * lin.v_dim,
            n_groups=lin.k_heads,
            num_heads=lin.v_heads,
            head_dim=lin.v_dim,
            state_size=lin.k_dim,
            conv_kernel=lin.conv_kernel,
        )
        params = mamba_utils.Mamba2CacheParams(shape=shape, layers=layers)
    else:
        shape = mamba_utils.KimiLinearStateShape.create(
            tp_world_size=tp,
            num_heads=lin.v_heads,
            head_dim=lin.v_dim,
            num_k_heads=lin.k_heads,
            head_k_dim=lin.k_dim,
            conv_kernel_size=lin.conv_kernel,
        )
        params = mamba_utils.KimiLinearCacheParams(shape=shape, layers=layers)
    return memory_pool.MambaPool(
        size=MAMBA_SIZE, spec_state_size=MAMBA_SIZE, cache_params=params, mamba_layer_ids=layers, device="cpu"
    )


@pytest.mark.parametrize("model", [QWEN3_NEXT, KIMI_LINEAR], ids=["gdn", "kda"])
@pytest.mark.parametrize("tp", [1, 2])
def test_state_tensors_are_sglangs(model: Model, tp: int) -> None:
    cache = sglang_pool(model, tp).mamba_cache
    theirs = [*cache.conv, cache.temporal]
    ours = Pool(model, "decode", tp, 0, 10, 4, "pull").states
    assert [(tuple(t.shape), t.stride(), t.dtype) for t in theirs] == [
        (tuple(t.shape), t.stride(), t.dtype) for t in ours
    ]
