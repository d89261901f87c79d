"""``python -m learner.export``: the policy of any checkpoint a run keeps, in the exported
(TensorFlow-free) format, with the counters of that checkpoint; what cannot be exported is one
sentence."""

import json
import os
import shutil

import numpy as np
import pytest

from impala_rep.export import load_policy, save_policy
from impala_rep.networks import NetworkConfig
from impala_rep.networks.numpy_backend import NumpyNetwork
from impala_rep.specs import stacked_observation_specs
from learner.export import ExportError, checkpoint_export_dir, export_checkpoint, kept_checkpoints, main
from learner.run import Trainer

from fake_batches import STEP_AGENT_STEPS, FixedBatches, catch_config


def _train(logdir, spec, steps, **kwargs):
    """Trains a catch run in ``logdir`` (resuming it) up to ``steps`` learner steps, and ends it
    with its final checkpoint and export."""
    trainer = Trainer(catch_config(logdir, total_steps=steps * STEP_AGENT_STEPS, **kwargs), spec)
    trainer.start()
    trainer.batcher.close()
    trainer.batcher = FixedBatches(trainer.batch_spec(), 10, idle=0.01, seed=steps)
    try:
        trainer.train()
    finally:
        trainer.close()


def _npz(directory):
    with np.load(os.path.join(directory, "params.npz")) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def run(tmp_path_factory, catch_spec):
    """A run with checkpoints at learner steps 2 and 4, and the export each wrote."""
    logdir = str(tmp_path_factory.mktemp("run"))
    _train(logdir, catch_spec, 2)
    shutil.copytree(os.path.join(logdir, "policy"), os.path.join(logdir, "..", "policy-at-2"))
    _train(logdir, catch_spec, 4)
    return logdir


def test_an_older_checkpoint_is_exported_as_the_run_exported_it_then(run):
    assert sorted(kept_checkpoints(run)) == [2, 4]
    out = export_checkpoint(run, 2)
    assert out == os.path.abspath(checkpoint_export_dir(run, 2))
    then = os.path.join(run, "..", "policy-at-2")
    exported, written = _npz(out), _npz(then)
    assert sorted(exported) == sorted(written)
    for name in written:
        np.testing.assert_array_equal(exported[name], written[name])
    assert any(not np.array_equal(written[name], _npz(os.path.join(run, "policy"))[name]) for name in written)
    meta = load_policy(out).metadata
    with open(os.path.join(then, "policy.json")) as f:
        meta_then = json.load(f)
    for key in ("learner_step", "agent_steps", "checkpoint", "env", "env_spec", "network", "frame_stack"):
        assert meta[key] == meta_then[key], key
    assert meta["train_seconds"] == pytest.approx(meta_then["train_seconds"], abs=0.1)


def test_the_newest_checkpoint_is_the_default_and_out_is_where_it_goes(run, tmp_path):
    out = export_checkpoint(run, out=str(tmp_path / "newest"))
    newest = _npz(os.path.join(run, "policy"))
    for name, value in _npz(out).items():
        np.testing.assert_array_equal(value, newest[name])
    assert load_policy(out).metadata["learner_step"] == 4


def test_what_cannot_be_exported_is_one_sentence(run, tmp_path, capsys):
    with pytest.raises(ExportError, match=r"keeps checkpoints at learner steps 2, 4, not at 3 "):
        export_checkpoint(run, 3)
    with pytest.raises(ExportError, match="holds no checkpoints"):
        export_checkpoint(str(tmp_path))
    with pytest.raises(ExportError, match="is not a directory"):
        export_checkpoint(str(tmp_path / "missing"))
    # A run whose export is gone: nothing describes the network to read the checkpoint into.
    copy = str(tmp_path / "copy")
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("policy", "exports"))
    with pytest.raises(ExportError, match="describes the network to read the checkpoint into"):
        export_checkpoint(copy, 2)
    # Another network's export beside these checkpoints (a run of other settings).
    newest = load_policy(os.path.join(run, "policy"))
    network = dict(newest.metadata["network"], mlp_sizes=[17])
    other = NumpyNetwork(NetworkConfig(**network),
                         stacked_observation_specs(newest.env_spec.observations, newest.frame_stack),
                         newest.env_spec.action)
    save_policy(os.path.join(copy, "policy"), other.params, dict(newest.metadata, network=network))
    with pytest.raises(ExportError, match="or another run's than the policy exported in"):
        export_checkpoint(copy, 2)
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m learner.export: error: ") and "Traceback" not in err


