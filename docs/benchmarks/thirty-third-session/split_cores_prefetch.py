"""Learner on core 0, one actor process on core 1 (as if on hosts of their own): agent steps/s
trained on, with --param-prefetch-steps 0 and 2 alternating. Loopback only, bounded in time."""
import json, os, signal, subprocess, sys, tempfile, time, shutil
ROUNDS = int(os.environ.get("ROUNDS", "3")); WARM = float(os.environ.get("WARM", "25")); WIN = float(os.environ.get("WIN", "40"))
ENV = os.environ.get("ABENV", "dmc/cartpole-swingup")
py = ".venv/bin/python"
env = dict(os.environ, PYTHONPATH="scripts:.", MUJOCO_GL="egl")
out = {0: [], 2: []}
for r in range(ROUNDS):
    for lead in (0, 2):
        d = tempfile.mkdtemp(prefix="split_")
        port = str(50600 + r * 10 + lead)
        L = subprocess.Popen(["taskset", "-c", "0", py, "-m", "learner.run", "--env", ENV, "--learner", "cpu", "--network", "shallow",
                              "--unroll-length", "20", "--batch-size", "32", "--frame-stack", "3", "--no-anneal", "--total-steps", "1000000000000",
                              "--log-interval", "1", "--logdir", d + "/run", "--port", port, "--checkpoint-interval", "100000"],
                             stdout=open(d + "/learner.txt", "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        A = subprocess.Popen(["taskset", "-c", "1", py, "-m", "actors.run", "--learner-address", "127.0.0.1:" + port, "--actors", "16",
                              "--param-prefetch-steps", str(lead)],
                             stdout=open(d + "/actor.txt", "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        mf = d + "/run/metrics.jsonl"; t0 = time.time()
        while (not os.path.exists(mf) or os.path.getsize(mf) == 0) and time.time() - t0 < 300: time.sleep(1)
        time.sleep(WARM + WIN)
        recs = [json.loads(l) for l in open(mf)]
        end = recs[-1]; start = [x for x in recs if x["time"] <= end["time"] - WIN][-1]
        rate = (end["agent_steps"] - start["agent_steps"]) / (end["time"] - start["time"])
        lag = sum(x.get("policy_lag_mean", 0) for x in recs[-5:]) / 5
        wait = end.get("time_share/wait_batch")
        for p in (A, L):
            os.killpg(p.pid, signal.SIGTERM)
        for p in (A, L):
            try: p.wait(60)
            except subprocess.TimeoutExpired: os.killpg(p.pid, signal.SIGKILL); p.wait()
        out[lead].append(round(rate))
        print(f"round {r} prefetch {lead}: {rate:.0f} agent steps/s, learner waiting {wait:.2f}, policy lag {lag:.2f}", flush=True)
        shutil.rmtree(d, ignore_errors=True)
        time.sleep(2)
print(json.dumps(out))
