"""Per-thread CPU of a live synthetic launcher run, in microseconds per agent step, over a WIN-second window after WARM seconds (thirty-third session). Extra arguments go to the launcher.

PER_THREAD=1 (thirty-fourth session) lists the actor processes' threads, and the learner's Python threads, one by one instead of by name, each with its voluntary and involuntary context switches a second. The functions serve docs/benchmarks/thirty-fourth-session/slice_ab.py too."""
import collections, glob, json, os, signal, subprocess, sys, tempfile, time


def start_launcher(extra):
    """Starts the synthetic launcher run (its own session); returns (process, metrics file) once it has a record."""
    d = tempfile.mkdtemp(prefix="tc_")
    cmd = [".venv/bin/python", "-m", "impala_rep.launch", "--env", "benchmark:synthetic_env", "--actors", "32", "--learner", "cpu",
           "--network", "shallow", "--unroll-length", "20", "--batch-size", "32", "--frame-stack", "3", "--no-anneal",
           "--total-steps", "1000000000000", "--log-interval", "1", "--logdir", d + "/run"] + list(extra)
    env = dict(os.environ, PYTHONPATH="scripts:.")
    p = subprocess.Popen(cmd, stdout=open(d + "/log.txt", "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    mf = d + "/run/metrics.jsonl"
    while not os.path.exists(mf) or os.path.getsize(mf) == 0:
        time.sleep(1)
    return p, mf


def launcher_pids(p):
    """{pid: role} of the launcher ("learner"), its actors.run children ("actorparent") and theirs ("actor")."""
    out = {p.pid: "learner"}
    for k in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split():
        if b"actors.run" in open(f"/proc/{k}/cmdline", "rb").read():
            out[int(k)] = "actorparent"
            try:
                for kk in open(f"/proc/{k}/task/{k}/children").read().split():
                    out[int(kk)] = "actor"
            except OSError:
                pass
    return out


def sample(p):
    """{(role, pid, tid, comm): (CPU seconds, voluntary switches, involuntary switches)} of every thread."""
    tck = os.sysconf("SC_CLK_TCK")
    res = {}
    for pid, role in launcher_pids(p).items():
        for t in glob.glob(f"/proc/{pid}/task/*"):
            try:
                st = open(t + "/stat").read()
                comm = st[st.index("(") + 1:st.rindex(")")]
                f = st[st.rindex(")") + 2:].split()
                switches = {l.split(":")[0]: int(l.split()[1]) for l in open(t + "/status") if "ctxt_switches" in l}
                res[(role, pid, int(t.rsplit("/", 1)[1]), comm)] = (
                    (int(f[11]) + int(f[12])) / tck, switches["voluntary_ctxt_switches"], switches["nonvoluntary_ctxt_switches"])
            except OSError:
                pass
    return res


def stop(p):
    """Stops the launcher run and its actor processes (its session)."""
    os.killpg(p.pid, signal.SIGTERM)
    p.wait(60)


def last_record(mf):
    return json.loads(open(mf).readlines()[-1])


def main():
    warm, win = float(os.environ.get("WARM", 30)), float(os.environ.get("WIN", 30))
    per_thread = os.environ.get("PER_THREAD") == "1"
    p, mf = start_launcher(sys.argv[1:])
    try:
        time.sleep(warm)
        a, s0, t0 = sample(p), last_record(mf), time.time()
        time.sleep(win)
        b, s1, t1 = sample(p), last_record(mf), time.time()
        n = s1["agent_steps"] - s0["agent_steps"]
        cpu, vol, invol = collections.Counter(), collections.Counter(), collections.Counter()
        for k in b:
            if k in a:
                role, pid, tid, comm = k
                name = comm.rstrip("0123456789-_")
                if per_thread and (role != "learner" or comm == "python"):
                    name += f":{tid}"
                cpu[(role, name)] += b[k][0] - a[k][0]
                vol[(role, name)] += b[k][1] - a[k][1]
                invol[(role, name)] += b[k][2] - a[k][2]
        tot = 0
        print(f"agent steps/s {n/(s1['time']-s0['time']):.0f}")
        for key, c in sorted(cpu.items(), key=lambda x: -x[1]):
            if c > 0:
                role, name = key
                line = f"{role:12s} {name:24s} {c/n*1e6:8.1f} us/step"
                if per_thread:
                    line += f"  vol/s {vol[key]/(t1-t0):8.0f} invol/s {invol[key]/(t1-t0):8.0f}"
                print(line)
                tot += c
        print(f"total {tot/n*1e6:.1f} us/step; wall cores {tot/(t1-t0):.2f}")
    finally:
        stop(p)


if __name__ == "__main__":
    main()
