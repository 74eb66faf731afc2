#!/usr/bin/env bash
# The vLLM connector end to end on a GPU machine: vLLM allocates every worker's KV caches on CUDA, the
# connector registers them as NIXL VRAM, and each case (tests/integrations/gpu_e2e.py; default Kimi-Linear
# pull P TP1 -> D TP2, push P TP1 -> D TP2, pull P TP2 -> D TP1, and streaming push (the prefill forward layer
# by layer on the GPU, each layer's KV posted after its CUDA event) P TP1 -> D TP2 and P TP2 -> D TP1) checks
# every byte the decode workers hold.
# Arguments go to gpu_e2e.py (--case MODE:P_TP:D_TP, --lengths).
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
exec "$HYBRID_KV_VLLM_VENV/bin/python" "$e2e" "$@"
