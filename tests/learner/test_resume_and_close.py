"""How a run ends and starts again (learner/run.py): the final checkpoint is written before the
last evaluation is waited for, never twice at one step, never with non-finite parameters; a
resume refuses another task's checkpoint, names the settings that changed, and says when the
budget is already spent."""

import json
import logging
import os
import time

import numpy as np
import pytest

from impala_rep.probe import probe_env_spec
from learner.run import Trainer, check_resumed_settings

from fake_batches import STEP_AGENT_STEPS, FixedBatches, catch_config as _config


def _trainer(logdir, spec, batches=10, **kwargs):
    trainer = Trainer(_config(logdir, **kwargs), spec)
    trainer.start()  # writes config.json, as the entry points do
    trainer.batcher.close()
    trainer.batcher = FixedBatches(trainer.batch_spec(), batches, episode=(1.0, 5), idle=0.01)
    return trainer


def _checkpoints(logdir):
    return sorted(n for n in os.listdir(os.path.join(logdir, "checkpoints")) if n.endswith(".index"))


class RecordingEvaluator:
    """Stands in for PolicyEvaluator: one evaluation at a time, and what was saved when each
    wait began."""

    def __init__(self, trainer, running=False):
        self.trainer, self.running, self.started, self.waits = trainer, running, [], []

    def start(self, step):
        if self.running:
            return False
        self.running = True
        self.started.append(step)
        return True

    def poll(self):
        return None

    def wait(self, timeout_s):
        self.waits.append(os.path.basename(self.trainer.manager.latest_checkpoint or "none"))
        self.running = False
        return None

    def close(self):
        pass


def test_close_writes_the_last_checkpoint_before_waiting_for_a_running_evaluation(tmp_path, catch_spec):
    trainer = _trainer(tmp_path, catch_spec, total_steps=3 * STEP_AGENT_STEPS)
    evaluator = trainer.evaluator = RecordingEvaluator(trainer, running=True)  # an earlier step's, still running
    try:
        trainer.train()
    finally:
        trainer.close()
    # the first wait (for the earlier evaluation) began with ckpt-3 already on disk; then the
    # last export got its own evaluation
    assert evaluator.waits == ["ckpt-3", "ckpt-3"] and evaluator.started == [3]
    assert _checkpoints(tmp_path) == ["ckpt-3.index"]


def test_save_writes_nothing_from_non_finite_parameters(tmp_path, catch_spec):
    trainer = _trainer(tmp_path, catch_spec, total_steps=2 * STEP_AGENT_STEPS)
    try:
        trainer.train()
        assert trainer.save().endswith("ckpt-2")
        params = trainer.step.get_params()[1]
        name = sorted(params)[0]
        bad = dict(params)
        bad[name] = np.full_like(params[name], np.nan)
        trainer.step.set_params(bad)  # as if the last step diverged and its check was never made
        trainer._saved_step = None
        assert trainer.save() is None
        assert trainer.diverged is not None and "are not finite" in trainer.diverged
    finally:
        trainer.close()  # saves nothing after the divergence
    assert _checkpoints(tmp_path) == ["ckpt-2.index"]
    with open(os.path.join(tmp_path, "policy", "policy.json")) as f:
        assert json.load(f)["learner_step"] == 2


def test_a_resume_with_the_budget_spent_says_so_and_writes_no_checkpoint_again(tmp_path, catch_spec, caplog):
    first = _trainer(tmp_path, catch_spec, total_steps=2 * STEP_AGENT_STEPS)
    try:
        first.train()
    finally:
        first.close()
    index = os.path.join(tmp_path, "checkpoints", "ckpt-2.index")
    written = os.stat(index).st_mtime_ns
    with caplog.at_level(logging.INFO, logger="impala_rep.learner"):
        again = _trainer(tmp_path, catch_spec, total_steps=2 * STEP_AGENT_STEPS)
        try:
            again.evaluator = evaluator = RecordingEvaluator(again)
            again.train()
            assert again.learner_step == 2
        finally:
            again.close()
    assert "has already trained 40 agent steps" in caplog.text and "Raise --total-steps to go on" in caplog.text
    assert os.stat(index).st_mtime_ns == written and _checkpoints(tmp_path) == ["ckpt-2.index"]
    assert evaluator.started == []  # the earlier run evaluated its last export


