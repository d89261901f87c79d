"""The trainer's time budget in process (no actors): it stops training, it is counted across
train() calls and resumes, and checkpoints written before it existed still resume."""

import json
import os
import threading
import time

import pytest
import tensorflow as tf

from impala_rep.config import RunConfig
from impala_rep.probe import probe_env_spec
from learner.run import Trainer


@pytest.fixture(scope="module")
def catch_spec():
    return probe_env_spec("catch", {})


def _config(logdir, **kwargs):
    return RunConfig(env="catch", logdir=str(logdir), batch_size=4, unroll_length=5, total_steps=10**9,
                     log_interval_s=1.0, **kwargs)


def _stop_after(seconds):
    """A stop event set after ``seconds``: a budget that fails to stop training fails the test
    instead of hanging it."""
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    timer.daemon = True
    timer.start()
    return stop


def test_the_time_budget_stops_training_and_counts_across_calls_and_resumes(tmp_path, catch_spec):
    trainer = Trainer(_config(tmp_path, time_budget_s=2.0), catch_spec)
    try:
        assert trainer.train_seconds() == 0.0 and not trainer.done()
        started = time.monotonic()
        # No actors: it waits for batches until the budget is spent.
        trainer.train(_stop_after(10.0), max_learner_steps=10)
        elapsed = time.monotonic() - started
        assert 2.0 <= trainer.train_seconds() < 5.0 and elapsed < 5.0
        assert trainer.done() and trainer.learner_step == 0
        spent = trainer.train_seconds()
        trainer.train(_stop_after(10.0))  # spent: returns at once, and the clock does not run between calls
        assert trainer.train_seconds() - spent < 0.5
        trainer.save()
    finally:
        trainer.close(save=False)
    policy = json.load(open(os.path.join(tmp_path, "policy", "policy.json")))
    assert policy["train_seconds"] == pytest.approx(spent, abs=0.5)

    # Resumed with a longer budget: the clock starts where the checkpoint left it.
    resumed = Trainer(_config(tmp_path, time_budget_s=3.0), catch_spec)
    try:
        assert resumed.restored_from and resumed.train_seconds() == pytest.approx(spent, abs=0.5)
        assert not resumed.done()
        started = time.monotonic()
        resumed.train(_stop_after(10.0))
        assert time.monotonic() - started < 3.0 - spent + 1.5
        assert resumed.done() and resumed.train_seconds() >= 3.0
    finally:
        resumed.close(save=False)


def test_a_checkpoint_without_the_training_time_resumes_from_zero_seconds(tmp_path, catch_spec, caplog):
    trainer = Trainer(_config(tmp_path), catch_spec)
    try:
        trainer.agent_steps.assign(1234)
        trainer.step.set_train_seconds(77.0)
        # As runs before the time budget wrote them: everything but train_seconds.
        objects = dict(trainer.step.checkpoint_objects())
        objects.pop("train_seconds")
        old = tf.train.Checkpoint(agent_steps=trainer.agent_steps, **objects)
        tf.train.CheckpointManager(old, os.path.join(tmp_path, "checkpoints"), max_to_keep=3).save(checkpoint_number=7)
    finally:
        trainer.close(save=False)
    with caplog.at_level("INFO", logger="impala_rep.learner"):
        resumed = Trainer(_config(tmp_path), catch_spec)
    try:
        assert resumed.restored_from.endswith("ckpt-7")
        assert int(resumed.agent_steps.numpy()) == 1234 and resumed.train_seconds() == 0.0
        assert "does not record the training time (an older checkpoint): it counts from 0" in caplog.text
        resumed.step.set_train_seconds(42.0)
        resumed.save()  # a new checkpoint keeps it
    finally:
        resumed.close(save=False)
    again = Trainer(_config(tmp_path), catch_spec)
    try:
        assert again.train_seconds() == 42.0 and int(again.agent_steps.numpy()) == 1234
    finally:
        again.close(save=False)


def test_a_divergence_the_tick_reports_stops_training_and_saves_nothing_after_it(tmp_path, catch_spec, caplog):
    """What the launcher does when an actor process finds the run diverged (its policy's
    log-probabilities NaN or infinite with finite parameters): the trainer stops at that tick,
    and close() writes nothing over the last checkpoint and export."""
    trainer = Trainer(_config(tmp_path), catch_spec)
    ticks = []

    def tick():
        ticks.append(time.monotonic())
        if len(ticks) == 2:
            trainer.mark_diverged("actor process 0's policy gave NaN or infinite log-probabilities with parameters version 3")
        return {}

    try:
        trainer.save()
        saved = sorted(os.listdir(os.path.join(tmp_path, "checkpoints")))
        exported = open(os.path.join(tmp_path, "policy", "policy.json")).read()
        with caplog.at_level("ERROR"):
            trainer.train(_stop_after(10.0), on_tick=tick)  # no actors: each tick follows a 1-s wait
        assert len(ticks) == 2  # it returned at the tick that reported it, not at the stop timer
    finally:
        trainer.close()
    assert trainer.diverged.startswith("actor process 0's policy gave NaN or infinite log-probabilities with "
                                       "parameters version 3: the run diverged and stopped without saving")
    assert "Start again with a lower --learning-rate or --clip-norm" in caplog.text
    assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == saved
    assert open(os.path.join(tmp_path, "policy", "policy.json")).read() == exported
