"""The learner-step probe (learner.probe): what the launcher sizes a CPU learner's threads by."""

import os

import numpy as np
import pytest

from impala_rep.config import RunConfig
from learner.probe import probe_learner_cost, synthetic_batch, time_learner_step


@pytest.fixture(scope="module")
def catch_spec():
    import envs
    from impala_rep.specs import env_spec_from_dm_env

    return env_spec_from_dm_env(envs.make("catch", seed=0))


def test_synthetic_batch_has_the_steps_shapes_and_the_batchers_layout(catch_spec):
    from impala_rep.replicator import make_replicator
    from learner.run import make_learner_step

    config = RunConfig(env="catch", unroll_length=5, batch_size=4)
    step = make_learner_step(config, catch_spec, make_replicator("cpu", num_replicas=1))
    batch = synthetic_batch(step.batch_spec, np.random.default_rng(0))
    assert set(batch) == set(step.batch_spec)
    for key, spec in step.batch_spec.items():
        assert batch[key].shape == tuple(spec.shape) and batch[key].dtype == np.dtype(spec.dtype), key
        assert batch[key].ctypes.data % 64 == 0, key
    assert np.all(batch["step_type"] == 1) and np.all(batch["discount"] == 1)
    frames = [k for k in batch if k.startswith(("frames/", "observation/"))]
    assert frames and all(np.std(batch[k]) > 0 for k in frames)  # random input, not zeros
    metrics = step.train(batch)
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_learner_step_cost_is_cpu_seconds_per_agent_step(catch_spec):
    config = RunConfig(env="catch", unroll_length=5, batch_size=4)
    result = time_learner_step(config, catch_spec, cpu_seconds=0.2, min_steps=3)
    assert result["agent_steps_per_step"] == 20 and result["steps"] >= 3
    assert result["cpu_seconds"] >= 0.2  # it ran until the CPU budget, not just min_steps
    assert result["seconds_per_step"] == pytest.approx(result["cpu_seconds"] / (20 * result["steps"]))
    # A step on 128 times the agent steps costs more per step, so not 128 times less per agent
    # step: the measurement follows the run's own shapes. (Batch 16 against 4 at unroll 5 cost
    # only about 25% more per step on catch's small network, a margin a busy host's timing noise
    # once reversed in CI; unroll 20 and batch 128 cost about 10 times more.)
    bigger = time_learner_step(RunConfig(env="catch", unroll_length=20, batch_size=128), catch_spec,
                               cpu_seconds=0.2, min_steps=3)
    assert bigger["agent_steps_per_step"] == 2560
    assert bigger["cpu_seconds"] / bigger["steps"] > result["cpu_seconds"] / result["steps"]
    # With half of each batch replayed, a step trains on half as many fresh agent steps: each
    # costs the learner twice as much, which the launcher's learner threads must see.
    replay = time_learner_step(RunConfig(env="catch", unroll_length=5, batch_size=4, replay_ratio=0.5), catch_spec,
                               cpu_seconds=0.1, min_steps=2)
    assert replay["agent_steps_per_step"] == 10
    assert replay["seconds_per_step"] == pytest.approx(replay["cpu_seconds"] / (10 * replay["steps"]))


def test_probe_runs_in_a_subprocess_and_reports_failures_as_sentences(catch_spec):
    config = RunConfig(env="catch", unroll_length=5, batch_size=4)
    result = probe_learner_cost(config, catch_spec)
    assert "error" not in result, result
    assert result["steps"] >= 2 and result["agent_steps_per_step"] == 20 and result["seconds_per_step"] > 0
    assert result["cpu_memory"] == "pool", result  # timed as the learner runs: LEARNER_TF_ENV
    broken = probe_learner_cost(RunConfig(env="catch", network={"torso": "no-such-torso"}), catch_spec)
    assert broken["error"].startswith("could not time the learner step: "), broken
    assert "no-such-torso" in broken["error"]
    slow = probe_learner_cost(config, catch_spec, timeout=0.01)
    assert slow == {"error": "timing the learner step took more than 0.01 s"}


def test_probe_output_that_is_not_a_result_is_a_sentence(catch_spec, monkeypatch):
    import subprocess

    config = RunConfig(env="catch", unroll_length=5, batch_size=4)
    for stdout in ("a stray line\n", "[1, 2]\n"):
        monkeypatch.setattr(subprocess, "run", lambda *a, out=stdout, **k: subprocess.CompletedProcess(a, 0, out, ""))
        result = probe_learner_cost(config, catch_spec)
        assert result == {"error": f"timing the learner step printed no result, but: {stdout.strip()}"}


def test_the_learners_tensorflow_env_is_set_where_unset_and_a_users_value_stays(catch_spec, monkeypatch):
    from learner.run import LEARNER_TF_ENV, configure_tensorflow_env

    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC", raising=False)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")
    configure_tensorflow_env()
    assert os.environ["TF_CPU_ALLOCATOR_USE_BFC"] == LEARNER_TF_ENV["TF_CPU_ALLOCATOR_USE_BFC"] == "true"
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "1"
    # The opt-out reaches the learner step: TensorFlow then takes its CPU tensors from malloc
    # (with oneDNN's operations off too: where TensorFlow turns them on, as on an Intel host
    # with AMX, their allocator pools whatever TF_CPU_ALLOCATOR_USE_BFC says).
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "false")
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
    configure_tensorflow_env()
    assert os.environ["TF_CPU_ALLOCATOR_USE_BFC"] == "false"
    result = probe_learner_cost(RunConfig(env="catch", unroll_length=5, batch_size=4), catch_spec)
    assert result["cpu_memory"] == "malloc", result
