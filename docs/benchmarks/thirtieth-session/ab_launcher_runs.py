"""A/B launcher runs: python ab_launcher_runs.py NAME:'extra flags' ... ; rounds alternate.

The twenty-eighth session's script, with BASEFLAGS (launcher flags after the synthetic
defaults, e.g. the main job's) and VAR=VALUE tokens among a config's flags setting that run's
environment; it prints each run's full parameter replies over the window. PIN=tf in a
config pins the learner's two tf_Compute threads to cores 0 and 1, PIN=tf,act also actor
process i (all its threads) to core i, 5 s after the first metrics record."""
import json, os, signal, subprocess, sys, time, tempfile, shutil
ROUNDS = int(os.environ.get("ROUNDS", "2")); WARM = float(os.environ.get("WARM", "40")); WIN = float(os.environ.get("WIN", "40"))
ENV = os.environ.get("ABENV", "benchmark:synthetic_env")
configs = [a.split(":", 1) for a in sys.argv[1:]]
results = {n: [] for n, _ in configs}
for r in range(ROUNDS):
    for name, extra in configs:
        d = tempfile.mkdtemp(prefix="ab_")
        cmd = [".venv/bin/python", "-m", "impala_rep.launch", "--env", ENV, "--actors", "32", "--learner", "cpu",
               "--network", "shallow", "--unroll-length", "20", "--batch-size", "32", "--frame-stack", "3", "--no-anneal",
               "--total-steps", "1000000000000", "--no-resume", "--log-interval", "1", "--checkpoint-interval", "10000000",
               "--bind", "127.0.0.1", "--logdir", d + "/run"] + os.environ.get("BASEFLAGS", "").split() + [x for x in extra.split() if "=" not in x or x.startswith("-")]
        env = dict(os.environ, PYTHONPATH="scripts:.", MUJOCO_GL="egl")
        env.update(x.split("=", 1) for x in extra.split() if "=" in x and not x.startswith("-"))
        log = open(d + "/log.txt", "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        mf = d + "/run/metrics.jsonl"
        t0 = time.time()
        while not os.path.exists(mf) or os.path.getsize(mf) == 0:
            time.sleep(1)
            if time.time() - t0 > 300: break
        pin = env.get("PIN", "")
        if pin:
            time.sleep(5)
            import glob
            tasks = {}
            for t in glob.glob(f"/proc/{p.pid}/task/*"):
                try: tasks[int(t.rsplit("/", 1)[1])] = open(t + "/comm").read().strip()
                except OSError: pass
            if "tf" in pin:
                tf = sorted(tid for tid, n in tasks.items() if n.startswith("tf_Compute"))
                print("    tf threads", [(tid, tasks[tid]) for tid in tf], flush=True)
                for i, tid in enumerate(tf):
                    os.sched_setaffinity(tid, {i % 2})
            if "act" in pin:
                kids = [int(x) for x in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()]
                acts = sorted(k for k in kids if b"actors.run" in open(f"/proc/{k}/cmdline", "rb").read())
                print("    actor pids", acts, flush=True)
                for i, a in enumerate(acts):
                    for t in glob.glob(f"/proc/{a}/task/*"):
                        os.sched_setaffinity(int(t.rsplit("/", 1)[1]), {i % 2})
        time.sleep(WARM + WIN)
        recs = [json.loads(l) for l in open(mf)]
        end = recs[-1]; start = [x for x in recs if x["time"] <= end["time"] - WIN][-1]
        rate = (end["agent_steps"] - start["agent_steps"]) / (end["time"] - start["time"])
        ps = [k for k in end if k.endswith("parameters_sent")]
        sent = (end[ps[0]] - start[ps[0]]) if ps else float("nan")
        print(f"    full parameter replies in the window {sent:.0f}", flush=True)
        last = recs[-5:]
        q = sum(x["queue_fill"] for x in last)/len(last); lag = sum(x.get("policy_lag_mean", 0) for x in last)/len(last)
        os.killpg(p.pid, signal.SIGTERM)
        try: p.wait(60)
        except subprocess.TimeoutExpired: os.killpg(p.pid, signal.SIGKILL); p.wait()
        plan = [l.strip() for l in open(d + "/log.txt") if "plan" in l or "learner threads" in l or "replicas" in l][:4]
        results[name].append(round(rate))
        print(f"round {r} {name}: {rate:.0f} agent steps/s, queue {q:.2f}, lag {lag:.1f}", flush=True)
        if r == 0: print("   ", *plan, sep="\n    ", flush=True)
        shutil.rmtree(d, ignore_errors=True)
        time.sleep(3)
print(json.dumps(results))
