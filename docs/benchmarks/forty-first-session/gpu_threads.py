"""Per-thread CPU of a live GPU launcher run, in microseconds per agent step (forty-first session).

Starts `python3 -m impala_rep.launch --env benchmark:synthetic_env --learner gpu` with the extra
arguments given, waits WARM seconds (default 25) after its first metrics record, then samples
every thread of the launcher's process tree (/proc/PID/task/TID/stat) at the start and the end of
a WIN-second window (default 20) and prints, for each role (learner: the launcher's process;
intake: `learner.intake`; actors: `actors.run` processes) and thread name, the CPU per agent step
trained on and the context switches a second. Then stops the run (SIGTERM to its session).
Run from the repository root with PYTHON set to the interpreter (default python3).
"""
import collections, glob, json, os, signal, subprocess, sys, tempfile, time


def tree(root):
    """{pid: role} of root and its descendants."""
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            kids = [int(k) for t in glob.glob(f"/proc/{pid}/task/*") for k in open(t + "/children").read().split()]
        except OSError:
            continue
        out[pid] = "intake" if b"learner.intake" in cmd else "actors" if b"actors.run" in cmd else "learner" if pid == root else "other"
        todo += kids
    return out


def sample(root):
    tck = os.sysconf("SC_CLK_TCK")
    res = {}
    for pid, role in tree(root).items():
        for t in glob.glob(f"/proc/{pid}/task/*"):
            try:
                st = open(t + "/stat").read()
                comm = st[st.index("(") + 1:st.rindex(")")]
                f = st[st.rindex(")") + 2:].split()
                sw = {l.split(":")[0]: int(l.split()[1]) for l in open(t + "/status") if "ctxt_switches" in l}
                res[(role, pid, int(t.rsplit("/", 1)[1]), comm)] = (
                    (int(f[11]) + int(f[12])) / tck, sw["voluntary_ctxt_switches"], sw["nonvoluntary_ctxt_switches"])
            except (OSError, ValueError, KeyError):
                pass
    return res


def main():
    warm, win = float(os.environ.get("WARM", 25)), float(os.environ.get("WIN", 20))
    d = tempfile.mkdtemp(prefix="gt_")
    cmd = [os.environ.get("PYTHON", "python3"), "-m", "impala_rep.launch", "--env", "benchmark:synthetic_env",
           "--learner", os.environ.get("LEARNER", "gpu"), "--total-steps", "1000000000000", "--log-interval", "1", "--no-resume",
           "--checkpoint-interval", "never", "--logdir", d + "/run"] + sys.argv[1:]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["scripts", ".", os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen(cmd, stdout=open(d + "/log.txt", "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    mf = d + "/run/metrics.jsonl"
    try:
        t_end = time.time() + 240
        while not os.path.exists(mf) or os.path.getsize(mf) == 0:
            if p.poll() is not None or time.time() > t_end:
                print(open(d + "/log.txt").read()[-3000:]); return 1
            time.sleep(1)
        time.sleep(warm)
        last = lambda: json.loads(open(mf).readlines()[-1])
        a, r0, t0 = sample(p.pid), last(), time.time()
        time.sleep(win)
        b, r1, t1 = sample(p.pid), last(), time.time()
        n = r1["agent_steps"] - r0["agent_steps"]
        cpu, vol, inv, count = (collections.Counter() for _ in range(4))
        for k, v in b.items():
            if k in a:
                key = (k[0], k[3].rstrip("0123456789-_:") or k[3])
                cpu[key] += v[0] - a[k][0]; vol[key] += v[1] - a[k][1]; inv[key] += v[2] - a[k][2]; count[key] += 1
        print(f"{' '.join(sys.argv[1:])}: agent steps/s {n / (r1['time'] - r0['time']):.0f}, learner steps/s "
              f"{r1.get('learner_steps_per_s', 0):.1f}, wall {t1 - t0:.1f} s")
        by_role = collections.Counter()
        for key, c in sorted(cpu.items(), key=lambda x: -x[1]):
            by_role[key[0]] += c
            if c / n * 1e6 >= 0.5:
                print(f"  {key[0]:8s} {key[1]:20s} x{count[key]:<4d} {c / n * 1e6:8.1f} us/step  cores {c / (t1 - t0):5.2f}"
                      f"  vol/s {vol[key] / (t1 - t0):8.0f}  invol/s {inv[key] / (t1 - t0):8.0f}")
        print("  by role: " + ", ".join(f"{r} {c / n * 1e6:.1f} us/step ({c / (t1 - t0):.2f} cores)" for r, c in by_role.most_common()))
    finally:
        try:
            os.killpg(p.pid, signal.SIGTERM); p.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(p.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
