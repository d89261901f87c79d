"""--capture-spikes (learner/capture.py): the learner keeps the state and batches of its last
updates, writes them out when the policy's entropy jumps, and the replay of what it wrote
reproduces the run's updates."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from impala_rep.config import ConfigError, RunConfig
from impala_rep.losses import LossConfig
from learner.capture import SpikeCapture, layer_of, read_capture, replay_capture
from learner.run import Trainer

from fake_batches import FixedBatches, catch_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_capture_replays_to_the_runs_own_metrics_and_parameters(tmp_path, catch_spec):
    trainer = Trainer(catch_config(tmp_path, capture_spikes=2), catch_spec)
    trainer.batcher.close()
    trainer.batcher = FixedBatches(trainer.batch_spec(), 8)
    seen = []
    train_and_read = trainer.step.train_and_read

    def spy(batch):
        metrics, read = train_and_read(batch)
        seen.append({k: float(np.asarray(v)) for k, v in metrics.items()})
        return metrics, read
    trainer.step.train_and_read = spy
    try:
        trainer.train(max_learner_steps=5)
        assert trainer.capture.captured == []  # catch's entropy does not jump on these batches
        trainer.capture.is_collapse = lambda entropy, highest: True  # the next step is one, whatever its entropy
        trainer.train(max_learner_steps=1)
        final = {k: np.array(v) for k, v in trainer.step.get_params()[1].items()}
    finally:
        trainer.close(save=False)
    path = os.path.join(tmp_path, "captures", "step-6")
    assert trainer.capture.captured == [path]
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".")]  # no partial capture left
    # Snapshots every 2 steps, the two newest kept: the state after step 2, then updates 3 to 6.
    steps, batches = read_capture(path)
    assert steps["state_learner_step"] == 2
    assert [s["learner_step"] for s in steps["steps"]] == [2, 3, 4, 5]
    assert [s["metrics"]["entropy_mean"] for s in steps["steps"]] == pytest.approx(
        [m["entropy_mean"] for m in seen[2:6]])
    assert set(batches[0]) == set(trainer.batch_spec()) | {"policy_version"}

    rows, params = replay_capture(path)
    assert [r["learner_step"] for r in rows] == [2, 3, 4, 5]
    for row in rows:
        assert {"entropy_mean", "value_mean", "grad_norm", "baseline_loss"} <= set(row["recorded"])
        assert set(row["replayed"]) == set(row["recorded"])
        for name in row["recorded"]:
            assert row["replayed"][name] == pytest.approx(row["recorded"][name], rel=1e-4, abs=1e-6), name
        assert set(row["update"]) == {layer_of(name) for name in final}
        assert all(0 < v < 1 for v in row["update"].values())
        assert set(row["shift"]) == {layer_of(name) for name in final if name.endswith("/kernel")}
        # A shift is the kernel's mean change over its mean magnitude: at most its update's size
        # times sqrt(n) |w| / sum(|w|) (Cauchy-Schwarz), about 1.25 for weights of a normal spread.
        assert all(abs(row["shift"][k]) <= 3 * row["update"][k] for k in row["shift"])
    # The last batch's metrics on each state are its own on the last one (the step that made the
    # capture), and on the others the run's state then, not the run's metrics for it.
    assert rows[-1]["last_batch"]["entropy_mean"] == pytest.approx(rows[-1]["replayed"]["entropy_mean"], rel=1e-5)
    assert rows[0]["last_batch"]["entropy_mean"] != pytest.approx(rows[0]["replayed"]["entropy_mean"], rel=1e-3)
    # The replay ends where the run did: its last update's parameters are the run's.
    assert set(params) == set(final)
    for name, value in final.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
    still, _ = replay_capture(path, learning_rate=1e-12)  # the settings replace the run's
    assert all(v < 1e-6 for r in still for v in r["update"].values())
    assert all(abs(v) < 1e-6 for r in still for v in r["shift"].values())
    assert any(abs(v) > 1e-6 for r in rows for v in r["shift"].values())
    assert all(v > 1e-4 for r in rows for v in r["update"].values())
    assert still[0]["replayed"]["entropy_mean"] == pytest.approx(rows[0]["replayed"]["entropy_mean"])
    # Loss settings too: without the baseline's loss the first update's total loss is the rest.
    no_baseline, _ = replay_capture(path, loss={"baseline_cost": 0.0})
    first, other = rows[0]["replayed"], no_baseline[0]["replayed"]
    assert other["entropy_mean"] == pytest.approx(first["entropy_mean"])  # the same state and batch
    with open(os.path.join(path, "config.json")) as f:
        baseline_cost = json.load(f)["loss"].get("baseline_cost", LossConfig().baseline_cost)
    assert baseline_cost > 0
    assert other["loss"] == pytest.approx(first["loss"] - baseline_cost * first["baseline_loss"], rel=1e-4, abs=1e-5)
    assert other["loss"] != pytest.approx(first["loss"], rel=1e-3)
    # The baseline's gradient kept out of the shared layers: the same loss, another update.
    unshared, _ = replay_capture(path, loss={"baseline_torso_scale": 0.0})
    assert unshared[0]["replayed"]["loss"] == pytest.approx(first["loss"], rel=1e-5)
    assert unshared[0]["replayed"]["grad_norm"] != pytest.approx(first["grad_norm"], rel=1e-3)
    # PopArt from the capture's state: the statistics start from the first batch's targets, the
    # values are the run's and the baseline loss is on their scale.
    popart, _ = replay_capture(path, loss={"popart": 3e-4, "popart_terms": "baseline"})
    row = popart[0]["replayed"]
    assert row["popart_mu"] == pytest.approx(row["vs_mean"], rel=1e-5)
    assert row["popart_sigma"] == pytest.approx(np.sqrt(max(row["vs_square_mean"] - row["vs_mean"] ** 2, 1e-8)),
                                                rel=1e-2)
    assert row["value_mean"] == pytest.approx(first["value_mean"], rel=1e-5)
    assert row["baseline_loss"] == pytest.approx(first["baseline_loss"], rel=1e-5)  # sigma 1 in the first update
    assert popart[1]["replayed"]["baseline_loss"] != pytest.approx(rows[1]["replayed"]["baseline_loss"], rel=1e-2)
    whole, _ = replay_capture(path, loss={"popart": 3e-4})  # all terms (the default); sigma 1 in the first update
    assert whole[0]["replayed"]["loss"] == pytest.approx(first["loss"], rel=1e-5)
    assert whole[1]["replayed"]["pg_loss"] != pytest.approx(popart[1]["replayed"]["pg_loss"], rel=1e-3)
    with pytest.raises(ValueError, match="not discount"):
        replay_capture(path, loss={"discount": 0.9})

    out = subprocess.run([sys.executable, "scripts/replay_capture.py", path, "--json", "--baseline-cost", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    cli_rows = json.loads(out.stdout)
    assert [r["replayed"]["grad_norm"] for r in cli_rows] == pytest.approx(
        [r["replayed"]["grad_norm"] for r in no_baseline], rel=1e-4)


def test_a_capture_comes_only_when_the_entropy_rises_past_the_kept_steps_and_not_again_at_once(tmp_path):
    import tensorflow as tf

    counter = tf.Variable(0, dtype=tf.int64)
    capture = SpikeCapture(tf.train.Checkpoint(counter=counter), str(tmp_path), history=2,
                           describe={"config.json": "{}"}, max_captures=2)
    batch = {"x": np.zeros(3, np.float32)}
    written = []
    entropies = [0.7, 0.72, 0.69, 1.5, 6.4, 14.0, 0.7, 0.7, 0.7, 7.0, 0.7, 0.7, 0.7, 8.0]
    for step, entropy in enumerate(entropies):
        capture.before_step(step, batch, 0.0)
        counter.assign(step + 1)
        written.append(capture.after_step({"entropy_mean": np.float32(entropy)}))
    # Snapshots every 2 steps, the two newest kept. 1.5 is 0.8 above the median of 0.7, 0.72 and
    # 0.69: no capture; 6.4 rises 5.3 past the median of 0.69 and 1.5 (steps 2 and 3): a capture;
    # 14.0 rises past it too, but within the 2 quiet steps after it; 7.0 rises past the kept steps'
    # 0.7 (the snapshot at step 8 dropped 6.4 and 14.0); the last jump is past max_captures.
    assert [i for i, w in enumerate(written) if w] == [4, 9]
    first = os.path.join(tmp_path, "captures", "step-5")
    assert capture.captured == [first, os.path.join(tmp_path, "captures", "step-10")]
    steps, batches = read_capture(first)
    assert steps["state_learner_step"] == 2 and [s["learner_step"] for s in steps["steps"]] == [2, 3, 4]
    assert len(batches) == 3 and open(os.path.join(first, "config.json")).read() == "{}"
    steps, batches = read_capture(capture.captured[1])
    assert steps["state_learner_step"] == 6 and [s["learner_step"] for s in steps["steps"]] == [6, 7, 8, 9]
    # The state is the counter's at step 6.
    tf.train.Checkpoint(counter=counter).read(os.path.join(capture.captured[1], steps["checkpoint"])).assert_consumed()
    assert int(counter.numpy()) == 6


@pytest.mark.parametrize("entropies, captured_at", [
    ([5.3, 4.1, 3.5, 5.58, 6.7], None),  # early in a walker run: 2 nats, but not twice the median
    ([0.8, 0.7, 1.7, 2.4, 0.7], None),  # a window's ordinary highest at 0.4M agent steps: not 2 nats
    ([0.8, 0.7, 2.9], 2),
    # A rise over several steps, none past twice the highest before it (the sixty-fourth session's
    # collapse made no capture under that rule): 3.3 is past the median of the steps before it.
    ([0.8, 0.7, 0.9, 0.8, 1.4, 2.2, 3.3, 5.0, 8.4], 6),
    # A Gaussian policy's can be negative: -0.5 is 1.55 nats past the median -2.05, not 2.05;
    # 1.0 is past the median -2.0 by 3.
    ([-2.0, -2.1, -0.5, 1.0], 3),
])
def test_a_collapse_is_a_rise_of_two_nats_and_of_the_kept_steps_median_entropy(tmp_path, entropies, captured_at):
    import tensorflow as tf

    capture = SpikeCapture(tf.train.Checkpoint(counter=tf.Variable(0)), str(tmp_path), history=8, describe={})
    written = []
    for step, entropy in enumerate(entropies):
        capture.before_step(step, {"x": np.zeros(1)}, 0.0)
        written.append(capture.after_step({"entropy_mean": entropy}))
    assert [i for i, w in enumerate(written) if w] == ([] if captured_at is None else [captured_at])
    capture.close()
    capture.close()


def test_capture_spikes_is_a_whole_number_of_steps(tmp_path):
    with pytest.raises(ConfigError, match="capture-spikes must be a whole number"):
        RunConfig(env="catch", logdir=str(tmp_path), capture_spikes=-1)
    with pytest.raises(ConfigError, match="capture-spikes"):
        RunConfig(env="catch", logdir=str(tmp_path), capture_spikes=True)
    from impala_rep.flags import CommandLineParser, add_learner_flags, config_from_args

    parser = CommandLineParser(prog="t")
    add_learner_flags(parser)
    assert config_from_args(parser.parse_args(["--env", "catch", "--capture-spikes", "16"])).capture_spikes == 16


def test_replaying_something_that_is_not_a_capture_says_so(tmp_path):
    with pytest.raises(ValueError, match="is not a whole capture of --capture-spikes"):
        read_capture(str(tmp_path))
    out = subprocess.run([sys.executable, "scripts/replay_capture.py", str(tmp_path / "nothing")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "give a captures/step-S directory" in out.stderr
    # A directory that is not a capture (no config.json, steps.json or batches): the same sentence as above.
    out = subprocess.run([sys.executable, "scripts/replay_capture.py", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "is not a whole capture of --capture-spikes" in out.stderr, out.stderr
