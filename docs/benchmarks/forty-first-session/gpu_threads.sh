#!/usr/bin/env bash
# Where the live actors' CPU goes on the lent H200 machine, thread by thread, with --jit (forty-first
# session; see BENCHMARKS.md). After the thirty-sixth session's pieces' calls:
#   cp .gpu/cu12.04 /tmp/gp/ && bash docs/benchmarks/forty-first-session/gpu_threads.sh 2>&1 | tee $OUT/log
# Two runs of gpu_threads.py (25 s warm-up, a 20-s window): 128 actors as the launcher plans them,
# then the same with --param-refresh-lag 8 (an actor process gets new parameters only when 8 or
# more versions behind), which says what the parameter replies cost the actors and the intake.
source docs/benchmarks/thirty-sixth-session/gpu_setup.sh > /dev/null
export PYTHON=python3
timeout 150 python3 docs/benchmarks/forty-first-session/gpu_threads.py --actors 128 --jit
timeout 150 python3 docs/benchmarks/forty-first-session/gpu_threads.py --actors 128 --jit --param-refresh-lag 8
echo "all took $(( $(date +%s) - t0 )) s"
