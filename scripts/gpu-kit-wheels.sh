#!/usr/bin/env bash
# Fetch and build, on a machine with network, the exact set of wheels scripts/gpu-kit.sh installs on the bare
# accelerator machine (CPython 3.12, x86_64, no network), into .gpu-kit/ (git-ignored; carried beside the tree),
# then print each wheel's size and the total with the tree, and fail when it is over the 64 MiB a run may carry.
#
# The set, for an image that has python3 with pip, torch and numpy (and their dependencies) and nothing else:
#   hybrid-kv      the abi3 wheel, built here as scripts/wheel.sh builds it (maturin --zig, manylinux_2_28)
#   nixl-cu13      NIXL and its bundled UCX for CUDA 13 (cp312)
#   nixl           the meta package `import nixl` goes through (selects nixl_cu13 from torch's CUDA version)
#   pyzmq          the side channel (cp312 abi3, libzmq with CURVE bundled)
#   msgspec        verified transfers' control messages (cp312)
# Not carried: torch and numpy (the image's), rich (only the other subcommands use it; the kit runs
# `python -m hybrid_kv.cli.gpu_kit`), cryptography (the transport derives its keys with hashlib).
# Versions default to those installed beside this script's Python (what the tests here ran with).
#   HYBRID_KV_KIT_WHEELS   output folder (default: .gpu-kit at the repository root)
#   PYTHON                 interpreter with pip, maturin and ziglang (default: python; scripts/env.sh's venv is
#                          set up when maturin is not found)
set -euo pipefail
HKV_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$HKV_ROOT"
if ! command -v maturin >/dev/null 2>&1; then
    . "$HKV_ROOT/scripts/env.sh"
fi
py="${PYTHON:-python}"
kit_dir="${HYBRID_KV_KIT_WHEELS:-$HKV_ROOT/.gpu-kit}"
limit=$((64 << 20))
version() { "$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
nixl_v="$(version nixl-cu13)"; zmq_v="$(version pyzmq)"; msgspec_v="$(version msgspec)"

rm -rf "$kit_dir"
mkdir -p "$kit_dir"
echo "[gpu-kit-wheels] building the abi3 hybrid-kv wheel (maturin build --release --zig --compatibility manylinux_2_28)" >&2
maturin build --release --zig --compatibility manylinux_2_28 -o "$kit_dir" 2>&1 \
    | { grep --line-buffered -E '^ *(Finished|error)|Built wheel|💥|Caused by' || true; } | sed -u -E 's/^ */[gpu-kit-wheels]   /' >&2
ls "$kit_dir"/hybrid_kv-*-cp310-abi3-manylinux_2_28_x86_64.whl >/dev/null 2>&1 \
    || { echo "[gpu-kit-wheels] error: no cp310-abi3-manylinux_2_28_x86_64 hybrid-kv wheel was built" >&2; exit 1; }
bash "$HKV_ROOT/scripts/gpu-kit-stamp.sh" > "$kit_dir/rust-sources.sha256"

echo "[gpu-kit-wheels] downloading for cp312 manylinux x86_64: nixl-cu13 $nixl_v, nixl $nixl_v, pyzmq $zmq_v, msgspec $msgspec_v" >&2
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_17 manylinux2014; do
    platforms+=(--platform "${tag}_x86_64")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d "$kit_dir" "nixl-cu13==$nixl_v" "nixl==$nixl_v" "pyzmq==$zmq_v" "msgspec==$msgspec_v"
for name in hybrid_kv nixl_cu13 nixl-"$nixl_v" pyzmq msgspec; do
    ls "$kit_dir/$name"*.whl >/dev/null 2>&1 || { echo "[gpu-kit-wheels] error: no $name wheel in $kit_dir" >&2; exit 1; }
done

# What a run carries: the working tree as git sees it (tracked files, and untracked ones it does not ignore) and
# this folder.
tree_bytes="$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -b -- 2>/dev/null \
    | awk '{s += $1} END {print s + 0}')"
kit_bytes=0
echo "[gpu-kit-wheels] carried set in $kit_dir:" >&2
for f in "$kit_dir"/*; do
    n="$(stat -c %s "$f")"
    kit_bytes=$((kit_bytes + n))
    printf '[gpu-kit-wheels] %12d B  %7.2f MiB  %s\n' "$n" "$(echo "$n" | awk '{print $1 / 1048576}')" "$(basename "$f")" >&2
done
total=$((kit_bytes + tree_bytes))
mib() { echo "$1" | awk '{printf "%.2f", $1 / 1048576}'; }
printf '[gpu-kit-wheels] %12d B  %7.2f MiB  wheels\n' "$kit_bytes" "$(mib "$kit_bytes")" >&2
printf '[gpu-kit-wheels] %12d B  %7.2f MiB  working tree (git ls-files: tracked and untracked, not ignored)\n' \
    "$tree_bytes" "$(mib "$tree_bytes")" >&2
printf '[gpu-kit-wheels] %12d B  %7.2f MiB  total, of %d B (64 MiB): %d B left\n' \
    "$total" "$(mib "$total")" "$limit" "$((limit - total))" >&2
if [ "$total" -gt "$limit" ]; then
    echo "[gpu-kit-wheels] error: the carried set and the tree are $((total - limit)) B over 64 MiB: a run cannot carry them" >&2
    exit 1
fi
echo "[gpu-kit-wheels] OK: carry .gpu-kit with the tree and run, from the repository root: bash scripts/gpu-kit.sh --out \$OUT/gpu-kit.json" >&2
