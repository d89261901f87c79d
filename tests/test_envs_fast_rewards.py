"""``envs.fast_rewards``: dm_control's ``rewards.tolerance``, faster, with the same values.

Every sigmoid, bounds (a point, an interval, open ends), margins (0 and not) and inputs (inside,
on and outside the bounds, huge, infinite, NaN) as a float, a NumPy float64, a 0-d and a small
array: the fast path gives the original's type and shape, the same NaNs, values within 1e-15,
and the same bits where no transcendental function is involved. Inputs it does not handle go
to the original, and so do calls outside the scope; bad arguments raise the original's errors.
The dmc envs take the fast path only with ``fast_reward=True``. Cartpole's one-pole, walker's
and cheetah's rewards computed directly (``task_reward``) equal ``get_reward``'s bit for bit
over states across and beyond their bounds, and stand aside for a reward method replaced by
other code. TensorFlow-free.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import envs
from envs import fast_rewards

rewards = pytest.importorskip("dm_control.utils.rewards")

SIGMOIDS = ["gaussian", "hyperbolic", "long_tail", "reciprocal", "cosine", "linear", "quadratic", "tanh_squared"]
EXACT_SIGMOIDS = {"linear", "quadratic", "long_tail", "reciprocal"}  # no exp/cos/cosh/tanh
XS = [0.0, 0.25, -0.25, 1.0, -1.0, 1.5, -2.0, 3.7, -40.0, 1e3, 1e200, -1e308, np.inf, -np.inf, np.nan, 5e-324]
BOUNDS = [(0.0, 0.0), (-1.0, 1.0), (0.5, np.inf), (-np.inf, -0.5), (0, 2)]
MARGINS = [0.0, 0.3, 1, 2.0, 1e-300]


def _original():
    fast_rewards.install()
    assert fast_rewards._original is not None  # pylint: disable=protected-access
    return fast_rewards._original  # pylint: disable=protected-access


def _values_at_margin(sigmoid):
    values = [0.1, 0.5, 0.95]
    return values + [0.0] if sigmoid in ("cosine", "linear", "quadratic") else values


def _fast(*args, **kwargs):
    with fast_rewards.scope:
        return fast_rewards.tolerance(*args, **kwargs)


def _inputs():
    """(x, label) for each input type: float, np.float64, 0-d, (1,), (2, 3) arrays."""
    for x in XS:
        yield float(x), "float"
        yield np.float64(x), "np.float64"
        yield np.array(x), "0-d"
        yield np.array([x]), "(1,)"
    grid = np.array(XS[:6], dtype=np.float64).reshape(2, 3)
    yield grid, "(2, 3)"
    yield grid[:, ::-1], "(2, 3) strided"


def _same(fast, orig, exact: bool, where) -> None:
    assert type(fast) is type(orig), where
    if isinstance(orig, np.ndarray):
        assert fast.shape == orig.shape and fast.dtype == orig.dtype, where
    fast_a, orig_a = np.asarray(fast, dtype=np.float64), np.asarray(orig, dtype=np.float64)
    np.testing.assert_array_equal(np.isnan(fast_a), np.isnan(orig_a), err_msg=str(where))
    if exact:
        np.testing.assert_array_equal(fast_a, orig_a, err_msg=str(where))
    else:
        np.testing.assert_allclose(fast_a, orig_a, rtol=0, atol=1e-15, err_msg=str(where))


def test_fast_path_matches_dm_control_everywhere():
    original = _original()
    checked = 0
    for sigmoid in SIGMOIDS:
        for value, bounds, margin in itertools.product(_values_at_margin(sigmoid), BOUNDS, MARGINS):
            for x, label in _inputs():
                where = (sigmoid, value, bounds, margin, label, x)
                with np.errstate(all="ignore"):
                    orig = original(x, bounds=bounds, margin=margin, sigmoid=sigmoid, value_at_margin=value)
                fast = _fast(x, bounds=bounds, margin=margin, sigmoid=sigmoid, value_at_margin=value)
                _same(fast, orig, sigmoid in EXACT_SIGMOIDS or margin == 0, where)
                checked += 1
    assert checked > 10_000


def test_default_value_at_margin_and_positional_arguments():
    original = _original()
    for x in (0.3, -2.5, 7.0):
        _same(_fast(x, (0.0, 1.0), 2.0), original(x, (0.0, 1.0), 2.0), False, x)
        _same(_fast(x, margin=1.0), original(x, margin=1.0), False, x)


def test_numpy_scalar_bounds_and_margin_still_give_a_float():
    original = _original()
    bounds, margin = (np.float64(0.0), np.float64(1.0)), np.float64(2.0)
    for sigmoid in SIGMOIDS:
        for x in (0.5, 1.7, -3.0):
            fast = _fast(x, bounds, margin, sigmoid, 0.3)
            _same(fast, original(x, bounds, margin, sigmoid, 0.3), sigmoid in EXACT_SIGMOIDS, (sigmoid, x))


def test_fast_path_runs_only_inside_the_scope(monkeypatch):
    original = _original()
    calls = []
    real_fast = fast_rewards._fast  # pylint: disable=protected-access
    monkeypatch.setattr(fast_rewards, "_fast", lambda *a: calls.append(a) or real_fast(*a))
    assert not fast_rewards.active()
    assert rewards.tolerance is fast_rewards.tolerance
    assert rewards.tolerance(2.0, (0.0, 1.0), 1.0) == original(2.0, (0.0, 1.0), 1.0)
    assert calls == []
    with fast_rewards.scope:
        assert fast_rewards.active()
        with fast_rewards.scope:  # re-entrant
            rewards.tolerance(2.0, (0.0, 1.0), 1.0)
        assert fast_rewards.active()
    assert not fast_rewards.active()
    assert len(calls) == 1


def test_unhandled_inputs_go_to_dm_control():
    original = _original()
    big = np.linspace(-3, 3, fast_rewards.MAX_FAST_SIZE + 1)
    cases = [
        (np.float32(2.0), dict(margin=1.0)),
        (np.array([2.0, 0.1], dtype=np.float32), dict(margin=1.0)),
        (big, dict(margin=1.0)),
        (3, dict(margin=1.0)),
        (2.0, dict(bounds=[0.0, 1.0], margin=1.0)),
    ]
    for x, kwargs in cases:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fast_rewards, "_sigmoid", lambda *a: pytest.fail(f"fast path taken for {x!r}"))
            fast = _fast(x, **kwargs)
        orig = original(x, **kwargs)
        assert type(fast) is type(orig)
        np.testing.assert_array_equal(fast, orig)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(bounds=(1.0, 0.0)), "Lower bound"),
        (dict(margin=-1.0), "non-negative"),
        (dict(margin=1.0, value_at_margin=0.0), "strictly between"),  # gaussian refuses 0
        (dict(margin=1.0, value_at_margin=1.0, sigmoid="linear"), "smaller than 1"),
        (dict(margin=1.0, value_at_margin=-0.1, sigmoid="cosine"), "nonnegative"),
        (dict(margin=1.0, sigmoid="sigmoidal"), "Unknown sigmoid"),
        (dict(bounds=(-1.0, 1.0), margin=1.0, sigmoid="sigmoidal"), "Unknown sigmoid"),  # x in bounds
    ],
)
def test_bad_arguments_raise_dm_controls_errors(kwargs, match):
    _original()
    with pytest.raises(ValueError, match=match):
        _fast(0.5, **kwargs)
    with pytest.raises(ValueError, match=match):
        rewards.tolerance(0.5, **kwargs)


def _reward_scope_seen(fast_reward: bool) -> set:
    """Whether the fast path was on at each tolerance call of a cartpole env's steps (two
    poles: a task whose reward is not computed directly, so it calls tolerance)."""
    env = envs.make("dmc/cartpole-two_poles", seed=0, observation="state", fast_reward=fast_reward)
    seen = set()
    real = rewards.tolerance
    try:
        rewards.tolerance = lambda *a, **k: seen.add(fast_rewards.active()) or real(*a, **k)
        env.reset()
        for _ in range(3):
            env.step(np.zeros(env.action_spec().shape, env.action_spec().dtype))
    finally:
        rewards.tolerance = real
        env.close()
    return seen


def test_dmc_envs_use_the_fast_path_only_when_asked():
    assert _reward_scope_seen(True) == {True}
    assert _reward_scope_seen(False) == {False}
    assert not fast_rewards.active()
    with pytest.raises(envs.EnvError, match="fast_reward must be true or false"):
        envs.make("dmc/cartpole-swingup", fast_reward="yes", observation="state")


def test_scope_is_left_when_a_step_raises():
    env = envs.make("dmc/cartpole-swingup", seed=0, observation="state")
    env.reset()
    env.unwrapped.task.get_reward = lambda physics: 1 / 0
    with pytest.raises(ZeroDivisionError):
        env.step(np.zeros(env.action_spec().shape, env.action_spec().dtype))
    assert not fast_rewards.active()
    env.close()


# ----------------------------------------------------------------------------- task_reward

CARTPOLE_ONE_POLE = ["dmc/cartpole-swingup", "dmc/cartpole-balance", "dmc/cartpole-swingup_sparse",
                     "dmc/cartpole-balance_sparse"]
DIRECT_REWARDS = CARTPOLE_ONE_POLE + ["dmc/walker-stand", "dmc/walker-walk", "dmc/walker-run", "dmc/cheetah-run"]


def _set_random_state(env_id, physics, rng, near: bool) -> None:
    """A random state: for cartpole anywhere (``near=False``) or near the sparse rewards'
    bounds (cart within 0.4 of the centre, pole within 0.15 rad of upright), with a control in
    and beyond [-1, 1]; for walker and cheetah positions and velocities spread widely enough
    to cross the height, uprightness and speed bounds."""
    with physics.reset_context():
        if env_id.startswith("dmc/cartpole"):
            if near:
                physics.data.qpos[:] = rng.uniform([-0.4, -0.15], [0.4, 0.15])
            else:
                physics.data.qpos[:] = rng.uniform([-3.0, -np.pi], [3.0, np.pi])
            physics.data.qvel[:] = rng.normal(0.0, [2.0, 8.0])
        else:
            physics.data.qpos[:] = rng.normal(0.0, 0.3 if near else 1.0, physics.model.nq)
            physics.data.qvel[:] = rng.normal(0.0, 3.0 if near else 8.0, physics.model.nv)
    physics.data.ctrl[:] = rng.uniform(-1.5, 1.5, physics.model.nu)


@pytest.mark.parametrize("env_id", DIRECT_REWARDS)
def test_reward_computed_directly_is_get_rewards_value(env_id):
    env = envs.make(env_id, seed=0, observation="state")
    task, physics = env.unwrapped.task, env.unwrapped.physics
    direct = fast_rewards.task_reward(task, physics)
    assert direct is not None and direct.applies()
    rng = np.random.default_rng(0)
    values = set()
    for i in range(600):
        _set_random_state(env_id, physics, rng, near=i % 2 == 0)
        with fast_rewards.scope:
            expected = task.get_reward(physics)
        got = direct()
        assert type(got) is float
        assert got == expected, (i, got, expected)  # the fast path's value, bit for bit
        assert abs(got - task.get_reward(physics)) <= 1e-15  # outside the scope: dm_control's own
        values.add(got)
    assert min(values) >= 0.0 and max(values) <= 1.0
    if env_id.endswith("_sparse"):
        assert values == {0.0, 1.0}
    elif env_id == "dmc/cheetah-run":  # 0 below standstill, 1 from the run speed on, linear between
        assert {0.0, 1.0} <= values and len(values) > 200
    else:
        assert len(values) > 500
    env.close()


def test_direct_reward_stands_aside_for_replaced_methods(monkeypatch):
    from dm_control.suite import cartpole

    for env_id in ("dmc/cartpole-two_poles", "dmc/ball_in_cup-catch"):
        env = envs.make(env_id, seed=0, observation="state")
        assert fast_rewards.task_reward(env.unwrapped.task, env.unwrapped.physics) is None, env_id
        env.close()

    env = envs.make("dmc/cartpole-swingup", seed=0, observation="state", action_repeat=4)
    task, physics = env.unwrapped.task, env.unwrapped.physics
    built = fast_rewards.task_reward(task, physics)
    assert built is not None
    zero = np.zeros(env.action_spec().shape, env.action_spec().dtype)
    env.reset()
    # A reward replaced on the instance after the env was made: the env's steps use it.
    task.get_reward = lambda physics: 0.25
    assert not built.applies() and fast_rewards.task_reward(task, physics) is None
    assert env.step(zero).reward == 1.0  # 4 control steps of 0.25
    del task.get_reward
    assert built.applies()
    # A physics method replaced on the class by other code.
    monkeypatch.setattr(cartpole.Physics, "cart_position", lambda self: 0.0)
    assert not built.applies() and fast_rewards.task_reward(task, physics) is None
    monkeypatch.undo()
    assert built.applies()
    env.close()
