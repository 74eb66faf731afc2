#!/usr/bin/env bash
# The GPU kit, for a bare accelerator machine: only a system python3 with torch (CUDA) and numpy, no network, no
# package index, no vLLM (the lent H200). It runs hybrid-kv's whole transport below vLLM there: NIXL VRAM
# registration of preset pools, pull and push between rank processes on the one GPU with every byte checked on the
# device, throughput against a torch copy, descriptors/s, the UCX transports used, verify=all digests, streaming
# push with per-layer compute, planner timings (python/hybrid_kv/kit/). scripts/gpu-e2e.sh is for machines that
# have vLLM (the connector with real vLLM engines).
#
# Usage, from anywhere:  bash scripts/gpu-kit.sh --out PATH.json [hybrid-kv gpu-kit options: --device cpu, --steps...]
#   1. installs the carried wheels (.gpu-kit/*.whl, made beforehand on a machine with network by
#      scripts/gpu-kit-wheels.sh: the abi3 hybrid-kv wheel, nixl-cu13, nixl, pyzmq, msgspec) into a temporary
#      folder: pip --no-index --no-deps, nothing fetched; then puts this tree's Python sources over the hybrid-kv
#      wheel's (the kit that runs is this tree's; the wheel brings the compiled core, which must have been built
#      from this tree's Rust sources: checked against the wheel's stamp, scripts/gpu-kit-stamp.sh);
#   2. runs python3 -m hybrid_kv.cli.gpu_kit: each step in its own process group with a time bound (the whole run
#      within --budget-s, default 420 s), the JSON summary at --out after every step, logs beside it (PATH-logs/).
# Without wheels in .gpu-kit/ (a development machine; CI's dry run) it runs with the interpreter's own packages.
# Exit status: 0 every step ok, 1 a step failed (the summary says which and why), 2 bad arguments or set-up.
#   HYBRID_KV_KIT_WHEELS   the carried wheels' folder (default: .gpu-kit at the repository root)
#   PYTHON                 the interpreter (default: python3)
set -euo pipefail
HKV_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
kit_dir="${HYBRID_KV_KIT_WHEELS:-$HKV_ROOT/.gpu-kit}"
py="${PYTHON:-python3}"
shopt -s nullglob
wheels=("$kit_dir"/*.whl)
site=""
if [ "${#wheels[@]}" -gt 0 ]; then
    want="$(cat "$kit_dir/rust-sources.sha256" 2>/dev/null || echo none)"
    have="$(bash "$HKV_ROOT/scripts/gpu-kit-stamp.sh")"
    if [ "$want" != "$have" ]; then
        echo "[gpu-kit] error: the hybrid-kv wheel in $kit_dir was not built from this tree's Rust sources" \
            "(stamp $want, tree $have); rebuild the carried set: bash scripts/gpu-kit-wheels.sh" >&2
        exit 2
    fi
    "$py" -m pip --version >/dev/null 2>&1 || { echo "[gpu-kit] error: $py has no pip to install the carried wheels" >&2; exit 2; }
    site="$(mktemp -d "${TMPDIR:-/tmp}/hkv-gpu-kit.XXXXXX")"
    echo "[gpu-kit] installing ${#wheels[@]} carried wheels into $site (pip --no-index --no-deps)" >&2
    "$py" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$site" "${wheels[@]}"
    "$py" - "$HKV_ROOT/python/hybrid_kv" "$site/hybrid_kv" <<'PY'
import shutil, sys
shutil.copytree(sys.argv[1], sys.argv[2], dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
PY
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "[gpu-kit] no wheels in $kit_dir: running with $py's own packages and this tree's python/" >&2
    export PYTHONPATH="$HKV_ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
fi
status=0
"$py" -m hybrid_kv.cli.gpu_kit "$@" || status=$?
[ -n "$site" ] && rm -rf "$site"
exit "$status"
