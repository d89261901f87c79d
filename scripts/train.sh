#!/usr/bin/env bash
# Sets up (idempotent) and trains on a pixel DM Control task with a CPU learner on this
# machine. The defaults below are the settings of the best cartpole run in docs/RESULTS.md
# (run 13: 64x64 pixels, action repeat 8, an 11-bin discretised policy, rewards scaled by
# 1/8, gradient clip 1000, entropy cost 0.02, unrolls of 10 steps, batches of 8 unrolls,
# learning-rate warm-up, envs out of phase (the dmc/ default)), with a budget of whichever
# comes first of 4M agent steps and 50 minutes of training, the learning rate annealed linearly
# to 0 over whichever of the two is further along: on the first sessions' host 1.6M steps took
# 54 minutes (greedy evaluation 756.7), on faster hosts 18-24 minutes, where 1.6M steps ended
# below 700 in 2 runs of 12 and 3-4M steps at 847-857 in all 3 (runs 17, 19, 27). Since the
# seventy-first session it adds PopArt (step size 3e-4) with RMSProp's epsilon over PopArt's sigma
# squared: on the Zen 4 host its three full runs ended at 861.6-865.0 (runs 46-48, the last from a fresh
# clone), past 700 at 10 minutes (711.2-819.2; 812-838 in three 20-minute runs), where the default scored 535-786 at 10 minutes in
# three runs and silenced 107-113 of the dense layer's 256 units. Each
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
    --popart 3e-4 --rmsprop-epsilon-scale sigma \
    --unroll-length 10 --batch-size 8 --actors 16 --total-steps 4000000 --time-budget 50m --checkpoint-interval 300 --eval-episodes 10 --eval-greedy \
    --logdir runs/cartpole-swingup "$@"
