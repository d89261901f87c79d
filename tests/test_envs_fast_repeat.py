"""``dmc/...`` fast action repeat is timestep-for-timestep what dm_control's own loop gives.

The reference is built here from ``dm_control.suite`` directly (not through ``envs``): the
suite env with the same seed, stepped with ``env.step`` ``action_repeat`` times per agent
step (rewards summed, discounts multiplied, stopping at ``LAST``, the step after ``LAST``
resetting), and for pixels its own ``dm_control.mujoco.Camera`` rendering with
``Camera.render``. Both sides get the same action sequence over full episodes, an explicit
mid-episode ``reset`` and the auto-reset after ``LAST``; step types, rewards, discounts,
the ``state`` observation, the full physics state and the pixels must be identical (exact
equality, no tolerance; the fast physics step included), and so must the rewards with ``fast_reward=False``; with the default
``fast_reward=True`` the rewards may differ in the last bits (``envs.fast_rewards``: at most
:data:`FAST_REWARD_ATOL` here). TensorFlow-free.
"""

from __future__ import annotations

import dm_env
import numpy as np
import pytest

import envs
from envs import dmc

# A reward sums up to 4 control steps' rewards in [0, 1], each within 1e-15 of dm_control's.
FAST_REWARD_ATOL = 1e-13


def _uses_fast_repeat(env) -> bool:
    while isinstance(env, envs.wrappers.Wrapper):
        if isinstance(env, dmc._ControlRepeat):  # pylint: disable=protected-access
            return True
        env = env.env
    return False


def _control_repeat(env):
    while isinstance(env, envs.wrappers.Wrapper):
        if isinstance(env, dmc._ControlRepeat):  # pylint: disable=protected-access
            return env
        env = env.env
    return None


def _uses_fast_step(env) -> bool:
    repeat = _control_repeat(env)
    return repeat is not None and repeat._physics_step is not None  # pylint: disable=protected-access


def _reference_env(env_id: str, seed: int):
    domain, task = dmc.parse_dmc_id(env_id)
    return dmc._suite().load(  # pylint: disable=protected-access
        domain, task, task_kwargs={"random": seed}, environment_kwargs={"flat_observation": True}
    )


def _reference_step(env, action, repeat: int) -> dm_env.TimeStep:
    timestep = env.step(action)
    if timestep.first():
        return timestep
    reward, discount = timestep.reward, timestep.discount
    for _ in range(repeat - 1):
        if timestep.last():
            break
        timestep = env.step(action)
        reward = reward + timestep.reward
        discount = discount * timestep.discount
    return timestep._replace(reward=reward, discount=discount)


def _actions(env, n: int, seed: int) -> np.ndarray:
    spec = env.action_spec()
    rng = np.random.default_rng(seed)
    lo = np.broadcast_to(spec.minimum, spec.shape)
    hi = np.broadcast_to(spec.maximum, spec.shape)
    return rng.uniform(lo, hi, size=(n,) + spec.shape).astype(spec.dtype)


def _check_same(
    new: dm_env.TimeStep, ref: dm_env.TimeStep, new_env, ref_env, where: str, state: bool, reward_atol: float
) -> None:
    assert new.step_type == ref.step_type, where
    if ref.first():
        assert new.reward is None and new.discount is None, where
    else:
        assert type(new.reward) is np.float64 and type(new.discount) is np.float64, where
        if reward_atol:
            assert abs(new.reward - np.float64(ref.reward)) <= reward_atol, (where, new.reward, ref.reward)
        else:
            assert new.reward == np.float64(ref.reward), (where, new.reward, ref.reward)
        assert new.discount == np.float64(ref.discount), (where, new.discount, ref.discount)
    if state:
        expected = np.asarray(ref.observation["observations"], dtype=np.float32)
        np.testing.assert_array_equal(new.observation["state"], expected, err_msg=where)
    else:
        assert "state" not in new.observation, where
    np.testing.assert_array_equal(new_env.physics.get_state(), ref_env.physics.get_state(), err_msg=where)
    assert new_env.physics.data.time == ref_env.physics.data.time, where


