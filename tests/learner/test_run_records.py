"""What a run leaves in its run directory: the last metrics record of a run that ends between
two log intervals (learner/run.py Trainer._train), and --no-resume setting the earlier run's
checkpoints, summaries, policy export and evaluations aside (set_aside_earlier_run)."""

import json
import logging
import math
import os
import re
import subprocess
import sys
import threading

import pytest

import learner.run
from learner.run import Trainer, set_aside_earlier_run

from fake_batches import STEP_AGENT_STEPS, FixedBatches, catch_config as _config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trainer(logdir, catch_spec, batches, **kwargs):
    trainer = Trainer(_config(logdir, **kwargs), catch_spec)
    trainer.batcher.close()
    trainer.batcher = FixedBatches(trainer.batch_spec(), batches, episode=(1.0, 5), idle=0.01)
    return trainer


def _records(logdir):
    path = os.path.join(logdir, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def test_a_run_that_ends_before_its_first_log_interval_writes_one_record_of_what_it_trained(
        tmp_path, catch_spec, caplog):
    trainer = _trainer(tmp_path / "short", catch_spec, 10, total_steps=3 * STEP_AGENT_STEPS)
    try:
        with caplog.at_level(logging.INFO, logger="impala_rep.learner"):
            trainer.train()  # the agent-step budget ends it after 3 steps, long before 60 s
        assert trainer.learner_step == 3
    finally:
        trainer.close(save=False)
    (record,) = _records(tmp_path / "short")
    assert record["learner_step"] == 3 and record["agent_steps"] == 3 * STEP_AGENT_STEPS
    assert record["env_frames"] == 3 * STEP_AGENT_STEPS and record["episode_return"] == 1.0
    assert 0 < record["learner_steps_per_s"] < math.inf
    assert record["agent_steps_per_s"] == pytest.approx(STEP_AGENT_STEPS * record["learner_steps_per_s"])
    assert re.search(r"step 3 \| agent steps 60 \| env frames/s \d+ \| learner steps/s", caplog.text)

    # The same fields as the periodic records; and a run whose last step was just recorded
    # (an interval shorter than a step) gets no second record of it.
    every_step = _trainer(tmp_path / "every", catch_spec, 10, total_steps=3 * STEP_AGENT_STEPS, log_interval_s=1e-6)
    try:
        every_step.train()
    finally:
        every_step.close(save=False)
    periodic = _records(tmp_path / "every")
    assert [r["learner_step"] for r in periodic] == [1, 2, 3]
    assert set(periodic[-1]) == set(record)


def test_each_train_call_records_its_last_steps_and_an_idle_one_records_nothing(tmp_path, catch_spec):
    trainer = _trainer(tmp_path, catch_spec, 5)
    try:
        trainer.train(max_learner_steps=2)
        trainer.train(max_learner_steps=3)
        stop = threading.Event()
        threading.Timer(0.3, stop.set).start()
        trainer.train(stop)  # no batch comes until it stops: nothing trained, nothing recorded
    finally:
        trainer.close(save=False)
    assert [(r["learner_step"], r["agent_steps"]) for r in _records(tmp_path)] == [(2, 40), (5, 100)]


def test_each_record_holds_its_windows_extremes_of_the_loss_metrics(tmp_path, catch_spec):
    """``loss/*`` is the window's last step; ``window/*`` (learner.run.WINDOW_EXTREMES) the
    extremes over all of its steps, with the step of the largest gradient norm, reset each window."""
    seen = []

    def spying(trainer):
        train_and_read = trainer.step.train_and_read

        def spy(batch):
            metrics, read = train_and_read(batch)
            seen.append((read[0], dict(metrics)))
            return metrics, read
        trainer.step.train_and_read = spy
        return trainer

    trainer = spying(_trainer(tmp_path / "window", catch_spec, 6))
    try:
        trainer.train(max_learner_steps=6)
    finally:
        trainer.close(save=False)
    (record,) = _records(tmp_path / "window")
    assert [step for step, _ in seen] == [1, 2, 3, 4, 5, 6]
    norms = [m["grad_norm"] for _, m in seen]
    assert record["loss/grad_norm"] == pytest.approx(norms[-1])
    assert record["window/grad_norm_max"] == pytest.approx(max(norms))
    assert record["window/grad_norm_max_step"] == seen[norms.index(max(norms))][0]
    for name, pick in learner.run.WINDOW_EXTREMES:
        assert record[f"window/{name}_{pick.__name__}"] == pytest.approx(pick(m[name] for _, m in seen)), name

    seen.clear()
    every_step = spying(_trainer(tmp_path / "every", catch_spec, 4, log_interval_s=1e-6))
    try:
        every_step.train(max_learner_steps=4)
    finally:
        every_step.close(save=False)
    records = _records(tmp_path / "every")
    assert [r["learner_step"] for r in records] == [1, 2, 3, 4]
    for r, (step, metrics) in zip(records, seen):  # one step per window: its own values, none carried over
        assert r["window/grad_norm_max"] == pytest.approx(metrics["grad_norm"]) == pytest.approx(r["loss/grad_norm"])
        assert r["window/value_mean_min"] == pytest.approx(metrics["value_mean"])
        assert r["window/grad_norm_max_step"] == step


def test_log_interval_never_writes_no_record(tmp_path, catch_spec):
    trainer = _trainer(tmp_path, catch_spec, 3, log_interval_s=math.inf)
    try:
        trainer.train(max_learner_steps=3)
        assert trainer.learner_step == 3
    finally:
        trainer.close(save=False)
    assert _records(tmp_path) == []


def test_a_diverged_run_records_nothing_after_its_last_record(tmp_path, catch_spec, poison_update):
    trainer = _trainer(tmp_path, catch_spec, 5)
    try:
        poison_update(trainer, 2)
        trainer.train(max_learner_steps=5)
        assert trainer.diverged is not None
    finally:
        trainer.close()
    assert _records(tmp_path) == []


def test_no_resume_sets_the_earlier_runs_parts_aside_in_one_directory(tmp_path, catch_spec):
    first = _trainer(tmp_path, catch_spec, 2)
    try:
        first.train(max_learner_steps=2)
    finally:
        first.close()  # saves ckpt-2, its policy export and summaries
    old_events = set(os.listdir(tmp_path / "summaries"))
    assert old_events and os.path.exists(tmp_path / "checkpoints" / "ckpt-2.index")

    second = _trainer(tmp_path, catch_spec, 1, resume=False)
    try:
        assert second.restored_from is None and second.learner_step == 0
        second.train(max_learner_steps=1)
    finally:
        second.close()
    (before,) = [n for n in os.listdir(tmp_path) if n.startswith("before-")]
    (metrics_before,) = [n for n in os.listdir(tmp_path) if n.startswith("metrics-before-")]
    assert metrics_before == f"metrics-{before}.jsonl"  # one time stamp for both
    assert sorted(os.listdir(tmp_path / before)) == ["checkpoints", "policy", "summaries"]
    assert [r["learner_step"] for r in _records(tmp_path)] == [1]
    assert [json.loads(line)["learner_step"] for line in open(tmp_path / metrics_before)] == [2]
    # The new run's checkpoints only, its index names only them; the old ones are kept aside.
    assert sorted(n for n in os.listdir(tmp_path / "checkpoints") if n.startswith("ckpt-")) == [
        "ckpt-1.data-00000-of-00001", "ckpt-1.index"]
    index = (tmp_path / "checkpoints" / "checkpoint").read_text()
    assert "ckpt-1" in index and "ckpt-2" not in index
    assert os.path.exists(tmp_path / before / "checkpoints" / "ckpt-2.index")
    assert "ckpt-2" in (tmp_path / before / "checkpoints" / "checkpoint").read_text()
    new_events = set(os.listdir(tmp_path / "summaries"))
    assert new_events and not new_events & old_events
    assert set(os.listdir(tmp_path / before / "summaries")) == old_events
    assert json.load(open(tmp_path / "policy" / "policy.json"))["learner_step"] == 1
    assert json.load(open(tmp_path / before / "policy" / "policy.json"))["learner_step"] == 2


def test_setting_aside_moves_what_holds_anything_and_says_why_it_cannot(tmp_path, monkeypatch):
    assert set_aside_earlier_run(str(tmp_path), "20240101-000000") is None  # nothing to move
    for part in ("checkpoints", "summaries", "eval"):
        (tmp_path / part).mkdir()
        (tmp_path / part / "f").write_text(part)
    (tmp_path / "policy").mkdir()  # empty: left where it is
    (tmp_path / "before-20240101-000000").mkdir()  # taken (two fresh starts in one second)
    kept = set_aside_earlier_run(str(tmp_path), "20240101-000000")
    assert kept == str(tmp_path / "before-20240101-000000-1")
    assert sorted(os.listdir(kept)) == ["checkpoints", "eval", "summaries"]
    assert (tmp_path / "before-20240101-000000-1" / "eval" / "f").read_text() == "eval"
    assert sorted(os.listdir(tmp_path)) == ["before-20240101-000000", "before-20240101-000000-1", "policy"]

    for part in ("checkpoints", "summaries"):
        (tmp_path / part).mkdir()
        (tmp_path / part / "f").write_text(part)
    real_rename = os.rename

    def refused(src, dst):
        if src.endswith("summaries"):
            raise PermissionError(13, "Permission denied")
        return real_rename(src, dst)

    monkeypatch.setattr(learner.run.os, "rename", refused)
    with pytest.raises(ValueError) as err:
        set_aside_earlier_run(str(tmp_path), "20240102-000000")
    assert str(err.value) == (
        f"--no-resume cannot move the earlier run's checkpoints, summaries aside into "
        f"{tmp_path / 'before-20240102-000000'} (Permission denied): move them away yourself, or give this "
        "run another --logdir.")
    # What was moved is back, and the directory made for it is gone.
    assert (tmp_path / "checkpoints" / "f").read_text() == "checkpoints"
    assert not (tmp_path / "before-20240102-000000").exists()


def test_a_trainer_that_cannot_set_the_earlier_run_aside_does_not_start(tmp_path, catch_spec, monkeypatch):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "checkpoint").write_text('model_checkpoint_path: "ckpt-2"\n')

    def refused(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(learner.run.os, "rename", refused)
    with pytest.raises(ValueError, match="^--no-resume cannot move the earlier run's checkpoints aside into"):
        Trainer(_config(tmp_path, resume=False), catch_spec)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == [".lock", "checkpoints"]  # nothing new was written
    Trainer(_config(tmp_path, resume=False), catch_spec).close(save=False)  # the directory was let go


def test_the_short_launch_of_a_first_run_records_its_steps(tmp_path):
    logdir = tmp_path / "run"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    proc = subprocess.run(  # an interval longer than the run (the default 5 s is not, on a busy host)
        [sys.executable, "-m", "impala_rep.launch", "--env", "catch", "--actors", "2", "--batch-size", "4",
         "--unroll-length", "5", "--total-steps", "2000", "--log-interval", "3600", "--logdir", str(logdir)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"step 100 \| agent steps 2000 \|", proc.stderr), proc.stderr[-3000:]
    assert [(r["learner_step"], r["agent_steps"]) for r in _records(logdir)] == [(100, 2000)]


def test_the_learner_alone_refuses_buffers_this_host_cannot_hold(tmp_path, monkeypatch, capsys):
    # learner.run has no actors to plan, but its queue and replay buffer are its own to fit.
    monkeypatch.setattr(learner.run, "configure_logging", lambda: None)
    monkeypatch.setattr(learner.run, "configure_tensorflow_env", lambda: None)  # keeps this process's environment
    started = []
    monkeypatch.setattr(learner.run, "start_trainer", lambda config, spec: (started.append(config), (None, None))[1])
    with pytest.raises(SystemExit) as exit_:
        learner.run.main(["--env", "catch", "--logdir", str(tmp_path), "--replay-ratio", "0.5",
                          "--replay-unrolls", "100000000"])
    assert exit_.value.code == 2 and started == []
    err = capsys.readouterr().err
    assert "the learner needs about" in err and "use a smaller --replay-unrolls" in err, err
