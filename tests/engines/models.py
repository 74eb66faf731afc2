"""Tiny models the real-engine tests write themselves (no downloads): a ``config.json`` plus seeded random
weights from transformers' own initialisation, saved with ``save_pretrained``.

The weights use a raised ``initializer_range`` (0.2, transformers' default is 0.02): with small weights
attention over the KV cache barely moves the logits, so a decode engine that read wrong KV bytes could still
produce the right tokens. At 0.2 the prompt's KV visibly decides the output (``test_weights_make_kv_matter``
checks it in a real engine).

Shapes are chosen for vLLM's CPU kernels: attention head sizes the CPU backend supports (64, 128), MLA with
latent 512 + rope 64 (head size 576, ``cpu_mla.py``), the CPU GDN kernel with linear head dim 128.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

INIT_RANGE = 0.2
SEED = 1234
VOCAB = 512

CONFIGS: dict[str, dict[str, Any]] = {
    # Llama-shaped GQA: 4 query heads over 2 KV heads of 64
    "gqa": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
    # DeepSeek-V2-shaped MLA (dense MLP: first_k_dense_replace = every layer); CPU MLA: latent 512 + rope 64
    "mla": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 2,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
    # Qwen3-Next-shaped hybrid: GDN (linear attention, head dim 128 for the CPU kernel) + full attention
    "qwen3_next": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "partial_rotary_factor": 0.25,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
}


ENGINE_ENV: dict[str, dict[str, str]] = {"qwen3_next": {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}}
"""Environment an engine serving the model needs. SSM conv states in the DS layout, which hybrid-kv (and vLLM's
NixlConnector) transfer: vLLM's CPU platform picks SD on CPUs with AVX512-BF16 unless the connector is named
NixlConnector, and it decides in the API server before any connector module is imported, so operators set it
(the connector refuses an SD engine at start-up with an error naming this variable)."""


def write_model(name: str, root: Path, dtype: str = "bfloat16") -> Path:
    """Write model ``name`` of ``CONFIGS`` (config + seeded random weights) under ``root/name``; returns it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = root / name
    if (out / "config.json").exists():
        return out
    raw = dict(CONFIGS[name])
    model_type = raw.pop("model_type")
    config = AutoConfig.for_model(model_type, **raw, initializer_range=INIT_RANGE)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["initializer_range"] = INIT_RANGE
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


if __name__ == "__main__":  # python tests/engines/models.py DIR: write every model (for trying engines by hand)
    import sys

    for n in CONFIGS:
        print(write_model(n, Path(sys.argv[1])))
