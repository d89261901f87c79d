"""--overlap-publish: the learner's parameters checked and encoded for the actors on a thread of
their own while the next step runs (learner/params.py BackgroundPublisher, learner/run.py)."""

import dataclasses
import threading
import time

import numpy as np
import pytest

from impala_rep.config import ConfigError, RunConfig
from impala_rep.flags import config_from_args
from impala_rep.launch import build_parser
from impala_rep.probe import probe_env_spec
from learner.params import BackgroundPublisher, ParameterStore
from learner.run import Trainer, params_finite

from fake_batches import FixedBatches


def _w(value):
    return {"w": np.full(3, value, np.float32)}


class SlowStore(ParameterStore):
    """Publishes after a pause (so that the next step runs meanwhile) and records what it got."""

    def __init__(self, delay=0.0):
        super().__init__()
        self.delay = delay
        self.seen = []
        self.started = threading.Event()

    def publish(self, params, version=None):
        self.started.set()
        time.sleep(self.delay)
        self.seen.append((version, {k: np.array(v, copy=True) for k, v in params.items()}))
        return super().publish(params, version=version)


def test_the_publisher_publishes_the_newest_and_flush_waits_for_it():
    store = SlowStore(delay=0.2)
    pub = BackgroundPublisher(store, check=params_finite)
    try:
        pub.submit(2, _w(2.0))
        assert store.started.wait(5)  # version 2 is being published ...
        pub.submit(3, _w(3.0))  # ... so 3 waits, and 4 replaces it
        pub.submit(4, _w(4.0))
        assert pub.flush(10)
        assert [v for v, _ in store.seen] == [2, 4] and pub.dropped == 1 and pub.published == 2
        version, params = store.get()
        assert version == 4 and np.all(params["w"] == 4.0)
    finally:
        pub.close()
    assert not pub._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        pub.submit(5, _w(5.0))


def test_a_snapshot_that_fails_the_check_is_not_published_nor_anything_after_it():
    store = ParameterStore()
    pub = BackgroundPublisher(store, check=params_finite)
    try:
        pub.submit(2, _w(1.0))
        pub.flush(10)
        pub.submit(3, _w(np.nan))
        pub.flush(10)
        assert pub.failed == 3 and store.version == 2
        pub.submit(4, _w(1.0))
        pub.flush(10)
        assert store.version == 2 and pub.failed == 3
    finally:
        pub.close()


def test_an_error_in_the_publishing_thread_reaches_the_caller(caplog):
    store = ParameterStore()
    pub = BackgroundPublisher(store)
    try:
        pub.submit(2, _w(1.0))
        pub.flush(10)
        pub.submit(1, _w(1.0))  # versions must grow: the store refuses it, in the publisher's thread
        with pytest.raises(RuntimeError, match="publishing the learner's parameters failed: parameter version must grow"):
            pub.flush(10)
        pub.submit(3, _w(3.0))  # the thread goes on
        assert pub.flush(10) and store.version == 3
        pub.submit(3, _w(3.0))  # refused again, and not raised before close() ...
    finally:
        with caplog.at_level("ERROR", logger="impala_rep.learner"):
            pub.close()  # ... which publishes what is pending, raises nothing and logs the error
    assert "publishing the learner's parameters failed: parameter version must grow" in caplog.text
    assert not pub._thread.is_alive()


def test_the_flag_and_its_default():
    args = build_parser().parse_args(["--env", "catch"])
    assert config_from_args(args).overlap_publish == "auto"
    args = build_parser().parse_args(["--env", "catch", "--overlap-publish", "on"])
    assert config_from_args(args).overlap_publish == "on"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--env", "catch", "--overlap-publish", "yes"])
    with pytest.raises(ConfigError, match="overlap-publish must be one of auto, on, off, got 'yes'"):
        RunConfig(overlap_publish="yes")


@pytest.fixture(scope="module")
def catch_spec():
    return probe_env_spec("catch", {})


