"""learner.evaluator: evaluating each exported policy in a subprocess while training runs.

TensorFlow-free: the policy is exported from the NumPy backend, as the learner exports it.
"""

import json
import logging
import os
import subprocess
import sys
import time

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


def test_the_child_lowers_its_own_priority_without_a_preexec_fn(tmp_path, monkeypatch):
    # preexec_fn would run Python in the forked child of a learner whose gRPC threads are live,
    # and gRPC's fork handlers then abort it now and then: the child must nice itself.
    _export_catch_policy(str(tmp_path))
    seen = {}
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        seen.update(kwargs)
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    evaluator = PolicyEvaluator(str(tmp_path), episodes=100000, nice=5)
    assert evaluator.command("r.json")[-2:] == ["--nice", "5"]
    assert "--nice" not in PolicyEvaluator(str(tmp_path), episodes=1, nice=0).command("r.json")
    try:
        assert evaluator.start(7)
        assert seen.get("preexec_fn") is None
        deadline = time.monotonic() + 60
        while os.getpriority(os.PRIO_PROCESS, evaluator._proc.pid) != min(19, base + 5):
            assert evaluator.running, open(tmp_path / "eval" / "evaluator.log").read()
            assert time.monotonic() < deadline, "the evaluation never lowered its priority"
            time.sleep(0.05)
    finally:
        evaluator.close()


def test_nice_out_of_range_is_refused():
    with pytest.raises(ValueError, match="nice must be between 0 and 19, got 20"):
        PolicyEvaluator("/nonexistent", episodes=1, nice=20)
    proc = subprocess.run([sys.executable, "-m", "impala_rep.evaluate", "/nonexistent", "--nice", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--nice must be between 0 and 19, got -1." in proc.stderr
