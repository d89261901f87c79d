"""IMPALA loss: config validation, NumPy reference, episode ends, reductions, gradients.

Shape letters: T transitions per unroll (T+1 steps), B batch.
"""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
from scipy import special

from impala_rep.distributions import make_policy
from impala_rep.losses import LossConfig, impala_loss, loss_terms
from impala_rep.networks import NetworkConfig
from impala_rep.specs import STEP_FIRST, STEP_LAST, STEP_MID, ArraySpec

NUM_ACTIONS = 3
POLICY = make_policy(ArraySpec("action", (), "int32", num_values=NUM_ACTIONS), NetworkConfig())
NO_CLIP = LossConfig(discount=0.9, clip_rho_threshold=None, clip_pg_rho_threshold=None)


def make_batch(step_type, discount, T1=None, B=1, seed=0, on_policy=False, logits=None):
    rng = np.random.default_rng(seed)
    step_type = np.asarray(step_type, np.uint8).reshape(-1, B) if step_type is not None else None
    T1 = step_type.shape[0] if step_type is not None else T1
    if step_type is None:
        step_type = np.full((T1, B), STEP_MID, np.uint8)
    logits = rng.normal(size=(T1, B, NUM_ACTIONS)).astype(np.float32) if logits is None else logits
    action = rng.integers(0, NUM_ACTIONS, size=(T1, B)).astype(np.int32)
    target_lp = np.take_along_axis(special.log_softmax(logits, -1), action[..., None], -1)[..., 0]
    behaviour_lp = target_lp if on_policy else target_lp + rng.normal(0, 0.5, size=(T1, B))
    reward = rng.normal(size=(T1, B)).astype(np.float32)
    reward[step_type == STEP_FIRST] = 0.0
    batch = {
        "action": action,
        "reward": reward,
        "discount": np.asarray(discount, np.float32).reshape(T1, B) if discount is not None else np.ones((T1, B), np.float32),
        "step_type": step_type,
        "behaviour_log_prob": behaviour_lp.astype(np.float32),
    }
    values = rng.normal(size=(T1, B)).astype(np.float32)
    return batch, logits, values


def terms(batch, logits, values, config=NO_CLIP):
    return loss_terms(POLICY, {"logits": tf.constant(logits)}, tf.constant(values), batch, config)


def reference_loss(batch, logits, values, config):
    """IMPALA loss in NumPy, with a backward V-trace loop, masking LAST->FIRST transitions."""
    logp = special.log_softmax(logits.astype(np.float64), -1)
    target_lp = np.take_along_axis(logp, batch["action"][..., None], -1)[..., 0][:-1]
    entropy = -(np.exp(logp) * logp).sum(-1)[:-1]
    mask = (batch["step_type"][:-1] != STEP_LAST).astype(np.float64)
    rhos = np.exp(target_lp - batch["behaviour_log_prob"][:-1]) * mask
    clip = lambda x, c: x if c is None else np.minimum(c, x)  # noqa: E731
    gammas = config.discount * batch["discount"][1:]
    rewards = batch["reward"][1:]
    T = rhos.shape[0]
    vs = np.zeros_like(rhos)
    acc = np.zeros(rhos.shape[1])
    for t in reversed(range(T)):
        v_next = values[t + 1]
        delta = clip(rhos[t], config.clip_rho_threshold) * (rewards[t] + gammas[t] * v_next - values[t])
        acc = delta + gammas[t] * config.lambda_ * np.minimum(1.0, rhos[t]) * acc
        vs[t] = values[t] + acc
    vs_next = np.concatenate([vs[1:], values[-1:]], 0)
    pg_adv = clip(rhos, config.clip_pg_rho_threshold) * (rewards + gammas * vs_next - values[:-1])
    pg_loss = -(mask * pg_adv * target_lp).sum()
    baseline_loss = 0.5 * (mask * (vs - values[:-1]) ** 2).sum()
    entropy_loss = -(mask * entropy).sum()
    return pg_loss + config.baseline_cost * baseline_loss + config.entropy_cost * entropy_loss


