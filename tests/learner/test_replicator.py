"""Tests of the replicator core (impala_rep.replicator) on logical CPU devices.

The conftest gives this pytest process 4 logical CPU devices; tests that need a different
process state (devices not yet initialised, or initialised with fewer) run a subprocess.
"""

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from impala_rep.replicator import (
    BATCH_AXIS,
    Replicator,
    ReplicatorError,
    make_replicator,
    parse_cluster_spec,
)

REPO = Path(__file__).resolve().parents[2]


def _one_sentence(message: str) -> None:
    assert "\n" not in message and "Traceback" not in message
    assert message.rstrip().endswith("."), message


@pytest.fixture(scope="module", params=[1, 2, 4])
def replicator(request):
    return make_replicator("cpu", num_replicas=request.param)


def _per_replica(replicator, value):
    return [t.numpy() for t in replicator.local_results(value)]


def test_cpu_replicator_has_the_devices_asked_for(replicator):
    assert isinstance(replicator, Replicator)
    assert replicator.kind == "cpu"
    assert len(replicator.devices) == replicator.num_replicas
    assert all("CPU" in d for d in replicator.devices)


def test_distribute_splits_the_batch_axis_in_replica_order(replicator):
    n = replicator.num_replicas
    x = np.arange(3 * 8 * 2, dtype=np.float32).reshape(3, 8, 2)  # [T+1, B, 2]
    shards = _per_replica(replicator, replicator.distribute({"x": x}, axis=1)["x"])
    assert len(shards) == n
    for r, shard in enumerate(shards):
        np.testing.assert_array_equal(shard, x[:, r * 8 // n:(r + 1) * 8 // n])


def test_distribute_gives_each_replica_its_slice_on_every_axis(replicator):
    """Per-entry axes (0, 1 and a negative one), eagerly and inside tf.function."""
    n = replicator.num_replicas
    batch = {
        "obs": np.arange(3 * 4 * n * 5, dtype=np.uint8).reshape(3, 4 * n, 5),
        "state": np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3),
        "last": np.arange(2 * 3 * n, dtype=np.int32).reshape(2, 3 * n),
    }
    axes = {"obs": 1, "state": 0, "last": -1}
    expected = [
        {
            "obs": batch["obs"][:, 4 * r:4 * (r + 1)],
            "state": batch["state"][2 * r:2 * (r + 1)],
            "last": batch["last"][:, 3 * r:3 * (r + 1)],
        }
        for r in range(n)
    ]

    @tf.function
    def traced(b):
        return replicator.run(lambda shard: shard, (replicator.distribute(b, axis=axes),))

    for dist in (replicator.distribute(batch, axis=axes), traced(batch)):
        for key in batch:
            shards = _per_replica(replicator, dist[key])
            assert len(shards) == n
            for r, shard in enumerate(shards):
                assert shard.dtype == batch[key].dtype
                np.testing.assert_array_equal(shard, expected[r][key])


def test_collectives_give_documented_values_on_every_replica(replicator):
    n = replicator.num_replicas

    @tf.function
    def collectives():
        def step():
            r = replicator.replica_id()
            v = tf.cast(r, tf.float32) + 1.0  # replica r holds r + 1
            vec = tf.stack([v, -v])           # [2]
            return {
                "id": r,
                "sum": replicator.all_reduce(v, "sum", axis_name=BATCH_AXIS),
                "mean": replicator.all_reduce(v, "mean"),
                "max": replicator.all_reduce(v, "max"),
                "min": replicator.all_reduce(vec, "min"),
                "gather": replicator.all_gather(v),
                "gather_vec": replicator.all_gather(vec, axis=0),
                "bcast_last": replicator.broadcast(vec, source=n - 1),
                "bcast_int": replicator.broadcast(r * 10 + 7, source=0),
            }

        return replicator.run(step)

    out = collectives()
    ones_to_n = np.arange(1, n + 1, dtype=np.float32)
    np.testing.assert_array_equal(_per_replica(replicator, out["id"]), np.arange(n))
    for key, expected in [
        ("sum", ones_to_n.sum()),
        ("mean", ones_to_n.mean()),
        ("max", float(n)),
        ("min", np.array([1.0, -float(n)], np.float32)),
        ("gather", ones_to_n),
        ("gather_vec", np.stack([ones_to_n, -ones_to_n], 1).ravel()),
        ("bcast_last", np.array([n, -n], np.float32)),
        ("bcast_int", 7),
    ]:
        values = _per_replica(replicator, out[key])
        assert len(values) == n
        for r, value in enumerate(values):
            np.testing.assert_array_equal(value, expected, err_msg=f"{key} on replica {r}")


def test_wrap_optimizer_sums_gradients_and_clips_the_sum(replicator):
    n = replicator.num_replicas
    with replicator.scope():
        var = tf.Variable([0.0, 0.0])
        plain = replicator.wrap_optimizer(tf_keras.optimizers.SGD(1.0))
        clipped = replicator.wrap_optimizer(tf_keras.optimizers.SGD(1.0), clip_norm=1.0)
        for opt in (plain, clipped):
            opt.optimizer.build([var])  # slots are created in the scope, not in tf.function

    @tf.function
    def apply(opt):
        def step():
            g = tf.cast(replicator.replica_id(), tf.float32) + 1.0
            return opt.apply_gradients([(tf.stack([g, 0.0]), var)])

        return replicator.run(step)

    norms = _per_replica(replicator, apply(plain))
    total = n * (n + 1) / 2  # sum over replicas of (r + 1)
    np.testing.assert_allclose(norms, total)
    for copy in _per_replica(replicator, var):
        np.testing.assert_allclose(copy, [-total, 0.0])
    apply(clipped)  # the summed gradient [total, 0] clipped to norm 1
    for copy in _per_replica(replicator, var):
        np.testing.assert_allclose(copy, [-total - 1.0, 0.0], rtol=1e-6)


def test_reduce_in_cross_replica_context(replicator):
    n = replicator.num_replicas
    per_replica = replicator.run(lambda: tf.cast(replicator.replica_id(), tf.float32))
    assert float(replicator.reduce("sum", per_replica)) == n * (n - 1) / 2
    assert float(replicator.reduce("mean", per_replica)) == (n - 1) / 2
    with pytest.raises(ValueError, match="reduction op"):
        replicator.reduce("max", per_replica)


def test_indivisible_batch_names_the_fix():
    replicator = make_replicator("cpu", num_replicas=4)
    with pytest.raises(ValueError) as err:
        replicator.distribute({"reward": np.zeros((21, 6), np.float32)}, axis=1)
    message = str(err.value)
    _one_sentence(message)
    assert "'reward'" in message and "not divisible by the 4 replicas" in message and "multiple of 4" in message
    with pytest.raises(ValueError, match="no axis 1"):
        replicator.distribute(np.zeros(8, np.float32), axis=1)


def test_collective_misuse_is_reported():
    replicator = make_replicator("cpu", num_replicas=2)
    with pytest.raises(RuntimeError, match="inside the step function"):
        replicator.all_reduce(tf.constant(1.0))
    with pytest.raises(ValueError, match="unknown replica axis 'model'"):
        replicator.run(lambda: replicator.all_reduce(tf.constant(1.0), axis_name="model"))
    with pytest.raises(ValueError, match="must be one of"):
        replicator.run(lambda: replicator.all_reduce(tf.constant(1.0), op="prod"))
    with pytest.raises(ValueError, match="source must be a replica index"):
        replicator.run(lambda: replicator.broadcast(tf.constant(1.0), source=2))


def test_bad_kind_and_counts():
    with pytest.raises(ValueError, match="unknown replicator kind 'fpga'"):
        make_replicator("fpga")
    with pytest.raises(ValueError, match="at least 1"):
        make_replicator("cpu", num_replicas=0)
    with pytest.raises(TypeError, match="must be an int"):
        make_replicator("cpu", num_replicas=2.0)


def test_auto_falls_back_to_cpu_without_accelerators():
    if tf.config.list_physical_devices("GPU") or tf.config.list_physical_devices("TPU"):
        pytest.skip("this host has an accelerator")
    replicator = make_replicator("auto", num_replicas=2)
    assert replicator.kind == "cpu" and replicator.num_replicas == 2


def test_gpu_without_gpu_is_one_sentence():
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this host has a GPU")
    with pytest.raises(ReplicatorError) as err:
        make_replicator("gpu")
    _one_sentence(str(err.value))
    assert "no GPU is visible" in str(err.value) and "kind='cpu'" in str(err.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tpu_without_tpu_is_one_sentence():
    if tf.config.list_physical_devices("TPU"):
        pytest.skip("this host has a TPU")
    with pytest.raises(ReplicatorError) as err:
        make_replicator("tpu")
    _one_sentence(str(err.value))
    assert "no TPU is attached" in str(err.value)
    address = f"grpc://127.0.0.1:{_free_port()}"  # nothing listens there
    with pytest.raises(ReplicatorError) as err:
        make_replicator("tpu", tpu=address)
    _one_sentence(str(err.value))
    assert "cannot be reached" in str(err.value) and address in str(err.value)


def test_tpu_name_that_cannot_be_looked_up_is_one_sentence(monkeypatch):
    # A TPU name (not grpc://HOST:PORT) is resolved through the cloud's metadata server; off the
    # cloud urllib raises URLError (an OSError), which came out as a traceback.
    import urllib.error

    def unreachable(*args, **kwargs):
        raise urllib.error.URLError(OSError(-2, "Name or service not known"))

    monkeypatch.setattr(tf.distribute.cluster_resolver, "TPUClusterResolver", unreachable)
    with pytest.raises(ReplicatorError) as err:
        make_replicator("tpu", tpu="my-tpu")
    _one_sentence(str(err.value))
    assert "'my-tpu' could not be initialised" in str(err.value) and "metadata server" in str(err.value)
    assert "tpu='grpc://HOST:PORT'" in str(err.value)


GOOD_CLUSTER = {"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "task": {"type": "worker", "index": 1}}


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("{not json", "not valid JSON"),
        ([1, 2], "must be a mapping"),
        ({"task": {"type": "worker", "index": 0}}, "no 'cluster' mapping"),
        ({"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}}, "non-empty 'worker' list"),
        ({"cluster": {"worker": ["localhost"]}, "task": {"type": "worker", "index": 0}}, "is not host:port"),
        ({"cluster": {"worker": ["h:99999"]}, "task": {"type": "worker", "index": 0}}, "is not host:port"),
        ({"cluster": {"worker": ["h:1"], "ps": ["h:2"]}, "task": {"type": "worker", "index": 0}}, "job 'ps'"),
        ({"cluster": {"worker": ["h:1"]}}, "needs a 'task'"),
        ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 1}}, "task index 1"),
        ({"cluster": {"worker": ["h:1"]}, "task": {"type": "chief", "index": 0}}, "task type 'chief'"),
    ],
)
def test_malformed_cluster_spec_is_one_sentence(spec, fragment):
    with pytest.raises(ValueError) as err:
        make_replicator("multiworker", cluster=spec if isinstance(spec, str) else json.dumps(spec) if isinstance(spec, list) else spec)
    _one_sentence(str(err.value))
    assert fragment in str(err.value)


