"""The learner step as the launcher builds it (LearnerStep, R CPU replicas, batch B), timed on one
synthetic batch for SECS seconds; prints the step time, frames/s, CPU per step, peak RSS and
page faults. Forty-seventh session. Environment: R (replicas, 2), B (batch, 32), INTRA/INTER
(TensorFlow's pools, 1/2), MODE (full | grads: the replicas' forward/backward only), EXEC or
NESTED (a function executor type for the whole step or for each replica's gradient function),
TF_CPU_ALLOCATOR_USE_BFC (true: TensorFlow's pooling CPU allocator; unset here: malloc).
    R=2 .venv/bin/python docs/benchmarks/forty-seventh-session/learner_step_variants.py
    R=2 TF_CPU_ALLOCATOR_USE_BFC=true .venv/bin/python docs/benchmarks/forty-seventh-session/learner_step_variants.py
"""
import os, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
INTRA=int(os.environ.get("INTRA","1")); INTER=int(os.environ.get("INTER","2")); R=int(os.environ.get("R","2")); B=int(os.environ.get("B","32"))
MODE=os.environ.get("MODE","full")
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(INTRA)
tf.config.threading.set_inter_op_parallelism_threads(INTER)
from impala_rep.replicator import make_replicator
import numpy as np
rep = make_replicator("cpu", num_replicas=R)
from impala_rep.networks import NetworkConfig
from impala_rep.specs import ArraySpec
from learner.probe import synthetic_batch
from learner.step import LearnerStep
obs = {"pixels": ArraySpec("pixels", (84,84,9), "uint8")}
action = ArraySpec("action", (1,), "float32", minimum=-1.0, maximum=1.0)
L = LearnerStep.from_config(rep, NetworkConfig(torso="shallow"), obs, action, 20, B, frame_stack={"pixels":3})
from tensorflow.python.eager import context
if os.environ.get("NESTED"):
    L._grad_fn = tf.function(L._loss_and_grads, autograph=False, experimental_attributes={"_noinline": True})
    orig_grad = L._grad_fn
    class G:
        def __call__(self, b):
            with context.function_executor_type(os.environ["NESTED"]):
                return orig_grad(b)
    L._grad_fn = G()
    L.train_fn = tf.function(L._train, input_signature=L.train_fn.input_signature, autograph=False)
batch = synthetic_batch(L.batch_spec, np.random.default_rng(0))
if MODE == "full":
    def fn():
        if not os.environ.get("EXEC"):
            return L.train(batch)
        with context.function_executor_type(os.environ["EXEC"]):
            return L.train(batch)
else:
    inputs = L._inputs(batch)
    axes = {key: 0 if key.startswith("core_state/") else 1 for key in inputs}
    def g(b):
        def rs(x):
            grads, m = L._grad_fn(x)
            return tf.add_n([tf.reduce_sum(gg) for gg in grads])
        pr = rep.run(rs, (rep.distribute(b, axis=axes),))
        return rep.reduce("sum", pr)
    spec = {k: tf.TensorSpec(v.shape, v.dtype) for k, v in inputs.items()}
    gf = tf.function(g, autograph=False)
    fn = lambda: float(gf(inputs))
for _ in range(3): fn()
n=0; t=time.perf_counter(); c=time.process_time()
while time.perf_counter()-t < float(os.environ.get("SECS","15")): fn(); n+=1
el=time.perf_counter()-t; cpu=time.process_time()-c
import resource; ru=resource.getrusage(resource.RUSAGE_SELF); print("maxrss_mb", ru.ru_maxrss//1024, "minflt", ru.ru_minflt, "nvcsw", ru.ru_nvcsw, "nivcsw", ru.ru_nivcsw)
print(f"R={R} B={B} intra={INTRA} inter={INTER} mode={MODE}: step {1e3*el/n:.1f} ms, fps {20*B*n/el:.0f}, cpu/step {1e3*cpu/n:.1f} ms")
if os.environ.get("INSPECT"):
    cf = L.train_fn.get_concrete_function()
    for op in cf.graph.get_operations():
        if "PartitionedCall" in op.type:
            print(op.name, op.type, op.get_attr("executor_type"), op.get_attr("f").name[:60])
if os.environ.get("INSPECT"):
    for f in cf.graph.as_graph_def().library.function:
        if "loss_and_grads" in f.signature.name:
            print(f.signature.name, dict(f.attr))
