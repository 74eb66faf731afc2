#!/usr/bin/env bash
# The README's main command: set up (once), build, and run the demo with its built-in defaults.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec hybrid-kv demo "$@"