# -- config --


def test_loss_config_defaults_follow_design():
    c = LossConfig()
    assert (c.discount, c.baseline_cost, c.entropy_cost) == (0.99, 0.5, 0.01)
    assert (c.clip_rho_threshold, c.clip_pg_rho_threshold, c.lambda_) == (1.0, 1.0, 1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.discount = 0.5


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"discount": 1.5}, ValueError),
        ({"discount": -0.1}, ValueError),
        ({"baseline_cost": -1.0}, ValueError),
        ({"entropy_cost": -0.01}, ValueError),
        ({"clip_rho_threshold": 0.0}, ValueError),
        ({"clip_pg_rho_threshold": -2.0}, ValueError),
        ({"lambda_": 1.1}, ValueError),
        ({"discount": "0.99"}, TypeError),
        ({"entropy_cost": float("nan")}, TypeError),
        ({"reward_scale": 0.0}, ValueError),
        ({"reward_clip": -1.0}, ValueError),
        ({"baseline_torso_scale": 1.5}, ValueError),
        ({"baseline_torso_scale": -0.5}, ValueError),
        ({"popart": 1.5}, ValueError),
        ({"popart": -3e-4}, ValueError),
    ],
)
def test_loss_config_validation(kwargs, error):
    with pytest.raises(error, match=list(kwargs)[0]):
        LossConfig(**kwargs)


# -- values --


@pytest.mark.parametrize(
    "config",
    [LossConfig(), NO_CLIP, LossConfig(discount=0.95, baseline_cost=1.0, entropy_cost=0.1, clip_rho_threshold=0.5, lambda_=0.7)],
)
def test_matches_numpy_reference(config):
    step_type = np.array([[0, 1], [1, 1], [2, 1], [0, 2], [1, 0], [1, 1], [2, 1]])
    discount = np.array([[1, 1], [1, 1], [0, 1], [1, 1], [1, 1], [1, 1], [1, 1]])
    batch, logits, values = make_batch(step_type, discount, B=2, seed=1)
    loss, metrics = impala_loss(POLICY, {"logits": tf.constant(logits)}, tf.constant(values), batch, config)
    np.testing.assert_allclose(loss.numpy(), reference_loss(batch, logits, values, config), rtol=1e-5, atol=1e-5)
    assert metrics["num_transitions"].numpy() == 10  # 12 transitions, two start at a LAST step
    for key in ("loss", "pg_loss", "baseline_loss", "entropy_loss", "entropy_sum", "rho_sum", "vs_sum"):
        assert metrics[key].shape == () and np.isfinite(metrics[key].numpy())
    # |log rho| summed over the transitions that do not start at a LAST step.
    target_lp = np.take_along_axis(special.log_softmax(logits, -1), batch["action"][..., None], -1)[..., 0]
    log_rho = (target_lp - batch["behaviour_log_prob"])[:-1]
    np.testing.assert_allclose(metrics["abs_log_rho_sum"].numpy(), np.abs(log_rho)[step_type[:-1] != STEP_LAST].sum(),
                               rtol=1e-5)


def test_reward_scale_and_clip_act_on_the_rewards_the_loss_sees():
    step_type = np.array([[0, 1], [1, 1], [2, 1], [0, 2], [1, 0], [1, 1], [2, 1]])
    batch, logits, values = make_batch(step_type, None, B=2, seed=3)
    batch["reward"] = batch["reward"] * 4.0
    scaled = dict(batch, reward=batch["reward"] * 0.25)
    clipped = dict(batch, reward=np.clip(batch["reward"] * 0.25, -0.5, 0.5))

    def loss(b, config):
        return impala_loss(POLICY, {"logits": tf.constant(logits)}, tf.constant(values), b, config)[0].numpy()

    np.testing.assert_allclose(loss(batch, LossConfig(reward_scale=0.25)), loss(scaled, LossConfig()), rtol=1e-6)
    np.testing.assert_allclose(
        loss(batch, LossConfig(reward_scale=0.25, reward_clip=0.5)), loss(clipped, LossConfig()), rtol=1e-6
    )
    assert not np.isclose(loss(batch, LossConfig(reward_scale=0.25)), loss(batch, LossConfig()))


