"""Tests of the replicated learner step (learner.step).

Tolerance of replica equivalence: float32 sums taken in a different order (per-replica
partial sums, then the all-reduce) differ by a few ulps; after K=3 RMSProp steps the
parameters of 2 and 4 replicas match one replica to ``rtol=1e-5, atol=1e-6``. Within one
run the copies on all replicas are bit-identical (every replica applies the same
all-reduced gradient).
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from impala_rep.losses import LossConfig
from impala_rep.replicator import make_replicator
from learner.step import LearnerStep, OptimizerConfig, make_batch_spec
from multiworker_worker import TinyNetwork, tiny_batch_spec, tiny_batches, tiny_policy

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
T, B, K = 4, 8, 3
RTOL, ATOL = 1e-5, 1e-6


def _tiny_learner(num_replicas, **kwargs):
    return LearnerStep(
        make_replicator("cpu", num_replicas=num_replicas), TinyNetwork, tiny_policy(), tiny_batch_spec(T, B), **kwargs
    )


def _train(learner, batches):
    return [learner.train(b) for b in batches]


def _replica_copies(learner):
    return [
        {v.name: c.numpy() for v in learner.network.trainable_variables for c in [learner.replicator.local_results(v)[r]]}
        for r in range(learner.replicator.num_replicas)
    ]


@pytest.fixture(scope="module")
def batches():
    return tiny_batches(K, T, B)


@pytest.fixture(scope="module")
def one_replica(batches):
    learner = _tiny_learner(1)
    initial = learner.get_params()[1]
    metrics = _train(learner, batches)
    return initial, learner.get_params(), metrics


@pytest.mark.parametrize("num_replicas", [2, 4])
def test_replicas_match_one_replica(batches, one_replica, num_replicas):
    initial, (version_1, params_1), metrics_1 = one_replica
    learner = _tiny_learner(num_replicas)
    metrics = _train(learner, batches)
    version, params = learner.get_params()
    assert version == version_1 == K
    for name in params_1:
        assert not np.allclose(params_1[name], initial[name], atol=1e-4), f"{name} did not train"
        np.testing.assert_allclose(params[name], params_1[name], rtol=RTOL, atol=ATOL, err_msg=name)
    for m, m1 in zip(metrics, metrics_1):
        for key in ("loss", "grad_norm", "num_transitions", "rho_mean", "learning_rate"):
            np.testing.assert_allclose(m[key], m1[key], rtol=1e-5, err_msg=key)
    copies = _replica_copies(learner)
    for copy in copies[1:]:
        for name in copy:
            np.testing.assert_array_equal(copy[name], copies[0][name])


def test_one_step_is_rmsprop_on_the_clipped_global_gradient(batches):
    """An oracle written from the formulas: g = grad of the global summed loss on one device,
    clipped to norm 40; ms = (1 - rho) g^2; p -= lr g / sqrt(ms + eps)."""
    learner = _tiny_learner(4)
    _, p0 = learner.get_params()
    reference = TinyNetwork()
    batch = {k: tf.constant(v) for k, v in batches[0].items()}
    with tf.GradientTape() as tape:
        first = tf.equal(tf.cast(batch["step_type"], tf.int32), 0)
        policy_params, values = reference.unroll({"obs": batch["observation/obs"]}, first, {})
        from impala_rep.losses import impala_loss

        loss, _ = impala_loss(learner.policy, policy_params, values, batch, LossConfig())
    names = ["kernel", "bias"]
    grads = tape.gradient(loss, [reference.kernel, reference.bias])
    grads, norm = tf.clip_by_global_norm(grads, 40.0)
    metrics = learner.train(batches[0])
    np.testing.assert_allclose(metrics["grad_norm"], norm.numpy(), rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], loss.numpy(), rtol=1e-5)
    _, p1 = learner.get_params()
    for name, g in zip(names, grads):
        g = g.numpy()
        expected = p0[name] - 6e-4 * g / np.sqrt(0.01 * g * g + 0.01)
        np.testing.assert_allclose(p1[name], expected, rtol=1e-5, atol=1e-7, err_msg=name)


def test_xla_step_matches_uncompiled(batches, one_replica):
    _, (_, params_1), metrics_1 = one_replica
    learner = _tiny_learner(2, jit_compile=True)
    metrics = _train(learner, batches)
    _, params = learner.get_params()
    for name in params_1:
        np.testing.assert_allclose(params[name], params_1[name], rtol=RTOL, atol=ATOL, err_msg=name)
    np.testing.assert_allclose(metrics[-1]["loss"], metrics_1[-1]["loss"], rtol=1e-5)


def test_step_has_a_fixed_input_signature(batches):
    learner = _tiny_learner(2)
    _train(learner, batches)
    assert learner.train_fn.experimental_get_tracing_count() == 1
    spec = learner.train_fn.input_signature[0]
    assert spec["observation/obs"].shape == (T + 1, B, 5) and spec["step_type"].dtype == tf.uint8


def test_clipping_bounds_the_update(batches):
    learner = _tiny_learner(2, optimizer_config=OptimizerConfig(clip_norm=1e-6))
    _, p0 = learner.get_params()
    metrics = learner.train(batches[0])
    assert metrics["grad_norm"] > 1.0  # reported before clipping
    _, p1 = learner.get_params()
    for name in p0:  # |update| <= lr * |g| / sqrt(eps) with |g| <= 1e-6
        assert np.max(np.abs(p1[name] - p0[name])) <= 6e-4 * 1e-6 / 0.1 * 1.01


def test_learning_rate_anneals_linearly_to_zero(batches):
    learner = _tiny_learner(2, optimizer_config=OptimizerConfig(anneal_steps=2))
    rates = [m["learning_rate"] for m in _train(learner, batches)]
    np.testing.assert_allclose(rates, [6e-4, 3e-4, 0.0], atol=1e-9)
    _, before = learner.get_params()
    learner.train(batches[0])
    _, after = learner.get_params()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])


def test_learning_rate_warms_up_then_anneals(batches):
    config = OptimizerConfig(learning_rate=6e-4, warmup_steps=2, anneal_steps=4)
    learner = _tiny_learner(2, optimizer_config=config)
    rates = [m["learning_rate"] for m in _train(learner, batches)]
    # step 0: half warmed up, full anneal factor; step 1: warmed up, 3/4 left; step 2: half left.
    np.testing.assert_allclose(rates, [3e-4, 6e-4 * 0.75, 6e-4 * 0.5][: len(rates)], rtol=1e-6)
    assert len(rates) == 3
    assert OptimizerConfig(warmup_steps=0).learning_rate_schedule() == 6e-4  # constant: a float
    with pytest.raises(ValueError, match="warmup_steps must be a whole number"):
        OptimizerConfig(warmup_steps=-1)


def test_learning_rate_anneals_over_whichever_budget_is_further_along(batches):
    # 2 replicas: the seconds are a mirrored variable, set from outside the step.
    config = OptimizerConfig(learning_rate=6e-4, warmup_steps=0, anneal_steps=4, anneal_seconds=100.0)
    learner = _tiny_learner(2, optimizer_config=config)
    rates = []
    for seconds, batch in zip([0.0, 60.0, 10.0], batches):
        learner.set_train_seconds(seconds)
        rates.append(learner.train(batch)["learning_rate"])
    # step 0 at 0 s: all left; step 1 at 60 s: time is ahead (0.4 left, steps 0.75);
    # step 2 at 10 s: steps are ahead (0.5 left, time 0.9).
    np.testing.assert_allclose(rates, [6e-4, 6e-4 * 0.4, 6e-4 * 0.5], rtol=1e-5)
    learner.set_train_seconds(150.0)  # past the time budget: a rate of 0 leaves the parameters
    _, before = learner.get_params()
    assert learner.train(batches[0])["learning_rate"] == 0.0
    _, after = learner.get_params()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])
    by_time = _tiny_learner(1, optimizer_config=OptimizerConfig(warmup_steps=0, anneal_seconds=10.0))
    by_time.set_train_seconds(2.5)
    np.testing.assert_allclose(by_time.train(batches[0])["learning_rate"], 6e-4 * 0.75, rtol=1e-5)
    with pytest.raises(ValueError, match="train_seconds must be a finite number of seconds, 0 or more"):
        by_time.set_train_seconds(-1.0)
    with pytest.raises(ValueError, match="anneal_seconds must be positive, or None"):
        OptimizerConfig(anneal_seconds=0.0)
    with pytest.raises(TypeError, match="anneal_seconds must be a finite number"):
        OptimizerConfig(anneal_seconds=float("inf"))
    with pytest.raises(ValueError, match="anneal_seconds needs the train_seconds variable"):
        OptimizerConfig(anneal_seconds=5.0).learning_rate_schedule()


def test_get_params_is_a_versioned_copy(batches):
    learner = _tiny_learner(2)
    version, params = learner.get_params()
    assert version == 0 and set(params) == {"kernel", "bias"}
    params["kernel"][:] = 123.0  # a copy: the network is untouched
    assert not np.any(learner.get_params()[1]["kernel"] == 123.0)
    learner.train(batches[0])
    assert learner.get_params()[0] == 1 == int(learner.step.numpy())


def test_checkpoint_round_trip(batches, tmp_path):
    learner = _tiny_learner(2)
    learner.train(batches[0])
    learner.set_train_seconds(12.5)
    checkpoint = tf.train.Checkpoint(**learner.checkpoint_objects())
    path = checkpoint.save(str(tmp_path / "ckpt"))
    saved = learner.get_params()
    learner.train(batches[1])
    learner.set_train_seconds(99.0)
    checkpoint.restore(path).assert_existing_objects_matched()
    version, params = learner.get_params()
    assert version == saved[0] == 1
    assert float(learner.train_seconds.numpy()) == 12.5
    for name in params:
        np.testing.assert_array_equal(params[name], saved[1][name])
    # Optimizer slots are restored too: the next step repeats exactly.
    after_1 = (learner.train(batches[1]), learner.get_params()[1])
    checkpoint.restore(path)
    after_2 = (learner.train(batches[1]), learner.get_params()[1])
    for name in params:
        np.testing.assert_array_equal(after_1[1][name], after_2[1][name])


def test_a_resumed_constant_learning_rate_is_this_runs_not_the_checkpoints(batches, tmp_path):
    # A constant rate is an optimizer variable: a restore brings back the writer's rate, so a
    # run resumed with a lower --learning-rate (say, after diverging) kept the old one.
    constant = dict(warmup_steps=0, anneal_steps=None)
    learner = _tiny_learner(2, optimizer_config=OptimizerConfig(learning_rate=1e-3, **constant))
    learner.train(batches[0])
    path = tf.train.Checkpoint(**learner.checkpoint_objects()).save(str(tmp_path / "ckpt"))
    resumed = _tiny_learner(2, optimizer_config=OptimizerConfig(learning_rate=1e-5, **constant))
    tf.train.Checkpoint(**resumed.checkpoint_objects()).restore(path).assert_existing_objects_matched()
    assert np.isclose(float(resumed.optimizer.learning_rate.numpy()), 1e-3)  # the checkpoint's
    resumed.restore_configured_learning_rate()
    assert np.isclose(float(resumed.optimizer.learning_rate.numpy()), 1e-5)
    # A schedule follows the restored step counter and is left alone.
    annealed = _tiny_learner(2, optimizer_config=OptimizerConfig(learning_rate=1e-3, warmup_steps=0, anneal_steps=10))
    annealed.train(batches[0])
    path = tf.train.Checkpoint(**annealed.checkpoint_objects()).save(str(tmp_path / "annealed"))
    again = _tiny_learner(2, optimizer_config=OptimizerConfig(learning_rate=1e-3, warmup_steps=0, anneal_steps=10))
    schedule = again.optimizer.learning_rate
    tf.train.Checkpoint(**again.checkpoint_objects()).restore(path).assert_existing_objects_matched()
    again.restore_configured_learning_rate()
    assert again.optimizer.learning_rate is schedule
    assert int(again.optimizer.iterations.numpy()) == 1  # the restored step the schedule follows


def test_bad_batches_and_configs_are_sentences(batches):
    learner = _tiny_learner(2)
    bad = dict(batches[0])
    del bad["reward"]
    with pytest.raises(ValueError, match="the batch lacks 'reward'"):
        learner.train(bad)
    with pytest.raises(ValueError, match=r"batch\['reward'\] has dtype float64, but the learner step expects float32"):
        learner.train({**batches[0], "reward": batches[0]["reward"].astype(np.float64)})
    with pytest.raises(ValueError, match=r"has shape \[5, 4\], but the learner step expects \[5, 8\]"):
        learner.train({**batches[0], "reward": batches[0]["reward"][:, :4]})
    with pytest.raises(ValueError, match="batch size 6 is not divisible by the 4 replicas.* or change num_replicas"):
        LearnerStep(make_replicator("cpu", num_replicas=4), TinyNetwork, tiny_policy(), tiny_batch_spec(T, 6))
    # A TPU runs one replica per core: no advice to change the replicas there.
    with pytest.raises(ValueError, match=r"multiple of 8 \(e.g. 8\): a TPU runs one replica per core\.$"):
        LearnerStep._check_batch_spec(tiny_batch_spec(T, 6), 8, "tpu")
    with pytest.raises(ValueError, match="learning_rate must be positive"):
        OptimizerConfig(learning_rate=0.0)
    with pytest.raises(ValueError, match="decay must lie in"):
        OptimizerConfig(decay=1.0)
    with pytest.raises(ValueError, match="clip_norm must be positive, or None"):
        OptimizerConfig(clip_norm=0.0)
    with pytest.raises(TypeError, match="anneal_steps must be an int or None"):
        OptimizerConfig(anneal_steps=1.5)
    with pytest.raises(ValueError, match="anneal_steps must be at least 1"):
        OptimizerConfig(anneal_steps=0)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        make_batch_spec({}, tiny_policy().action_spec, T, 0)


@pytest.mark.parametrize("epsilon", [1e-12, 1e4])
def test_rmsprop_epsilon_sets_how_far_the_first_update_moves_each_weight(epsilon):
    # The first RMSProp step from a zero mean square: lr * g / sqrt((1 - decay) * g^2 + epsilon).
    # With epsilon far below (1 - decay) g^2 every weight moves lr / sqrt(1 - decay), whatever
    # its gradient; far above, lr * g / sqrt(epsilon), as SGD at a rate cut by sqrt(epsilon).
    lr, decay = 1e-3, 0.99
    learner = _tiny_learner(1, optimizer_config=OptimizerConfig(learning_rate=lr, decay=decay, epsilon=epsilon,
                                                               clip_norm=None))
    assert float(learner.optimizer.epsilon) == epsilon
    _, before = learner.get_params()
    batch = tiny_batches(1, T, B)[0]
    learner.train(batch)
    _, after = learner.get_params()
    moved = np.concatenate([np.abs(after[k] - before[k]).ravel() for k in before])
    moved = moved[moved > 0]
    assert moved.size >= 20
    if epsilon < 1:
        np.testing.assert_allclose(moved, lr / np.sqrt(1 - decay), rtol=1e-3)
    else:
        assert moved.max() < lr * 1e-1  # the gradients here are far below sqrt(1e4) = 100


def test_baseline_torso_scale_reaches_the_network_and_a_network_without_it_is_a_sentence():
    from impala_rep.networks import NetworkConfig
    from impala_rep.specs import ArraySpec

    obs = {"position": ArraySpec("position", (3,), "float32")}
    action = ArraySpec("action", (2,), "float32", minimum=-1.0, maximum=1.0)
    learner = LearnerStep.from_config(make_replicator("cpu", num_replicas=1), NetworkConfig(torso="mlp", mlp_sizes=(8,)),
                                      obs, action, T, B, loss_config=LossConfig(baseline_torso_scale=0.25))
    assert learner.network.value_torso_scale == 0.25
    with pytest.raises(ValueError, match="loss_config.baseline_torso_scale is 0.5, but the network applies 1.0"):
        _tiny_learner(1, loss_config=LossConfig(baseline_torso_scale=0.5))
    assert _tiny_learner(1, loss_config=LossConfig()).network is not None


def _popart_learner(optimizer_config, replicas=1):
    from impala_rep.networks import NetworkConfig
    from impala_rep.specs import ArraySpec

    obs = {"position": ArraySpec("position", (3,), "float32")}
    action = ArraySpec("action", (2,), "float32", minimum=-1.0, maximum=1.0)
    return LearnerStep.from_config(make_replicator("cpu", num_replicas=replicas),
                                   NetworkConfig(torso="mlp", mlp_sizes=(8,)), obs, action, T, B,
                                   loss_config=LossConfig(popart=0.25), optimizer_config=optimizer_config)


def _large_return_batches(learner, count, seed=3):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        data = {key: rng.normal(size=spec.shape).astype(spec.dtype) if spec.dtype == "float32" else
                np.ones(spec.shape, spec.dtype) for key, spec in learner.batch_spec.items()}
        data["reward"] = rng.uniform(5.0, 15.0, size=data["reward"].shape).astype(np.float32)  # sigma far above 1
        data["discount"] = np.full(data["discount"].shape, 0.9, np.float32)
        data["behaviour_log_prob"] = np.full(data["behaviour_log_prob"].shape, -50.0, np.float32)  # rho clipped to 1
        data["action"] = np.clip(data["action"], -1.0, 1.0)
        out.append(data)
    return out


def test_popart_moves_the_statistics_to_the_batches_value_targets_after_each_update():
    learner = _popart_learner(OptimizerConfig(), replicas=2)
    assert learner.network.popart
    batches = iter(_large_return_batches(learner, 5))
    mean = mean_square = 0.0
    for i, rate in enumerate((1.0, 0.5, 0.33333334, 0.25, 0.25)):  # max(step size, 1/updates)
        metrics, (_, params) = learner.train_and_read(next(batches))
        mean += rate * (metrics["vs_mean"] - mean)
        mean_square += rate * (metrics["vs_square_mean"] - mean_square)
        assert metrics["popart_mu"] == pytest.approx(mean, rel=1e-5)
        assert metrics["popart_sigma"] == pytest.approx(np.sqrt(mean_square - mean ** 2), rel=1e-3)
    assert metrics["popart_mu"] > 10.0  # the targets' scale, not the value head's at its start
    # What the actors get is the value head with the statistics folded in.
    mu, sigma = (float(x) for x in learner.network.value_stats())
    raw = learner.network.named_variables
    np.testing.assert_allclose(params["value/kernel"], raw["value/kernel"].numpy() * sigma, rtol=1e-5)
    np.testing.assert_allclose(params["value/bias"], raw["value/bias"].numpy() * sigma + mu, rtol=1e-5)
    with pytest.raises(ValueError, match="loss_config.popart is 0.001, but the network was built without popart"):
        _tiny_learner(1, loss_config=LossConfig(popart=1e-3))


@pytest.mark.parametrize("replicas", [1, 2])
def test_rmsprop_epsilon_over_sigma_squared_is_what_each_update_uses(replicas):
    # epsilon_scale "sigma": each update adds epsilon / sigma^2 (sigma as it stood before the
    # update) to the mean squares. Two learners from the same start on the same batches: the
    # first update is the same (sigma starts at 1); the second, after sigma has grown past 1,
    # moves the weights of the one whose epsilon shrank further than the fixed one's.
    epsilon = 1e4  # far above the mean squares: the steps scale as 1 / sqrt(epsilon)
    scaled = _popart_learner(OptimizerConfig(epsilon=epsilon, epsilon_scale="sigma", clip_norm=None), replicas)
    fixed = _popart_learner(OptimizerConfig(epsilon=epsilon, clip_norm=None), replicas)
    fixed.set_params(scaled.get_params()[1])
    assert scaled.optimizer.epsilon is scaled.rmsprop_epsilon and fixed.rmsprop_epsilon is None
    batches = _large_return_batches(scaled, 2)
    sigma = 1.0
    moved = {}

    def weights(learner):  # the value head's are left out: PopArt rescales them after each update, in both alike
        return {name: v.numpy().copy() for name, v in learner.network.named_variables.items()
                if not name.startswith("value/")}

    for i, batch in enumerate(batches):
        start = {"scaled": weights(scaled), "fixed": weights(fixed)}
        metrics = scaled.train(batch)
        fixed.train(batch)
        assert metrics["rmsprop_epsilon"] == pytest.approx(epsilon / sigma ** 2, rel=1e-5)
        assert float(scaled.rmsprop_epsilon.numpy()) == pytest.approx(epsilon / sigma ** 2, rel=1e-5)
        sigma = float(metrics["popart_sigma"])
        moved[i] = {name: sum(float(np.abs(w[k] - start[name][k]).sum()) for k in w)
                    for name, w in (("scaled", weights(scaled)), ("fixed", weights(fixed)))}
    assert sigma > 5.0  # returns of 5-15 per step, discounted at 0.9: epsilon / sigma^2 under 400
    assert moved[0]["scaled"] == pytest.approx(moved[0]["fixed"], rel=1e-5)
    assert moved[1]["scaled"] > 2.0 * moved[1]["fixed"]


def test_rmsprop_epsilon_over_sigma_needs_popart_and_stays_out_of_the_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="epsilon_scale must be one of fixed, sigma, got 'popart'"):
        OptimizerConfig(epsilon_scale="popart")
    with pytest.raises(ValueError, match="epsilon_scale is 'sigma', but the loss keeps no PopArt sigma"):
        _tiny_learner(1, optimizer_config=OptimizerConfig(epsilon_scale="sigma"))
    # A checkpoint of either scale restores into the other: the epsilon is derived from sigma.
    fixed = _popart_learner(OptimizerConfig())
    fixed.train(_large_return_batches(fixed, 1)[0])
    path = tf.train.Checkpoint(**fixed.checkpoint_objects()).save(str(tmp_path / "ckpt"))
    scaled = _popart_learner(OptimizerConfig(epsilon_scale="sigma"))
    scaled.train(_large_return_batches(scaled, 1, seed=4)[0])  # its slots exist, as on resume
    tf.train.Checkpoint(**scaled.checkpoint_objects()).restore(path).assert_existing_objects_matched()
    sigma = float(scaled.network.value_stats()[1])
    assert sigma == pytest.approx(float(fixed.network.value_stats()[1]))
    metrics = scaled.train(_large_return_batches(scaled, 1, seed=5)[0])
    assert metrics["rmsprop_epsilon"] == pytest.approx(0.01 / sigma ** 2, rel=1e-5)


# -- the real network ----------------------------------------------------------------------


@pytest.mark.parametrize("torso, lstm", [("shallow", None), ("deep", 8)])
def test_impala_network_replicas_match_one_replica(torso, lstm):
    """TFNetwork + impala_loss on small pixel batches (Gaussian policy): 2 replicas == 1 (and XLA)."""
    from impala_rep.networks import NetworkConfig
    from impala_rep.specs import ArraySpec

    obs = {"pixels": ArraySpec("pixels", (36, 36, 3), "uint8"), "velocity": ArraySpec("velocity", (2,), "float32")}
    action = ArraySpec("action", (2,), "float32", minimum=-1.0, maximum=1.0)
    config = NetworkConfig(torso=torso, hidden_size=16, mlp_sizes=(8,), lstm_size=lstm)
    t, b = 3, 4
    rng = np.random.default_rng(0)
    results = []
    configurations = ((1, False), (2, False), (2, True)) if lstm is None else ((1, False), (2, False))
    for n, jit in configurations:
        learner = LearnerStep.from_config(make_replicator("cpu", num_replicas=n), config, obs, action, t, b, jit_compile=jit)
        if not results:
            initial = learner.get_params()[1]
        else:
            learner.set_params(initial)  # same start for every run
        data = []
        for _ in range(2):
            batch = {}
            for key, spec in learner.batch_spec.items():
                if spec.dtype == "uint8" and key.startswith("observation/"):
                    batch[key] = rng.integers(0, 256, size=spec.shape, dtype=np.uint8)
                elif key == "step_type":
                    batch[key] = rng.choice(np.array([0, 1, 2], np.uint8), size=spec.shape, p=[0.2, 0.6, 0.2])
                elif key == "discount":
                    batch[key] = np.ones(spec.shape, np.float32)
                else:
                    batch[key] = rng.normal(size=spec.shape).astype(np.float32) - (3.0 if key == "behaviour_log_prob" else 0.0)
            data.append(batch)
        if results:
            data = results[0][2]
        metrics = [learner.train(x) for x in data]
        results.append((learner.get_params()[1], metrics, data))
    base = results[0][0]
    # Two replicas sum the gradient in another order than one. The deep torso's 15 layers
    # amplify that: in a full-suite run on the thirty-third session's AMD host one of its
    # kernels differed by up to 6e-5 after the two steps (74 of 9,216 elements of one output
    # channel), while its parameters move by only about 4e-5 (median) in them. So the deep
    # case is a coarse check (it trains under two replicas, with an LSTM, to the same
    # parameters within 1e-4 and the same loss); replication bugs are the shallow case's to
    # catch: its parameters move by about 3e-4 (median, 8e-4 mean) and it keeps 1e-5.
    atol = 1e-4 if torso == "deep" else 1e-5
    for params, metrics, _ in results[1:]:
        for name in base:
            np.testing.assert_allclose(params[name], base[name], rtol=1e-4, atol=atol, err_msg=name)
        np.testing.assert_allclose(metrics[-1]["loss"], results[0][1][-1]["loss"], rtol=1e-4)
    assert any(not np.allclose(base[n], initial[n]) for n in base)


def test_get_params_reads_the_real_networks_variables_now(batches):
    """The TF network's parameters are read in one tf.function call: the same names and
    values as the network's own eager read, the step counter with them, and fresh values
    after a step and after set_params (nothing cached)."""
    from impala_rep.networks import NetworkConfig
    from impala_rep.specs import ArraySpec

    obs = {"pixels": ArraySpec("pixels", (36, 36, 3), "uint8")}
    action = ArraySpec("action", (1,), "float32", minimum=-1.0, maximum=1.0)
    learner = LearnerStep.from_config(make_replicator("cpu", num_replicas=2), NetworkConfig(torso="shallow", hidden_size=16),
                                      obs, action, 3, 4)
    assert learner._params_reader is not None  # the one-call path, not the network's get_params

    def check(want_version):
        version, params = learner.get_params()
        eager = learner.network.get_params()
        assert version == want_version == int(learner.step.numpy())
        assert list(params) == list(eager)
        for name in eager:
            np.testing.assert_array_equal(params[name], eager[name], err_msg=name)
            assert params[name].dtype == np.float32 and params[name].flags.writeable
        return params

    before = check(0)
    rng = np.random.default_rng(1)
    batch = {}
    for key, spec in learner.batch_spec.items():
        if key.startswith("observation/"):
            batch[key] = rng.integers(0, 256, size=spec.shape, dtype=np.uint8)
        elif key == "step_type":
            batch[key] = np.ones(spec.shape, np.uint8)
        elif key == "discount":
            batch[key] = np.ones(spec.shape, np.float32)
        else:
            batch[key] = rng.normal(size=spec.shape).astype(np.float32) - (3.0 if key == "behaviour_log_prob" else 0.0)
    learner.train(batch)
    after = check(1)
    assert any(not np.array_equal(after[n], before[n]) for n in before)
    learner.set_params(before)
    restored = check(1)
    assert all(np.array_equal(restored[n], before[n]) for n in before)
    restored[next(iter(restored))][...] = 7.0  # a copy: the variables are untouched
    assert not np.any(learner.get_params()[1][next(iter(restored))] == 7.0)


def test_learner_on_single_frames_trains_like_the_learner_on_stacks():
    """The launcher's learner gets single frames ``frames/pixels`` [T+K, B, ...] and stacks
    them in its graph. With 1 and 2 replicas (the frames split along B) and with XLA, two
    steps give the parameters of the learner fed the stacks rebuild_stack builds."""
    from impala_rep.framestack import rebuild_stack
    from impala_rep.networks import NetworkConfig
    from impala_rep.specs import ArraySpec

    k, t, b = 3, 3, 4
    obs = {"pixels": ArraySpec("pixels", (36, 36, 3 * k), "uint8")}
    action = ArraySpec("action", (1,), "float32", minimum=-1.0, maximum=1.0)
    config = NetworkConfig(torso="shallow", hidden_size=16)
    rng = np.random.default_rng(4)
    batches = []
    for _ in range(2):
        frames = rng.integers(0, 256, size=(t + k, b, 36, 36, 3), dtype=np.uint8)
        step_type = rng.choice(np.array([0, 1, 2], np.uint8), size=(t + 1, b), p=[0.3, 0.5, 0.2])
        batches.append({
            "frames/pixels": frames, "step_type": step_type,
            "reward": rng.normal(size=(t + 1, b)).astype(np.float32),
            "discount": np.ones((t + 1, b), np.float32),
            "action": rng.uniform(-1, 1, size=(t + 1, b, 1)).astype(np.float32),
            "behaviour_log_prob": np.full((t + 1, b), -1.0, np.float32),
        })
    reference = LearnerStep.from_config(make_replicator("cpu", num_replicas=1), config, obs, action, t, b)
    assert "observation/pixels" in reference.batch_spec and not reference.frame_stack
    initial = reference.get_params()[1]
    for batch in batches:
        stacked = dict(batch, **{"observation/pixels": rebuild_stack(batch["frames/pixels"][k - 1:],
                                                                     batch["frames/pixels"][:k - 1], batch["step_type"])})
        reference.train(stacked)
    want = reference.get_params()[1]
    for n, jit in ((1, False), (2, False), (1, True)):
        learner = LearnerStep.from_config(make_replicator("cpu", num_replicas=n), config, obs, action, t, b,
                                          jit_compile=jit, frame_stack={"pixels": k})
        assert learner.batch_spec["frames/pixels"].shape == (t + k, b, 36, 36, 3)
        assert "observation/pixels" not in learner.batch_spec and learner.frame_stack == {"pixels": k}
        learner.set_params(initial)
        for batch in batches:
            learner.train(batch)
        got = learner.get_params()[1]
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=f"{n} replicas, xla={jit}: {name}")
    assert any(not np.allclose(want[name], initial[name]) for name in want)
    with pytest.raises(ValueError, match=r"batch\['frames/pixels'\] has shape"):
        learner.train(dict(batches[0], **{"frames/pixels": batches[0]["frames/pixels"][1:]}))
    with pytest.raises(ValueError, match="cannot be 2 stacked frames"):
        make_batch_spec(obs, action, t, b, frame_stack={"pixels": 2})
    with pytest.raises(ValueError, match=r"frame_stack names \['rgb'\]"):
        make_batch_spec(obs, action, t, b, frame_stack={"rgb": 3})


# -- two learner processes -------------------------------------------------------------------


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def test_multiworker_two_processes_end_with_identical_parameters(tmp_path, one_replica):
    ports = ",".join(map(str, _free_ports(2)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "multiworker_worker.py"), "--ports", ports, "--index", str(i),
             "--steps", str(K), "--unroll-length", str(T), "--batch-size", str(B), "--out", str(tmp_path / f"w{i}.npz")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=150)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    w0, w1 = (np.load(tmp_path / f"w{i}.npz") for i in range(2))
    assert int(w0["num_replicas"]) == 2 and int(w0["step"]) == int(w1["step"]) == K
    _, (_, params_1), _ = one_replica
    for name in ("kernel", "bias"):
        np.testing.assert_array_equal(w0[name], w1[name])
        # Two workers x B/2 each == one replica on the whole batch.
        np.testing.assert_allclose(w0[name], params_1[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_shared_tensor_aliases_aligned_arrays_and_leaves_the_rest():
    from impala_rep.framestack import aligned_empty
    from learner.step import shared_tensor

    big = aligned_empty((64, 128, 128), np.uint8)  # 1 MiB
    big[:] = 3
    tensor = shared_tensor(big)
    assert isinstance(tensor, tf.Tensor) and tensor.shape == big.shape and tensor.dtype == tf.uint8
    big[0, 0, 0] = 9  # the tensor reads the array's memory: no copy was made
    assert int(tensor.numpy()[0, 0, 0]) == 9 and int(tf.reduce_sum(tf.cast(tensor, tf.int64))) == 3 * big.size + 6
    misaligned = aligned_empty((2 ** 20 + 64,), np.uint8)[8:8 + 2 ** 20]  # TensorFlow would abort on it
    readonly = aligned_empty((2 ** 20,), np.uint8)
    readonly.flags.writeable = False
    for value in (misaligned, readonly, aligned_empty((16,), np.float32), big[:, ::2], [1, 2, 3]):
        assert shared_tensor(value) is value


def test_step_on_shared_batches_matches_the_copied_step(batches, one_replica, monkeypatch):
    import learner.step as step_module
    from impala_rep.framestack import aligned_empty

    monkeypatch.setattr(step_module, "_SHARE_MIN_BYTES", 0)  # share even the tiny batches
    aligned = []
    for batch in batches:
        copy = {}
        for key, value in batch.items():
            copy[key] = aligned_empty(value.shape, value.dtype)
            copy[key][...] = value
        aligned.append(copy)
    assert all(isinstance(step_module.shared_tensor(v), tf.Tensor) for v in aligned[0].values())
    learner = _tiny_learner(1)
    metrics = _train(learner, aligned)
    _, (version_1, params_1), metrics_1 = one_replica
    version, params = learner.get_params()
    assert version == version_1
    for name in params_1:
        np.testing.assert_array_equal(params[name], params_1[name], err_msg=name)
    assert metrics == metrics_1


def test_train_and_read_returns_the_steps_own_parameters(batches):
    """train_and_read = train + get_params in one call: the same metrics and parameters as
    the two calls on an identical learner, a version equal to the step counter, and
    read-only arrays that the next step does not change (a snapshot, not the variables)."""
    from impala_rep.networks import NetworkConfig
    from impala_rep.specs import ArraySpec
    from learner.probe import synthetic_batch

    obs = {"pixels": ArraySpec("pixels", (36, 36, 3), "uint8")}
    action = ArraySpec("action", (1,), "float32", minimum=-1.0, maximum=1.0)

    def make():
        return LearnerStep.from_config(make_replicator("cpu", num_replicas=2),
                                       NetworkConfig(torso="shallow", hidden_size=16), obs, action, 3, 4)

    fused, plain = make(), make()
    plain.set_params(fused.get_params()[1])  # the same starting point
    assert fused._train_read_fn is not None  # the one-call path
    rng = np.random.default_rng(2)
    data = [synthetic_batch(fused.batch_spec, rng) for _ in range(2)]
    for want_version, batch in enumerate(data, start=1):
        metrics, (version, params) = fused.train_and_read(batch)
        want_metrics = plain.train(batch)
        _, want_params = plain.get_params()
        assert version == want_version == int(fused.step.numpy())
        assert metrics == pytest.approx(want_metrics, rel=1e-6)
        assert list(params) == list(want_params)
        for name in params:
            np.testing.assert_array_equal(params[name], want_params[name], err_msg=name)
            assert not params[name].flags.writeable
        if want_version == 1:
            first = {n: p.copy() for n, p in params.items()}
            first_views = params
    # The next step's update left the first step's snapshot as it was.
    for name in first:
        np.testing.assert_array_equal(first_views[name], first[name], err_msg=name)
    assert any(not np.array_equal(params[n], first[n]) for n in first)

    # A network without named_variables: the two calls, same result shape.
    tiny = _tiny_learner(1)
    assert tiny._train_read_fn is None
    metrics, (version, params) = tiny.train_and_read(batches[0])
    assert version == 1 and set(params) == {"kernel", "bias"} and "loss" in metrics
    with pytest.raises(ValueError, match="the batch lacks 'reward'"):
        tiny.train_and_read({k: v for k, v in batches[0].items() if k != "reward"})
    with pytest.raises(ValueError, match="the batch lacks 'reward'"):
        fused.train_and_read({k: v for k, v in data[0].items() if k != "reward"})
