"""Conformance of every built-in env id and a sample of DM Control tasks, seeding, and the
DM Control options (render presets, sizes, cameras, observation modes, frame stacking).

Runs without TensorFlow (MuJoCo renders here). DM Control tasks render at 32x32 to stay fast.
"""

import os
import sys

import dm_env
import numpy as np
import pytest
from dm_env import specs

import envs
from envs import dmc

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# id -> (make kwargs, how episodes end, agent steps per episode).
BUILTIN_CASES = {
    "catch": ({}, "termination", 9),
    "reach": ({}, "truncation", 50),
}
EXTRA_CASES = {
    "catch[pixels]": ("catch", {"pixels": True, "rows": 6, "columns": 4}, "termination", 5),
    "reach[dim=1,discretize]": ("reach", {"dim": 1, "time_limit": 7, "discretize": 5}, "truncation", 7),
    "catch[time_limit=3]": ("catch", {"time_limit": 3}, "truncation", 3),
    "plugin": ("plugin_envs:make_counter", {"length": 4}, "termination", 4),
}
DMC_SAMPLE = ["dmc/cartpole-swingup", "dmc/walker-walk", "dmc/cheetah-run", "dmc/ball_in_cup-catch"]
DMC_SMALL = {"size": 32}


@pytest.fixture(autouse=True)
def _plugin_path(monkeypatch):
    monkeypatch.syspath_prepend(TESTS_DIR)


def random_action(spec, rng):
    if isinstance(spec, specs.DiscreteArray):
        return np.asarray(rng.integers(spec.num_values), dtype=spec.dtype)
    if hasattr(spec, "num_values"):  # MultiDiscreteArray
        return rng.integers(0, spec.num_values, size=spec.shape).astype(spec.dtype)
    if isinstance(spec, specs.BoundedArray):
        lo = np.broadcast_to(spec.minimum, spec.shape)
        hi = np.broadcast_to(spec.maximum, spec.shape)
        return rng.uniform(lo, hi).astype(spec.dtype)
    raise AssertionError(f"unexpected action spec {spec!r}")


def check_observation(env, observation):
    spec = env.observation_spec()
    assert isinstance(observation, dict), type(observation)
    assert set(observation) == set(spec)
    for key, value in observation.items():
        assert isinstance(value, np.ndarray), (key, type(value))
        spec[key].validate(value)  # exact shape, dtype and bounds
        assert value.ndim in (1, 3), f"{key}: observations are vectors [N] or images [H, W, C]"
        if value.ndim == 3:
            assert value.dtype == np.uint8 and value.flags["C_CONTIGUOUS"]


def run_episode(env, rng, max_steps=2000):
    """Runs one episode with random actions; returns the list of timesteps."""
    timestep = env.reset()
    steps = [timestep]
    while not timestep.last():
        assert len(steps) <= max_steps, "episode did not end"
        timestep = env.step(random_action(env.action_spec(), rng))
        steps.append(timestep)
    return steps


def check_conformance(env, end, length):
    assert isinstance(env, dm_env.Environment)
    rng = np.random.default_rng(0)
    for episode in range(2):
        steps = run_episode(env, rng)
        first, *rest = steps
        assert first.step_type == dm_env.StepType.FIRST
        assert first.reward is None and first.discount is None
        check_observation(env, first.observation)
        assert len(rest) == length, f"episode {episode} has {len(rest)} steps, expected {length}"
        for t in rest[:-1]:
            assert t.step_type == dm_env.StepType.MID
            env.reward_spec().validate(np.asarray(t.reward, env.reward_spec().dtype))
            assert np.asarray(t.reward).shape == ()
            env.discount_spec().validate(np.asarray(t.discount, env.discount_spec().dtype))
            assert t.discount > 0, "discount 0 only on termination"
            check_observation(env, t.observation)
        last = rest[-1]
        assert last.step_type == dm_env.StepType.LAST
        check_observation(env, last.observation)
        if end == "termination":
            assert last.discount == 0.0
        else:
            assert last.discount == 1.0, "truncation keeps the discount"
    # Stepping after LAST starts a new episode.
    assert env.step(random_action(env.action_spec(), rng)).first()


def observations(env, seed_actions, steps):
    """Concatenated observation arrays of ``steps`` steps (resetting after LAST)."""
    rng = np.random.default_rng(seed_actions)
    out = []
    timestep = env.reset()
    for _ in range(steps):
        out.append({k: v.copy() for k, v in timestep.observation.items()})
        timestep = env.reset() if timestep.last() else env.step(random_action(env.action_spec(), rng))
    return out