def test_frozen_hand_checked_loss():
    # pi uniform over 3 actions (log pi = -ln 3), mu(a) = 1/2 -> rho = 2/3; V = [0.5, 2], r = 1.
    # vs - V = pg_adv = 2/3 * (1 + 0.9 * 2 - 0.5) = 1.533333
    # pg = 1.533333 * ln 3 = 1.684539; baseline = 0.5 * 1.533333^2 = 1.175556; entropy = -ln 3
    batch = {
        "action": np.array([[1], [0]], np.int32),
        "reward": np.array([[0.0], [1.0]], np.float32),
        "discount": np.ones((2, 1), np.float32),
        "step_type": np.array([[STEP_FIRST], [STEP_MID]], np.uint8),
        "behaviour_log_prob": np.log(np.full((2, 1), 0.5, np.float32)),
    }
    logits = np.zeros((2, 1, 3), np.float32)
    values = np.array([[0.5], [2.0]], np.float32)
    loss, m = impala_loss(POLICY, {"logits": logits}, values, batch, LossConfig(discount=0.9))
    np.testing.assert_allclose(m["pg_loss"].numpy(), 1.684539, rtol=1e-5)
    np.testing.assert_allclose(m["baseline_loss"].numpy(), 1.175556, rtol=1e-5)
    np.testing.assert_allclose(m["entropy_loss"].numpy(), -1.098612, rtol=1e-5)
    np.testing.assert_allclose(loss.numpy(), 1.684539 + 0.5 * 1.175556 - 0.01 * 1.098612, rtol=1e-5)
    np.testing.assert_allclose(m["rho_sum"].numpy(), 2.0 / 3.0, rtol=1e-5)
    np.testing.assert_allclose(m["abs_log_rho_sum"].numpy(), np.log(1.5), rtol=1e-5)  # |ln(2/3)|


def test_termination_cuts_the_bootstrap():
    # steps: F M M L(terminal) F M ; transitions 0..4, transition 3 is LAST -> FIRST.
    batch, logits, values = make_batch([0, 1, 1, 2, 0, 1], [1, 1, 1, 0, 1, 1], seed=2, on_policy=True)
    r, v, g = batch["reward"][:, 0], values[:, 0], 0.9
    out = terms(batch, logits, values)
    vs = out.vs.numpy()[:, 0]
    np.testing.assert_allclose(vs[2], r[3], rtol=1e-5)
    np.testing.assert_allclose(vs[1], r[2] + g * r[3], rtol=1e-5)
    np.testing.assert_allclose(vs[0], r[1] + g * r[2] + g * g * r[3], rtol=1e-5)
    np.testing.assert_allclose(vs[3], v[3], rtol=1e-6)  # masked: no target of its own
    np.testing.assert_allclose(vs[4], r[5] + g * v[5], rtol=1e-5)  # new episode bootstraps
    np.testing.assert_array_equal(out.mask.numpy()[:, 0], [1, 1, 1, 0, 1])
    assert out.pg_advantages.numpy()[3, 0] == 0.0


def test_truncation_bootstraps_from_the_last_observation():
    batch, logits, values = make_batch([0, 1, 1, 2, 0, 1], [1, 1, 1, 1, 1, 1], seed=3, on_policy=True)
    r, v, g = batch["reward"][:, 0], values[:, 0], 0.9
    vs = terms(batch, logits, values).vs.numpy()[:, 0]
    np.testing.assert_allclose(vs[2], r[3] + g * v[3], rtol=1e-5)
    np.testing.assert_allclose(vs[1], r[2] + g * r[3] + g * g * v[3], rtol=1e-5)
    np.testing.assert_allclose(vs[0], r[1] + g * r[2] + g * g * r[3] + g**3 * v[3], rtol=1e-5)


