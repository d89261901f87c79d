#!/usr/bin/env bash
# --intake process against --intake thread on the GPU learner (fortieth session; see BENCHMARKS.md).
# Run on a lent NVIDIA machine from the repository root after the thirty-sixth session's pieces'
# calls (../thirty-sixth-session/gpu_check.sh says how):
#   cp .gpu/cu12.04 /tmp/gp/ && bash docs/benchmarks/fortieth-session/gpu_intake.sh 2>&1 | tee $OUT/log
# End to end on the synthetic workload, 128 actors (the launcher spreads them over the cores),
# the GPU learner with its parameters published beside the next step (--overlap-publish auto):
# the intake (gRPC service, queue, batcher, parameter store) in a child process (auto on a GPU)
# and in the learner's process, twice each, alternating; then the child process with XLA
# (--jit) and with batches of 128. Each run is about a minute: start-up, 20 s of warm-up, a
# 20-s window, stop.
source docs/benchmarks/thirty-sixth-session/gpu_setup.sh
df -h /dev/shm | tail -1
L="python3 scripts/bench_launch.py --env benchmark:synthetic_env --actors 128 --warmup 20 --seconds 20 --learner gpu --json"
run() { name=$1; shift; echo "== $name: $*"; timeout 100 $L "$@" | tee "$OUTD/$name.json"; }
run process1 --intake process
run thread1 --intake thread
run process2 --intake process
run thread2 --intake thread
run process_jit --intake process --jit
run process_b128 --intake process --batch-size 128
echo "all took $(( $(date +%s) - t0 )) s"
