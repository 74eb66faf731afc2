#!/usr/bin/env bash
# For a GPU machine that has vLLM (the vLLM venv, network to set it up). A bare accelerator image without vLLM or
# network (only python3 with torch and numpy) runs scripts/gpu-kit.sh instead: the whole transport below vLLM from
# carried wheels (README, "The GPU kit").
# The vLLM connector end to end on a GPU machine, in two parts:
# 1. in-process (tests/integrations/gpu_e2e.py): vLLM allocates every worker's KV caches on CUDA, the connector
#    registers them as NIXL VRAM, and each case (default Kimi-Linear pull P TP1 -> D TP2, push P TP1 -> D TP2,
#    pull P TP2 -> D TP1, and streaming push (the prefill forward layer by layer on the GPU, each layer's KV
#    posted after its CUDA event) P TP1 -> D TP2 and P TP2 -> D TP1) checks every byte the decode workers hold.
#    Arguments go to gpu_e2e.py (--case MODE:P_TP:D_TP, --lengths).
# 2. real engines (tests/engines with HYBRID_KV_ENGINE_DEVICE=cuda): the same real-engine cases the CPU runs
#    (GQA pull and push, DeepSeek-V2-shaped MLA, Qwen3-Next-shaped hybrid pull, push and streaming push; `vllm
#    serve` prefill and decode on the first GPU behind the test proxy), tokens and logprobs against the
#    references. HYBRID_KV_GPU_ENGINES=0 skips this part.
# Exit status: 0 passed, 1 failed, 3 no CUDA device (checked first, before any set-up or build: nothing run).
#   HYBRID_KV_VLLM_VENV   the vLLM test venv (default: ~/.venvs/hybrid-kv-vllm, made by scripts/vllm-env.sh)
set -euo pipefail
HKV_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
e2e="$HKV_ROOT/tests/integrations/gpu_e2e.py"
venv="${HYBRID_KV_VLLM_VENV:-$HOME/.venvs/hybrid-kv-vllm}"
if [ -x "$venv/bin/python" ]; then  # no GPU: say so before building anything
    "$venv/bin/python" "$e2e" --probe || exit $?
fi
. "$HKV_ROOT/scripts/env.sh"
. "$HKV_ROOT/scripts/vllm-env.sh"
cd "$HKV_ROOT"
echo "[hybrid-kv] gpu-e2e: the vLLM connector with CUDA tensors (NIXL VRAM), vLLM venv" >&2
status=0
"$HYBRID_KV_VLLM_VENV/bin/python" "$e2e" "$@" || status=$?
[ "$status" -eq 3 ] && exit 3
if [ "${HYBRID_KV_GPU_ENGINES:-1}" != "0" ]; then
    echo "[hybrid-kv] gpu-e2e: real vllm serve engines on CUDA (tests/engines)" >&2
    HYBRID_KV_ENGINE_DEVICE=cuda "$HYBRID_KV_VLLM_VENV/bin/python" -m pytest -q tests/engines || status=1
fi
exit "$status"
