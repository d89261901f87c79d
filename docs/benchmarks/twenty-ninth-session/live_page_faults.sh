#!/bin/bash
# Page faults and CPU per agent step of the learner and each actor process in a live synthetic
# launcher run (twenty-ninth session). Run from the repo root:
#   bash docs/benchmarks/twenty-ninth-session/live_page_faults.sh system   # glibc's defaults
#   bash docs/benchmarks/twenty-ninth-session/live_page_faults.sh reuse    # freed memory kept mapped
# "reuse" sets glibc's MALLOC_MMAP_THRESHOLD_ (32 MiB) and MALLOC_TRIM_THRESHOLD_ (128 MiB) for the
# launcher, which its actor processes inherit (the session measured it with an uncommitted
# --malloc flag that did the same with mallopt). Samples 20 s after 45 s of training.
set -eu
MODE=${1:?system or reuse}
EXTRA=()
[ "$MODE" = reuse ] && EXTRA=(MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=134217728)
rm -rf /tmp/frun
env "${EXTRA[@]}" PYTHONPATH=scripts .venv/bin/python -m impala_rep.launch --env benchmark:synthetic_env \
    --actors 32 --learner cpu --network shallow --unroll-length 20 --batch-size 32 --frame-stack 3 --no-anneal \
    --total-steps 1000000000000 --no-resume --logdir /tmp/frun --log-interval 1 --checkpoint-interval 10000000 \
    --bind 127.0.0.1 > /tmp/frun.log 2>&1 &
L=$!
sleep 45
python3 - $L <<'PY'
import os, sys, time, json
L = sys.argv[1]
kids = [p for p in os.listdir('/proc') if p.isdigit() and b'actors.run' in open(f'/proc/{p}/cmdline', 'rb').read()]
pids = [L] + kids
def st(p):
    f = open(f'/proc/{p}/stat').read(); f = f[f.rindex(')') + 2:].split()
    return int(f[7]), (int(f[11]) + int(f[12])) / os.sysconf('SC_CLK_TCK')
def steps():
    r = json.loads(open('/tmp/frun/metrics.jsonl').readlines()[-1]); return r['agent_steps'], r['time']
a = {p: st(p) for p in pids}; s0 = steps(); time.sleep(20); b = {p: st(p) for p in pids}; s1 = steps()
n = s1[0] - s0[0]
print('agent steps/s', round(n / (s1[1] - s0[1])))
for p in pids:
    print(p, 'learner' if p == L else 'actor', 'faults per agent step %.2f' % ((b[p][0] - a[p][0]) / n),
          'CPU ms per agent step %.4f' % (1e3 * (b[p][1] - a[p][1]) / n))
PY
kill -TERM $L; wait $L || true
