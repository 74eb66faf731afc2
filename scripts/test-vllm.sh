#!/usr/bin/env bash
# The vLLM connector tests (tests/integrations/) in the vLLM test venv; scripts/test.sh runs this too.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
. "$(dirname "${BASH_SOURCE[0]}")/vllm-env.sh"
cd "$HKV_ROOT"
echo "[hybrid-kv] pytest tests/integrations (vLLM connector, vLLM venv)" >&2
exec "$HYBRID_KV_VLLM_VENV/bin/python" -m pytest -q tests/integrations "$@"