def test_a_resume_on_another_task_is_refused_and_changed_settings_are_named(tmp_path, catch_spec, caplog):
    first = _trainer(tmp_path, catch_spec, total_steps=STEP_AGENT_STEPS)
    try:
        first.train()
    finally:
        first.close()
    other = probe_env_spec("catch", {"rows": 8})
    with pytest.raises(ValueError) as info:
        Trainer(_config(tmp_path, env_kwargs={"rows": 8}), other)
    message = str(info.value)
    assert message.startswith(f"{tmp_path} holds a run of 'catch', and this run is on 'catch' with {{\"rows\": 8}}")
    assert "--no-resume" in message and "--logdir" in message
    with caplog.at_level(logging.WARNING, logger="impala_rep.learner"):
        changed = check_resumed_settings(_config(tmp_path, total_steps=5 * STEP_AGENT_STEPS, seed=3, port=5000),
                                         os.path.join(tmp_path, "config.json"))
    assert changed == ["seed: 0 -> 3", f"total_steps: {STEP_AGENT_STEPS} -> {5 * STEP_AGENT_STEPS}"]  # not port
    assert "settings changed since its last start: seed: 0 -> 3; total_steps: 20 -> 100" in caplog.text
    assert check_resumed_settings(_config(tmp_path), os.path.join(tmp_path, "missing.json")) == []
    # The Trainer compares by its own learner's kind: a CPU learner resuming a run that recorded
    # param_refresh_lag 1 (before auto was the default) names no change.
    path = os.path.join(tmp_path, "config.json")
    with open(path) as f:
        recorded = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(recorded, param_refresh_lag=1), f)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="impala_rep.learner"):
        again = Trainer(_config(tmp_path, total_steps=STEP_AGENT_STEPS), catch_spec)
        again.close()
    assert again.restored_from and "settings changed" not in caplog.text


def test_an_auto_setting_that_means_what_the_earlier_run_set_has_not_changed(tmp_path, caplog):
    # A run started before --param-refresh-lag's auto recorded 1; resumed on a CPU learner, auto
    # is 1 there, and so is off for --overlap-publish and thread for --intake.
    earlier = dict(_config(tmp_path).to_json(), param_refresh_lag=1, overlap_publish="off", intake="thread")
    path = os.path.join(tmp_path, "config.json")
    with open(path, "w") as f:
        json.dump(earlier, f)
    now = _config(tmp_path)
    assert (now.param_refresh_lag, now.overlap_publish, now.intake) == ("auto", "auto", "auto")
    with caplog.at_level(logging.WARNING, logger="impala_rep.learner"):
        assert check_resumed_settings(now, path, "cpu") == []
    assert "settings changed" not in caplog.text
    # On a GPU learner auto means 8, on and process: each is a change, and so is any change
    # when the learner's kind is not given.
    assert check_resumed_settings(now, path, "gpu") == [
        'intake: "thread" -> "auto"', 'overlap_publish: "off" -> "auto"', 'param_refresh_lag: 1 -> "auto"']
    assert len(check_resumed_settings(now, path)) == 3
    # A hand-edited record that no resolver reads is a change, not a crash.
    with open(path, "w") as f:
        json.dump(dict(earlier, param_refresh_lag=[1]), f)
    assert check_resumed_settings(now, path, "cpu") == ['param_refresh_lag: [1] -> "auto"']


def test_an_intake_process_that_does_not_start_is_a_sentence(tmp_path, catch_spec, monkeypatch, capsys):
    import learner.intake
    import learner.run

    def fail(self):
        raise learner.intake.IntakeError("the learner's intake process exited with status 1 while starting; see the "
                                         "log above for why.")

    monkeypatch.setattr(learner.intake.ProcessIntake, "start", fail)
    monkeypatch.setattr(learner.run, "install_stop_handlers", lambda stop: None)  # not this test process's
    trainer, _ = learner.run.start_trainer(_config(tmp_path, intake="process"), catch_spec)
    assert trainer is None
    assert ("error: the learner's intake process exited with status 1 while starting; see the log above for why."
            in capsys.readouterr().err)


def test_a_divergence_the_actors_found_names_a_checkpoint_from_before_it(tmp_path, catch_spec):
    """Parameters finite but so large that the actors' policy overflows: when the newest
    checkpoint already holds that version, the sentence says resuming from it would diverge
    again and names an older one, instead of 'the last checkpoint is from before it'."""
    def diverged_at(version, logdir):
        trainer = _trainer(logdir, catch_spec)
        try:
            trainer.train(max_learner_steps=1)
            trainer.save()  # ckpt-1: parameters version 2
            trainer.train(max_learner_steps=2)
            trainer.save()  # ckpt-3: version 4
            trainer.mark_diverged(f"actor process 0's policy gave NaN or infinite log-probabilities with parameters "
                                  f"version {version}", version=version)
            return trainer.diverged
        finally:
            trainer.close()

    late = diverged_at(4, tmp_path / "late")
    assert "its last checkpoint (ckpt-3) and exported policy already hold those parameters" in late, late
    assert 'Resume from ckpt-1 (write model_checkpoint_path: "ckpt-1"' in late, late
    assert "with a lower --learning-rate or --clip-norm (or the rewards rescaled: --reward-scale" in late, late
    early = diverged_at(9, tmp_path / "early")
    assert "the last checkpoint (ckpt-3) and exported policy are from before it" in early, early
    assert _checkpoints(tmp_path / "late") == _checkpoints(tmp_path / "early") == ["ckpt-1.index", "ckpt-3.index"]