def _run_side_by_side(
    new_env, ref_env, repeat: int, actions: np.ndarray, state: bool, render=None, reward_atol=FAST_REWARD_ATOL
) -> dict:
    """Two full episodes, 5 steps into the third (auto-reset), then reset() mid-episode and 5 more."""
    def check(new, ref, where):
        _check_same(new, ref, new_env, ref_env, where, state, reward_atol)
        if render is not None:
            np.testing.assert_array_equal(new.observation["pixels"], render(), err_msg=where)

    counts = {"last": 0, "first": 0, "steps": 0, "terminations": 0}
    check(new_env.reset(), ref_env.reset(), "reset")
    i = 0
    after_second = None
    explicit_reset_done = False
    while True:
        action = actions[i % len(actions)]
        new, ref = new_env.step(action), _reference_step(ref_env, action, repeat)
        check(new, ref, f"agent step {i}")
        i += 1
        counts["steps"] += 1
        counts["first"] += int(ref.first())
        if ref.last():
            counts["last"] += 1
            counts["terminations"] += int(ref.discount == 0.0)
            if counts["last"] == 2:
                after_second = i
        if after_second is not None and i == after_second + 6:  # LAST, auto-reset FIRST, 4 MIDs
            if explicit_reset_done:
                break
            check(new_env.reset(), ref_env.reset(), "explicit reset")
            explicit_reset_done = True
            after_second = i - 1  # 5 more steps
    assert counts["last"] >= 2 and counts["first"] >= 2
    return counts


