"""Policy distributions against closed forms (scipy), NumPy vs TF, sampling, env mapping."""

import numpy as np
import pytest
import tensorflow as tf
from scipy import special, stats

from impala_rep.distributions import (
    LOG_STD_MAX,
    LOG_STD_MIN,
    CategoricalPolicy,
    DiscretisedPolicy,
    GaussianPolicy,
    make_policy,
)
from impala_rep.networks import NetworkConfig
from impala_rep.specs import ArraySpec

DISCRETE = ArraySpec("action", (), "int32", num_values=5)
BOUNDED = ArraySpec("action", (3,), "float32", minimum=(-1.0, 0.0, -2.0), maximum=(1.0, 2.0, 2.0))


def policy_of(kind, bins=7):
    spec = DISCRETE if kind == "categorical" else BOUNDED
    return make_policy(spec, NetworkConfig(policy=kind, bins=bins))


def random_params(policy, lead=(4, 3), seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.normal(0, 1.5, size=lead + s).astype(np.float32) for n, s in policy.param_shapes.items()}


def test_make_policy_auto_picks_by_spec():
    assert isinstance(make_policy(DISCRETE, NetworkConfig()), CategoricalPolicy)
    assert isinstance(make_policy(BOUNDED, NetworkConfig()), GaussianPolicy)
    assert isinstance(make_policy(BOUNDED, NetworkConfig(policy="discretised")), DiscretisedPolicy)
    assert isinstance(make_policy(DISCRETE), CategoricalPolicy)


def test_make_policy_accepts_dm_env_specs():
    from dm_env import specs

    assert make_policy(specs.DiscreteArray(4), NetworkConfig()).param_shapes == {"logits": (4,)}
    bounded = specs.BoundedArray((2,), np.float64, -1.0, 1.0)
    policy = make_policy(bounded, NetworkConfig())
    assert policy.param_shapes == {"mean": (2,), "log_std": (2,)}
    assert policy.to_env_action(np.array([3.0, -0.5], np.float32)).dtype == np.float64


@pytest.mark.parametrize(
    "spec, kind, match",
    [
        (ArraySpec("a", (2,), "float32"), "gaussian", "finite action bounds"),
        (ArraySpec("a", (2,), "float32"), "discretised", "finite action bounds"),
        (ArraySpec("a", (2,), "int32", minimum=0, maximum=3), "auto", "neither discrete"),
        (BOUNDED, "categorical", "discrete action spec"),
        (DISCRETE, "gaussian", "floating-point"),
    ],
)
def test_make_policy_rejects_specs_that_do_not_fit(spec, kind, match):
    with pytest.raises(ValueError, match=match):
        make_policy(spec, NetworkConfig(policy=kind))


def test_action_specs_and_param_shapes():
    cat = policy_of("categorical")
    assert cat.action_spec.shape == () and cat.action_spec.dtype == "int32" and cat.action_spec.num_values == 5
    gauss = policy_of("gaussian")
    assert gauss.action_spec.shape == (3,) and gauss.action_spec.dtype == "float32"
    assert gauss.action_spec.minimum is None and gauss.action_spec.maximum is None
    disc = policy_of("discretised", bins=7)
    assert disc.action_spec.shape == (3,) and disc.action_spec.num_values == 7
    assert disc.param_shapes == {"logits": (3, 7)}


def closed_form_log_prob_and_entropy(kind, params, action):
    if kind == "categorical":
        logp = special.log_softmax(params["logits"].astype(np.float64), axis=-1)
        lp = np.take_along_axis(logp, action[..., None].astype(np.int64), -1)[..., 0]
        return lp, stats.entropy(np.exp(logp), axis=-1)
    if kind == "discretised":
        logp = special.log_softmax(params["logits"].astype(np.float64), axis=-1)
        lp = np.take_along_axis(logp, action[..., None].astype(np.int64), -1)[..., 0].sum(-1)
        return lp, stats.entropy(np.exp(logp), axis=-1).sum(-1)
    std = np.exp(params["log_std"].astype(np.float64))
    lp = stats.norm.logpdf(action, loc=params["mean"], scale=std).sum(-1)
    return lp, stats.norm.entropy(scale=std).sum(-1)


