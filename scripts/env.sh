#!/usr/bin/env bash
# Source me. Creates (once per machine) and activates the venv the README's commands use, installs the
# Python requirements when they changed, and builds + installs the hybrid_kv extension from this checkout.
#   HYBRID_KV_VENV   where the venv lives (default: ~/.venvs/hybrid-kv, shared by every clone)
set -euo pipefail
HKV_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Already set up and built for this checkout by a calling script (e.g. .ci/run -> scripts/test.sh)?
if [ "${HKV_ENV_READY:-}" = "$HKV_ROOT" ] && [ -n "${VIRTUAL_ENV:-}" ]; then
    return 0
fi
HYBRID_KV_VENV="${HYBRID_KV_VENV:-$HOME/.venvs/hybrid-kv}"
export HYBRID_KV_VENV

if [ ! -x "$HYBRID_KV_VENV/bin/python" ]; then
    echo "[hybrid-kv] creating venv at $HYBRID_KV_VENV" >&2
    python3 -m venv "$HYBRID_KV_VENV"
fi
# shellcheck disable=SC1091
. "$HYBRID_KV_VENV/bin/activate"

stamp="$HYBRID_KV_VENV/.hybrid-kv-requirements.sha256"
want="$(sha256sum "$HKV_ROOT/requirements-dev.txt" | cut -d' ' -f1)"
# One progress line per package pip fetches or installs (a first run downloads torch: minutes).
hkv_pip() {
    python -m pip install --progress-bar off "$@" 2>&1 \
        | { grep --line-buffered -E '^ *(Collecting|Downloading|Installing collected|Successfully installed|ERROR|error)' \
            || true; } | sed -u -E 's/^ */[hybrid-kv]   /' >&2
}
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    echo "[hybrid-kv] installing Python requirements (torch is large; this happens once per machine)" >&2
    hkv_pip --upgrade pip
    hkv_pip -r "$HKV_ROOT/requirements-dev.txt"
    echo "$want" > "$stamp"
fi

if ! command -v cargo >/dev/null 2>&1; then
    echo "[hybrid-kv] error: cargo (Rust) is required to build the extension" >&2
    exit 1
fi
# The version-specific build (feature `python`, not the wheel's `abi3`): it keeps the binding's fastest
# block-id reading (README "Wheels"). One line per crate compiled (a first build compiles about 60: 1-3 min).
echo "[hybrid-kv] building the extension (maturin develop --release -F python)" >&2
build_log="$(mktemp)"
if ! (cd "$HKV_ROOT" && rm -f python/hybrid_kv/_core*.so && maturin develop --release -F python 2>&1) \
    | tee "$build_log" | { grep --line-buffered -E '^ *(Compiling|Finished)|Installed' || true; } \
    | sed -u -E 's/^ */[hybrid-kv]   /' >&2; then
    cat "$build_log" >&2
    echo "[hybrid-kv] error: building the extension failed (output above)" >&2
    rm -f "$build_log"
    exit 1
fi
rm -f "$build_log"
export HKV_ENV_READY="$HKV_ROOT"
