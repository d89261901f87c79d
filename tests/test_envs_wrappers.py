"""Unit tests of envs.wrappers on scripted envs (exact rewards, discounts, step types)."""

import os
import pickle

import dm_env
import numpy as np
import pytest
from dm_env import specs

import envs
from envs import wrappers
from impala_rep.specs import env_spec_from_dm_env


class Scripted(dm_env.Environment):
    """Replays a fixed list of (reward, discount, last) per step; observation = step index.

    Records the actions it received.
    """

    def __init__(self, script, action_spec=None):
        self.script = script
        self.actions = []
        self._t = 0
        self._action_spec = action_spec or specs.BoundedArray((2,), np.float64, [-1.0, 0.0], [1.0, 4.0])
        self.resets = 0

    def observation_spec(self):
        return {"t": specs.Array((1,), np.int64, name="t"), "img": specs.Array((2, 2, 1), np.uint8, name="img")}

    def action_spec(self):
        return self._action_spec

    def _obs(self):
        return {"t": np.array([self._t]), "img": np.full((2, 2, 1), self._t, np.uint8)}

    def reset(self):
        self._t = 0
        self.resets += 1
        return dm_env.restart(self._obs())

    def step(self, action):
        if self._t >= len(self.script):
            return self.reset()
        self.actions.append(np.array(action))
        reward, discount, last = self.script[self._t]
        self._t += 1
        step_type = dm_env.StepType.LAST if last else dm_env.StepType.MID
        return dm_env.TimeStep(step_type, reward, discount, self._obs())


def test_action_repeat_sums_rewards_multiplies_discounts_and_stops_at_last():
    env = wrappers.ActionRepeat(Scripted([(1.0, 1.0, False), (2.0, 0.5, False), (4.0, 1.0, False), (8.0, 0.0, True)]), 3)
    env.reset()
    t = env.step(np.zeros(2))
    assert t.mid() and t.reward == 7.0 and t.discount == 0.5 and t.observation["t"][0] == 3
    assert isinstance(t.reward, np.float64)
    t = env.step(np.zeros(2))  # only one inner step left: stops at LAST
    assert t.last() and t.reward == 8.0 and t.discount == 0.0
    assert env.step(np.zeros(2)).first()
    assert len(env.env.actions) == 4


def test_time_limit_truncates_keeping_discount_and_resets_after():
    inner = Scripted([(1.0, 0.9, False)] * 10)
    env = wrappers.TimeLimit(inner, 3)
    assert env.step(np.zeros(2)).first()  # step before reset starts an episode
    t1, t2, t3 = (env.step(np.zeros(2)) for _ in range(3))
    assert t1.mid() and t2.mid() and t3.last()
    assert t3.discount == 0.9  # kept: truncation, not termination
    assert env.step(np.zeros(2)).first() and inner.resets == 2
    # An inner termination before the limit comes through unchanged.
    env = wrappers.TimeLimit(Scripted([(1.0, 1.0, False), (5.0, 0.0, True)]), 5)
    env.reset()
    env.step(np.zeros(2))
    t = env.step(np.zeros(2))
    assert t.last() and t.discount == 0.0 and t.reward == 5.0


def test_clip_reward():
    env = wrappers.ClipReward(Scripted([(5.0, 1.0, False), (-3.0, 1.0, False), (0.25, 1.0, True)]))
    assert env.reset().reward is None
    assert [env.step(np.zeros(2)).reward for _ in range(3)] == [1.0, -1.0, 0.25]
    with pytest.raises(envs.EnvError, match=r"reward clipping needs minimum < maximum, got \[1.0, -1.0\]\."):
        wrappers.ClipReward(Scripted([]), 1.0, -1.0)


def test_discretize_multi_dimensional():
    inner = Scripted([(0.0, 1.0, False)] * 5)
    env = wrappers.DiscretizeActions(inner, 5)
    spec = env.action_spec()
    assert isinstance(spec, wrappers.MultiDiscreteArray)
    assert spec.shape == (2,) and spec.num_values == 5 and spec.dtype == np.int32
    assert spec.minimum == 0 and spec.maximum == 4
    env.reset()
    env.step(np.array([0, 4], np.int32))
    env.step(np.array([2, 1], np.int32))
    np.testing.assert_allclose(inner.actions[0], [-1.0, 4.0])
    np.testing.assert_allclose(inner.actions[1], [0.0, 1.0])
    # The shared spec reader sees a discrete spec with num_values.
    action = env_spec_from_dm_env(env).action
    assert action.num_values == 5 and action.shape == (2,)
    assert pickle.loads(pickle.dumps(spec)).num_values == 5
    for bad, words in ((np.array([0, 5]), r"must hold 2 integer\(s\) in \[0, 5\)"),
                       (np.array([0.0, 1.0]), "discretised actions must be integers, got dtype float64"),
                       (np.array([1, 1, 1]), r"must hold 2 integer\(s\) in \[0, 5\)")):
        with pytest.raises(ValueError, match=words):
            env.step(bad)


