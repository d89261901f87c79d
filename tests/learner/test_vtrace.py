"""V-trace: paper-formula oracle, frozen values, identities, modes of execution, bad input.

Shape letters: T time (transitions), B batch.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from impala_rep import vtrace
from impala_rep.distributions import make_policy
from impala_rep.networks import NetworkConfig
from impala_rep.specs import ArraySpec


def oracle(log_rhos, discounts, rewards, values, bootstrap_value, clip_rho=1.0, clip_pg_rho=1.0, lambda_=1.0):
    """V-trace written like the paper's definition (eq. 1), with explicit sums and products.

    v_s = V(x_s) + sum_{t=s}^{T-1} (prod_{i=s}^{t-1} gamma_i c_i) rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t))
    """
    log_rhos, discounts, rewards, values = (np.asarray(a, np.float64) for a in (log_rhos, discounts, rewards, values))
    bootstrap_value = np.asarray(bootstrap_value, np.float64)
    T = log_rhos.shape[0]
    rhos = np.exp(log_rhos)
    rho_bar = rhos if clip_rho is None else np.minimum(clip_rho, rhos)
    cs = lambda_ * np.minimum(1.0, rhos)
    v_next = np.concatenate([values[1:], bootstrap_value[None]], 0)
    vs = np.zeros_like(values)
    for s in range(T):
        total = values[s].copy()
        for t in range(s, T):
            weight = np.ones_like(values[s])
            for i in range(s, t):
                weight = weight * discounts[i] * cs[i]
            total = total + weight * rho_bar[t] * (rewards[t] + discounts[t] * v_next[t] - values[t])
        vs[s] = total
    vs_next = np.concatenate([vs[1:], bootstrap_value[None]], 0)
    pg_rho = rhos if clip_pg_rho is None else np.minimum(clip_pg_rho, rhos)
    pg = pg_rho * (rewards + discounts * vs_next - values)
    return vs, pg


def random_inputs(shape, seed=0, on_policy=False):
    rng = np.random.default_rng(seed)
    log_rhos = np.zeros(shape) if on_policy else rng.normal(0.0, 0.7, size=shape)
    discounts = rng.choice([0.0, 0.9, 0.99, 1.0], size=shape, p=[0.1, 0.3, 0.3, 0.3])
    rewards = rng.normal(size=shape)
    values = rng.normal(size=shape)
    bootstrap = rng.normal(size=shape[1:])
    return [np.asarray(a, np.float32) for a in (log_rhos, discounts, rewards, values, bootstrap)]


def run(*args, **kwargs):
    out = vtrace.from_importance_weights(*args, **kwargs)
    return out.vs.numpy(), out.pg_advantages.numpy()


@pytest.mark.parametrize("clip_rho, clip_pg_rho", [(1.0, 1.0), (None, None), (2.0, 0.5), (0.7, None)])
@pytest.mark.parametrize("lambda_", [1.0, 0.6, 0.0])
def test_matches_paper_oracle(clip_rho, clip_pg_rho, lambda_):
    inputs = random_inputs((7, 3), seed=1)
    vs, pg = run(*inputs, clip_rho_threshold=clip_rho, clip_pg_rho_threshold=clip_pg_rho, lambda_=lambda_)
    vs_ref, pg_ref = oracle(*inputs, clip_rho=clip_rho, clip_pg_rho=clip_pg_rho, lambda_=lambda_)
    np.testing.assert_allclose(vs, vs_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pg, pg_ref, rtol=1e-5, atol=1e-5)


def test_frozen_hand_checked_values():
    # rho = [0.5, 2, 1] -> clipped [0.5, 1, 1]; gamma 0.9.
    # delta = [0.5*(1 + 0.9*1 - 0.5), 0 + 0.9*(-1) - 1, 2 + 0.9*2 + 1] = [0.7, -1.9, 4.8]
    # vs - V: [4.8] -> -1.9 + 0.9*4.8 = 2.42 -> 0.7 + 0.9*0.5*2.42 = 1.789
    out = vtrace.from_importance_weights(
        log_rhos=np.log([[0.5], [2.0], [1.0]]).astype(np.float32),
        discounts=np.full((3, 1), 0.9, np.float32),
        rewards=np.array([[1.0], [0.0], [2.0]], np.float32),
        values=np.array([[0.5], [1.0], [-1.0]], np.float32),
        bootstrap_value=np.array([2.0], np.float32),
    )
    np.testing.assert_allclose(out.vs.numpy()[:, 0], [2.289, 3.42, 3.8], atol=1e-5)
    np.testing.assert_allclose(out.pg_advantages.numpy()[:, 0], [1.789, 2.42, 4.8], atol=1e-5)


def test_on_policy_without_clipping_is_n_step_return():
    log_rhos, discounts, rewards, values, bootstrap = random_inputs((6, 4), seed=2, on_policy=True)
    vs, _ = run(log_rhos, discounts, rewards, values, bootstrap, clip_rho_threshold=None, clip_pg_rho_threshold=None)
    # Discounted return to the end of the unroll, bootstrapped, computed forward.
    T = rewards.shape[0]
    expected = np.zeros_like(rewards, dtype=np.float64)
    for s in range(T):
        ret, scale = np.zeros(rewards.shape[1]), np.ones(rewards.shape[1])
        for t in range(s, T):
            ret = ret + scale * rewards[t]
            scale = scale * discounts[t]
        expected[s] = ret + scale * bootstrap
    np.testing.assert_allclose(vs, expected, rtol=1e-5, atol=1e-5)


def test_lambda_zero_gives_one_step_targets():
    log_rhos, discounts, rewards, values, bootstrap = random_inputs((5, 3), seed=3, on_policy=True)
    vs, _ = run(log_rhos, discounts, rewards, values, bootstrap, lambda_=0.0)
    v_next = np.concatenate([values[1:], bootstrap[None]], 0)
    np.testing.assert_allclose(vs, rewards + discounts * v_next, rtol=1e-5, atol=1e-5)


def test_zero_discount_mid_unroll_cuts_the_trace():
    log_rhos, discounts, rewards, values, bootstrap = random_inputs((8, 2), seed=4)
    discounts[3] = 0.0
    vs_a, pg_a = run(log_rhos, discounts, rewards, values, bootstrap)
    # Change everything after the cut: targets up to the cut must not move.
    rng = np.random.default_rng(9)
    for arr in (log_rhos, rewards, values):
        arr[4:] = rng.normal(size=arr[4:].shape)
    vs_b, pg_b = run(log_rhos, discounts, rewards, values, rng.normal(size=bootstrap.shape).astype(np.float32))
    np.testing.assert_allclose(vs_a[:4], vs_b[:4], rtol=1e-6)
    np.testing.assert_allclose(pg_a[:4], pg_b[:4], rtol=1e-6)
    assert not np.allclose(vs_a[4:], vs_b[4:])
    # At the cut the target is rho-weighted one-step with no bootstrap.
    rho = np.minimum(1.0, np.exp(log_rhos[3]))
    np.testing.assert_allclose(vs_a[3], values[3] + rho * (rewards[3] - values[3]), rtol=1e-5)


def test_zero_importance_weight_stops_the_trace():
    log_rhos, discounts, rewards, values, bootstrap = random_inputs((6, 3), seed=5)
    discounts[:] = 0.95
    log_rhos[2] = -np.inf
    vs, pg = run(log_rhos, discounts, rewards, values, bootstrap)
    assert np.all(np.isfinite(vs)) and np.all(np.isfinite(pg))
    np.testing.assert_allclose(vs[2], values[2], rtol=1e-6)  # no target of its own
    np.testing.assert_allclose(pg[2], 0.0)
    # The step before bootstraps from V(x_2), not from what follows.
    rho1 = np.minimum(1.0, np.exp(log_rhos[1]))
    np.testing.assert_allclose(vs[1], values[1] + rho1 * (rewards[1] + 0.95 * values[2] - values[1]), rtol=1e-5, atol=1e-6)


def test_higher_rank_inputs():
    inputs = random_inputs((5, 2, 3, 2), seed=6)
    vs, pg = run(*inputs)
    vs_ref, pg_ref = oracle(*inputs)
    assert vs.shape == (5, 2, 3, 2)
    np.testing.assert_allclose(vs, vs_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pg, pg_ref, rtol=1e-5, atol=1e-5)


def test_rank_one_inputs():
    inputs = random_inputs((4,), seed=7)
    vs, pg = run(*inputs)
    np.testing.assert_allclose(vs, oracle(*inputs)[0], rtol=1e-5, atol=1e-5)


def test_eager_tf_function_and_xla_agree():
    inputs = random_inputs((9, 4), seed=8)

    def fn(*args):
        return vtrace.from_importance_weights(*args, clip_rho_threshold=1.5, lambda_=0.9)

    eager = fn(*inputs)
    graph = tf.function(fn)(*inputs)
    xla = tf.function(fn, jit_compile=True)(*inputs)
    for other in (graph, xla):
        np.testing.assert_allclose(other.vs.numpy(), eager.vs.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(other.pg_advantages.numpy(), eager.pg_advantages.numpy(), rtol=1e-5, atol=1e-6)


def test_unknown_time_dimension_one_graph():
    """No Python loop over time: a graph traced with T unknown serves every T."""
    spec2 = tf.TensorSpec([None, 3], tf.float32)
    fn = tf.function(
        lambda a, b, c, d, e: vtrace.from_importance_weights(a, b, c, d, e).vs,
        input_signature=[spec2] * 4 + [tf.TensorSpec([3], tf.float32)],
    )
    for T in (2, 11):
        inputs = random_inputs((T, 3), seed=T)
        np.testing.assert_allclose(fn(*inputs).numpy(), oracle(*inputs)[0], rtol=1e-5, atol=1e-5)


def test_outputs_are_gradient_stopped():
    inputs = [tf.constant(a) for a in random_inputs((4, 2), seed=10)]
    with tf.GradientTape(persistent=True) as tape:
        for x in inputs:
            tape.watch(x)
        out = vtrace.from_importance_weights(*inputs)
        total = tf.reduce_sum(out.vs) + tf.reduce_sum(out.pg_advantages)
    assert all(g is None for g in tape.gradient(total, inputs))


def test_float64_inputs_stay_float64():
    inputs = [tf.constant(a, tf.float64) for a in random_inputs((4, 2), seed=11)]
    out = vtrace.from_importance_weights(*inputs)
    assert out.vs.dtype == tf.float64


@pytest.mark.parametrize(
    "bad, shape, expected",
    [
        ("discounts", (5, 2), "[4, 2]"),
        ("rewards", (4,), "[4, 2]"),
        ("values", (4, 3), "[4, 2]"),
        ("bootstrap_value", (4, 2), "[2]"),
        ("bootstrap_value", (3,), "[2]"),
    ],
)
def test_shape_mismatch_names_argument_and_shapes(bad, shape, expected):
    names = ["log_rhos", "discounts", "rewards", "values", "bootstrap_value"]
    args = dict(zip(names, random_inputs((4, 2))))
    args[bad] = np.zeros(shape, np.float32)
    with pytest.raises(ValueError) as info:
        vtrace.from_importance_weights(**args)
    message = str(info.value)
    assert bad in message and expected in message and "[" + ", ".join(map(str, shape)) + "]" in message


def test_scalar_log_rhos_rejected():
    with pytest.raises(ValueError, match="log_rhos"):
        vtrace.from_importance_weights(1.0, 1.0, 1.0, 1.0, 1.0)


@pytest.mark.parametrize("kwargs", [{"clip_rho_threshold": 0.0}, {"clip_pg_rho_threshold": -1.0}, {"lambda_": 1.5}])
def test_bad_thresholds_rejected(kwargs):
    with pytest.raises(ValueError):
        vtrace.from_importance_weights(*random_inputs((3, 2)), **kwargs)


def test_from_logits_matches_importance_weights():
    rng = np.random.default_rng(12)
    T, B, A = 5, 3, 4
    behaviour = rng.normal(size=(T, B, A)).astype(np.float32)
    target = rng.normal(size=(T, B, A)).astype(np.float32)
    actions = rng.integers(0, A, size=(T, B)).astype(np.int32)
    _, discounts, rewards, values, bootstrap = random_inputs((T, B), seed=12)
    out = vtrace.from_logits(behaviour, target, actions, discounts, rewards, values, bootstrap)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    pick = lambda lp: np.take_along_axis(lp, actions[..., None], -1)[..., 0]  # noqa: E731
    log_rhos = pick(log_softmax(target)) - pick(log_softmax(behaviour))
    np.testing.assert_allclose(out.log_rhos.numpy(), log_rhos, rtol=1e-5, atol=1e-5)
    vs_ref, pg_ref = oracle(log_rhos, discounts, rewards, values, bootstrap)
    np.testing.assert_allclose(out.vs.numpy(), vs_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.pg_advantages.numpy(), pg_ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="actions"):
        vtrace.from_logits(behaviour, target, actions[:, :2], discounts, rewards, values, bootstrap)


@pytest.mark.parametrize("kind", ["categorical", "gaussian", "discretised"])
def test_from_policy_for_every_policy_kind(kind):
    spec = (
        ArraySpec("action", (), "int32", num_values=3)
        if kind == "categorical"
        else ArraySpec("action", (2,), "float32", minimum=-1.0, maximum=1.0)
    )
    policy = make_policy(spec, NetworkConfig(policy=kind, bins=4))
    rng = np.random.default_rng(13)
    T, B = 4, 2
    params = {n: rng.normal(size=(T, B) + s).astype(np.float32) for n, s in policy.param_shapes.items()}
    actions, behaviour_lp = policy.sample_np(params, rng)
    behaviour_lp = behaviour_lp + rng.normal(0, 0.3, size=behaviour_lp.shape).astype(np.float32)
    _, discounts, rewards, values, bootstrap = random_inputs((T, B), seed=13)
    out = vtrace.from_policy(policy, behaviour_lp, params, actions, discounts, rewards, values, bootstrap)
    log_rhos = policy.log_prob_np(params, actions) - behaviour_lp
    np.testing.assert_allclose(out.log_rhos.numpy(), log_rhos, rtol=1e-4, atol=1e-4)
    vs_ref, _ = oracle(log_rhos, discounts, rewards, values, bootstrap)
    np.testing.assert_allclose(out.vs.numpy(), vs_ref, rtol=1e-4, atol=1e-4)


def test_from_log_probs_shape_mismatch():
    _, discounts, rewards, values, bootstrap = random_inputs((3, 2))
    with pytest.raises(ValueError, match=r"behaviour_action_log_probs.*\[3, 2\].*\[3, 1\]"):
        vtrace.from_log_probs(np.zeros((3, 1), np.float32), np.zeros((3, 2), np.float32), discounts, rewards, values, bootstrap)


def test_log_rho_minus_infinity_gives_no_nan_in_xla():
    inputs = random_inputs((4, 2), seed=14)
    inputs[0][1, 0] = -math.inf
    out = tf.function(lambda *a: vtrace.from_importance_weights(*a, clip_rho_threshold=None), jit_compile=True)(*inputs)
    assert np.all(np.isfinite(out.vs.numpy()))
