#!/usr/bin/env bash
# What limits the GPU learner's run once XLA makes the learner fast: the actors (forty-first
# session; see BENCHMARKS.md). Run on a lent NVIDIA machine from the repository root after the
# thirty-sixth session's pieces' calls (../thirty-sixth-session/gpu_check.sh says how):
#   cp .gpu/cu12.04 /tmp/gp/ && bash docs/benchmarks/forty-first-session/gpu_actors.sh 2>&1 | tee $OUT/log
# 1. The host's CPU (lscpu) and the actor loop's CPU per agent step there (scripts/bench_actor.py,
#    synthetic, no gRPC): one loop alone, then 8 and 16 loops at once (how the cores scale).
# 2. End to end on synthetic with --jit (the intake in its own process, the GPU default), a
#    20-s window after 20 s of warm-up each: the launcher's plan for 128 actors (one process per
#    core), then other splits of actors over processes.
source docs/benchmarks/thirty-sixth-session/gpu_setup.sh > /dev/null
lscpu | grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|CPU max MHz|L2|L3)"
A="python3 scripts/bench_actor.py --workload synthetic --seconds 4 --json"
J=/tmp/actor_json; mkdir -p $J  # not $OUT: the device tool returns a limited number of files
for n in 1 8 16; do
  echo "== bench_actor x$n (16 envs each)"
  for i in $(seq $n); do $A --envs 16 > "$J/actor_x${n}_$i.json" & done; wait
  python3 - "$J" "$n" <<'PY'
import json, sys
rows = [json.load(open(f"{sys.argv[1]}/actor_x{sys.argv[2]}_{i}.json")) for i in range(1, int(sys.argv[2]) + 1)]
loop = [r["loop_ms_per_step"] for r in rows]
print(f"loops {len(rows)}: loop ms/agent step min {min(loop):.4f} mean {sum(loop)/len(loop):.4f} max {max(loop):.4f};"
      f" inference {sum(r['inference_ms_per_step'] for r in rows)/len(rows):.4f}")
PY
done
L="python3 scripts/bench_launch.py --env benchmark:synthetic_env --warmup 20 --seconds 20 --learner gpu --jit --json"
run() { name=$1; shift; echo "== $name: $*"; timeout 110 $L "$@" > "$OUTD/$name.json"; python3 - "$OUTD/$name.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    keys = ("actors", "agent_steps_per_s", "learner_steps_per_s", "time_share/wait_batch", "time_share/train",
            "time_share/publish", "cores_learner", "cores_actors", "cores_machine", "policy_lag_mean", "plan")
    print({k: r.get(k) for k in keys if k in r})
PY
}
run jit_128 --actors 128
run jit_256 --actors 256
run jit_128_p12 --actors 128 --actor-processes 12
run jit_192_p12 --actors 192 --actor-processes 12
echo "all took $(( $(date +%s) - t0 )) s"