def test_discretize_joint_and_one_dimensional():
    inner = Scripted([(0.0, 1.0, False)] * 5)
    env = wrappers.DiscretizeActions(inner, 3, joint=True)
    assert isinstance(env.action_spec(), specs.DiscreteArray) and env.action_spec().num_values == 9
    env.reset()
    env.step(np.int32(5))  # (1, 2) row-major -> (0.0, 4.0)
    np.testing.assert_allclose(inner.actions[0], [0.0, 4.0])
    reach = envs.make("reach", seed=0, dim=1, discretize=11)
    assert isinstance(reach.action_spec(), specs.DiscreteArray) and reach.action_spec().num_values == 11
    np.testing.assert_allclose(reach.to_continuous(np.int32(10)), [1.0])
    with pytest.raises(envs.EnvError, match="at most 4096"):
        wrappers.DiscretizeActions(Scripted([], specs.BoundedArray((6,), np.float32, -1, 1)), 11, joint=True)


def test_select_observation_and_frame_stack():
    env = wrappers.SelectObservation(Scripted([(0.0, 1.0, False)] * 5), ["img"])
    assert list(env.observation_spec()) == ["img"]
    assert list(env.reset().observation) == ["img"]
    env = wrappers.FrameStack(Scripted([(0.0, 1.0, False)] * 3), 3)
    assert env.observation_spec()["img"].shape == (2, 2, 3)
    assert env.observation_spec()["t"].shape == (1,)  # vectors are not stacked
    assert env.reset().observation["img"][0, 0].tolist() == [0, 0, 0]
    assert env.step(np.zeros(2)).observation["img"][0, 0].tolist() == [0, 0, 1]
    assert env.step(np.zeros(2)).observation["img"][0, 0].tolist() == [0, 1, 2]
    assert env.step(np.zeros(2)).observation["img"][0, 0].tolist() == [1, 2, 3]
    assert env.step(np.zeros(2)).observation["img"][0, 0].tolist() == [0, 0, 0]  # new episode


def test_observation_dict_rejects_nested_specs():
    class Nested(Scripted):
        def observation_spec(self):
            return {"a": {"b": specs.Array((1,), np.float32)}}

    with pytest.raises(envs.EnvError, match="flat mapping"):
        wrappers.ObservationDict(Nested([]))


def test_observation_dict_gives_arrays_their_spec_dtype_or_says_what_the_env_returned():
    """A plug-in that declares float32 and returns float64 (NumPy's default) trains: the learner
    accepts only the announced dtype, and every unroll was rejected before. What the spec's
    dtype cannot hold, another shape, or other keys are sentences."""
    class Declared(Scripted):
        def __init__(self, obs):
            super().__init__([(1.0, 1.0, False)] * 3)
            self.obs = obs

        def observation_spec(self):
            return {"x": specs.Array((3,), np.float32), "img": specs.Array((2, 2, 1), np.uint8)}

        def _obs(self):
            return self.obs

    good = wrappers.ObservationDict(Declared({"x": np.zeros(3), "img": np.zeros((2, 2, 1), bool)}))
    for ts in (good.reset(), good.step(np.zeros(2))):
        assert ts.observation["x"].dtype == np.float32 and ts.observation["img"].dtype == np.uint8
    cases = [
        ({"x": np.zeros(3, np.float32), "img": np.zeros((2, 2, 1))}, "observation 'img' as float64, which its "
         "spec's uint8 cannot hold; return uint8 arrays, or declare float64 in the observation spec."),
        ({"x": np.zeros(4, np.float32), "img": np.zeros((2, 2, 1), np.uint8)}, "observation 'x' of shape [4]; its "
         "spec says [3]."),
        ({"x": np.zeros(3, np.float32)}, "the env returned observation ['x']; its spec has ['img', 'x']."),
        ({"x": np.zeros(3, np.float32), "y": np.zeros(1)}, "observation 'y', which its spec does not have"),
    ]
    for obs, words in cases:
        env = wrappers.ObservationDict(Declared(obs))
        with pytest.raises(envs.EnvError) as info:
            env.reset()
        assert words in str(info.value), (words, str(info.value))


