"""Process CPU and wall time per frame of the replicated learner step (train_and_read) on synthetic 84x84x3 batches stacked 3 deep (thirty-fourth session).

argv: NOSPIN REPLICAS BATCH STEPS. NOSPIN 1 sets ConfigProto.experimental.disable_thread_spinning through the eager context's private _config before TensorFlow initialises. REPO (environment): the checkout to import."""
import sys, time, os
sys.path.insert(0, os.environ.get("REPO", "/work/main"))
nospin, replicas, B, N = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
import numpy as np, tensorflow as tf
if nospin:
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context
    cfg = config_pb2.ConfigProto(); cfg.experimental.disable_thread_spinning = True
    context.context()._config = cfg
from learner.run import configure_threads
configure_threads(replicas, replicas)
from impala_rep.replicator import make_replicator
rep = make_replicator("cpu", num_replicas=replicas)
from impala_rep.networks import NetworkConfig
from impala_rep.specs import ArraySpec
from learner.probe import synthetic_batch
from learner.step import LearnerStep
obs = {"pixels": ArraySpec("pixels", (84, 84, 9), "uint8")}
action = ArraySpec("action", (1,), "float32", minimum=-1.0, maximum=1.0)
L = LearnerStep.from_config(rep, NetworkConfig(torso="shallow"), obs, action, 20, B, frame_stack={"pixels": 3})
batch = synthetic_batch(L.batch_spec, np.random.default_rng(0))
for _ in range(5): L.train_and_read(batch)
t, c = time.perf_counter(), time.process_time()
for _ in range(N): L.train_and_read(batch)
t, c = time.perf_counter() - t, time.process_time() - c
print(f"nospin={nospin} replicas={replicas} B={B}: step {t/N*1e3:.1f} ms wall, CPU/frame {c/(N*20*B)*1e6:.1f} us, wall cores {c/t:.2f}, {tf.config.threading.get_inter_op_parallelism_threads()}")