@pytest.mark.parametrize("kind", ["categorical", "gaussian", "discretised"])
def test_log_prob_and_entropy_match_closed_forms(kind):
    policy = policy_of(kind)
    params = random_params(policy, seed=1)
    action, sampled_lp = policy.sample_np(params, np.random.default_rng(2))
    assert action.shape == (4, 3) + policy.action_spec.shape
    assert action.dtype == np.dtype(policy.action_spec.dtype) and sampled_lp.dtype == np.float32
    lp_ref, ent_ref = closed_form_log_prob_and_entropy(kind, params, action)
    np.testing.assert_allclose(sampled_lp, lp_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(policy.log_prob_np(params, action), lp_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(policy.entropy_np(params), ent_ref, rtol=1e-5, atol=1e-5)
    tf_params = {k: tf.constant(v) for k, v in params.items()}
    np.testing.assert_allclose(policy.log_prob_tf(tf_params, tf.constant(action)).numpy(), lp_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(policy.entropy_tf(tf_params).numpy(), ent_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["categorical", "gaussian", "discretised"])
def test_tf_methods_run_under_xla(kind):
    policy = policy_of(kind)
    params = random_params(policy, seed=3)
    action, _ = policy.sample_np(params, np.random.default_rng(3))
    fn = tf.function(lambda p, a: (policy.log_prob_tf(p, a), policy.entropy_tf(p)), jit_compile=True)
    lp, ent = fn(params, action)
    np.testing.assert_allclose(lp.numpy(), policy.log_prob_np(params, action), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent.numpy(), policy.entropy_np(params), rtol=1e-5, atol=1e-5)


def test_categorical_sampling_frequencies():
    policy = policy_of("categorical")
    logits = np.array([1.0, 0.0, -1.0, 2.0, 0.5], np.float32)
    n = 40000
    params = {"logits": np.broadcast_to(logits, (n, 5))}
    action, _ = policy.sample_np(params, np.random.default_rng(4))
    freq = np.bincount(action, minlength=5) / n
    np.testing.assert_allclose(freq, special.softmax(logits), atol=0.01)
    assert policy.mode_np({"logits": logits}) == 3


def test_gaussian_sampling_moments_and_unclipped_actions():
    policy = policy_of("gaussian")
    n = 40000
    mean = np.array([0.5, 3.0, -1.0], np.float32)  # 3.0 lies above the bound 2.0
    log_std = np.log(np.array([0.1, 1.0, 2.0], np.float32))
    params = {"mean": np.broadcast_to(mean, (n, 3)), "log_std": np.broadcast_to(log_std, (n, 3))}
    action, _ = policy.sample_np(params, np.random.default_rng(5))
    np.testing.assert_allclose(action.mean(0), mean, atol=0.05)
    np.testing.assert_allclose(action.std(0), np.exp(log_std), rtol=0.03)
    assert action[:, 1].max() > 2.0  # the stored sample is not clipped
    env_action = policy.to_env_action(action)
    assert env_action.min(0).tolist() >= [-1.0, 0.0, -2.0] and env_action.max(0).tolist() <= [1.0, 2.0, 2.0]
    assert env_action[:, 1].max() == 2.0
    np.testing.assert_array_equal(policy.mode_np({"mean": mean, "log_std": log_std}), mean)


def test_discretised_to_env_action_maps_bins_to_values():
    policy = policy_of("discretised", bins=5)
    action = np.array([[0, 0, 0], [4, 4, 4], [2, 1, 3]], np.int32)
    np.testing.assert_allclose(
        policy.to_env_action(action), [[-1.0, 0.0, -2.0], [1.0, 2.0, 2.0], [0.0, 0.5, 1.0]], atol=1e-6
    )
    assert policy.to_env_action(action[2]).shape == (3,)


def test_discretised_to_env_action_keeps_env_shape():
    spec = ArraySpec("action", (2, 2), "float32", minimum=-1.0, maximum=1.0)
    policy = make_policy(spec, NetworkConfig(policy="discretised", bins=3))
    assert policy.action_spec.shape == (4,)
    assert policy.to_env_action(np.array([0, 1, 2, 1])).shape == (2, 2)
    assert make_policy(spec, NetworkConfig(policy="gaussian")).to_env_action(np.zeros(4)).shape == (2, 2)


def test_categorical_to_env_action_uses_env_dtype():
    spec = ArraySpec("action", (), "int64", num_values=3)
    assert make_policy(spec, NetworkConfig()).to_env_action(np.array(2, np.int32)).dtype == np.int64


def test_gaussian_log_std_head_is_a_smooth_clamp():
    policy = policy_of("gaussian")
    raw = np.linspace(-30, 30, 121).astype(np.float32)
    out_np = policy.params_from_head_np({"mean": raw, "log_std": raw})
    out_tf = policy.params_from_head_tf({"mean": tf.constant(raw), "log_std": tf.constant(raw)})
    np.testing.assert_array_equal(out_np["mean"], raw)
    np.testing.assert_allclose(out_np["log_std"], out_tf["log_std"].numpy(), atol=1e-5)
    log_std = out_np["log_std"]
    # Soft bounds: within 1e-2 of [LOG_STD_MIN, LOG_STD_MAX] and reaching them far out.
    assert LOG_STD_MIN - 1e-2 <= log_std.min() < LOG_STD_MIN + 1e-2
    assert LOG_STD_MAX - 1e-2 < log_std.max() <= LOG_STD_MAX + 1e-2
    assert np.all(np.diff(log_std) >= 0)
    inner = (raw > -8) & (raw < 8)
    assert np.all(np.diff(log_std[inner]) > 0)  # strictly increasing: no dead gradient inside
    mid = policy.params_from_head_np({"mean": raw, "log_std": np.zeros(1, np.float32)})["log_std"]
    assert -0.5 < mid[0] < 0.0  # std near 1 at initialisation


def test_multi_categorical_log_prob_and_entropy_are_sums_over_dimensions():
    from impala_rep.distributions import MultiCategoricalPolicy
    from impala_rep.specs import ArraySpec

    spec = ArraySpec("action", (3,), "int32", minimum=0, maximum=3, num_values=4)
    policy = make_policy(spec)
    assert isinstance(policy, MultiCategoricalPolicy) and policy.param_shapes == {"logits": (3, 4)}
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 3, 4)).astype(np.float32)
    action = rng.integers(0, 4, size=(5, 3)).astype(np.int32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = np.take_along_axis(logp, action[..., None], -1)[..., 0].sum(-1)
    np.testing.assert_allclose(policy.log_prob_tf({"logits": logits}, action).numpy(), expected, rtol=1e-5)
    np.testing.assert_allclose(policy.log_prob_np({"logits": logits}, action), expected, rtol=1e-5)
    entropy = -(np.exp(logp) * logp).sum(-1).sum(-1)
    np.testing.assert_allclose(policy.entropy_tf({"logits": logits}).numpy(), entropy, rtol=1e-5)