def test_truncation_at_the_unroll_end_bootstraps_from_its_value():
    batch, logits, values = make_batch([1, 1, 1, 2], [1, 1, 1, 1], seed=4, on_policy=True)
    r, v, g = batch["reward"][:, 0], values[:, 0], 0.9
    vs = terms(batch, logits, values).vs.numpy()[:, 0]
    np.testing.assert_allclose(vs[2], r[3] + g * v[3], rtol=1e-5)
    batch["discount"][3] = 0.0  # the same end as a termination
    vs = terms(batch, logits, values).vs.numpy()[:, 0]
    np.testing.assert_allclose(vs[2], r[3], rtol=1e-5)


@pytest.mark.parametrize("end_discount", [0.0, 1.0])
def test_nothing_leaks_across_the_episode_boundary(end_discount):
    batch, logits, values = make_batch([0, 1, 1, 2, 0, 1, 1], [1, 1, 1, end_discount, 1, 1, 1], seed=5)
    before = terms(batch, logits, values)
    # Change everything the LAST -> FIRST transition and the next episode could carry back.
    rng = np.random.default_rng(6)
    batch["action"][3:] = rng.integers(0, NUM_ACTIONS, size=batch["action"][3:].shape)
    batch["behaviour_log_prob"][3] = 5.0
    batch["reward"][4:] = rng.normal(size=batch["reward"][4:].shape) + 10
    values = values.copy()
    values[4:] += 10
    logits = logits.copy()
    logits[3] += rng.normal(size=logits[3].shape).astype(np.float32) * 3  # the masked step's policy
    after = terms(batch, logits, values)
    np.testing.assert_allclose(after.vs.numpy()[:3], before.vs.numpy()[:3], rtol=1e-6)
    np.testing.assert_allclose(after.pg_advantages.numpy()[:3], before.pg_advantages.numpy()[:3], rtol=1e-6)
    # The transition that starts at the LAST step has no target and no advantage.
    np.testing.assert_allclose(after.vs.numpy()[3], values[3], rtol=1e-6)
    assert after.pg_advantages.numpy()[3, 0] == 0.0 and after.log_rhos.numpy()[3, 0] == -np.inf


def test_masked_step_gets_no_gradient():
    batch, logits_np, values_np = make_batch([0, 1, 2, 0, 1, 1], [1, 1, 1, 1, 1, 1], seed=7)
    logits = tf.Variable(logits_np)
    values = tf.Variable(values_np)
    config = LossConfig(discount=0.9, entropy_cost=0.1)
    with tf.GradientTape() as tape:
        loss, _ = impala_loss(POLICY, {"logits": logits}, values, batch, config)
    g_logits, g_values = tape.gradient(loss, [logits, values])
    g_logits = g_logits.numpy()
    g_values = g_values.numpy()
    assert np.all(g_logits[2] == 0) and np.all(g_values[2] == 0)  # transition from the LAST step
    assert np.all(g_logits[-1] == 0) and np.all(g_values[-1] == 0)  # the bootstrap step
    for t in (0, 1, 3, 4):
        assert np.any(g_logits[t] != 0) and np.any(g_values[t] != 0)


def test_baseline_gradient_is_minus_cost_times_error():
    batch, logits, values_np = make_batch(None, None, T1=6, B=2, seed=8)
    values = tf.Variable(values_np)
    config = LossConfig(baseline_cost=0.5, entropy_cost=0.0)
    with tf.GradientTape() as tape:
        loss, _ = impala_loss(POLICY, {"logits": logits}, values, batch, config)
        out = loss_terms(POLICY, {"logits": logits}, values, batch, config)
    grad = tape.gradient(loss, values).numpy()
    np.testing.assert_allclose(grad[:-1], -0.5 * (out.vs - out.values).numpy(), rtol=1e-5, atol=1e-6)