def test_evaluate_takes_a_checkpoint_exporting_it_once(run, capsys):
    from impala_rep.evaluate import main as evaluate

    shutil.rmtree(checkpoint_export_dir(run, 2), ignore_errors=True)  # an earlier test's export
    assert evaluate([run, "--checkpoint", "2", "--episodes", "2", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "exporting the policy of" in out and "ckpt-2" in out
    report_path = out.strip().splitlines()[-1].removeprefix("report written to ")
    assert os.path.dirname(report_path) == os.path.join(run, "eval")  # the run's reports, not the export's
    with open(report_path) as f:
        report = json.load(f)
    assert report["learner_step"] == 2 and report["episodes"] == 2
    assert report["policy"].rstrip("/").endswith(os.path.join("exports", "ckpt-2"))
    # Again: the export newer than its checkpoint is used as it is.
    assert evaluate([run, "--checkpoint", "2", "--episodes", "1"]) == 0
    assert "exporting" not in capsys.readouterr().out
    # A checkpoint newer than its export (another run's, after --no-resume moved exports/ aside
    # but not this one) is exported again.
    index = os.path.join(run, "checkpoints", "ckpt-2.index")
    later = os.path.getmtime(os.path.join(checkpoint_export_dir(run, 2), "policy.json")) + 10
    os.utime(index, (later, later))
    assert evaluate([run, "--checkpoint", "2", "--episodes", "1"]) == 0
    assert "exporting the policy of" in capsys.readouterr().out
    assert evaluate([run, "--checkpoint", "3", "--episodes", "1"]) == 2
    err = capsys.readouterr().err
    assert "keeps checkpoints at learner steps 2, 4, not at 3" in err and "Traceback" not in err


def test_a_checkpoint_with_non_finite_parameters_is_not_exported(run, tmp_path):
    import tensorflow as tf

    from impala_rep.networks.tf_backend import TFNetwork

    nan_run = str(tmp_path / "nan")
    shutil.copytree(run, nan_run, ignore=shutil.ignore_patterns("exports"))
    newest = load_policy(os.path.join(run, "policy"))
    network = TFNetwork(NetworkConfig(**newest.metadata["network"]),
                        stacked_observation_specs(newest.env_spec.observations, newest.frame_stack),
                        newest.env_spec.action)
    for variable in network.named_variables.values():
        variable.assign(tf.fill(variable.shape, float("nan")))
    tf.train.CheckpointManager(tf.train.Checkpoint(network=network), os.path.join(nan_run, "checkpoints"),
                               max_to_keep=5).save(checkpoint_number=6)
    assert sorted(kept_checkpoints(nan_run)) == [2, 4, 6]
    with pytest.raises(ExportError, match="holds NaN or infinite parameters .* export an earlier checkpoint"):
        export_checkpoint(nan_run, 6)
    assert not os.path.exists(checkpoint_export_dir(nan_run, 6))


def test_a_popart_runs_checkpoint_exports_the_value_head_with_its_statistics(tmp_path, catch_spec):
    import tensorflow as tf

    from learner.export import POPART_STATS_KEY

    logdir = str(tmp_path / "popart")
    _train(logdir, catch_spec, 2, loss={"popart": 0.1})
    reader = tf.train.load_checkpoint(os.path.join(logdir, "checkpoints"))
    out = export_checkpoint(run_dir=logdir)
    exported, written = _npz(out), _npz(os.path.join(logdir, "policy"))  # the run's own export folds them in
    for name in written:
        np.testing.assert_allclose(exported[name], written[name], rtol=1e-6, err_msg=name)
    # The checkpoint holds the normalised head and the statistics; the export, the value's own head.
    mean, mean_square = (float(reader.get_tensor(POPART_STATS_KEY.replace("/mean/", f"/{k}/")))
                         for k in ("mean", "mean_square"))
    sigma = np.sqrt(mean_square - mean ** 2)
    assert mean != 0.0 and sigma != pytest.approx(1.0, abs=1e-3)
    head = "network/_named/value.S{}/.ATTRIBUTES/VARIABLE_VALUE"
    np.testing.assert_allclose(exported["value/kernel"], reader.get_tensor(head.format("kernel")) * sigma, rtol=1e-4)
    np.testing.assert_allclose(exported["value/bias"], reader.get_tensor(head.format("bias")) * sigma + mean,
                               rtol=1e-4, atol=1e-6)
