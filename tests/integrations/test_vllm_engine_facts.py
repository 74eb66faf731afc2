"""The handshake's engine facts are read from vLLM, not made up: ``kv_layout`` is the layout vLLM
resolved and allocated the caches with, ``attn_backend`` the backends of the registered layers as vLLM's own
NixlConnector reads them, and the compatibility hash covers the connector's wire version."""

from __future__ import annotations

import json
from typing import Any

import pytest
from vllm_harness import EngineSpec, build

from hybrid_kv import compat_hash
from hybrid_kv.integrations.vllm import layout


def spec(model: str, model_dirs: dict[str, str]) -> EngineSpec:
    return EngineSpec(f"facts-{model}", model, model_dirs[model], tp=1, mode="pull", port=0)


def register_layers(vc: Any, specs: dict[str, Any]) -> dict[str, str]:
    """Put one layer per KV-cache layer into vLLM's forward context, as a loaded model does, each with the backend
    vLLM's CPU platform uses for its kind (CPU attention, GDN state); returns the backend name per layer."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend
    from vllm.v1.kv_cache_interface import MambaSpec

    class Layer(AttentionLayerBase):  # type: ignore[misc, unused-ignore]
        def __init__(self, backend: Any, kv_spec: Any) -> None:
            self.backend, self.kv_spec = backend, kv_spec

        def get_attn_backend(self) -> Any:
            return self.backend

        def get_kv_cache_spec(self, vllm_config: Any) -> Any:
            return self.kv_spec

    ctx = vc.compilation_config.static_forward_context
    names = {}
    for name, s in specs.items():
        backend = GDNAttentionBackend if isinstance(s, MambaSpec) else CPUAttentionBackend
        ctx[name] = Layer(backend, s)
        names[name] = backend.get_name()
    return names


@pytest.mark.parametrize(("model", "expected_layout"), [("gqa", "LBHNC"), ("mla", None), ("kimi", None)])
def test_kv_layout_and_backend_are_what_vllm_uses(
    model_dirs: dict[str, str], model: str, expected_layout: str | None
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    vc, _, specs = build(spec(model, model_dirs))
    names = list(specs)
    # no model loaded: vLLM's CUDA wheel cannot pick a default backend here, and the fact says so
    with pytest.raises(ValueError, match="Invalid attention backend"):
        get_current_attn_backends(vc, names)
    assert layout.engine_facts(vc, names)[1] == layout.UNKNOWN_BACKEND
    per_layer = register_layers(vc, specs)
    kv_layout, attn_backend = layout.engine_facts(vc, names)
    # the layout the caches are allocated with (allocate_kv_cache reads the same resolved value)
    assert kv_layout == vc.cache_config.get_resolved_kv_cache_layout().name
    if expected_layout is not None:  # GQA: the heads-major layout the connector asks vLLM for
        assert kv_layout == expected_layout
    # NixlConnector: get_current_attn_backends(vllm_config) and each backend's get_name()
    vllm_names = {b.get_name() for b in get_current_attn_backends(vc, names)}
    assert attn_backend.split(",") == sorted(vllm_names) == sorted(set(per_layer.values()))
    if model == "kimi":
        assert attn_backend == "CPU_ATTN,GDN_ATTN"


def test_compat_hash_covers_the_connector_wire_version(
    model_dirs: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    vc, _, specs = build(spec("gqa", model_dirs))
    _, backend = layout.engine_facts(vc, list(specs))
    factors: dict[str, Any] = layout.compat_factors(vc, "pull", backend)
    assert factors["connector"] == f"hybrid-kv-vllm/{layout.CONNECTOR_WIRE_VERSION}"
    assert factors["attn_backend"].startswith(f"{backend}@vllm-")
    h = compat_hash(json.dumps(factors, sort_keys=True))
    monkeypatch.setattr(layout, "CONNECTOR_WIRE_VERSION", layout.CONNECTOR_WIRE_VERSION + 1)
    bumped = layout.compat_factors(vc, "pull", backend)
    assert compat_hash(json.dumps(bumped, sort_keys=True)) != h
    # another backend is another hash (vLLM's NixlConnector hashes its backend name too)
    other = layout.compat_factors(vc, "pull", "SOME_OTHER_BACKEND")
    assert compat_hash(json.dumps(other, sort_keys=True)) != compat_hash(json.dumps(bumped, sort_keys=True))


def test_compat_hash_covers_the_kernel_block_of_pages_only_transferred_whole(model_dirs: dict[str, str]) -> None:
    """vLLM's CPU attention pages of an ISA whose layout hybrid-kv does not cut (``page_facts``: not in
    ``K_TRANSPOSED_ISAS``) move whole: engines of other kernel blocks or ISAs hash differently; ``HKTV`` pages and
    other backends leave the kernel block to the handshake."""
    vc, _, _ = build(spec("gqa", model_dirs))

    def h(backend: str, kernel_block: int, isas: set[str] | None = None) -> str:
        factors = layout.compat_factors(vc, "pull", backend, kernel_block, isas)
        return compat_hash(json.dumps(factors, sort_keys=True))

    assert h("CPU_ATTN", 64, {"amx"}) != h("CPU_ATTN", 128, {"amx"})
    assert h("CPU_ATTN", 128, {"amx"}) != h("CPU_ATTN", 128, {"neon"})
    assert h("CPU_ATTN,GDN_ATTN", 384, {"amx"}) != h("CPU_ATTN,GDN_ATTN", 768, {"amx"})
    assert h("CPU_ATTN", 64) == h("CPU_ATTN", 128)  # HKTV pages: cut into token units
    assert h("FLASH_ATTN", 64) == h("FLASH_ATTN", 128)


def test_cpu_attention_pages_are_hktv_for_the_kernels_that_store_k_transposed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``page_facts``: the layers' ISAs (``layer.isa``, as vLLM's CPU attention builders set it) decide; the real
    engines' registration (``tests/engines/test_block_sizes.py``) reads them off vLLM's layers."""
    isas: set[str] = set()
    monkeypatch.setattr(layout, "cpu_attention_isas", lambda vc, names: isas)
    isas.update({"vec", "vec16"})
    assert layout.page_facts(None, [], "LBHNC", "CPU_ATTN,GDN_ATTN") == ("HKTV", None)
    assert layout.page_facts(None, [], "LBHNC", "FLASH_ATTN") == ("LBHNC", None)
    isas.add("amx")
    assert layout.page_facts(None, [], "LBHNC", "CPU_ATTN") == ("LBHNC", {"vec", "vec16", "amx"})
    isas.clear()
    assert layout.page_facts(None, [], "LBHNC", "CPU_ATTN") == ("LBHNC", {"unknown"})