def test_a_remote_tpus_checkpoints_are_written_by_this_host(tmp_path):
    """With --tpu-address the variables live on the TPU worker, which would read and write the
    files by TensorFlow's default; /job:localhost makes this host do it, where --logdir is.
    (No TPU here: the options, and that they save and restore on this host.)"""
    import tensorflow as tf

    from learner.run import checkpoint_options

    remote = checkpoint_options(_config(tmp_path, learner="tpu", tpu_address="grpc://10.0.0.2:8470"), "tpu")
    assert remote.experimental_io_device == "/job:localhost"
    assert checkpoint_options(_config(tmp_path, learner="tpu"), "tpu") is None  # a local TPU: its host is this one
    assert checkpoint_options(_config(tmp_path), "cpu") is None
    v = tf.Variable(3.0)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), str(tmp_path / "ckpt"), max_to_keep=1)
    path = manager.save(checkpoint_number=1, options=remote)
    v.assign(0.0)
    tf.train.Checkpoint(v=v).restore(path, options=remote).assert_existing_objects_matched()
    assert float(v.numpy()) == 3.0


@pytest.mark.parametrize("intake", ["thread", "process"])
def test_the_actors_hear_that_the_run_is_over_before_the_final_save(tmp_path, catch_spec, intake):
    # An actor whose next call comes after the server's short drain at stop (a slow env) would
    # otherwise retry a learner that is gone until it gives up.
    from actors.client import LearnerClient, LearnerFinishedError

    trainer = _trainer(tmp_path, catch_spec, total_steps=2 * STEP_AGENT_STEPS, intake=intake)
    client = LearnerClient(trainer.server.address, give_up_after_s=30)
    heard = []
    save = trainer.save

    def save_after_asking():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not heard:  # the process intake hears it a message later
            try:
                client.get_parameters()
                time.sleep(0.05)
            except LearnerFinishedError:
                heard.append(True)
        return save()

    try:
        client.connect()
        client.get_parameters()  # served while training
        trainer.train()
        trainer.save = save_after_asking
    finally:
        trainer.close()
        client.close(drain=False, timeout=2)
    assert heard == [True] and _checkpoints(tmp_path) == ["ckpt-2.index"]


def _summary_steps(logdir, tag="agent_steps"):
    import glob

    import tensorflow as tf

    steps = []
    for path in sorted(glob.glob(os.path.join(logdir, "summaries", "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            steps += [event.step for v in event.summary.value if v.tag == tag]
    return steps


def _run_steps(logdir, spec, steps, save=True):
    """Trains (resuming) to ``steps`` learner steps with a record at each, then closes: with
    ``save=False`` as if killed (no checkpoint of the last steps). Returns the learner step
    the run resumed at."""
    trainer = _trainer(logdir, spec, total_steps=steps * STEP_AGENT_STEPS, log_interval_s=1e-6)
    resumed_at = trainer.learner_step
    try:
        trainer.train()
    finally:
        trainer.close(save=save)
    return resumed_at


def test_a_resume_cuts_the_summaries_written_after_its_checkpoint(tmp_path, catch_spec):
    _run_steps(tmp_path, catch_spec, 2)  # ckpt-2
    _run_steps(tmp_path, catch_spec, 4, save=False)  # two steps the checkpoint does not hold
    assert _summary_steps(tmp_path) == [20, 40, 60, 80]
    assert _run_steps(tmp_path, catch_spec, 4) == 2
    assert _summary_steps(tmp_path) == [20, 40, 60, 80]  # each step once: the lost steps' records are cut
    aside = [n for n in os.listdir(tmp_path) if n.startswith("after-checkpoint-")]
    assert len(aside) == 1 and _summary_steps(os.path.join(tmp_path, aside[0])) == [60, 80]  # the lost run's file


def test_a_resume_without_a_checkpoint_sets_all_the_earlier_summaries_aside(tmp_path, catch_spec):
    _run_steps(tmp_path, catch_spec, 2, save=False)  # killed before its first checkpoint
    assert _summary_steps(tmp_path) == [20, 40]
    assert _run_steps(tmp_path, catch_spec, 1) == 0
    assert _summary_steps(tmp_path) == [20]


def test_an_earlier_dmc_record_without_coarse_shapes_resumes_with_the_coarse_shapes_it_rendered(tmp_path):
    # Runs recorded before coarse_shapes was written into every dmc/ config rendered them (the default).
    now = _config(tmp_path, env="dmc/cheetah-run", env_kwargs={"coarse_shapes": True})
    path = os.path.join(tmp_path, "config.json")
    with open(path, "w") as f:
        json.dump(dict(now.to_json(), env_kwargs={}), f)
    assert check_resumed_settings(now, path, "cpu") == []
    model_shapes = _config(tmp_path, env="dmc/cheetah-run", env_kwargs={"coarse_shapes": False})
    with pytest.raises(ValueError) as info:
        check_resumed_settings(model_shapes, path, "cpu")
    assert str(info.value).startswith(
        f"{tmp_path} holds a run of 'dmc/cheetah-run' with {{\"coarse_shapes\": true}}, and this run is on "
        "'dmc/cheetah-run' with {\"coarse_shapes\": false}")
