"""Per-thread CPU (us per agent step) and voluntary/involuntary context switches per second of a live synthetic launcher run, over a WIN-second window after WARM seconds (thirty-fourth session; the thirty-third session's thread_cpu.py with the switches, actor threads listed one by one). Extra arguments go to the launcher."""
import glob, json, os, signal, subprocess, sys, time, tempfile, collections
WARM, WIN = float(os.environ.get("WARM", 30)), float(os.environ.get("WIN", 30))
d = tempfile.mkdtemp(prefix="tc_")
cmd = [".venv/bin/python", "-m", "impala_rep.launch", "--env", "benchmark:synthetic_env", "--actors", "32", "--learner", "cpu",
       "--network", "shallow", "--unroll-length", "20", "--batch-size", "32", "--frame-stack", "3", "--no-anneal",
       "--total-steps", "1000000000000", "--log-interval", "1", "--logdir", d + "/run"] + sys.argv[1:]
env = dict(os.environ, PYTHONPATH="scripts:.")
p = subprocess.Popen(cmd, stdout=open(d + "/log.txt", "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
mf = d + "/run/metrics.jsonl"
while not os.path.exists(mf) or os.path.getsize(mf) == 0: time.sleep(1)
time.sleep(WARM)
tck = os.sysconf("SC_CLK_TCK")
def pids():
    out = {p.pid: "learner"}
    for k in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split():
        cl = open(f"/proc/{k}/cmdline", "rb").read()
        if b"actors.run" in cl:
            out[int(k)] = "actorparent"
            try:
                for kk in open(f"/proc/{k}/task/{k}/children").read().split(): out[int(kk)] = "actor"
            except OSError: pass
    return out
def sample():
    res = {}
    for pid, role in pids().items():
        for t in glob.glob(f"/proc/{pid}/task/*"):
            try:
                st = open(t + "/stat").read(); comm = st[st.index("(")+1:st.rindex(")")]
                f = st[st.rindex(")")+2:].split()
                stt = open(t + "/status").read().split("\n")
                vc = int([l for l in stt if l.startswith("voluntary_ctxt")][0].split()[1]); nv = int([l for l in stt if l.startswith("nonvoluntary_ctxt")][0].split()[1])
                res[(role, pid, int(t.rsplit("/",1)[1]), comm)] = ((int(f[11]) + int(f[12])) / tck, vc, nv)
            except OSError: pass
    return res
def steps():
    return json.loads(open(mf).readlines()[-1])
a, s0, t0 = sample(), steps(), time.time()
time.sleep(WIN)
b, s1, t1 = sample(), steps(), time.time()
n = s1["agent_steps"] - s0["agent_steps"]
agg = collections.Counter(); vcs = collections.Counter(); nvs = collections.Counter()
for k in b:
    if k in a:
        role, pid, tid, comm = k
        name = comm.rstrip("0123456789-_") + (f":{tid}" if role != "learner" or comm=="python" else "")
        agg[(role, name)] += b[k][0] - a[k][0]; vcs[(role, name)] += b[k][1]-a[k][1]; nvs[(role, name)] += b[k][2]-a[k][2]
tot = 0
print(f"agent steps/s {n/(s1['time']-s0['time']):.0f}")
for (role, name), c in sorted(agg.items(), key=lambda x: -x[1]):
    if c > 0: print(f"{role:12s} {name:24s} {c/n*1e6:8.1f} us/step  vol/s {vcs[(role,name)]/(t1-t0):8.0f} invol/s {nvs[(role,name)]/(t1-t0):8.0f}"); tot += c
print(f"total {tot/n*1e6:.1f} us/step; wall cores {tot/(t1-t0):.2f}")
os.killpg(p.pid, signal.SIGTERM); p.wait(60)
