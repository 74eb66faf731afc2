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
exec python -m pytest -q "$@"
