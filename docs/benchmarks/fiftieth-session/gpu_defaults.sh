#!/usr/bin/env bash
# Two launcher defaults checked on a GPU learner (fiftieth session; see BENCHMARKS.md): the
# learner's CPU tensors from TensorFlow's pool (TF_CPU_ALLOCATOR_USE_BFC=true, set since the
# forty-seventh session for the CPU learner; false restores malloc) and --param-refresh-lag
# (default 1; the forty-first session's one pair gave lag 8 +11% with --jit). Run on a lent NVIDIA
# machine from the repository root after the thirty-sixth session's pieces' calls
# (../thirty-sixth-session/gpu_check.sh says how; this session cut them at 52 MiB):
#   bash docs/benchmarks/fiftieth-session/gpu_defaults.sh 2>&1 | grep -v -E "^(I0000|W0000|E0000)" | tee $OUT/log
# End to end on synthetic, 128 actors (the launcher's one process per core), --learner gpu --jit,
# a 15-s window after 10 s of warm-up, in the order A B C C B A so drift falls on all three alike.
# A second call on the same warm machine ran base3, lag8_3, lag8_4, base4 instead of the six run
# lines below (the same run settings; its log is gpu_defaults_2.log).
source docs/benchmarks/thirty-sixth-session/gpu_setup.sh > /dev/null || exit $?
git log --oneline -1 2>/dev/null || true
lscpu | grep -E "^(Model name|CPU\(s\))"
L="python3 scripts/bench_launch.py --env benchmark:synthetic_env --actors 128 --warmup 10 --seconds 15 --learner gpu --jit --json"
run() { name=$1; setting=$2; shift 2; echo "== $name: $setting $*"; env "$setting" timeout 90 $L "$@" > "$OUTD/$name.json"
if [ -s "$OUTD/$name.json" ]; then python3 - "$OUTD/$name.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    keys = ("agent_steps_per_s", "learner_steps_per_s", "time_share/wait_batch", "time_share/train",
            "cores_learner", "cores_actors", "cores_machine", "policy_lag_mean", "peak_rss_mb", "error", "stop")
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k in keys})
PY
else echo "no JSON from $name (timed out or failed)"; fi
}
run base1 TF_CPU_ALLOCATOR_USE_BFC=true
run lag8_1 TF_CPU_ALLOCATOR_USE_BFC=true --param-refresh-lag 8
run malloc1 TF_CPU_ALLOCATOR_USE_BFC=false
run malloc2 TF_CPU_ALLOCATOR_USE_BFC=false
run lag8_2 TF_CPU_ALLOCATOR_USE_BFC=true --param-refresh-lag 8
run base2 TF_CPU_ALLOCATOR_USE_BFC=true
echo "all took $(( $(date +%s) - t0 )) s"
