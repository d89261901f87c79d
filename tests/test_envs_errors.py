"""Bad input to ``envs``: each gives one EnvError sentence saying what was wrong and what is
accepted. Also plug-in loading, ``parse_env_args`` and side-effect-free import.
"""

import logging
import os
import subprocess
import sys
import textwrap

import dm_env
import pytest

import envs

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)


@pytest.fixture(autouse=True)
def _plugin_path(monkeypatch):
    monkeypatch.syspath_prepend(TESTS_DIR)


def env_error(fn, *args, **kwargs) -> envs.EnvError:
    with pytest.raises(envs.EnvError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "\n" not in message and message.endswith("."), f"not one sentence: {message!r}"
    return info.value


# ----------------------------------------------------------------------------- ids

def test_unknown_id_suggests_close_matches():
    msg = str(env_error(envs.make, "cartpol-swingup"))
    assert "'cartpol-swingup'" in msg and "dmc/cartpole-swingup" in msg
    assert "package.module:callable" in msg and "catch" in msg
    msg = str(env_error(envs.make, "catc"))
    assert "(did you mean catch?)" in msg


@pytest.mark.parametrize("env_id", ["", "  ", None, 3])
def test_empty_or_non_string_id(env_id):
    env_error(envs.make, env_id)


def test_unknown_dmc_domain_lists_domains():
    msg = str(env_error(envs.make, "dmc/cartpol-swingup"))
    assert "unknown DM Control domain 'cartpol'" in msg
    assert "(did you mean cartpole?)" in msg
    assert "ball_in_cup" in msg and "walker" in msg  # the valid domains are listed


def test_unknown_dmc_task_lists_tasks():
    msg = str(env_error(envs.make, "dmc/cartpole-run"))
    assert "unknown task 'run'" in msg and "'cartpole'" in msg
    assert "swingup" in msg and "balance" in msg


@pytest.mark.parametrize("env_id", ["dmc/cartpole", "dmc/-swingup", "dmc/cartpole-"])
def test_malformed_dmc_id(env_id):
    assert "dmc/DOMAIN-TASK" in str(env_error(envs.make, env_id))


# ----------------------------------------------------------------------------- plug-ins

def test_plugin_loads_with_env_args():
    kwargs = envs.parse_env_args(["length=3", "label=abc"])
    env = envs.make("plugin_envs:make_counter", seed=1, **kwargs)
    assert isinstance(env, dm_env.Environment)
    assert env.length == 3 and env.label == "abc"  # attributes fall through the wrappers
    # Single-array observations are exposed under "observation".
    assert list(env.observation_spec()) == ["observation"]
    assert env.reset().observation["observation"].shape == (2,)


def test_plugin_class_attribute_and_wrapper_options():
    env = envs.make("plugin_envs:Factories.counter", seed=0, time_limit=2)
    t = env.reset()
    t = env.step(0)
    t = env.step(0)
    assert t.last() and t.discount == 1.0  # truncated by the time limit before termination


def test_plugin_seed_reaches_factory():
    a = envs.make("plugin_envs:make_counter", seed=1).reset().observation["observation"]
    b = envs.make("plugin_envs:make_counter", seed=2).reset().observation["observation"]
    assert a[1] != b[1]


def test_plugin_without_seed_parameter_warns():
    with pytest.warns(UserWarning, match="takes no seed"):
        env = envs.make("plugin_envs:make_counter_no_seed", seed=3, length=2)
    assert env.length == 2


@pytest.mark.parametrize(
    "env_id",
    ["plugin_envs:", ":make_counter", "plugin envs:make_counter", "plugin_envs:make-counter", "a..b:f", "m:f:g"],
)
def test_malformed_module_callable(env_id):
    msg = str(env_error(envs.make, env_id))
    assert "malformed factory id" in msg and "package.module:callable" in msg


def test_missing_module():
    err = env_error(envs.make, "no_such_package_xyz.envs:make")
    assert "cannot import module 'no_such_package_xyz.envs'" in str(err) and "PYTHONPATH" in str(err)
    assert isinstance(err.__cause__, ModuleNotFoundError)


def test_missing_attribute_lists_callables():
    msg = str(env_error(envs.make, "plugin_envs:make_countr"))
    assert "no attribute 'make_countr'" in msg and "make_counter" in msg


def test_not_callable():
    assert "not a callable" in str(env_error(envs.make, "plugin_envs:NOT_CALLABLE"))


def test_factory_that_raises_is_chained():
    err = env_error(envs.make, "plugin_envs:make_raising")
    assert "RuntimeError: simulator licence not found" in str(err)
    assert isinstance(err.__cause__, RuntimeError)
    # The sentence says where (a command line shows it without the chained traceback).
    assert "(in make_raising, " in str(err) and "plugin_envs.py line " in str(err), str(err)


def test_factory_returning_non_env():
    msg = str(env_error(envs.make, "plugin_envs:make_not_env"))
    assert "returned an object of type int, not a dm_env.Environment" in msg


def test_a_reward_spec_of_several_numbers_is_refused_with_a_sentence():
    from impala_rep.specs import env_spec_from_dm_env

    with pytest.raises(ValueError) as info:
        env_spec_from_dm_env(envs.make("plugin_envs:make_vector_reward"))
    assert str(info.value) == ("the env's reward spec is of shape [2]; impala_rep trains on one reward per step "
                               "(combine or select the parts in your factory, and declare a scalar reward_spec).")
    env_spec_from_dm_env(envs.make("plugin_envs:make_counter"))  # a scalar reward and discount pass


def test_unknown_plugin_option_lists_accepted():
    msg = str(env_error(envs.make, "plugin_envs:make_counter", lenght=3))
    assert "lenght" in msg and "length" in msg and "label" in msg


def test_register():
    envs.register("test/counter", lambda seed=None, length=5: __import__("plugin_envs").Counter(length, seed=seed))
    try:
        assert "test/counter" in envs.list_ids(include_dmc=False)
        assert envs.make("test/counter", seed=0, length=2).length == 2
        env_error(envs.register, "test/counter", lambda: None)
        env_error(envs.register, "dmc/mine", lambda: None)
        env_error(envs.register, "bad id", lambda: None)
        env_error(envs.register, "ok-id", 3)
    finally:
        from envs import registry

        registry._REGISTRY.pop("test/counter", None)


# ----------------------------------------------------------------------------- env args

def test_parse_env_args_types():
    args = envs.parse_env_args(
        ["size=64", "scale=0.5", "pixels=true", "dims=[48, 64]", "name=walker", "quoted=\"7\"", "none=null", "eq=a=b", "empty="]
    )
    assert args == {
        "size": 64, "scale": 0.5, "pixels": True, "dims": [48, 64], "name": "walker",
        "quoted": "7", "none": None, "eq": "a=b", "empty": "",
    }
    assert envs.parse_env_args([]) == {}


@pytest.mark.parametrize("items", [["size"], ["=3"], ["1x=3"], ["a b=3"], ["a=1", "a=2"], "size=3", [3]])
def test_parse_env_args_malformed(items):
    env_error(envs.parse_env_args, items)


@pytest.mark.parametrize(
    "env_id, kwargs, needle",
    [
        ("catch", {"rowz": 3}, "rows"),
        ("catch", {"rows": "ten"}, "rows must be an integer"),
        ("catch", {"pixels": "yes"}, "pixels must be true or false"),
        ("reach", {"dim": 3}, "dim must be 1 or 2"),
        ("catch", {"discretize": 5}, "continuous"),
        ("reach", {"discretize": 1}, "discretize"),
        ("catch", {"clip_rewards": "yes"}, "clip_rewards must be true or false"),
        ("catch", {"action_repeat": 0}, "action_repeat"),
        ("catch", {"frame_stack": 2}, "frame_stack needs [H, W, C]"),
        ("catch", {"observation_keys": ["pixels"]}, "observation keys ['observation']"),
        ("catch", {"time_limit": -1}, "time_limit"),
        ("dmc/cartpole-swingup", {"sise": 64}, "size"),
        ("dmc/cartpole-swingup", {"size": "big"}, "size must be a positive integer or [height, width]"),
        ("dmc/cartpole-swingup", {"size": [0, 3]}, "size"),
        ("dmc/cartpole-swingup", {"size": 100000}, "offscreen buffer"),
        ("dmc/cartpole-swingup", {"render": "fastest"}, "standard, fast, auto"),
        ("dmc/cartpole-swingup", {"observation": "rgb"}, "pixels, pixels_state, state"),
        ("dmc/cartpole-swingup", {"action_repeat": 0}, "action_repeat"),
        ("dmc/cartpole-swingup", {"camera": 7}, "camera"),
        ("dmc/cartpole-swingup", {"camera": "nope"}, "cameras"),
    ],
)
def test_bad_options(env_id, kwargs, needle):
    assert needle in str(env_error(envs.make, env_id, seed=0, **kwargs))


def test_bad_seed():
    env_error(envs.make, "catch", seed="1")
    env_error(envs.make, "catch", seed=1.5)
    import numpy as np

    a = envs.make("catch", seed=np.int64(4)).reset().observation["observation"]
    b = envs.make("catch", seed=4).reset().observation["observation"]
    np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- OpenGL, import

def _run(code, **env_overrides):
    env = {k: v for k, v in os.environ.items() if k not in ("MUJOCO_GL", "DISPLAY", "PYOPENGL_PLATFORM")}
    env.update(env_overrides)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )


_MAKE_DMC = """
    import envs
    try:
        envs.make("dmc/cartpole-swingup", size=16)
        print("RENDERED")
    except envs.EnvError as e:
        print("ENVERROR", e)
"""


def test_missing_opengl_backend_names_packages():
    # glvnd finds no EGL vendor library: the same failure as a machine without libegl-mesa0.
    out = _run(_MAKE_DMC, MUJOCO_GL="egl", __EGL_VENDOR_LIBRARY_FILENAMES="/nonexistent/egl_vendor.json")
    if "RENDERED" in out.stdout:
        pytest.skip("this EGL loader ignores __EGL_VENDOR_LIBRARY_FILENAMES; cannot simulate a missing backend")
    assert "ENVERROR" in out.stdout, out.stdout + out.stderr
    msg = out.stdout.split("ENVERROR", 1)[1]
    for needle in ("libegl1", "libegl-mesa0", "libgl1-mesa-dri", "MUJOCO_GL=egl", "osmesa"):
        assert needle in msg


def test_invalid_mujoco_gl_value():
    out = _run(_MAKE_DMC, MUJOCO_GL="nonexistent")
    assert "ENVERROR MUJOCO_GL='nonexistent' is not a MuJoCo rendering backend" in out.stdout, out.stdout + out.stderr
    assert "MUJOCO_GL=egl" in out.stdout and "libegl1" in out.stdout