def same(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def test_every_builtin_id_has_a_conformance_case():
    assert set(envs.list_ids(include_dmc=False)) == set(BUILTIN_CASES)


@pytest.mark.parametrize("env_id", sorted(BUILTIN_CASES))
def test_builtin_conformance(env_id):
    kwargs, end, length = BUILTIN_CASES[env_id]
    check_conformance(envs.make(env_id, seed=1, **kwargs), end, length)


@pytest.mark.parametrize("case", sorted(EXTRA_CASES))
def test_variant_conformance(case):
    env_id, kwargs, end, length = EXTRA_CASES[case]
    check_conformance(envs.make(env_id, seed=1, **kwargs), end, length)


@pytest.mark.parametrize("env_id", sorted(BUILTIN_CASES) + ["catch[pixels]", "plugin"])
def test_builtin_seeding(env_id):
    if env_id in EXTRA_CASES:
        env_id, kwargs, _, _ = EXTRA_CASES[env_id]
    else:
        kwargs = BUILTIN_CASES[env_id][0]
    a = observations(envs.make(env_id, seed=7, **kwargs), 0, 60)
    b = observations(envs.make(env_id, seed=7, **kwargs), 0, 60)
    c = observations(envs.make(env_id, seed=8, **kwargs), 0, 60)
    assert same(a, b), "same seed must give the same episodes"
    assert not same(a, c), "different seeds should give different episodes"


@pytest.mark.parametrize("env_id", DMC_SAMPLE)
def test_dmc_conformance(env_id):
    env = envs.make(env_id, seed=1, **DMC_SMALL)
    assert env.observation_spec()["pixels"].shape == (32, 32, 3)
    check_conformance(env, "truncation", 1000 // 4)


@pytest.mark.parametrize("env_id", ["dmc/cartpole-swingup", "dmc/walker-walk"])
def test_dmc_seeding(env_id):
    kwargs = dict(DMC_SMALL, observation="pixels_state")
    a = observations(envs.make(env_id, seed=3, **kwargs), 0, 15)
    b = observations(envs.make(env_id, seed=3, **kwargs), 0, 15)
    c = observations(envs.make(env_id, seed=4, **kwargs), 0, 15)
    assert same(a, b), "same seed must give the same observations"
    assert not same(a, c)


def test_dmc_action_repeat_sums_rewards():
    """One agent step with action_repeat=4 equals four steps with action_repeat=1."""
    env1 = envs.make("dmc/cartpole-swingup", seed=5, action_repeat=1, observation="state")
    env4 = envs.make("dmc/cartpole-swingup", seed=5, action_repeat=4, observation="state")
    env1.reset(), env4.reset()
    action = np.array([0.7])
    steps1 = [env1.step(action) for _ in range(4)]
    t4 = env4.step(action)
    assert t4.reward == pytest.approx(sum(t.reward for t in steps1))
    assert t4.reward != pytest.approx(steps1[-1].reward)
    np.testing.assert_array_equal(t4.observation["state"], steps1[-1].observation["state"])
    assert len(run_episode(env1, np.random.default_rng(0))) - 1 == 1000


def test_dmc_observation_modes():
    both = envs.make("dmc/cartpole-swingup", seed=0, observation="pixels_state", **DMC_SMALL)
    state = envs.make("dmc/cartpole-swingup", seed=0, observation="state")
    pixels = envs.make("dmc/cartpole-swingup", seed=0, **DMC_SMALL)
    assert set(both.observation_spec()) == {"pixels", "state"}
    assert set(state.observation_spec()) == {"state"}
    assert set(pixels.observation_spec()) == {"pixels"}
    # cartpole: position (3) + velocity (2), flattened to float32.
    assert state.observation_spec()["state"].shape == (5,)
    tb, ts, tp = both.reset(), state.reset(), pixels.reset()
    assert tb.observation["state"].dtype == np.float32
    np.testing.assert_array_equal(tb.observation["state"], ts.observation["state"])
    np.testing.assert_array_equal(tb.observation["pixels"], tp.observation["pixels"])
    assert state.render_preset is None  # state-only envs never render


def test_render_presets():
    imgs = {}
    for preset in ("standard", "fast", "auto"):
        env = envs.make("dmc/walker-walk", seed=0, size=48, render=preset)
        imgs[preset] = env.reset().observation["pixels"]
        assert imgs[preset].shape == (48, 48, 3) and imgs[preset].dtype == np.uint8
        assert imgs[preset].std() > 1.0, "rendered image is blank"
        resolved = env.render_preset
        if preset != "auto":
            assert resolved == preset
        shadowsize = env.physics.model.vis.quality.shadowsize
        assert (shadowsize == 0) == (resolved == "fast")
        assert (env.physics.model.vis.quality.offsamples == 0) == (resolved == "fast")
        quality = env.physics.model.vis.quality
        expected_tessellation = (dmc.FAST_NUMSLICES, dmc.FAST_NUMSTACKS) if resolved == "fast" else (28, 16)
        assert (quality.numslices, quality.numstacks) == expected_tessellation
    assert not np.array_equal(imgs["fast"], imgs["standard"])
    # fast turns the skybox off: the background is black (the clear colour), standard has none.
    assert (imgs["fast"].sum(-1) == 0).mean() > 0.2
    assert (imgs["standard"].sum(-1) == 0).mean() == 0.0
    software = any(s in dmc.renderer_name().lower() for s in ("llvmpipe", "softpipe", "swrast", "osmesa"))
    expected = "fast" if software else "standard"
    np.testing.assert_array_equal(imgs["auto"], imgs[expected])


def test_fast_preset_tessellation_keeps_the_look():
    """The fast preset's coarser capsules change silhouette pixels, not the picture: its frames
    against the same preset at the suite's full tessellation, over a walker episode's start."""
    size, seed = 64, 5
    env = envs.make("dmc/walker-walk", seed=seed, size=size, render="fast", action_repeat=1)
    kept = envs.make("dmc/walker-walk", seed=seed, size=size, render="fast", action_repeat=1, coarse_shapes=False)
    # After envs.make, which chooses MUJOCO_GL before dm_control is first imported.
    from dm_control.mujoco import engine  # pylint: disable=import-outside-toplevel

    full = dmc._suite().load("walker", "walk", task_kwargs={"random": seed})  # pylint: disable=protected-access
    quality = full.physics.model.vis.quality
    quality.shadowsize, quality.offsamples = 0, 0
    assert (quality.numslices, quality.numstacks) == (28, 16)
    camera = engine.Camera(full.physics, height=size, width=size, camera_id=0)
    flags = {"shadow": False, "reflection": False, "skybox": False}
    timestep, _, _ = env.reset(), kept.reset(), full.reset()
    rng = np.random.default_rng(seed)
    diffs, changed = [], []
    for _ in range(30):
        action = rng.uniform(-1.0, 1.0, size=env.action_spec().shape)
        timestep, kept_timestep, _ = env.step(action), kept.step(action), full.step(action)
        ours = timestep.observation["pixels"].astype(np.int16)
        reference = np.ascontiguousarray(camera.render(render_flag_overrides=dict(flags))).astype(np.int16)
        np.testing.assert_array_equal(kept_timestep.observation["pixels"], reference)  # coarse_shapes=False
        diff = np.abs(ours - reference)
        diffs.append(diff.mean())
        changed.append((diff.max(-1) > 16).mean())
    assert max(diffs) > 0.0, "the fast preset's tessellation did not reach the frames"
    assert np.mean(diffs) < 1.0, f"mean difference {np.mean(diffs):.3f} grey levels"
    assert np.mean(changed) < 0.01, f"{np.mean(changed):.4f} of the pixels differ by more than 16"
    assert (kept.physics.model.vis.quality.numslices, kept.physics.model.vis.quality.numstacks) == (28, 16)
    env.close()
    kept.close()
    with pytest.raises(envs.EnvError, match="coarse_shapes must be true or false"):
        envs.make("dmc/walker-walk", render="fast", coarse_shapes="yes")


def test_cheetah_run_keeps_the_model_shapes_by_default_and_other_tasks_take_the_coarse_ones():
    """The per-task default (``dmc.MODEL_SHAPES_TASKS``): cheetah-run's hour pairs ended ahead
    with the model's tessellation; walker-walk's favoured the coarse shapes (two of three), which it keeps."""
    def tessellation(env):
        quality = env.physics.model.vis.quality
        return int(quality.numslices), int(quality.numstacks)

    coarse = (dmc.FAST_NUMSLICES, dmc.FAST_NUMSTACKS)
    for env_id, given, expected in (("dmc/cheetah-run", None, (28, 16)), ("dmc/cheetah-run", True, coarse),
                                    ("dmc/walker-walk", None, coarse), ("dmc/walker-walk", False, (28, 16))):
        kwargs = {} if given is None else {"coarse_shapes": given}
        env = envs.make(env_id, seed=0, size=32, render="fast", **kwargs)
        assert tessellation(env) == expected, (env_id, given)
        env.close()
    assert [dmc.default_coarse_shapes(i) for i in ("dmc/cheetah-run", "dmc/walker-walk", "dmc/cartpole-swingup")] \
        == [False, True, True]


def test_dmc_size_camera_and_frame_stack():
    env = envs.make("dmc/cheetah-run", seed=0, size=[24, 40], camera=1, frame_stack=3)
    assert env.observation_spec()["pixels"].shape == (24, 40, 9)
    first = env.reset().observation["pixels"]
    assert first.shape == (24, 40, 9)
    # At the first step the stack repeats the first frame.
    np.testing.assert_array_equal(first[..., 0:3], first[..., 6:9])
    second = env.step(np.zeros(6)).observation["pixels"]
    np.testing.assert_array_equal(second[..., 3:6], first[..., 6:9])
    cam0 = envs.make("dmc/cheetah-run", seed=0, size=[24, 40], camera=0).reset().observation["pixels"]
    assert not np.array_equal(cam0, first[..., 6:9]), "camera option ignored"


def test_every_suite_task_has_an_id():
    from dm_control import suite

    ids = envs.list_ids()
    assert {f"dmc/{d}-{t}" for d, t in suite.ALL_TASKS} <= set(ids)
    assert "dmc/ball_in_cup-catch" in ids and "catch" in ids
    assert dmc.parse_dmc_id("dmc/ball_in_cup-catch") == ("ball_in_cup", "catch")


def test_dmc_state_env_without_rendering_is_conformant():
    env = envs.make("dmc/ball_in_cup-catch", seed=2, observation="state", action_repeat=8)
    check_conformance(env, "truncation", 1000 // 8)


def test_tensorflow_never_imported():
    assert "tensorflow" not in sys.modules