def test_policy_gradient_follows_the_advantage():
    # One transition, on-policy, zero value: the chosen action's probability must rise when
    # the reward is positive and fall when it is negative.
    for reward, sign in ((1.0, 1.0), (-1.0, -1.0)):
        batch, logits_np, _ = make_batch([1, 1], [1, 1], seed=9, on_policy=True)
        batch["reward"][1] = reward
        logits = tf.Variable(logits_np)
        with tf.GradientTape() as tape:
            loss, _ = impala_loss(POLICY, {"logits": logits}, np.zeros((2, 1), np.float32), batch, LossConfig(entropy_cost=0.0))
        step = -tape.gradient(loss, logits).numpy()[0, 0]  # gradient descent direction
        a = batch["action"][0, 0]
        assert sign * step[a] > 0 and np.all(sign * np.delete(step, a) < 0)


def test_entropy_term_pushes_towards_uniform():
    batch, _, _ = make_batch(None, None, T1=3, seed=10)
    batch["reward"][:] = 0.0
    logits = tf.Variable(np.array([[[3.0, 0.0, -3.0]]] * 3, np.float32))
    with tf.GradientTape() as tape:
        loss, _ = impala_loss(POLICY, {"logits": logits}, np.zeros((3, 1), np.float32), batch, LossConfig(baseline_cost=0.0, entropy_cost=1.0))
    step = -tape.gradient(loss, logits).numpy()[0, 0]
    assert step[0] < 0 < step[2]


def test_sums_over_batch_add_up_across_replicas():
    """Per-replica losses (and gradients) of a split batch add up to the whole batch's."""
    batch, logits_np, values_np = make_batch(None, None, T1=5, B=4, seed=11)
    batch["step_type"][2, 1] = STEP_LAST
    logits = tf.Variable(logits_np)
    config = LossConfig()

    def loss_of(cols):
        part = {k: v[:, cols] for k, v in batch.items()}
        return impala_loss(POLICY, {"logits": tf.gather(logits, cols, axis=1)}, values_np[:, cols], part, config)[0]

    with tf.GradientTape(persistent=True) as tape:
        whole = loss_of([0, 1, 2, 3])
        halves = loss_of([0, 1]) + loss_of([2, 3])
    np.testing.assert_allclose(whole.numpy(), halves.numpy(), rtol=1e-5)
    np.testing.assert_allclose(tape.gradient(whole, logits).numpy(), tape.gradient(halves, logits).numpy(), rtol=1e-5, atol=1e-6)


def test_eager_tf_function_and_xla_agree():
    batch, logits, values = make_batch([0, 1, 2, 0, 1, 1, 1], [1, 1, 0, 1, 1, 1, 1], seed=12)

    def fn(logits, values, batch):
        return impala_loss(POLICY, {"logits": logits}, values, batch, LossConfig())

    eager = fn(logits, values, batch)
    for compiled in (tf.function(fn), tf.function(fn, jit_compile=True)):
        loss, metrics = compiled(logits, values, batch)
        np.testing.assert_allclose(loss.numpy(), eager[0].numpy(), rtol=1e-5)
        np.testing.assert_allclose(metrics["vs_sum"].numpy(), eager[1]["vs_sum"].numpy(), rtol=1e-5)


