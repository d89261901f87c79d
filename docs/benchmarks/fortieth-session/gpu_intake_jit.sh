#!/usr/bin/env bash
# The second call (fortieth session): XLA (--jit) with the intake in the learner's process and
# in a child process, on the same warm machine right after gpu_intake.sh.
source docs/benchmarks/thirty-sixth-session/gpu_setup.sh > /dev/null
L="python3 scripts/bench_launch.py --env benchmark:synthetic_env --actors 128 --warmup 20 --seconds 20 --learner gpu --json"
run() { name=$1; shift; echo "== $name: $*"; timeout 100 $L "$@" | tee "$OUTD/$name.json"; }
run thread_jit --intake thread --jit
run process_jit2 --intake process --jit
echo "all took $(( $(date +%s) - t0 )) s"
