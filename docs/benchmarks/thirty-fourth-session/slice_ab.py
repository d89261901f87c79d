"""Live synthetic launcher run; alternating windows with per-task EEVDF slices (sched_attr.sched_runtime) set on the
actor processes' / learner's threads. Env: ACTOR_SLICE_MS, LEARNER_SLICE_MS (0 = leave default), WARM, WIN, ROUNDS."""
import ctypes, glob, json, os, signal, subprocess, sys, time, tempfile, collections
WARM, WIN, ROUNDS = float(os.environ.get("WARM", 30)), float(os.environ.get("WIN", 20)), int(os.environ.get("ROUNDS", 3))
AS, LS = float(os.environ.get("ACTOR_SLICE_MS", 0)), float(os.environ.get("LEARNER_SLICE_MS", 0))
libc = ctypes.CDLL(None, use_errno=True)
class Attr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32), ("flags", ctypes.c_uint64), ("nice", ctypes.c_int32),
                ("prio", ctypes.c_uint32), ("runtime", ctypes.c_uint64), ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64),
                ("umin", ctypes.c_uint32), ("umax", ctypes.c_uint32)]
def set_slice(tid, ms):
    a = Attr(); a.size = ctypes.sizeof(Attr)
    r = libc.syscall(315, tid, ctypes.byref(a), ctypes.sizeof(Attr), 0)  # sched_getattr
    if r != 0: return False
    a.runtime = int(ms * 1e6); a.flags = 0
    r = libc.syscall(314, tid, ctypes.byref(a), 0)  # sched_setattr
    if r != 0: print("setattr", tid, ctypes.get_errno()); return False
    return True
d = tempfile.mkdtemp(prefix="sl_")
cmd = [".venv/bin/python", "-m", "impala_rep.launch", "--env", "benchmark:synthetic_env", "--actors", "32", "--learner", "cpu",
       "--network", "shallow", "--unroll-length", "20", "--batch-size", "32", "--frame-stack", "3", "--no-anneal",
       "--total-steps", "1000000000000", "--log-interval", "1", "--logdir", d + "/run"] + sys.argv[1:]
env = dict(os.environ, PYTHONPATH="scripts:.")
p = subprocess.Popen(cmd, stdout=open(d + "/log.txt", "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
mf = d + "/run/metrics.jsonl"
while not os.path.exists(mf) or os.path.getsize(mf) == 0: time.sleep(1)
time.sleep(WARM)
def pids():
    out = {p.pid: "learner"}
    for k in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split():
        if b"actors.run" in open(f"/proc/{k}/cmdline", "rb").read():
            out[int(k)] = "actor"
            try:
                for kk in open(f"/proc/{k}/task/{k}/children").read().split(): out[int(kk)] = "actor"
            except OSError: pass
    return out
def apply(on):
    n = 0
    for pid, role in pids().items():
        ms = (AS if role == "actor" else LS) if on else 0
        if (AS if role == "actor" else LS) == 0: continue
        for t in glob.glob(f"/proc/{pid}/task/*"):
            n += set_slice(int(t.rsplit("/", 1)[1]), ms if on else 0)
    return n
def ctx():
    s = collections.Counter()
    for pid, role in pids().items():
        for t in glob.glob(f"/proc/{pid}/task/*"):
            try:
                for l in open(t + "/status"):
                    if l.startswith("nonvoluntary_ctxt"): s[role] += int(l.split()[1])
            except OSError: pass
    return s
def last(): return json.loads(open(mf).readlines()[-1])
res = collections.defaultdict(list)
for r in range(ROUNDS):
    for on in (False, True):
        apply(on); time.sleep(2)
        a, c0 = last(), ctx(); time.sleep(WIN); b, c1 = last(), ctx()
        rate = (b["agent_steps"] - a["agent_steps"]) / (b["time"] - a["time"])
        res[on].append(rate)
        print(f"round {r} slice {'on ' if on else 'off'} {rate:7.0f} agent steps/s  invol/s actor {(c1['actor']-c0['actor'])/WIN:5.0f} learner {(c1['learner']-c0['learner'])/WIN:5.0f}", flush=True)
for on in (False, True): print("on" if on else "off", " ".join(f"{x:.0f}" for x in res[on]), f"mean {sum(res[on])/len(res[on]):.0f}")
os.killpg(p.pid, signal.SIGTERM); p.wait(60)
