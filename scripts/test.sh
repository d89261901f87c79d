#!/usr/bin/env bash
# Sets up (idempotent) and runs the test suite in two pytest processes: the TensorFlow-free
# suites (they render MuJoCo scenes, which crash in a process that has loaded TensorFlow)
# and the TensorFlow suites in tests/learner/. Extra arguments go to both pytest runs,
# e.g. `bash scripts/test.sh -m slow` for the slow tests.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-test}" bash scripts/setup.sh
export MUJOCO_GL="${MUJOCO_GL:-egl}"
status=0
.venv/bin/python -m pytest tests --ignore=tests/learner "$@" || status=$?
.venv/bin/python -m pytest tests/learner "$@" || status2=$?
status2=${status2:-0}
# pytest exits 5 when a selection (e.g. -m slow) matches no test in one of the two runs.
for s in $status $status2; do
    if [ "$s" != 0 ] && [ "$s" != 5 ]; then exit "$s"; fi
done
if [ "$status" = 5 ] && [ "$status2" = 5 ]; then echo "no test matched the selection" >&2; exit 5; fi
exit 0
