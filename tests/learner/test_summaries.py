"""ScalarWriter: the compiled scalar summaries read back as the eager ones would."""

import glob
import os

import numpy as np
import pytest
import tensorflow as tf

from learner.summaries import ScalarWriter


def _events(logdir):
    """[(step, tag, value)] of every scalar summary under ``logdir``, in file order."""
    out = []
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for v in event.summary.value:
                out.append((event.step, v.tag, float(tf.make_ndarray(v.tensor))))
    return out


def _write(tmp_path, name, records, **kwargs):
    logdir = str(tmp_path / name)
    writer = tf.summary.create_file_writer(logdir)
    scalars = ScalarWriter(writer, **kwargs)
    for step, values in records:
        scalars.write(step, values)
    writer.flush()
    writer.close()
    return _events(logdir), scalars


RECORDS = [
    (640, {"loss/loss": 1.5, "queue_fill": 0.25, "agent_steps": 640}),
    (1280, {"loss/loss": -2.0, "queue_fill": 1.0, "agent_steps": 1280}),
    # Another set of names (an episode return appeared), then the first set again.
    (1920, {"loss/loss": 0.5, "queue_fill": 0.5, "agent_steps": 1920, "episode_return": 812.25}),
    (2560, {"loss/loss": 0.125, "queue_fill": 0.0, "agent_steps": 2560}),
]


def _expected():
    return [(step, k, float(np.float32(v))) for step, values in RECORDS for k, v in values.items()]


def test_compiled_records_read_back_with_their_tags_steps_and_values(tmp_path):
    events, scalars = _write(tmp_path, "compiled", RECORDS)
    assert events == _expected()
    assert scalars.compiled == 2  # one function per set of names, reused


def test_sets_beyond_the_limit_are_written_eagerly_with_the_same_events(tmp_path):
    events, scalars = _write(tmp_path, "limited", RECORDS, max_functions=1)
    assert events == _expected()
    assert scalars.compiled == 1


def test_eager_only_and_empty_records(tmp_path):
    events, scalars = _write(tmp_path, "eager", RECORDS + [(3200, {})], max_functions=0)
    assert events == _expected()
    assert scalars.compiled == 0


def test_tags_match_eager_tf_summary_scalar(tmp_path):
    logdir = str(tmp_path / "reference")
    writer = tf.summary.create_file_writer(logdir)
    with writer.as_default(step=7):
        for k, v in RECORDS[2][1].items():
            tf.summary.scalar(k, v)
    writer.flush()
    writer.close()
    events, _ = _write(tmp_path, "same", [(7, RECORDS[2][1])])
    assert events == _events(logdir)


def test_bad_max_functions():
    with pytest.raises(ValueError, match="max_functions must be 0 or more"):
        ScalarWriter(None, max_functions=-1)


def test_trim_events_after_keeps_the_steps_up_to_the_checkpoint_and_sets_the_rest_aside(tmp_path):
    from learner.summaries import trim_events_after

    kept_before, _ = _write(tmp_path, "run", RECORDS)
    path, = glob.glob(str(tmp_path / "run" / "events.out.tfevents.*"))
    name = os.path.basename(path)
    assert trim_events_after(str(tmp_path / "run"), 1280, str(tmp_path / "aside")) == [name]
    assert _events(tmp_path / "run") == [e for e in kept_before if e[0] <= 1280]
    assert _events(tmp_path / "aside") == kept_before  # the whole file, as it was
    # the file version record is kept, so TensorBoard still reads the trimmed file
    first = next(tf.compat.v1.train.summary_iterator(path))
    assert first.file_version.startswith("brain.Event")
    # nothing after the step: nothing to trim, nothing moved
    assert trim_events_after(str(tmp_path / "run"), 1280, str(tmp_path / "aside2")) == []
    assert not os.path.exists(tmp_path / "aside2")


def test_trim_events_after_keeps_what_a_file_cut_short_holds(tmp_path):
    from learner.summaries import trim_events_after

    kept_before, _ = _write(tmp_path, "run", RECORDS)
    path, = glob.glob(str(tmp_path / "run" / "events.out.tfevents.*"))
    with open(path, "rb+") as f:  # killed mid-record
        f.truncate(os.path.getsize(path) - 7)
    assert trim_events_after(str(tmp_path / "run"), 10**9, str(tmp_path / "aside")) == [os.path.basename(path)]
    assert _events(tmp_path / "run") == kept_before[:-1]  # the last event (one scalar) was cut
