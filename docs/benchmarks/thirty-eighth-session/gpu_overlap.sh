#!/usr/bin/env bash
# --overlap-publish on the GPU learner (thirty-eighth session; see BENCHMARKS.md). Run on a lent
# NVIDIA machine from the repository root after the thirty-sixth session's pieces' calls
# (../thirty-sixth-session/gpu_check.sh says how):
#   cp .gpu/cu12.04 /tmp/gp/ && bash docs/benchmarks/thirty-eighth-session/gpu_overlap.sh 2>&1 | tee $OUT/log
# End to end on the synthetic workload, 128 actors (the launcher spreads them over the cores),
# the GPU learner: the parameters published between steps (off) and overlapping the next step
# (auto, which is on for a GPU learner), twice each, alternating; then with XLA (--jit) and
# with batches of 128. Each run is about a minute: start-up, 20 s of warm-up, a 20-s window, stop.
source docs/benchmarks/thirty-sixth-session/gpu_setup.sh
L="python3 scripts/bench_launch.py --env benchmark:synthetic_env --actors 128 --warmup 20 --seconds 20 --learner gpu --json"
run() { name=$1; shift; echo "== $name: $*"; timeout 100 $L "$@" | tee "$OUTD/$name.json"; }
run off1 --overlap-publish off
run on1
run off2 --overlap-publish off
run on2
run on_jit --jit
run on_b128 --batch-size 128
echo "all took $(( $(date +%s) - t0 )) s"
