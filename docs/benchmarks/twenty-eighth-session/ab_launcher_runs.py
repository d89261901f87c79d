"""A/B launcher runs on synthetic: python ab.py NAME:'extra flags' ... ; rounds alternate."""
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
               "--bind", "127.0.0.1", "--logdir", d + "/run"] + extra.split()
        env = dict(os.environ, PYTHONPATH="scripts:.", MUJOCO_GL="egl")
        log = open(d + "/log.txt", "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        mf = d + "/run/metrics.jsonl"
        t0 = time.time()
        while not os.path.exists(mf) or os.path.getsize(mf) == 0:
            time.sleep(1)
            if time.time() - t0 > 300: break
        time.sleep(WARM + WIN)
        recs = [json.loads(l) for l in open(mf)]
        end = recs[-1]; start = [x for x in recs if x["time"] <= end["time"] - WIN][-1]
        rate = (end["agent_steps"] - start["agent_steps"]) / (end["time"] - start["time"])
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
