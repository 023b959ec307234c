#!/usr/bin/env bash
# The whole suite: the fast tiers the README's test command runs and the slow tier (tests marked
# `slow`: the peer libraries' other models, ...). Run it before calling a change done.
# Extra arguments go to pytest (a file, -k, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
exec timeout "${AUTOSP_SUITE_TIMEOUT:-10800}" python -m pytest -m "slow or not slow" "$@"
