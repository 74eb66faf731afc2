"""The harness's engines as vLLM sees them: ``EngineSpec`` (everything a worker process needs to rebuild its
config), the tiny model directories, each layer's KV-cache spec, and ``build``: the ``VllmConfig`` and the
``KVCacheConfig`` vLLM's own planner makes (``vllm_harness`` describes the harness)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODELS = ("kimi", "gqa", "mla")
KB = 16  # kernel block (tokens) of every attention group here


@dataclass(frozen=True)
class EngineSpec:
    """One engine: everything a worker process needs to rebuild its config (picklable)."""

    engine_id: str
    model: str  # kimi | gqa | mla
    model_dir: str
    tp: int
    mode: str
    port: int
    num_blocks: int = 160
    host: str = "127.0.0.1"
    extra: tuple[tuple[str, Any], ...] = ()
    seed: int = 0
    netns: str | None = None  # network namespace (``ip netns`` name) the workers run in; None: the test's own
    device: str = "cpu"  # "cpu", or "cuda": worker r's KV caches on GPU r % device_count (NIXL VRAM)
    layerwise: bool = False  # prefill steps as forwards, layer by layer with save hooks (see the module docs)
    layer_s: float = 0.0  # compute time of each layer in a layerwise forward (a sleep)
    max_batched_tokens: int = 4096  # the scheduler's token budget per step (smaller: chunked prefill)
    block_size: int = 32  # the scheduler's block (tokens) of the GQA and MLA models
    gqa_kernel_block: int = KB  # the attention kernel block (tokens) of the GQA model

    @property
    def logical_block_size(self) -> int:
        if self.model == "kimi":
            from hybrid_kv.presets import get_preset

            return get_preset("tiny-kimi-linear").geometry(self.tp).logical_block_size
        return self.block_size


# ---------------------------------------------------------------------------------------------- models


def write_model_dirs(root: Path) -> dict[str, str]:
    """Tiny HF configs (no weights, no tokenizer: only ModelConfig reads them)."""
    configs = {
        "kimi": {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": 1024,
            "hidden_size": 64,
            "num_hidden_layers": 12,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "intermediate_size": 128,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "q_lora_rank": None,
            "mla_use_nope": True,
            "torch_dtype": "bfloat16",
            "max_position_embeddings": 4096,
            "num_experts": 4,
            "num_experts_per_token": 2,
            "moe_intermediate_size": 32,
            "linear_attn_config": {
                "kda_layers": [i + 1 for i in range(12) if i % 4 != 3],
                "full_attn_layers": [4, 8, 12],
                "num_heads": 4,
                "head_dim": 16,
                "short_conv_kernel_size": 4,
            },
        },
        "gqa": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 1024,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 8,
            "intermediate_size": 128,
            "torch_dtype": "bfloat16",
            "max_position_embeddings": 4096,
        },
        "mla": {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": 1024,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "q_lora_rank": None,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 2,
            "torch_dtype": "bfloat16",
            "max_position_embeddings": 4096,
        },
    }
    out = {}
    for name, cfg in configs.items():
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg))
        out[name] = str(d)
    return out


def layer_specs(spec: EngineSpec) -> dict[str, Any]:
    """Per-layer KV-cache specs of one TP rank, as the model's attention layers would report them."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    bs, tp = spec.logical_block_size, spec.tp
    out: dict[str, Any] = {}
    if spec.model == "kimi":
        from hybrid_kv.presets import get_preset

        geo = get_preset("tiny-kimi-linear").geometry(tp)
        for i in range(12):
            if i % 4 == 3:
                out[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
                    block_size=bs, num_kv_heads=1, head_size=48, dtype=torch.bfloat16
                )
            else:
                out[f"model.layers.{i}.self_attn.kda"] = MambaSpec(
                    block_size=bs,
                    shapes=((3 * 64 // tp, 3), (4 // tp, 16, 16)),
                    dtypes=(torch.bfloat16, torch.float32),
                    page_size_padded=geo.page_bytes,
                    mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                )
    elif spec.model == "gqa":
        for i in range(2):
            out[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=bs, num_kv_heads=4 // tp, head_size=8, dtype=torch.bfloat16
            )
    else:
        for i in range(2):
            out[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
                block_size=bs, num_kv_heads=1, head_size=48, dtype=torch.bfloat16
            )
    return out


def build(spec: EngineSpec) -> tuple[Any, Any, dict[str, Any]]:
    """``(VllmConfig, KVCacheConfig, layer specs)`` of an engine, through vLLM's own config and planner."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    mc = ModelConfig(model=spec.model_dir, dtype="bfloat16", seed=0, skip_tokenizer_init=True, max_model_len=2048)
    extra = {"mode": spec.mode, "side_channel_port": spec.port, "side_channel_host": spec.host, **dict(spec.extra)}
    vc = VllmConfig(
        model_config=mc,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=spec.max_batched_tokens,
            max_model_len=2048,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
        ),
        cache_config=CacheConfig(block_size=spec.logical_block_size, cache_dtype="auto", enable_prefix_caching=False),
        parallel_config=ParallelConfig(tensor_parallel_size=spec.tp),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridKvConnector",
            kv_connector_module_path="hybrid_kv.integrations.vllm",
            kv_role="kv_both",
            engine_id=spec.engine_id,
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig(spec.device),
    )
    # vLLM turns the hybrid KV-cache manager (HMA) off on platforms without a GPU; every GPU deployment of a
    # hybrid model runs with it on, which is the configuration under test.
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    from hybrid_kv.integrations.vllm import HybridKvConnector

    vc.cache_config.kv_cache_layout = HybridKvConnector.get_required_kvcache_layout(vc) or "LBNHC"
    specs = layer_specs(spec)
    groups = get_global_kv_cache_groups(vc, [specs])
    page = max(s.page_size_bytes for s in specs.values())
    tensors = 3 if spec.model == "kimi" else 2
    kv_cfg = get_kv_cache_configs(vc, [specs], [page * tensors * spec.num_blocks], groups)[0]
    return vc, kv_cfg, specs
