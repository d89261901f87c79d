#!/bin/bash
# The actor loop alone against the live actors' main threads, in turn twice (forty-ninth session):
#   bash docs/benchmarks/forty-ninth-session/live_vs_loop.sh > docs/benchmarks/forty-ninth-session/live_vs_loop.txt
set -e
for round in 1 2; do
  echo "== round $round: scripts/bench_actor.py --workload dmc/cartpole-swingup --envs 16 --seconds 24"
  .venv/bin/python scripts/bench_actor.py --workload dmc/cartpole-swingup --envs 16 --seconds 24 2>&1 | grep -v WARNING
  echo "== round $round: live launcher run, per thread (thread_cpu.py, 45 s after 45 s)"
  WARM=45 WIN=45 PER_THREAD=1 .venv/bin/python docs/benchmarks/thirty-third-session/thread_cpu.py \
    --env dmc/cartpole-swingup --env-arg action_repeat=4 --env-arg render=fast --env-arg size=84 2>&1 | head -6
done
