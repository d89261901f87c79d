"""learner.evaluator: evaluating each exported policy in a subprocess while training runs.

TensorFlow-free: the policy is exported from the NumPy backend, as the learner exports it.
"""

import json
import logging
import os

import pytest

from learner.evaluator import PolicyEvaluator


def _export_catch_policy(run_dir, learner_step=7, agent_steps=1234):
    import envs
    from impala_rep.export import save_policy
    from impala_rep.networks import NetworkConfig
    from impala_rep.networks.numpy_backend import NumpyNetwork
    from impala_rep.specs import env_spec_from_dm_env

    spec = env_spec_from_dm_env(envs.make("catch", seed=0))
    net = NumpyNetwork(NetworkConfig(), spec.observations, spec.action, seed=3)
    meta = {"env": "catch", "env_spec": spec.to_json(), "network": {}, "frame_stack": {},
            "learner_step": learner_step, "agent_steps": agent_steps}
    save_policy(os.path.join(run_dir, "policy"), net.params, meta)


def test_evaluates_the_exported_policy_and_reports_once(tmp_path):
    run_dir = str(tmp_path)
    _export_catch_policy(run_dir)
    evaluator = PolicyEvaluator(run_dir, episodes=4, greedy=True, seed=2, nice=5)
    assert evaluator.poll() is None  # nothing started yet
    assert evaluator.start(7)
    assert not evaluator.start(8)  # one evaluation at a time: this checkpoint is skipped
    result = evaluator.wait(120)
    assert result is not None, open(tmp_path / "eval" / "evaluator.log").read()
    assert (result.learner_step, result.agent_steps, result.episodes, result.greedy) == (7, 1234, 4, True)
    assert -1.0 <= result.mean_return <= 1.0  # catch returns +1 or -1 per episode
    report = json.loads((tmp_path / "eval" / "eval-7.json").read_text())
    assert report["returns"] and len(report["returns"]) == 4 and report["seed"] == 2
    assert evaluator.poll() is None  # the result is handed over once
    assert not os.path.exists(tmp_path / "eval" / "eval-8.json")


def test_a_failed_evaluation_is_a_warning_not_a_crash(tmp_path, caplog):
    evaluator = PolicyEvaluator(str(tmp_path), episodes=1)  # no policy exported here
    assert evaluator.start(3)
    with caplog.at_level(logging.WARNING, logger="impala_rep.learner"):
        assert evaluator.wait(120) is None
    assert "evaluating the policy exported at learner step 3 failed (exit status 2)" in caplog.text
    assert "evaluator.log" in caplog.text
    assert "no exported policy" in (tmp_path / "eval" / "evaluator.log").read_text()


def test_episodes_must_be_positive():
    with pytest.raises(ValueError, match="eval-episodes must be at least 1"):
        PolicyEvaluator("/nonexistent", episodes=0)


def test_close_stops_a_running_evaluation(tmp_path):
    _export_catch_policy(str(tmp_path))
    evaluator = PolicyEvaluator(str(tmp_path), episodes=100000)
    assert evaluator.start(7) and evaluator.running
    evaluator.close()
    assert not evaluator.running and evaluator.poll() is None