@pytest.mark.parametrize("kind", ["gaussian", "discretised"])
def test_continuous_policies(kind):
    spec = ArraySpec("action", (2,), "float32", minimum=-1.0, maximum=1.0)
    policy = make_policy(spec, NetworkConfig(policy=kind, bins=5))
    rng = np.random.default_rng(13)
    T1, B = 5, 3
    params = {n: tf.Variable(rng.normal(size=(T1, B) + s).astype(np.float32)) for n, s in policy.param_shapes.items()}
    action, blp = policy.sample_np({n: v.numpy() for n, v in params.items()}, rng)
    batch = {
        "action": action,
        "reward": rng.normal(size=(T1, B)).astype(np.float32),
        "discount": np.ones((T1, B), np.float32),
        "step_type": np.ones((T1, B), np.uint8),
        "behaviour_log_prob": blp,
    }
    with tf.GradientTape() as tape:
        loss, metrics = impala_loss(policy, params, np.zeros((T1, B), np.float32), batch, LossConfig())
    grads = tape.gradient(loss, list(params.values()))
    assert np.isfinite(loss.numpy())
    np.testing.assert_allclose(metrics["rho_sum"].numpy(), T1 * B - B, rtol=1e-4)  # on-policy: rho = 1
    assert all(g is not None and np.any(g.numpy() != 0) for g in grads)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda b: b.pop("reward"), r"batch lacks \['reward'\]"),
        (lambda b: b.__setitem__("reward", np.zeros((4, 1), np.float32)), r"batch\['reward'\].*\[5, 1\].*\[4, 1\]"),
        (lambda b: b.__setitem__("discount", np.zeros((5,), np.float32)), r"batch\['discount'\].*\[5, 1\].*\[5\]"),
        (lambda b: b.__setitem__("action", np.zeros((5, 1, 2), np.int32)), r"batch\['action'\].*\[5, 1\].*\[5, 1, 2\]"),
        (lambda b: b.__setitem__("step_type", np.zeros((5, 2), np.uint8)), r"batch\['step_type'\]"),
    ],
)
def test_bad_batch_shapes_raise_value_error(change, match):
    batch, logits, values = make_batch(None, None, T1=5, seed=14)
    change(batch)
    with pytest.raises(ValueError, match=match):
        impala_loss(POLICY, {"logits": logits}, values, batch, LossConfig())


def test_bad_values_params_and_config():
    batch, logits, values = make_batch(None, None, T1=5, seed=15)
    with pytest.raises(ValueError, match=r"values must have shape \[T\+1, B\]"):
        impala_loss(POLICY, {"logits": logits}, values[:, 0], batch, LossConfig())
    with pytest.raises(ValueError, match=r"policy_params\['logits'\].*\[5, 1, 3\].*\[5, 1, 4\]"):
        impala_loss(POLICY, {"logits": np.zeros((5, 1, 4), np.float32)}, values, batch, LossConfig())
    with pytest.raises(ValueError, match="policy_params lack"):
        impala_loss(POLICY, {}, values, batch, LossConfig())
    with pytest.raises(TypeError, match="LossConfig"):
        impala_loss(POLICY, {"logits": logits}, values, batch, {"discount": 0.99})