def _config(logdir, overlap):
    return RunConfig(env="catch", logdir=str(logdir), batch_size=4, unroll_length=5, total_steps=10**9,
                     log_interval_s=1.0, overlap_publish=overlap)



def test_auto_overlaps_only_off_the_cpu(tmp_path, catch_spec):
    trainer = Trainer(_config(tmp_path, "auto"), catch_spec)
    try:
        assert trainer.replicator.kind == "cpu" and not trainer.overlap_publish and trainer._publisher is None
    finally:
        trainer.close(save=False)


def test_a_cpu_learner_sends_every_version_unless_told_otherwise(tmp_path, catch_spec):
    # --param-refresh-lag auto: 1 on a CPU learner (8 on GPU and TPU learners: config.py).
    for lag, served in (("auto", 1), (3, 3)):
        trainer = Trainer(dataclasses.replace(_config(tmp_path / str(lag), "auto"), param_refresh_lag=lag), catch_spec)
        try:
            assert trainer.param_refresh_lag == served and trainer.server.refresh_lag == served
        finally:
            trainer.close(save=False)


def test_overlapped_publishing_sends_each_steps_own_parameters_and_settles_before_returning(tmp_path, catch_spec):
    trainer = Trainer(_config(tmp_path, "on"), catch_spec)
    try:
        assert trainer.overlap_publish
        store = SlowStore(delay=0.3)
        trainer._publisher.close()
        trainer.params = store
        trainer._publisher = BackgroundPublisher(store, check=params_finite)
        submitted = {}
        submit = trainer._publisher.submit

        def recording_submit(version, params):  # what the step gave, copied before the next step runs
            submitted[version] = {k: np.array(v, copy=True) for k, v in params.items()}
            submit(version, params)

        trainer._publisher.submit = recording_submit
        trainer.batcher = FixedBatches(trainer.batch_spec(), 6)
        trainer.train(max_learner_steps=6)
        assert trainer.learner_step == 6
        # train() returned only once the last step's parameters were published.
        assert store.version == 7 and [v for v, _ in store.seen][-1] == 7
        assert len(store.seen) >= 2  # the 0.3-s publishes overlapped later steps
        for version, params in store.seen:  # the next steps did not change what was being published
            for name, value in params.items():
                np.testing.assert_array_equal(value, submitted[version][name], err_msg=f"{name} at version {version}")
        _, now = trainer.step.get_params()
        for name, value in store.get()[1].items():
            np.testing.assert_array_equal(value, now[name])
    finally:
        trainer.close(save=False)


def test_overlapped_publishing_stops_a_diverged_run_and_saves_nothing_after_it(tmp_path, catch_spec, poison_update):
    import os

    trainer = Trainer(_config(tmp_path, "on"), catch_spec)
    try:
        trainer.save()
        saved = sorted(os.listdir(os.path.join(tmp_path, "checkpoints")))
        trainer.batcher = FixedBatches(trainer.batch_spec(), 10)
        poison_update(trainer, 3)  # the third update makes the parameters NaN
        trainer.train(max_learner_steps=10)
        assert trainer.diverged is not None
        assert trainer.diverged.startswith("the update of learner step 3 made the network's parameters NaN or infinite")
        assert trainer.learner_step <= 5  # it stopped within a step or two of it
        # The NaN version (4) never reached the actors; 3 may have been dropped for it.
        assert trainer.params.version in (2, 3) and trainer._publisher.failed == 4
        assert all(np.all(np.isfinite(v)) for v in trainer.params.get()[1].values())
    finally:
        trainer.close()
    assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == saved


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_params_finite_finds_one_non_finite_value_in_any_array(bad):
    params = {"a": np.ones([4, 5], np.float32), "b": np.zeros([300], np.float32), "n": np.arange(3)}
    assert params_finite(params)
    params["b"][137] = bad
    assert not params_finite(params)
