#!/usr/bin/env bash
# Sets up (idempotent) and trains on a pixel DM Control task with a CPU learner on this
# machine. Extra arguments go to `python -m impala_rep.launch` and override the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-plots}" bash scripts/setup.sh
export MUJOCO_GL="${MUJOCO_GL:-egl}"
exec .venv/bin/python -m impala_rep.launch --env dmc/cartpole-swingup --learner cpu --logdir runs/cartpole-swingup "$@"