def test_import_has_no_side_effects_and_mujoco_gl_defaults_to_egl():
    out = _run(
        """
        import os, sys
        import envs
        assert "MUJOCO_GL" not in os.environ, "import envs must not set MUJOCO_GL"
        assert "dm_control" not in sys.modules and "mujoco" not in sys.modules
        envs.make("catch", seed=0).reset()
        assert "dm_control" not in sys.modules, "built-in envs must not import dm_control"
        envs.make("dmc/cartpole-swingup", seed=0, size=16).reset()
        print("MUJOCO_GL", os.environ.get("MUJOCO_GL"))
        assert "tensorflow" not in sys.modules
        """
    )
    assert out.returncode == 0, out.stderr
    assert "MUJOCO_GL egl" in out.stdout


@pytest.mark.parametrize("entry_point_logging", [False, True])
def test_entry_points_keep_dm_control_start_up_lines_out_of_an_error(entry_point_logging):
    """An unknown id imports dm_control (to suggest close task ids), whose import logs OpenGL and
    MuJoCo banners at INFO; the entry points' configure_logging keeps them out, so the error is
    what the user sees. Without it (plain INFO logging, the control) the banners are there."""
    setup = (
        "from impala_rep.flags import configure_logging; configure_logging('%(message)s')"
        if entry_point_logging
        else "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s')"
    )
    out = _run(
        setup
        + "\nimport envs\ntry:\n    envs.make('cartpole-swingup')\nexcept envs.EnvError as e:\n    print('ENVERROR', e)\n",
        MUJOCO_GL="egl",
    )
    assert out.returncode == 0, out.stderr
    assert "ENVERROR unknown env id 'cartpole-swingup' (did you mean dmc/cartpole-swingup" in out.stdout, out.stdout
    banners = ("attempting to import specified OpenGL backend", "MuJoCo library version", "OpenGL_accelerate")
    shown = [b for b in banners if b in out.stderr]
    if entry_point_logging:
        assert not shown, out.stderr
    else:
        assert shown, out.stderr


@pytest.mark.parametrize("entry_point_logging", [False, True])
def test_entry_points_log_a_repeated_mujoco_warning_once(entry_point_logging):
    """MuJoCo warns about dm_control's cheetah model on every env made (16 lines in an actor
    process); with the entry points' logging the warning is logged once per process."""
    setup = (
        "from impala_rep.flags import configure_logging; configure_logging('%(message)s')"
        if entry_point_logging
        else "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s')"
    )
    out = _run(setup + "\nimport envs\nfor seed in range(3):\n    envs.make('dmc/cheetah-run', seed=seed, size=8)\n",
               MUJOCO_GL="egl")
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("settotalmass") == (1 if entry_point_logging else 3), out.stderr


def test_once_filter_passes_each_message_once_and_stops_remembering_at_its_limit():
    from impala_rep.flags import OnceFilter

    def record(msg, level=30):
        return logging.LogRecord("absl", level, __file__, 1, msg, None, None)

    once = OnceFilter(limit=2)
    assert [once.filter(record(m)) for m in ("a", "a", "b", "a", "b")] == [True, False, True, False, False]
    assert once.filter(record("a", level=40))  # another level is another message
    assert once.filter(record("c")) and once.filter(record("c"))  # past the limit: not remembered
