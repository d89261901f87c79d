#!/bin/bash
# Forty-seventh session. usage: live_learner_faults.sh LABEL [ENV=VAL ...]: a synthetic launcher run;
# the learner process's page faults per agent step and the agent steps/s over 40 s after 50 s.
#   bash docs/benchmarks/forty-seventh-session/live_learner_faults.sh malloc TF_CPU_ALLOCATOR_USE_BFC=false   # the launcher sets true where unset since 902af36
#   bash docs/benchmarks/forty-seventh-session/live_learner_faults.sh pool TF_CPU_ALLOCATOR_USE_BFC=true
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/live_faults}; mkdir -p "$OUT"
label=$1; shift
rm -rf $OUT/live_$label
env "$@" PYTHONPATH=scripts timeout 110 .venv/bin/python -m impala_rep.launch --env benchmark:synthetic_env --actors 32 --learner cpu --no-anneal --total-steps 1000000000 --logdir $OUT/live_$label --log-interval 1 --bind 127.0.0.1 > $OUT/live_$label.log 2>&1 &
sleep 50
P=$(pgrep -f "^.venv/bin/python -m impala_rep.launch" | head -1)
f() { awk '{print $10}' /proc/$P/stat; }
st() { tail -1 $OUT/live_$label/metrics.jsonl | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print(d["agent_steps"], d["time"])'; }
a=$(f); s0=$(st); sleep 40; b=$(f); s1=$(st)
python3 -c "
a0,t0='$s0'.split(); a1,t1='$s1'.split()
print('$label', 'faults/agent step %.1f' % (($b-$a)/(int(a1)-int(a0))), 'rate %.0f' % ((int(a1)-int(a0))/(float(t1)-float(t0))))"
wait
