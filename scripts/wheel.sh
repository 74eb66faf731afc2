#!/usr/bin/env bash
# Build the portable wheel (abi3, CPython >= 3.10, manylinux_2_28 through zig) into dist/, then install it
# alone (numpy and rich from PyPI, no torch, nixl or zmq) into a fresh venv of each other Python version
# found here and check the installed `hybrid-kv` command. CI runs this (.ci/run).
#   HYBRID_KV_WHEEL_PYTHONS   interpreters to install into (default: python3.10/3.12/3.13 found on the machine)
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HKV_ROOT"
echo "[hybrid-kv] building the portable wheel (maturin build --release --zig --compatibility manylinux_2_28)" >&2
rm -f dist/hybrid_kv-*.whl
maturin build --release --zig --compatibility manylinux_2_28 -o dist 2>&1 \
    | { grep --line-buffered -E '^ *(Finished|error)|Built wheel|💥|Caused by' || true; } | sed -u -E 's/^ */[hybrid-kv]   /' >&2
wheel="$(ls dist/hybrid_kv-*-cp310-abi3-manylinux_2_28_x86_64.whl dist/hybrid_kv-*-cp310-abi3-manylinux_2_28_*.whl 2>/dev/null | head -1)"
[ -n "$wheel" ] || { echo "[hybrid-kv] error: no cp310-abi3-manylinux_2_28 wheel in dist/" >&2; exit 1; }
echo "[hybrid-kv] wheel: $(basename "$wheel")" >&2

own="$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
pythons=()
if [ -n "${HYBRID_KV_WHEEL_PYTHONS:-}" ]; then
    read -r -a pythons <<< "$HYBRID_KV_WHEEL_PYTHONS"
else
    root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
    for v in 3.10 3.12 3.13; do
        [ "$v" = "$own" ] && continue
        for py in "$root"/versions/"$v".*/bin/python"$v" /usr/bin/python"$v" /usr/local/bin/python"$v"; do
            if [ -x "$py" ] && "$py" -c 'import venv, ensurepip' 2>/dev/null; then pythons+=("$py"); break; fi
        done
    done
fi
if [ "${#pythons[@]}" -eq 0 ]; then
    echo "[hybrid-kv] warning: no Python other than $own found; installing the wheel into a fresh $own venv" >&2
    pythons=("$(command -v python3)")
fi

fail() { echo "[hybrid-kv] error: wheel check on $1: $2" >&2; exit 1; }
for py in "${pythons[@]}"; do
    venv="$(mktemp -d)/venv"
    "$py" -m venv "$venv"
    ver="$("$venv/bin/python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
    echo "[hybrid-kv] installing the wheel alone into a fresh Python $ver venv" >&2
    "$venv/bin/python" -m pip install -q --progress-bar off "$wheel"
    cli="$venv/bin/hybrid-kv"
    want="hybrid-kv $("$venv/bin/python" -c 'import hybrid_kv; print(hybrid_kv.__version__)')"
    [ "$("$cli" --version)" = "$want" ] || fail "$ver" "--version does not print '$want'"
    "$cli" check --preset tiny-kimi-linear --prefill-tp 2 --decode-tp 1 >/dev/null \
        || fail "$ver" "check --preset without torch, nixl and zmq"
    "$venv/bin/python" -c 'from hybrid_kv import fixtures, presets; assert fixtures.F2_PAGE and presets.PRESETS' \
        || fail "$ver" "the package's data files (fixtures.json, presets.json) not loaded"
    "$cli" plan tests/data/scenarios/hybrid_mla_f2.json >/dev/null || fail "$ver" "plan"
    for cmd in regions demo; do
        set +e; err="$("$cli" "$cmd" 2>&1 >/dev/null)"; rc=$?; set -e
        [ "$rc" = 2 ] || fail "$ver" "hybrid-kv $cmd without torch exits $rc, not 2: $err"
        [ "$(printf '%s\n' "$err" | wc -l)" = 1 ] || fail "$ver" "hybrid-kv $cmd: not one line: $err"
        case "$err" in *"pip install 'hybrid-kv["*) ;; *) fail "$ver" "hybrid-kv $cmd names no extra: $err" ;; esac
        case "$err" in *Traceback*) fail "$ver" "hybrid-kv $cmd: traceback" ;; esac
    done
    echo "[hybrid-kv] wheel OK on Python $ver: import, --version, check --preset and plan without extras," \
        "one-line errors naming the extra for regions and demo" >&2
    rm -rf "$(dirname "$venv")"
done