@pytest.mark.parametrize(
    "env_id,repeat",
    [
        ("dmc/cartpole-swingup", 4),
        ("dmc/cartpole-swingup", 1),
        ("dmc/cartpole-swingup", 3),  # 1000 is no multiple of 3: the episode ends mid-repeat
        ("dmc/walker-walk", 4),
        ("dmc/cheetah-run", 4),
        ("dmc/ball_in_cup-catch", 4),
    ],
)
@pytest.mark.parametrize("fast_reward", [False, True])
def test_state_matches_dm_control_loop(env_id, repeat, fast_reward):
    seed = 7
    new_env = envs.make(env_id, seed=seed, action_repeat=repeat, observation="state", fast_reward=fast_reward)
    assert _uses_fast_repeat(new_env) and _uses_fast_step(new_env)  # the defaults, against dm_control's loop
    ref_env = _reference_env(env_id, seed)
    counts = _run_side_by_side(
        new_env, ref_env, repeat, _actions(ref_env, 97, seed), state=True,
        reward_atol=FAST_REWARD_ATOL if fast_reward else 0.0,
    )
    assert counts["steps"] >= 2 * (-(-1000 // repeat))
    new_env.close()


def test_termination_mid_repeat_matches_dm_control_loop():
    # No task in the sample terminates; make one: discount 0 once the physics clock passes
    # 0.505 s (control step 51 of cartpole, inside agent step 13 with repeat 4).
    seed, repeat = 3, 4
    new_env = envs.make("dmc/cartpole-swingup", seed=seed, action_repeat=repeat, observation="state")
    ref_env = _reference_env("dmc/cartpole-swingup", seed)
    for env in (new_env.unwrapped, ref_env):
        env.task.get_termination = lambda physics: 0.0 if physics.data.time > 0.505 else None
    counts = _run_side_by_side(new_env, ref_env, repeat, _actions(ref_env, 50, seed), state=True)
    assert counts["terminations"] == counts["last"] >= 2
    new_env.close()


def _reference_camera(ref_env, size: int, preset: str):
    from dm_control.mujoco import engine  # pylint: disable=import-outside-toplevel

    physics = ref_env.physics
    flags = {}
    if preset == "fast":
        physics.model.vis.quality.shadowsize = 0
        physics.model.vis.quality.offsamples = 0
        physics.model.vis.quality.numslices = dmc.FAST_NUMSLICES
        physics.model.vis.quality.numstacks = dmc.FAST_NUMSTACKS
        flags = {"shadow": False, "reflection": False, "skybox": False}
    camera = engine.Camera(physics, height=size, width=size, camera_id=0)
    return lambda: np.ascontiguousarray(camera.render(render_flag_overrides=dict(flags)))


@pytest.mark.parametrize("observation", ["pixels", "pixels_state"])
def test_pixels_match_dm_control_loop_and_camera(observation):
    seed, repeat, size = 11, 4, 32
    new_env = envs.make(
        "dmc/cartpole-swingup", seed=seed, action_repeat=repeat, size=size, render="fast", observation=observation
    )
    ref_env = _reference_env("dmc/cartpole-swingup", seed)
    render = _reference_camera(ref_env, size, "fast")
    _run_side_by_side(
        new_env, ref_env, repeat, _actions(ref_env, 64, seed), state=observation == "pixels_state", render=render
    )
    new_env.close()


def test_standard_preset_pixels_match_camera_render():
    seed, repeat, size = 5, 4, 32
    new_env = envs.make("dmc/walker-walk", seed=seed, action_repeat=repeat, size=size, render="standard")
    ref_env = _reference_env("dmc/walker-walk", seed)
    render = _reference_camera(ref_env, size, "standard")
    actions = _actions(ref_env, 12, seed)
    _check_same(new_env.reset(), ref_env.reset(), new_env, ref_env, "reset", False, FAST_REWARD_ATOL)
    for i, action in enumerate(actions):
        new = new_env.step(action)
        ref = _reference_step(ref_env, action, repeat)
        _check_same(new, ref, new_env, ref_env, f"step {i}", False, FAST_REWARD_ATOL)
        np.testing.assert_array_equal(new.observation["pixels"], render(), err_msg=f"step {i}")
    new_env.close()


@pytest.mark.parametrize("repeat", [1, 4])
def test_fast_repeat_false_is_the_same(repeat):
    kwargs = dict(seed=2, action_repeat=repeat, size=24, render="fast", observation="pixels_state")
    fast = envs.make("dmc/ball_in_cup-catch", fast_reward=False, **kwargs)
    slow = envs.make("dmc/ball_in_cup-catch", fast_repeat=False, **kwargs)
    assert _uses_fast_repeat(fast)
    assert not _uses_fast_repeat(slow)
    a, b = fast.reset(), slow.reset()
    for i, action in enumerate(_actions(fast, 300, 0)):
        assert a.step_type == b.step_type and a.reward == b.reward and a.discount == b.discount, i
        np.testing.assert_array_equal(a.observation["state"], b.observation["state"])
        np.testing.assert_array_equal(a.observation["pixels"], b.observation["pixels"])
        a, b = fast.step(action), slow.step(action)
    with pytest.raises(envs.EnvError, match="fast_repeat"):
        envs.make("dmc/cartpole-swingup", fast_repeat="yes", observation="state")


def test_fast_step_false_is_the_same_and_bad_values_are_refused():
    kwargs = dict(seed=5, action_repeat=4, size=24, render="fast", observation="pixels_state")
    fast = envs.make("dmc/walker-walk", **kwargs)
    slow = envs.make("dmc/walker-walk", fast_step=False, **kwargs)
    assert _uses_fast_step(fast) and not _uses_fast_step(slow) and _uses_fast_repeat(slow)
    a, b = fast.reset(), slow.reset()
    for i, action in enumerate(_actions(fast, 300, 1)):
        assert a.step_type == b.step_type and a.reward == b.reward and a.discount == b.discount, i
        np.testing.assert_array_equal(a.observation["state"], b.observation["state"])
        np.testing.assert_array_equal(a.observation["pixels"], b.observation["pixels"])
        np.testing.assert_array_equal(fast.physics.get_state(), slow.physics.get_state())
        a, b = fast.step(action), slow.step(action)
    fast.close()
    slow.close()
    with pytest.raises(envs.EnvError, match="fast_step must be true or false"):
        envs.make("dmc/cartpole-swingup", fast_step="yes", observation="state")


@pytest.mark.filterwarnings("ignore:The 'warn' function is deprecated:DeprecationWarning")  # dm_control's logging.warn
@pytest.mark.parametrize("fast_step", [True, False])
def test_invalid_physics_raises_as_dm_control_does(fast_step, caplog):
    from dm_control.rl import control

    env = envs.make("dmc/cartpole-swingup", seed=0, observation="state", fast_step=fast_step)
    assert _uses_fast_step(env) == fast_step
    zero = np.zeros(env.action_spec().shape, env.action_spec().dtype)
    physics = env.physics
    env.reset()
    physics.data.qvel[:] = np.nan
    with pytest.raises(control.PhysicsError, match=r"^Physics state is invalid. Warning\(s\) raised: mjWARN_BADQVEL$"):
        env.step(zero)
    # Inside suppress_physics_errors the step goes on (MuJoCo reset the state) and says why.
    env.reset()
    caplog.clear()
    with physics.suppress_physics_errors(), caplog.at_level("WARNING"):
        physics.data.qvel[:] = np.nan
        timestep = env.step(zero)
    assert timestep.mid() and np.isfinite(timestep.observation["state"]).all()
    if fast_step:  # dm_control's own step logs through absl, which pytest may not capture
        assert "Warning(s) raised: mjWARN_BADQVEL" in caplog.text
    env.close()