def test_popart_puts_the_baseline_loss_on_the_scale_of_sigma_and_needs_it():
    step_type = np.array([[0, 1], [1, 1], [2, 1], [0, 2], [1, 0], [1, 1], [2, 1]])
    batch, logits, values = make_batch(step_type, None, B=2, seed=5)
    params = {"logits": tf.constant(logits)}
    values = tf.constant(values * 30.0 + 50.0)  # values of the size a walker's are
    plain_loss, plain = impala_loss(POLICY, params, values, batch, LossConfig())
    sigma = 7.5
    loss, metrics = impala_loss(POLICY, params, values, batch, LossConfig(popart=3e-4, popart_terms="baseline"),
                                value_scale=sigma)
    np.testing.assert_allclose(metrics["baseline_loss"].numpy(), plain["baseline_loss"].numpy() / sigma ** 2, rtol=1e-5)
    for key in ("pg_loss", "entropy_loss", "vs_sum", "num_transitions"):  # the rest is as it was
        np.testing.assert_allclose(metrics[key].numpy(), plain[key].numpy(), rtol=1e-6, err_msg=key)
    assert "vs_square_sum" not in plain
    terms = loss_terms(POLICY, params, values, batch, LossConfig())
    np.testing.assert_allclose(metrics["vs_square_sum"].numpy(),
                               np.sum(terms.mask.numpy() * np.square(terms.vs.numpy())), rtol=1e-5)
    assert loss.numpy() != pytest.approx(plain_loss.numpy(), rel=1e-3)
    with pytest.raises(ValueError, match="LossConfig.popart is set, so impala_loss needs value_scale"):
        impala_loss(POLICY, params, values, batch, LossConfig(popart=3e-4))
    # The default puts the advantages and the entropy term on sigma's scale too; "policy" the advantages.
    config = LossConfig(popart=3e-4)
    pg, bl, ent = (plain[k].numpy() for k in ("pg_loss", "baseline_loss", "entropy_loss"))
    for terms, entropy_cost in (("policy", config.entropy_cost), ("all", config.entropy_cost / sigma)):
        loss, metrics = impala_loss(POLICY, params, values, batch, LossConfig(popart=3e-4, popart_terms=terms),
                                    value_scale=sigma)
        np.testing.assert_allclose(metrics["pg_loss"].numpy(), pg / sigma, rtol=1e-5)
        np.testing.assert_allclose(metrics["baseline_loss"].numpy(), bl / sigma ** 2, rtol=1e-5)
        np.testing.assert_allclose(loss.numpy(), pg / sigma + config.baseline_cost * bl / sigma ** 2
                                   + entropy_cost * ent, rtol=1e-5, err_msg=terms)
    with pytest.raises(ValueError, match="popart_terms must be one of all, policy, baseline, impala, got 'value'"):
        LossConfig(popart=3e-4, popart_terms="value")


def test_popart_terms_impala_is_impalas_loss_divided_by_sigma_gradients_included():
    """With "impala" the loss, and its gradients with respect to the values and the policy's
    parameters (what the shared layers see), are IMPALA's divided by sigma; with "all" the
    values' gradient is IMPALA's divided by sigma squared."""
    step_type = np.array([[0, 1], [1, 1], [2, 1], [0, 2], [1, 0], [1, 1], [2, 1]])
    batch, logits, values = make_batch(step_type, None, B=2, seed=6)
    logits = tf.Variable(logits)
    values = tf.Variable(values * 30.0 + 50.0)
    sigma = 6.5

    def loss_and_grads(config, **kwargs):
        with tf.GradientTape() as tape:
            loss, metrics = impala_loss(POLICY, {"logits": logits}, values, batch, config, **kwargs)
        return loss.numpy(), metrics, [g.numpy() for g in tape.gradient(loss, [logits, values])]

    plain_loss, plain, (plain_logits, plain_values) = loss_and_grads(LossConfig())
    loss, metrics, (grad_logits, grad_values) = loss_and_grads(
        LossConfig(popart=3e-4, popart_terms="impala"), value_scale=sigma)
    np.testing.assert_allclose(loss, plain_loss / sigma, rtol=1e-5)
    np.testing.assert_allclose(grad_logits, plain_logits / sigma, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(grad_values, plain_values / sigma, rtol=1e-4, atol=1e-7)
    assert np.any(plain_values != 0)
    # The metric stays the normalised baseline loss, unweighted, as under the other choices.
    np.testing.assert_allclose(metrics["baseline_loss"].numpy(), plain["baseline_loss"].numpy() / sigma ** 2,
                               rtol=1e-5)
    _, _, (all_logits, all_values) = loss_and_grads(LossConfig(popart=3e-4, popart_terms="all"), value_scale=sigma)
    np.testing.assert_allclose(all_logits, plain_logits / sigma, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(all_values, plain_values / sigma ** 2, rtol=1e-4, atol=1e-7)
