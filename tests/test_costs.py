"""The step-cost measurements and the learner-thread choice built on them (TensorFlow-free)."""

import math

import numpy as np
import pytest
from dm_env import specs

from impala_rep.costs import LEARNER_FACTOR, LIVE_ACTOR_COST, actor_processes, learner_threads, random_actions, time_env_step, time_policy_step


def test_learner_gets_its_share_of_the_cores():
    # No env cost (the benchmark's synthetic workload): the learner's share is 3/4, 1.5 of 2 cores.
    assert learner_threads(2, 0.0, 0.27e-3) == 2
    # Pixel cartpole as probed here: env 1.43 ms, policy 0.26 ms per agent step: 0.63 of 2 cores.
    assert learner_threads(2, 1.43e-3, 0.26e-3) == 1
    # The same on 16 cores: share 5.0.
    assert learner_threads(16, 1.43e-3, 0.26e-3) == 5
    # An env far dearer than the network still leaves the learner one thread.
    assert learner_threads(8, 1.0, 1e-4) == 1
    # Nothing costs anything: every core.
    assert learner_threads(4, 0.0, 0.0) == 4


def test_learner_share_rounds_up_only_past_a_tenth_of_a_core():
    # No env cost, a measured learner step: the share of 2 cores is 2 L / (F + L).
    assert learner_threads(2, 0.0, 0.2e-3, 0.23e-3) == 1  # 1.07 cores
    assert learner_threads(2, 0.0, 0.2e-3, 0.26e-3) == 2  # 1.13 cores
    env = 1e-3
    forward = env / (2 * LEARNER_FACTOR)  # learner 0.5 ms of 1 + 1/6 + 0.5 ms: 30% of the work
    assert learner_threads(3, env, forward) == 1  # 0.9 cores
    assert learner_threads(4, env, forward) == 2  # 1.2 cores (1 while the rule was a quarter core)
    assert learner_threads(6, env, forward) == 2  # 1.8 cores
    assert learner_threads(10, env, forward) == 3  # 3.0 cores
    assert learner_threads(11, env, forward) == 4  # 3.3 cores


def test_a_measured_learner_step_replaces_the_estimate():
    # A policy of 0.14 ms with no env cost: the estimate (a learner step of LEARNER_FACTOR = 3
    # forwards) asks for 2 threads (share 1.5 of 2 cores); a learner step measured at 0.15 ms
    # (share 1.03) for 1.
    assert learner_threads(2, 0.0, 0.14e-3) == 2
    assert learner_threads(2, 0.0, 0.14e-3, 0.15e-3) == 1
    # The synthetic workload on the twenty-eighth session's AMD host: policy 0.13 ms, learner
    # step 0.20 ms (share 1.21), 2 threads; they trained on 5-7% more agent steps/s than 1.
    assert learner_threads(2, 0.0, 0.13e-3, 0.20e-3) == 2
    # The first sessions' host: the step cost 3.2x the policy, and the measurement agrees with the estimate.
    assert learner_threads(2, 0.0, 0.27e-3, 0.87e-3) == 2
    # A learner step that costs nothing leaves the learner its floor of one thread.
    assert learner_threads(8, 1e-3, 1e-4, 0.0) == 1
    with pytest.raises(ValueError, match="learner_seconds must be a finite number"):
        learner_threads(2, 0.0, 1e-4, float("inf"))


@pytest.mark.parametrize("cores, env, forward, message", [
    (0, 0.0, 1e-3, "cores must be a positive integer"),
    (True, 0.0, 1e-3, "cores must be a positive integer"),
    (2, -1.0, 1e-3, "env_seconds must be a finite number"),
    (2, 0.0, float("nan"), "forward_seconds must be a finite number"),
])
def test_learner_threads_rejects_bad_input(cores, env, forward, message):
    with pytest.raises(ValueError, match=message):
        learner_threads(cores, env, forward)


def test_actor_processes_fill_the_cores_the_learner_leaves():
    # Synthetic on the eleventh session's host: learner share 1.22 of 2 cores, actors 0.78: one process.
    assert actor_processes(2, 32, 0.0, 0.14e-3, 0.22e-3) == 1
    # Pixel cartpole as the twelfth session probed it: learner share 0.42, actors 1.58: two.
    assert actor_processes(2, 32, 0.69e-3, 0.13e-3, 0.21e-3) == 2
    # Never more processes than envs or cores, never fewer than one.
    assert actor_processes(16, 3, 1e-3, 1e-4, 1e-4) == 3
    assert actor_processes(4, 64, 1.0, 1e-4, 1e-4) == 4
    assert actor_processes(1, 8, 0.0, 1e-4, 1.0) == 1
    # Live actors cost more than their pieces (one process left 0.3 of 2 cores idle at shares of
    # 1.08 and 1.00), so a share past 0.8 of a core (times LIVE_ACTOR_COST, past a whole one)
    # earns a process of its own, and 0.8 or less does not.
    assert LIVE_ACTOR_COST == 1.25
    env = 1e-3
    assert actor_processes(2, 32, env, 0.0, env * 0.95 / 1.05) == 2  # the actors' share 1.05
    assert actor_processes(2, 32, env, 0.0, env * 1.0 / 1.0) == 2  # 1.00
    assert actor_processes(2, 32, env, 0.0, env * 1.15 / 0.85) == 2  # 0.85
    assert actor_processes(2, 32, env, 0.0, env * 1.2 / 0.8) == 1  # 0.80
    assert actor_processes(2, 32, env, 0.0, env * 1.3 / 0.7) == 1  # 0.70
    assert actor_processes(4, 32, env, 0.0, env * 2.2 / 1.8) == 3  # 1.80 on 4 cores: 2.25, rounded up