def test_integer_bounded_actions_become_discrete_for_the_categorical_policies(monkeypatch):
    """An int BoundedArray action (a Gym Discrete/MultiDiscrete through an adapter) had no
    policy ("neither discrete nor floating-point", and categorical wanted num_values)."""
    from impala_rep.distributions import CategoricalPolicy, MultiCategoricalPolicy, make_policy

    monkeypatch.syspath_prepend(os.path.dirname(os.path.abspath(__file__)))
    env = envs.make("plugin_envs:make_integer_action")
    spec = env.action_spec()
    assert isinstance(spec, specs.DiscreteArray) and spec.num_values == 4
    assert isinstance(make_policy(spec), CategoricalPolicy)
    env.reset()
    env.step(np.int32(0))
    env.step(np.int32(3))
    inner = env
    while hasattr(inner, "_env"):
        inner = inner._env
    assert [int(a) for a in inner.received] == [1, 4] and inner.received[0].dtype == np.int64

    vector = wrappers.IntegerActions(Scripted([(0.0, 1.0, False)] * 2, specs.BoundedArray((2,), np.int32, -1, 1)))
    assert vector.action_spec().num_values == 3 and vector.action_spec().shape == (2,)
    assert isinstance(make_policy(vector.action_spec()), MultiCategoricalPolicy)
    vector.reset()
    vector.step(np.array([0, 2], np.int32))
    np.testing.assert_array_equal(vector._env.actions[0], [-1, 1])

    uneven = Scripted([], specs.BoundedArray((2,), np.int32, [0, 0], [1, 4]))
    with pytest.raises(envs.EnvError, match=r"has ranges of \[2, 5\] values; impala_rep's categorical policies need one"):
        wrappers.IntegerActions(uneven)


def test_catch_pixels_learnable_structure():
    """Catch: the paddle follows the actions, reward +1 when under the ball, -1 otherwise."""
    for target in ("hit", "miss"):
        env = envs.make("catch", seed=3, pixels=True, scale=2)
        t = env.reset()
        board = t.observation["pixels"][::2, ::2, 0]
        ball_col = int(np.argmax(board[0]))
        total = 0.0
        while not t.last():
            paddle = int(np.argmax(board[-1]))
            want = ball_col if target == "hit" else (ball_col + 2) % 5
            t = env.step(np.int32(1 + np.sign(want - paddle)))
            board = t.observation["pixels"][::2, ::2, 0]
            total += t.reward
        assert total == (1.0 if target == "hit" else -1.0)
        assert t.discount == 0.0


def test_reach_shaped_reward_and_clip_rewards_option():
    env = envs.make("reach", seed=0, time_limit=40)
    t = env.reset()
    rewards = []
    while not t.last():
        pos, target = t.observation["observation"][:2], t.observation["observation"][2:]
        t = env.step(np.clip((target - pos) * 10, -1, 1).astype(np.float32))
        rewards.append(t.reward)
        assert t.reward == pytest.approx(-np.linalg.norm(t.observation["observation"][:2] - t.observation["observation"][2:]), abs=1e-6)
    assert rewards[-1] > rewards[0] and rewards[-1] > -0.05  # moving to the target pays
    # Seed 0 starts more than 1 from the target: the raw reward is below -1, the clipped one -1;
    # seed 1 starts within 1: clipping leaves it as it is.
    for seed, clipped_reward in ((0, -1.0), (1, None)):
        raw = envs.make("reach", seed=seed, dim=2)
        raw.reset()
        raw_reward = raw.step(np.zeros(2, np.float32)).reward
        clipped = envs.make("reach", seed=seed, clip_rewards=True, dim=2)
        clipped.reset()
        reward = clipped.step(np.zeros(2, np.float32)).reward
        if clipped_reward is None:
            assert -1.0 < raw_reward and reward == pytest.approx(raw_reward)
        else:
            assert raw_reward < -1.0 and reward == clipped_reward
