#!/usr/bin/env bash
# Learning with a GPU learner and its default --param-refresh-lag (auto: 8), against lag 1, on a lent
# NVIDIA machine (fifty-third session; see RESULTS.md). The main job's cartpole recipe (scripts/train.sh:
# 64x64 pixels, action repeat 8, 11 bins, unrolls of 10, batches of 8) with --learner gpu, 128 actors in
# the launcher's one process per core, MuJoCo on the GPU through NVIDIA's EGL, the render preset fixed
# to `fast` (the CPU hosts' frames, so that the saved policies can be evaluated there), seed 0, the
# learning rate annealed over a BUDGET of training (default 3m), the RUNS listed (default "lag8 lag1":
# lag 8 first, then lag 1; lag8-jit adds --jit). The fifty-third session, whose device time a failed
# copy of one piece cut to a third, ran RUNS=lag8 BUDGET=150, then RUNS=lag8-jit BUDGET=50.
# On the device, after one call per piece (.gpu/tf.*, .gpu/cu12.* of
# ../thirty-sixth-session/prepare_gpu_pieces.sh cut at 52 MiB and .dmc/dmc.* of
# prepare_gpu_dmc_pieces.sh, each copied to /tmp/gp), carrying .whl and .gpu/stubs:
#   bash docs/benchmarks/fifty-third-session/gpu_learning.sh 2>&1 | grep -v -E "^(I0000|W0000|E0000)" | tee $OUT/log
# LEARNER=cpu PY=.venv/bin/python BUDGET=20 ACTORS=16 runs the same lines on a CPU host (a check of the
# script itself). Run directories (less their checkpoints) land in $OUT as runs.tar.
set -u
LEARNER=${LEARNER:-gpu}; BUDGET=${BUDGET:-3m}; ACTORS=${ACTORS:-128}; PY=${PY:-python3}
RUNS=${RUNS:-lag8 lag1}; OUTD=${OUT:-/tmp/out}; mkdir -p "$OUTD"
if [ "$LEARNER" = gpu ]; then
  source docs/benchmarks/thirty-sixth-session/gpu_setup.sh > "$OUTD/setup.log" 2>&1 || { cat "$OUTD/setup.log"; exit 3; }
  mkdir -p /tmp/dmc && cat /tmp/gp/dmc.* | xz -d -T0 | tar -xf - -C /tmp/dmc || exit 4
  export PYTHONPATH=/tmp/site:/tmp/dmc/site:$PWD LD_LIBRARY_PATH=$LD_LIBRARY_PATH:/tmp/dmc/gl
  export TF_FORCE_GPU_ALLOW_GROWTH=true  # leave GPU memory for the actors' EGL contexts
  lscpu | grep -E "^(Model name|CPU\(s\))"
fi
export MUJOCO_GL=egl
git log --oneline -1 2>/dev/null || true
t0=$(date +%s)
# MuJoCo renders in a process without TensorFlow: which renderer, and how fast one env steps.
$PY - <<'PY' || exit 5
import time
from envs import dmc, make
env = make("dmc/cartpole-swingup", seed=0, action_repeat=8, size=64, render="fast")
print("GL_RENDERER:", dmc.renderer_name())
env.reset(); t = time.perf_counter()
for _ in range(200):
    env.step([0.0])
print("one env, fast preset: %.0f agent steps/s" % (200 / (time.perf_counter() - t)))
PY
run() { name=$1; shift; echo "== $name: $*"; t1=$(date +%s)
  timeout 290 $PY -m impala_rep.launch --env dmc/cartpole-swingup --learner "$LEARNER" \
    --env-arg action_repeat=8 --env-arg size=64 --env-arg render=fast --policy discretised --bins 11 \
    --clip-norm 1000 --entropy-cost 0.02 --unroll-length 10 --batch-size 8 --actors "$ACTORS" \
    --total-steps 40000000 --time-budget "$BUDGET" --checkpoint-interval 60 --eval-episodes 10 --eval-greedy \
    --log-interval 15 --seed 0 --logdir "/tmp/runs/$name" "$@" 2>&1 | grep -v -E "^(I0000|W0000|E0000)" | tail -40
  echo "$name took $(( $(date +%s) - t1 )) s"
  # one archive: the device tool does not bring back folders nested this deep under $OUT
  (cd /tmp && tar -cf "$OUTD/runs.tar" --exclude=checkpoints runs)
}
for spec in $RUNS; do
  case $spec in
    lag8) run gpu-lag8 ;;
    lag1) run gpu-lag1 --param-refresh-lag 1 ;;
    lag8-jit) run gpu-lag8-jit --jit ;;
    *) echo "unknown run $spec (lag8, lag1 or lag8-jit)"; exit 2 ;;
  esac
done
echo "all took $(( $(date +%s) - t0 )) s"
