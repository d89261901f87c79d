#!/usr/bin/env bash
# Sets up (idempotent) and trains on a pixel DM Control task with a CPU learner on this
# machine. The defaults below are the settings of the best cartpole run in docs/RESULTS.md
# (run 13: 64x64 pixels, action repeat 8, an 11-bin discretised policy, rewards scaled by
# 1/8, gradient clip 1000, entropy cost 0.02, unrolls of 10 steps, batches of 8 unrolls,
# learning-rate warm-up, then annealed linearly to 0 over the 1.6M agent-step budget, envs
# out of phase (the dmc/ default); 54 minutes on the first sessions' host, final greedy evaluation
# 756.7; 17.6 minutes and 711.9 on the twelfth session's faster host, run 16). Each
# checkpoint's policy (every 5 minutes) is evaluated on 10 greedy
# episodes as it trains (RUN_DIR/eval). Extra
# arguments go to `python -m impala_rep.launch` after them: a repeated flag overrides,
# except --env-arg, which adds a key (and may not repeat one).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-plots}" bash scripts/setup.sh
export MUJOCO_GL="${MUJOCO_GL:-egl}"
exec .venv/bin/python -m impala_rep.launch --env dmc/cartpole-swingup --learner cpu \
    --env-arg action_repeat=8 --env-arg size=64 --policy discretised --bins 11 --clip-norm 1000 --entropy-cost 0.02 \
    --unroll-length 10 --batch-size 8 --actors 16 --total-steps 1600000 --checkpoint-interval 300 --eval-episodes 10 --eval-greedy \
    --logdir runs/cartpole-swingup "$@"
