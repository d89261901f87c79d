"""One replica's gradient function (batch 16) called from NT Python threads at once in one
process, for SECS seconds: grads/s, CPU and page faults per call. Forty-seventh session; two of
these processes with NT=1 side by side are the "two processes" comparison.
    NT=2 .venv/bin/python docs/benchmarks/forty-seventh-session/learner_grads_on_threads.py
"""
import os, sys, time, threading
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
EXEC=os.environ.get("EXEC","")  # "" default, or SINGLE_THREADED_EXECUTOR
NT=int(os.environ.get("NT","2")); INTER=int(os.environ.get("INTER","2"))
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(INTER)
from impala_rep.replicator import make_replicator
import numpy as np
rep = make_replicator("cpu", num_replicas=1)
from impala_rep.networks import NetworkConfig
from impala_rep.specs import ArraySpec
from learner.probe import synthetic_batch
from learner.step import LearnerStep
from tensorflow.python.eager import context
obs = {"pixels": ArraySpec("pixels", (84,84,9), "uint8")}
action = ArraySpec("action", (1,), "float32", minimum=-1.0, maximum=1.0)
L = LearnerStep.from_config(rep, NetworkConfig(torso="shallow"), obs, action, 20, 16, frame_stack={"pixels":3})
batch = synthetic_batch(L.batch_spec, np.random.default_rng(0))
inputs = {k: tf.constant(v) for k, v in L._inputs(batch).items()}
gf = tf.function(lambda b: tf.add_n([tf.reduce_sum(g) for g in L._grad_fn(b)[0]]), autograph=False)
def call():
    if EXEC:
        with context.function_executor_type(EXEC):
            return gf(inputs).numpy()
    return gf(inputs).numpy()
for _ in range(2): call()
SECS=float(os.environ.get("SECS","10"))
counts=[0]*NT
def worker(i):
    t=time.perf_counter()
    while time.perf_counter()-t < SECS: call(); counts[i]+=1
import resource
f0=resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t=time.perf_counter(); c=time.process_time()
ths=[threading.Thread(target=worker,args=(i,)) for i in range(NT)]
[x.start() for x in ths]; [x.join() for x in ths]
el=time.perf_counter()-t; cpu=time.process_time()-c
n=sum(counts)
flt=resource.getrusage(resource.RUSAGE_SELF).ru_minflt-f0
print(f"NT={NT} EXEC={EXEC or 'default'} inter={INTER}: grads/s {n/el:.2f}, fps-equiv {320*n/el:.0f}, cpu per grad {1e3*cpu/n:.1f} ms, faults/grad {flt/n:.0f}")
