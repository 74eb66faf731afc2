#!/usr/bin/env bash
# Print one SHA-256 over the sources the compiled core is built from (rust/, build.rs, Cargo.toml, Cargo.lock,
# pyproject.toml): gpu-kit-wheels.sh stores it beside the wheel it builds, gpu-kit.sh refuses a wheel whose stamp
# is not the tree's (the kit runs the tree's Python on the wheel's core, so the two must match). Needs only
# coreutils and find, as on the accelerator image.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
find rust build.rs Cargo.toml Cargo.lock pyproject.toml -type f \( -name '*.rs' -o -name '*.toml' -o -name '*.lock' \) -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-64