def test_cluster_spec_from_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="set the TF_CONFIG environment variable"):
        parse_cluster_spec(None)
    monkeypatch.setenv("TF_CONFIG", json.dumps(GOOD_CLUSTER))
    assert parse_cluster_spec(None) == GOOD_CLUSTER


SUBPROCESS = textwrap.dedent(
    """
    import sys
    from impala_rep.replicator import make_replicator, ReplicatorError
    # Devices not yet initialised: the replicator configures 3 logical CPUs.
    print("replicas", make_replicator("cpu", num_replicas=3).num_replicas)
    try:
        make_replicator("cpu", num_replicas=5)   # TF is initialised now, with 3
    except ReplicatorError as exc:
        print("error", exc)
    print("fewer ok", make_replicator("cpu", num_replicas=2).num_replicas)
    """
)


def test_too_many_logical_cpus_after_initialisation_names_the_fix():
    proc = subprocess.run(
        [sys.executable, "-c", SUBPROCESS], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    lines = [l for l in proc.stdout.splitlines() if l.split(" ", 1)[0] in ("replicas", "error", "fewer")]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert lines[0] == "replicas 3"
    message = lines[1][len("error "):]
    _one_sentence(message)
    assert "already initialised 3 logical CPU device(s)" in message
    assert "before TensorFlow initialises" in message and "restart the process" in message
    assert lines[2] == "fewer ok 2"


THREADS_SUBPROCESS = """
import tensorflow as tf
from learner.run import configure_threads
configure_threads({threads}, {replicas})
print("threads", tf.config.threading.get_intra_op_parallelism_threads(),
      tf.config.threading.get_inter_op_parallelism_threads())
"""


@pytest.mark.parametrize("threads, replicas, intra, inter", [(2, 2, 1, 2), (2, 1, 2, 2), (1, 1, 1, 1), (4, 2, 2, 2)])
def test_cpu_replicas_split_the_learner_threads(threads, replicas, intra, inter):
    """Each CPU replica's ops get threads / replicas threads, and the replicas run side by side
    (inter-op threads): 2 one-thread replicas ran the shallow step 1.94x faster than 1 replica
    on 1 thread, 1 replica on 2 threads only 1.30-1.47x (docs/BENCHMARKS.md)."""
    code = THREADS_SUBPROCESS.format(threads=threads, replicas=replicas)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [l for l in proc.stdout.splitlines() if l.startswith("threads ")] == [f"threads {intra} {inter}"]
