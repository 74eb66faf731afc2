#!/usr/bin/env bash
# Source me after scripts/env.sh. Creates (once per machine) the vLLM test venv: vLLM 0.33.0 pins
# torch==2.14.0, which conflicts with the main venv's torch, so the connector tests get their own venv with
# vllm, nixl, pyzmq, prometheus_client and pytest (scripts/requirements-vllm.txt, reinstalled when it changes).
# hybrid_kv is the extension scripts/env.sh just built, put on the venv's path (as `maturin develop` does).
#   HYBRID_KV_VLLM_VENV   where the venv lives (default: ~/.venvs/hybrid-kv-vllm)
set -euo pipefail
HKV_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HYBRID_KV_VLLM_VENV="${HYBRID_KV_VLLM_VENV:-$HOME/.venvs/hybrid-kv-vllm}"
export HYBRID_KV_VLLM_VENV
if [ ! -x "$HYBRID_KV_VLLM_VENV/bin/python" ]; then
    echo "[hybrid-kv] creating the vLLM test venv at $HYBRID_KV_VLLM_VENV" >&2
    python3 -m venv "$HYBRID_KV_VLLM_VENV"
fi
vstamp="$HYBRID_KV_VLLM_VENV/.hybrid-kv-vllm-requirements.sha256"
vwant="$(sha256sum "$HKV_ROOT/scripts/requirements-vllm.txt" | cut -d' ' -f1)"
if [ "$(cat "$vstamp" 2>/dev/null || true)" != "$vwant" ]; then
    echo "[hybrid-kv] installing vLLM 0.33.0 into the test venv (large download; once per machine)" >&2
    "$HYBRID_KV_VLLM_VENV/bin/python" -m pip install -q --upgrade pip
    "$HYBRID_KV_VLLM_VENV/bin/python" -m pip install -q -r "$HKV_ROOT/scripts/requirements-vllm.txt"
    echo "$vwant" > "$vstamp"
fi
site="$("$HYBRID_KV_VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$HKV_ROOT/python" > "$site/hybrid_kv.pth"