@pytest.mark.parametrize("actors", [0, -1, True, 2.0])
def test_actor_processes_rejects_bad_actors(actors):
    with pytest.raises(ValueError, match="actors must be a positive integer"):
        actor_processes(2, actors, 0.0, 1e-4)


def test_random_actions_stay_in_the_spec():
    rng = np.random.default_rng(0)
    discrete = random_actions(specs.DiscreteArray(3), 200, rng)
    assert discrete.dtype == np.int32 and set(discrete.tolist()) == {0, 1, 2}
    box = random_actions(specs.BoundedArray((2,), np.float32, [-1.0, 0.0], [1.0, 5.0]), 500, rng)
    assert box.shape == (500, 2) and box.dtype == np.float32
    assert box[:, 0].min() >= -1 and box[:, 0].max() <= 1 and box[:, 1].min() >= 0 and box[:, 1].max() <= 5
    assert box[:, 1].max() > 4  # spread over the range, not stuck at a bound
    free = random_actions(specs.Array((3,), np.float64), 10, rng)
    assert free.shape == (10, 3) and np.all(np.isfinite(free))


def test_env_and_policy_step_costs_are_measured():
    import envs
    from impala_rep.config import frame_stack_keys
    from impala_rep.distributions import make_policy
    from impala_rep.networks import NetworkConfig
    from impala_rep.networks.numpy_backend import NumpyNetwork
    from impala_rep.specs import env_spec_from_dm_env, stacked_observation_specs

    env = envs.make("catch", seed=0)
    env_cost = time_env_step(env, cpu_seconds=0.05)
    assert env_cost["calls"] >= 5 and 0 < env_cost["seconds_per_step"] < 0.05
    spec = env_spec_from_dm_env(env)
    config = NetworkConfig(torso="auto", policy="auto")
    obs_specs = stacked_observation_specs(spec.observations, frame_stack_keys(spec.observations, 3))
    network = NumpyNetwork(config, obs_specs, spec.action)
    one = time_policy_step(network, make_policy(spec.action, config), obs_specs, batch=1, cpu_seconds=0.05)
    many = time_policy_step(network, make_policy(spec.action, config), obs_specs, batch=32, cpu_seconds=0.05)
    assert one["calls"] >= 3 and many["batch"] == 32 and one["cpu_seconds"] >= 0.05
    # Per agent step: the CPU time over calls x batch.
    assert math.isclose(many["seconds_per_step"], many["cpu_seconds"] / (32 * many["calls"]))
    assert 0 < one["seconds_per_step"] == one["cpu_seconds"] / one["calls"]
    with pytest.raises(ValueError, match="batch must be at least 1"):
        time_policy_step(network, make_policy(spec.action, config), obs_specs, batch=0)


def test_probe_times_the_actors_step_and_reports_a_bad_network_as_a_sentence():
    from impala_rep.probe import probe_env

    wanted = {"network": {"torso": "auto", "policy": "auto"}, "frame_stack": 3, "batch": 4}
    spec, costs = probe_env("catch", costs=wanted)
    assert spec.action.num_values == 3
    assert costs["env"]["seconds_per_step"] > 0 and costs["policy"]["seconds_per_step"] > 0
    assert costs["policy"]["batch"] == 4
    spec, costs = probe_env("catch", costs=dict(wanted, network={"torso": "no-such-torso"}))
    assert "policy" not in costs and "could not time the policy" in costs["error"]
    assert costs["env"]["calls"] >= 5  # the env was still timed
    spec, costs = probe_env("catch")
    assert costs is None


def test_probe_reports_an_env_it_cannot_time_and_still_returns_the_spec(monkeypatch):
    import os

    from impala_rep.probe import probe_env

    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    wanted = {"network": {"torso": "auto", "policy": "auto"}, "frame_stack": 3, "batch": 4}
    spec, costs = probe_env("plugin_envs:make_failing_step", costs=wanted)
    assert spec.action.num_values == 2
    assert costs == {"error": "could not time the env under random actions: RuntimeError: step is not implemented yet"}


def test_probe_reads_its_result_past_what_the_env_prints(monkeypatch):
    # An env printing on close or at exit made the probe's last line not JSON ("Expecting value").
    import os

    from impala_rep.probe import probe_env

    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    spec, costs = probe_env("plugin_envs:make_chatty", costs={"network": {"torso": "auto", "policy": "auto"},
                                                             "frame_stack": 3, "batch": 2})
    assert [s.shape for s in spec.observations.values()] == [(2,)] and costs["env"]["seconds_per_step"] > 0
