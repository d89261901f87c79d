#!/usr/bin/env bash
# Sets up (idempotent) and runs the default test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m slow` for the slow tests.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-test}" bash scripts/setup.sh
export MUJOCO_GL="${MUJOCO_GL:-egl}"
exec .venv/bin/python -m pytest "$@"
