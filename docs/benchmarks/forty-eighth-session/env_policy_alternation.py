#!/usr/bin/env python
"""What an actor process's env and policy cost each other by running in turn on one thread.

The benchmark's ceiling times the env (steps back to back) and the policy (calls back to
back) each alone; an actor process alternates them: 16 env steps, one policy call, 16 env
steps, ... This script times, on one thread with the actors' thread settings, each part
right after the other part ("policy>env": the env's 16 steps right after a policy call) or
right after itself ("env>env"), or right after writing N MB of other memory ("ev16>env"),
the conditions in turn at a fine grain so that the host's drift touches them alike.
CPU ms per agent step (thread time) and minor page faults per agent step.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 LP_NUM_THREADS=0 \
        .venv/bin/python docs/benchmarks/forty-eighth-session/env_policy_alternation.py 16 120
"""
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]
os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402

import envs as envs_lib  # noqa: E402
from bench_actor import env_and_inference_parts  # noqa: E402
from benchmark import WORKLOADS, actor_network  # noqa: E402
from impala_rep.specs import env_spec_from_dm_env  # noqa: E402

n = int(sys.argv[1]) if len(sys.argv) > 1 else 16
secs = float(sys.argv[2]) if len(sys.argv) > 2 else 60
w = WORKLOADS["dmc/cartpole-swingup"]
env_list = [envs_lib.make(w.env_id, seed=i, **w.env_kwargs) for i in range(n)]
spec = env_spec_from_dm_env(env_list[0])
frame_stack, _, network, policy = actor_network(spec)
step_envs, infer = env_and_inference_parts(env_list, spec, frame_stack, network, policy, np.random.default_rng(0))
sizes = [1, 4, 16]
bufs = {m: np.ones(m * (1 << 20) // 8) for m in sizes}
before = {"env": step_envs, "policy": infer}
for m in sizes:
    before[f"ev{m}"] = (lambda b: (lambda: np.add(b, 1.0, out=b)))(bufs[m])
keys = ["env>env", "policy>env"] + [f"ev{m}>env" for m in sizes]
keys += ["policy>policy", "env>policy"] + [f"ev{m}>policy" for m in sizes]
acc = {k: [0.0, 0, 0] for k in keys}
infer(), step_envs()  # warm-up
t0, i = time.perf_counter(), 0
while time.perf_counter() - t0 < secs:
    key = keys[i % len(keys)]
    first_part, timed_part = key.split(">")
    before[first_part]()
    faults0, cpu0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time()
    before[timed_part]()
    a = acc[key]
    a[0] += time.thread_time() - cpu0
    a[1] += n
    a[2] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    i += 1
print(f"dmc/cartpole-swingup, {n} envs, {secs:g} s; CPU ms per agent step of the part after '>', after the part before it")
for key, (cpu, steps, faults) in acc.items():
    print(f"  {key:14s} {1e3 * cpu / steps:.3f}  faults/agent step {faults / steps:.2f}  ({steps // n} calls)")
