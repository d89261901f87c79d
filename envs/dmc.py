"""DeepMind Control Suite tasks with pixel observations (ids ``dmc/DOMAIN-TASK``).

TensorFlow-free, and ``dm_control`` is imported lazily, at make-time, never when ``envs``
is imported.

**OpenGL backend.** MuJoCo reads ``MUJOCO_GL`` once, when ``dm_control`` is first imported.
:func:`make_dmc` therefore prepares it just before that import: if ``MUJOCO_GL`` is unset
and there is no ``DISPLAY``, it sets ``MUJOCO_GL=egl`` in ``os.environ`` (headless EGL;
Mesa's llvmpipe on a machine without a GPU). Set ``MUJOCO_GL`` yourself (``egl``,
``osmesa`` or ``glfw``) to choose otherwise. A missing backend raises :class:`EnvError`
naming the Debian packages to install.

**Observations** (flat dict):
  * ``pixels``: uint8 ``[H, W, 3]``, C-contiguous, from camera ``camera`` (default 0),
    rendered once per agent step (after the action repeats);
  * ``state``: float32 ``[N]``, the suite's proprioceptive observations flattened and
    concatenated in the suite's order.

**Render presets.** ``standard`` is dm_control's published look. ``fast`` sets
``model.vis.quality.shadowsize = 0`` and ``offsamples = 0`` and sizes the offscreen buffer
to the frame (``vis.global_.offwidth``/``offheight``) before the first render, and turns the
shadow, reflection and skybox scene flags off: about 20x faster on a software renderer.
``auto`` (default) picks ``fast`` on a software renderer (llvmpipe, softpipe, swrast,
OSMesa) and ``standard`` on a GPU.

**Coarse shapes** (``coarse_shapes=True``, the default except for the tasks of
``MODEL_SHAPES_TASKS``; only under ``fast``): MuJoCo's
built-in shapes (capsules, cylinders, spheres, ellipsoids) are drawn with at most
``FAST_NUMSLICES`` = 16 slices and ``FAST_NUMSTACKS`` = 8 stacks
(``model.vis.quality.numslices``/``numstacks``; the suite's 28 and 16). On llvmpipe a small
frame's cost is mostly its triangles: cartpole-swingup at 64x64 renders in about half the CPU
(0.73 -> 0.39 ms here), walker-walk or cheetah-run at 84x84 in about 0.8 against 1.5 ms, and
the frames differ from the full tessellation only at the rounded shapes' silhouettes, by a
fraction of a grey level on average (``tests/test_envs.py``). ``coarse_shapes=False`` keeps
the model's tessellation. ``MODEL_SHAPES_TASKS`` (cheetah-run) keep it by default: there the
model's shapes learned enough more per agent step to end hour-long runs ahead in spite of the
fewer agent steps (docs/RESULTS.md); ``default_coarse_shapes(env_id)`` gives a task's default.

**Shared rendering contexts** (``share_context=True``, the default): the pixel envs of one
thread whose models render alike share one OpenGL context and one MuJoCo render context
(``envs.render_share``), which saves a context switch per frame when a process steps many
envs (about 20% of the CPU of a cartpole frame with llvmpipe) and the memory of a context
per env. The frames are the same bit for bit (``tests/test_envs_render_share.py``).

**Episodes.** Every DM Control episode ends by truncation at 1000 control steps (``LAST``
with discount 1.0), i.e. after ``1000 / action_repeat`` agent steps; rewards of repeated
steps are summed and discounts multiplied, stopping early at ``LAST``, and cast to the
suite's reward and discount spec dtype (``float64``). ``seed`` seeds the task's random
state: the same seed gives the same episodes.

**Action repeat** (``fast_repeat=True``, the default) runs the repeated control steps
itself, exactly as ``dm_control.rl.control.Environment.step`` does (``task.before_step``,
``physics.step(n_sub_steps)``, ``task.after_step``, ``task.get_reward``, the step limit and
``task.get_termination``, auto-reset on the step after ``LAST``), but computes the task's
observation only where it is used: once per agent step, after the last repeat, and only
when ``observation`` includes ``state``. Pixels-only envs never compute it. Rewards
(with ``fast_reward=False``; within 1e-15 per control step with fast rewards, below),
discounts, step types, states and pixels are identical to repeating ``env.step``
(``fast_repeat=False``; ``tests/test_envs_fast_repeat.py`` checks this against dm_control's
own loop over full episodes). Measured here: 10-25% less CPU per agent step (cartpole-swingup
at 84x84, fast preset: about 1.74 -> 1.55 ms; state only: 0.83 -> 0.65 ms). Envs whose class
overrides dm_control's ``step``/``reset`` fall back to the plain loop.

**Fast rewards** (``fast_reward=True``, the default, with ``fast_repeat``): the control steps
compute the task's reward with ``envs.fast_rewards.tolerance``, dm_control's
``rewards.tolerance`` in Python's ``math`` for the floats and one-element arrays the suite's
rewards pass, instead of NumPy calls on such tiny inputs (cartpole-swingup at action repeat 8
on a slow host: ``get_reward`` about 80 -> 28 us per control step). Rewards equal dm_control's
to within 1e-15 (the last bit of one ``exp``/``cos``/``cosh``/``tanh``; most sigmoids to the
bit); everything else is untouched. For cartpole's one-pole tasks, walker's and cheetah's the
whole reward is computed directly (``envs.fast_rewards.task_reward``: the state read by index
instead of through dm_control's named indexing, the same arithmetic on floats; the same value
bit for bit as ``get_reward`` with the fast ``tolerance``; per control step on a slow host
cartpole about 40 -> 2-4 us, walker 22-24 -> 4), unless a reward method was replaced.
``fast_reward=False`` (or ``fast_repeat=False``) uses dm_control's own function and
``get_reward``.

**Fast physics step** (``fast_step=True``, the default, with ``fast_repeat``): the control
steps call MuJoCo's ``mj_step2``/``mj_step``/``mj_step1`` as dm_control's ``Physics.step``
does and check for new MuJoCo warnings as it does (``PhysicsError`` naming them, or a logged
warning inside ``suppress_physics_errors``), without the context manager and NumPy
temporaries it runs per call (timed alone on a slow host: a whole control step of cartpole
25-41 -> 18-24 us, cheetah 45-48 -> 25-26, walker, 10 substeps, 173-260 -> 150-234). States,
rewards and pixels are the same bit for bit (``tests/test_envs_fast_repeat.py``). A physics
class that overrides ``step`` keeps its own. Measured with the direct rewards above
(``scripts/bench_envs.py``, one process, the same host, alternating with the code before): the
main job's cartpole env (64x64, action repeat 8) 496-557 -> 985-1,213 agent steps per
CPU-second, the benchmark's (84x84, repeat 4) 664-741 -> 1,173-1,479; the fast step's share,
alone (``--fast-step both``), 948 -> 1,049 at the main job's setting. In the env's loop, with a
render between agent steps, the two save more than timed alone (about 125 against 40-70 us per
control step). ``fast_step=False`` calls ``physics.step``.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import dm_env
import numpy as np
from dm_env import specs

from envs import fast_rewards
from envs.errors import EnvError
from envs.render_share import release_contexts, share_contexts
from envs.wrappers import ActionRepeat, Wrapper

__all__ = [
    "RENDER_PRESETS",
    "OBSERVATION_MODES",
    "FAST_NUMSLICES",
    "FAST_NUMSTACKS",
    "MODEL_SHAPES_TASKS",
    "make_dmc",
    "default_coarse_shapes",
    "run_env_kwargs",
    "recorded_env_kwargs",
    "parse_dmc_id",
    "dmc_ids",
    "renderer_name",
    "is_software_renderer",
    "DMCObservation",
]

RENDER_PRESETS = ("standard", "fast", "auto")
OBSERVATION_MODES = ("pixels", "pixels_state", "state")

_GL_PACKAGES_HINT = (
    "install the Debian packages libegl1 libegl-mesa0 libgl1-mesa-dri and set MUJOCO_GL=egl "
    "(or install libosmesa6 and set MUJOCO_GL=osmesa)"
)
# The values dm_control 1.0 accepts for MUJOCO_GL.
_MUJOCO_GL_VALUES = (
    "", "0", "1", "disable", "disabled", "egl", "enable", "enabled", "false", "glfw", "off", "on",
    "osmesa", "true",
)
_SOFTWARE_RENDERERS = ("llvmpipe", "softpipe", "swrast", "osmesa", "software rasterizer")
_FAST_FLAGS = {"shadow": False, "reflection": False, "skybox": False}
# The fast preset's tessellation of MuJoCo's built-in shapes (half the suite's 28 x 16).
FAST_NUMSLICES = 16
FAST_NUMSTACKS = 8


# The tasks whose new runs keep the model's tessellation (coarse_shapes=False) by default: on
# cheetah-run the model's shapes ended three seeds' hour pairs ahead (87, 37 and 30 greedy) and two
# 30-minute pairs, on fewer agent steps (docs/RESULTS.md, fifty-fourth to sixty-first sessions).
# Walker-walk keeps the coarse shapes, as every task not named here does: two of its three seeds'
# hour pairs ended ahead with them (39 and 63 greedy; the other 41 behind; the sixty-second session).
MODEL_SHAPES_TASKS = frozenset({"dmc/cheetah-run"})


def default_coarse_shapes(env_id: Any) -> bool:
    """``coarse_shapes`` for a new run of ``env_id`` that does not give it: False for the tasks
    of :data:`MODEL_SHAPES_TASKS`, True otherwise."""
    return env_id not in MODEL_SHAPES_TASKS


def run_env_kwargs(env_id: Any, env_kwargs: Any) -> Any:
    """The env arguments of a new run as its config holds them: for a ``dmc/`` id,
    ``coarse_shapes`` written out (the task's :func:`default_coarse_shapes` where not given);
    anything else as it is (a non-dict, for the caller's own check to refuse).

    Every run config of a ``dmc/`` id holds it, so that a later change of a default cannot
    change what an earlier run's frames look like when it is resumed, repeated (``--config``)
    or its policy evaluated."""
    return _with_coarse_shapes(env_id, env_kwargs, default_coarse_shapes(env_id))


def recorded_env_kwargs(env_id: Any, env_kwargs: Any) -> Any:
    """The env arguments an earlier run's record (its ``config.json``, a policy export) holds,
    as that run rendered them: for a ``dmc/`` id without ``coarse_shapes``, True, since a
    record without it predates :func:`run_env_kwargs` and rendered the coarse shapes, then
    every task's default (from the forty-fifth session; runs from before it rendered the
    model's shapes: give them ``coarse_shapes=false``). Anything else as it is."""
    return _with_coarse_shapes(env_id, env_kwargs, True)


def _with_coarse_shapes(env_id: Any, env_kwargs: Any, default: bool) -> Any:
    if not isinstance(env_id, str) or not env_id.startswith("dmc/") or not isinstance(env_kwargs, dict):
        return env_kwargs
    if "coarse_shapes" in env_kwargs:
        return dict(env_kwargs)
    return {**env_kwargs, "coarse_shapes": default}


log = logging.getLogger(__name__)

# The attributes of dm_control.rl.control.Environment that _ControlRepeat mirrors.
_CONTROL_ATTRS = ("_task", "_physics", "_n_sub_steps", "_step_limit", "_step_count", "_reset_next_step",
                  "_flat_observation")

_renderer_name: Optional[str] = None  # cached GL_RENDERER string, probed once per process


def _prepare_gl() -> None:
    """Defaults ``MUJOCO_GL`` and checks it, before dm_control is first imported."""
    if "dm_control._render" in sys.modules:
        return  # already imported: MUJOCO_GL has been read and can no longer change anything
    if "MUJOCO_GL" not in os.environ and not os.environ.get("DISPLAY"):
        os.environ["MUJOCO_GL"] = "egl"
    value = os.environ.get("MUJOCO_GL")
    if value is not None and value not in _MUJOCO_GL_VALUES:
        raise EnvError(
            f"MUJOCO_GL={value!r} is not a MuJoCo rendering backend; set MUJOCO_GL=egl (headless, "
            "Debian packages libegl1 libegl-mesa0 libgl1-mesa-dri), osmesa (libosmesa6) or glfw "
            "(with a display)."
        )


def _gl_error(exc: BaseException) -> EnvError:
    backend = os.environ.get("MUJOCO_GL", "<unset>")
    return EnvError(
        f"no usable OpenGL backend for MuJoCo rendering (MUJOCO_GL={backend}: "
        f"{type(exc).__name__}: {str(exc).rstrip('.')}); {_GL_PACKAGES_HINT}; state-only envs "
        "(observation='state') also run with MUJOCO_GL=disable."
    )


def _suite():
    """Imports ``dm_control.suite`` (lazily), turning OpenGL set-up failures into EnvError."""
    _prepare_gl()
    try:
        from dm_control import suite  # pylint: disable=import-outside-toplevel
    except (ImportError, RuntimeError, AttributeError, OSError) as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] in ("dm_control", "mujoco"):
            raise EnvError(
                "dm_control is not installed; install it with pip install 'dm-control>=1.0.50,<1.1' "
                "'mujoco>=3.2,<4'."
            ) from exc
        raise _gl_error(exc) from exc
    return suite


def dmc_ids() -> List[str]:
    """Every ``dmc/DOMAIN-TASK`` id, one per task in ``dm_control.suite.ALL_TASKS``."""
    return [f"dmc/{domain}-{task}" for domain, task in _suite().ALL_TASKS]


def parse_dmc_id(env_id: str) -> Tuple[str, str]:
    """``"dmc/ball_in_cup-catch"`` -> ``("ball_in_cup", "catch")``; validates against the suite."""
    name = env_id[len("dmc/"):] if env_id.startswith("dmc/") else env_id
    suite = _suite()
    domains = suite.TASKS_BY_DOMAIN
    domain, sep, task = name.partition("-")
    if not sep or not domain or not task:
        raise EnvError(
            f"DM Control ids have the form dmc/DOMAIN-TASK (e.g. dmc/cartpole-swingup), got {env_id!r}."
        )
    if domain not in domains:
        close = difflib.get_close_matches(domain, list(domains), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise EnvError(
            f"unknown DM Control domain {domain!r} in {env_id!r}{hint}; valid domains: "
            f"{', '.join(sorted(domains))}."
        )
    if task not in domains[domain]:
        raise EnvError(
            f"unknown task {task!r} for DM Control domain {domain!r}; valid tasks: "
            f"{', '.join(sorted(domains[domain]))}."
        )
    return domain, task


def renderer_name() -> str:
    """The OpenGL renderer string (``GL_RENDERER``) MuJoCo renders with, probed once.

    E.g. ``"llvmpipe (LLVM 15.0.6, 256 bits)"`` on Mesa's software renderer. Raises
    :class:`EnvError` when no OpenGL backend works.
    """
    global _renderer_name
    if _renderer_name is None:
        _suite()
        try:
            from dm_control import _render  # pylint: disable=import-outside-toplevel
            from OpenGL import GL  # pylint: disable=import-outside-toplevel

            if _render.BACKEND == "osmesa":
                _renderer_name = "OSMesa"
            else:
                probe = _render.Renderer(max_width=1, max_height=1)
                try:
                    with probe.make_current() as ctx:
                        name = ctx.call(GL.glGetString, GL.GL_RENDERER)
                finally:
                    probe.free()
                _renderer_name = name.decode() if isinstance(name, bytes) else str(name)
        except EnvError:
            raise
        except Exception as exc:  # any failure to create a GL context
            raise _gl_error(exc) from exc
    return _renderer_name


def is_software_renderer() -> bool:
    """True when MuJoCo renders on a CPU rasteriser (llvmpipe, softpipe, swrast, OSMesa)."""
    name = renderer_name().lower()
    return any(s in name for s in _SOFTWARE_RENDERERS)


def _size_option(size: Any) -> Tuple[int, int]:
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        size = (size, size)
    if (
        isinstance(size, (list, tuple))
        and len(size) == 2
        and all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 1 for s in size)
    ):
        return int(size[0]), int(size[1])
    raise EnvError(f"dmc option size must be a positive integer or [height, width], got {size!r}.")


def _choice_option(name: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise EnvError(f"dmc option {name} must be one of {', '.join(choices)}, got {value!r}.")
    return value


def _render_flag_index(key: str) -> int:
    """The ``mjtRndFlag`` index of a lowercase render-flag name (``"shadow"`` -> ``mjRND_SHADOW``)."""
    import mujoco  # pylint: disable=import-outside-toplevel

    return int(getattr(mujoco.mjtRndFlag, "mjRND_" + key.upper()))


def _supports_fast_repeat(env: Any) -> bool:
    """True for a plain ``dm_control.rl.control.Environment`` (``step``/``reset`` not overridden)."""
    from dm_control.rl import control  # pylint: disable=import-outside-toplevel

    cls = type(env)
    return (
        isinstance(env, control.Environment)
        and cls.step is control.Environment.step
        and cls.reset is control.Environment.reset
        and all(hasattr(env, name) for name in _CONTROL_ATTRS)
    )


class _PhysicsStep:
    """``physics.step(nstep)`` as dm_control's ``mujoco.Physics.step`` runs it, for a physics
    whose class does not override ``step``: the same MuJoCo calls in the same order
    (``legacy_step``: ``mj_step2``, ``mj_step`` for the remaining substeps and ``mj_step1``, or
    ``mj_step`` alone with the RK4 integrator; otherwise ``mj_step``), and the same check for
    new MuJoCo warnings afterwards (``PhysicsError`` naming them, or a logged warning inside
    ``suppress_physics_errors``), without the context manager and the NumPy temporaries that
    ``Physics.step`` runs per call (7-20 us per control step on a slow host, a third to a half
    of a small model's whole step). The state after each call is the same bit for bit
    (``tests/test_envs_fast_repeat.py``)."""

    def __init__(self, physics: Any):
        import mujoco  # pylint: disable=import-outside-toplevel

        self._physics = physics
        self._mj_step, self._mj_step1, self._mj_step2 = mujoco.mj_step, mujoco.mj_step1, mujoco.mj_step2
        self._rk4 = int(mujoco.mjtIntegrator.mjINT_RK4.value)
        self._warning_names = list(mujoco.mjtWarning.__members__)

    def __call__(self, nstep: int = 1) -> None:
        # pylint: disable=protected-access
        physics = self._physics
        model, data = physics.model.ptr, physics.data.ptr
        warnings = physics._warnings  # dm_control's view of data.warning.number
        before = warnings.tolist()
        if physics.legacy_step:
            if model.opt.integrator != self._rk4:
                self._mj_step2(model, data)
                if nstep > 1:
                    self._mj_step(model, data, nstep - 1)
            else:
                self._mj_step(model, data, nstep)
            self._mj_step1(model, data)
        else:
            self._mj_step(model, data, nstep)
        after = warnings.tolist()
        if after != before:
            self._new_warnings(before, after)

    def _new_warnings(self, before: List[int], after: List[int]) -> None:
        from dm_control.mujoco import engine  # pylint: disable=import-outside-toplevel
        from dm_control.rl import control  # pylint: disable=import-outside-toplevel

        names = [name for name, b, a in zip(self._warning_names, before, after) if a > b]
        if not names:
            return
        # dm_control's own sentence (engine.Physics.check_invalid_state).
        message = engine._INVALID_PHYSICS_STATE.format(warning_names=", ".join(names))  # pylint: disable=protected-access
        if self._physics._warnings_cause_exception:  # pylint: disable=protected-access
            raise control.PhysicsError(message)
        log.warning(message)


def _supports_fast_step(physics: Any) -> bool:
    """True where :class:`_PhysicsStep` may stand in for ``physics.step``."""
    from dm_control.mujoco import engine  # pylint: disable=import-outside-toplevel

    return (
        isinstance(physics, engine.Physics)
        and type(physics).step is engine.Physics.step
        and all(hasattr(physics, name) for name in ("_warnings", "_warnings_cause_exception", "legacy_step"))
    )


class _ControlRepeat(Wrapper):
    """Repeats an action ``repeat`` times inside a dm_control ``control.Environment``.

    Mirrors ``control.Environment.reset`` and ``step`` line by line, on the wrapped env's own
    episode state (``_step_count``, ``_reset_next_step``: the wrapped env stays consistent),
    and returns what :class:`envs.wrappers.ActionRepeat` over ``env.step`` returns: the
    rewards summed, the discounts multiplied (1.0 for ``MID``; the step limit's 1.0 or the
    task's termination discount for ``LAST``), stopping early at ``LAST``; the step after
    ``LAST`` resets. The difference: the task's observation is computed only at the end of
    an agent step and only with ``observe=True``; with ``observe=False`` every timestep's
    observation is ``None`` (for :class:`DMCObservation`, which then renders only).
    """

    def __init__(self, env: dm_env.Environment, repeat: int, observe: bool, fast_reward: bool = False,
                 fast_step: bool = False):
        super().__init__(env)
        from dm_control.rl import control  # pylint: disable=import-outside-toplevel

        self._flatten = control.flatten_observation
        self._repeat = int(repeat)
        self._observe = bool(observe)
        self._reward_type = np.dtype(env.reward_spec().dtype).type
        self._discount_type = np.dtype(env.discount_spec().dtype).type
        # The fast path of rewards.tolerance on while this env's control steps run, or nothing.
        self._reward_scope = contextlib.nullcontext()
        # pylint: disable=protected-access
        task, physics = env._task, env._physics
        # The task's reward computed directly (envs.fast_rewards.task_reward), or None: get_reward.
        self._task_reward = None
        if fast_reward:
            fast_rewards.install()
            self._reward_scope = fast_rewards.scope
            self._task_reward = fast_rewards.task_reward(task, physics)
        self._physics_step = _PhysicsStep(physics) if fast_step and _supports_fast_step(physics) else None

    @property
    def repeat(self) -> int:
        return self._repeat

    def _observation(self):
        if not self._observe:
            return None
        env = self._env
        observation = env._task.get_observation(env._physics)  # pylint: disable=protected-access
        if env._flat_observation:  # pylint: disable=protected-access
            observation = self._flatten(observation)
        return observation

    def reset(self) -> dm_env.TimeStep:
        # pylint: disable=protected-access
        env = self._env
        env._reset_next_step = False
        env._step_count = 0
        with env._physics.reset_context():
            env._task.initialize_episode(env._physics)
        return dm_env.TimeStep(dm_env.StepType.FIRST, None, None, self._observation())

    def step(self, action) -> dm_env.TimeStep:
        # pylint: disable=protected-access
        env = self._env
        if env._reset_next_step:
            return self.reset()
        task, physics = env._task, env._physics
        with self._reward_scope:
            reward, discount = self._repeat_action(action, task, physics)
        if discount is None:
            step_type, discount = dm_env.StepType.MID, 1.0
        else:
            step_type = dm_env.StepType.LAST
        return dm_env.TimeStep(
            step_type, self._reward_type(reward), self._discount_type(discount), self._observation()
        )

    def _repeat_action(self, action, task, physics):
        """(summed reward, discount or None while the episode goes on) of one agent step."""
        # pylint: disable=protected-access
        env = self._env
        n_sub_steps, step_limit = env._n_sub_steps, env._step_limit
        physics_step = self._physics_step or physics.step
        task_reward = self._task_reward
        if task_reward is not None and not task_reward.applies():  # a reward method replaced since
            task_reward = None
        reward = None
        discount = None
        for _ in range(self._repeat):
            task.before_step(action, physics)
            physics_step(n_sub_steps)
            task.after_step(physics)
            sub_reward = task.get_reward(physics) if task_reward is None else task_reward()
            reward = sub_reward if reward is None else reward + sub_reward
            env._step_count += 1
            if env._step_count >= step_limit:
                discount = 1.0
            else:
                discount = task.get_termination(physics)
            if discount is not None:  # episode over
                env._reset_next_step = True
                break
        return reward, discount


class DMCObservation(Wrapper):
    """Exposes a dm_control suite env's observations as ``pixels`` and/or ``state``.

    Wraps a suite env loaded with ``flat_observation=True``, inside a ``_ControlRepeat`` (or,
    with ``fast_repeat=False`` and ``action_repeat > 1``, an :class:`ActionRepeat`); with ``observation="pixels"`` the
    inner timesteps carry no observation. Renders with one persistent ``dm_control.mujoco.Camera``
    (``Physics.render`` builds a new camera and scene per call, about 2.5x slower at 84x84
    here); after the first frame it skips ``Camera.render``'s per-call overhead (the render
    preset's scene flags are set once on the private camera, not overridden and restored
    per frame); the frame is copied to a C-contiguous uint8 ``[H, W, 3]`` array.

    Attributes: ``render_preset`` (``standard`` or ``fast``, resolved from ``auto``),
    ``physics`` (the dm_control ``Physics``, via attribute fall-through).
    """

    def __init__(
        self,
        env: dm_env.Environment,
        physics: Any,
        size: Tuple[int, int],
        camera: Any,
        render_preset: str,
        observation: str,
        share_context: bool = True,
    ):
        super().__init__(env)
        self._share_context = bool(share_context)
        self._physics = physics
        self._height, self._width = size
        self._camera_id = camera
        self._pixels = observation in ("pixels", "pixels_state")
        self._state = observation in ("state", "pixels_state")
        self.render_preset = render_preset if self._pixels else None
        self._camera = None
        self._direct = False  # render through _render_direct (set up by the first render)
        self._flags = dict(_FAST_FLAGS) if render_preset == "fast" else {}
        inner = env.observation_spec()["observations"]
        self._spec: Dict[str, specs.Array] = {}
        if self._pixels:
            self._spec["pixels"] = specs.BoundedArray(
                (self._height, self._width, 3), np.uint8, 0, 255, name="pixels"
            )
        if self._state:
            self._spec["state"] = specs.Array(inner.shape, np.float32, name="state")

    def observation_spec(self) -> Dict[str, specs.Array]:
        return dict(self._spec)

    def render(self) -> np.ndarray:
        """Renders the current state: uint8 ``[H, W, 3]``, C-contiguous, a fresh array."""
        if self._camera is None:
            return self._first_render()
        if self._direct:
            return self._render_direct()
        return np.ascontiguousarray(self._camera.render(render_flag_overrides=dict(self._flags)))

    def _first_render(self) -> np.ndarray:
        from dm_control.mujoco import engine  # pylint: disable=import-outside-toplevel

        try:
            if self._share_context:
                share_contexts(self._physics)
            self._camera = engine.Camera(
                self._physics, height=self._height, width=self._width, camera_id=self._camera_id
            )
            frame = self._camera.render(render_flag_overrides=dict(self._flags))
        except EnvError:
            raise
        except ValueError as exc:  # camera id or size out of range (checked before, kept for safety)
            raise EnvError(f"dmc rendering options were refused by dm_control: {exc}") from exc
        except Exception as exc:  # OpenGL context creation failed
            self._camera = None
            raise _gl_error(exc) from exc
        frame = np.ascontiguousarray(frame)
        camera = self._camera
        if all(hasattr(camera, name) for name in ("update", "scene", "_render_on_gl_thread", "_rgb_buffer")):
            # The camera is private to this env: set the preset's scene flags once, for good,
            # instead of Camera.render's per-call override context (flag copy and restore).
            # mjv_updateScene leaves the scene flags alone.
            for key, value in self._flags.items():
                camera.scene.flags[_render_flag_index(key)] = value
            self._direct = True
        return frame

    def _render_direct(self) -> np.ndarray:
        """``Camera.render`` for an RGB frame without overlays, minus its per-call overhead."""
        camera = self._camera
        camera.update()
        with self._physics.contexts.gl.make_current() as ctx:  # another env's context may be current
            ctx.call(camera._render_on_gl_thread, depth=False, overlays=())  # pylint: disable=protected-access
        # The buffer's first row is the image's bottom row (Camera.render returns np.flipud).
        return np.ascontiguousarray(camera._rgb_buffer[::-1])  # pylint: disable=protected-access

    def _convert(self, timestep: dm_env.TimeStep) -> dm_env.TimeStep:
        obs: Dict[str, np.ndarray] = {}
        if self._pixels:
            obs["pixels"] = self.render()
        if self._state:
            obs["state"] = np.asarray(timestep.observation["observations"], dtype=np.float32)
        return timestep._replace(observation=obs)

    def reset(self) -> dm_env.TimeStep:
        return self._convert(self._env.reset())

    def step(self, action) -> dm_env.TimeStep:
        return self._convert(self._env.step(action))

    def close(self) -> None:
        if self._camera is not None:
            self._camera._scene.free()  # pylint: disable=protected-access
            self._camera = None
            self._direct = False
        release_contexts(self._physics)
        super().close()


def make_dmc(
    env_id: str,
    seed: Optional[int] = None,
    size: Any = 84,
    camera: Any = 0,
    action_repeat: int = 4,
    render: str = "auto",
    observation: str = "pixels",
    fast_repeat: bool = True,
    share_context: bool = True,
    fast_reward: bool = True,
    coarse_shapes: Optional[bool] = None,
    fast_step: bool = True,
) -> dm_env.Environment:
    """Builds ``dmc/DOMAIN-TASK`` (see the module docstring for every option).

    Args:
      env_id: ``dmc/DOMAIN-TASK``, e.g. ``dmc/ball_in_cup-catch``.
      seed: seeds the task (``None``: fresh entropy).
      size: int or ``[height, width]`` of the rendered image (at most the model's offscreen
        buffer, 480 x 640 for the suite).
      camera: camera index or name (default 0, the suite's tracking camera).
      action_repeat: physics-control steps per agent step (rewards summed).
      render: ``standard``, ``fast`` or ``auto``.
      observation: ``pixels`` (``{"pixels"}``), ``pixels_state`` (``{"pixels", "state"}``) or
        ``state`` (``{"state"}``, no rendering).
      fast_repeat: repeat actions inside the control loop, computing the task's observation
        only when it is returned (same timesteps, cheaper; see the module docstring);
        ``False`` repeats dm_control's own ``env.step``.
      fast_reward: with ``fast_repeat``, compute the task's reward with
        ``envs.fast_rewards.tolerance`` (dm_control's ``rewards.tolerance`` in ``math``;
        equal to within 1e-15, cheaper; see the module docstring); ``False`` keeps
        dm_control's own.
      fast_step: with ``fast_repeat``, step the physics with the same MuJoCo calls as
        dm_control's ``Physics.step`` but without its per-call Python (same states bit for bit,
        cheaper; see the module docstring); ``False`` calls ``physics.step``.
      coarse_shapes: with the ``fast`` preset, draw capsules, cylinders and spheres with
        ``FAST_NUMSLICES`` x ``FAST_NUMSTACKS`` (cheaper; the frames differ only at rounded
        silhouettes); ``False`` keeps the model's tessellation; ``None`` (default): the task's
        :func:`default_coarse_shapes`. No effect under ``standard``.
      share_context: render with the rendering contexts shared by the envs of this thread
        whose models render alike (``envs.render_share``; same frames, cheaper when one
        process steps many envs); ``False`` gives this env contexts of its own, as
        dm_control does.

    Returns:
      A ``dm_env.Environment`` with flat-dict observations; ``render_preset`` holds the
      resolved preset.
    """
    height, width = _size_option(size)
    render = _choice_option("render", render, RENDER_PRESETS)
    observation = _choice_option("observation", observation, OBSERVATION_MODES)
    if isinstance(action_repeat, bool) or not isinstance(action_repeat, (int, np.integer)) or action_repeat < 1:
        raise EnvError(f"dmc option action_repeat must be an integer of at least 1, got {action_repeat!r}.")
    if not isinstance(fast_repeat, (bool, np.bool_)):
        raise EnvError(f"dmc option fast_repeat must be true or false, got {fast_repeat!r}.")
    if not isinstance(share_context, (bool, np.bool_)):
        raise EnvError(f"dmc option share_context must be true or false, got {share_context!r}.")
    if not isinstance(fast_reward, (bool, np.bool_)):
        raise EnvError(f"dmc option fast_reward must be true or false, got {fast_reward!r}.")
    if coarse_shapes is None:
        coarse_shapes = default_coarse_shapes(env_id)
    if not isinstance(coarse_shapes, (bool, np.bool_)):
        raise EnvError(f"dmc option coarse_shapes must be true or false, got {coarse_shapes!r}.")
    if not isinstance(fast_step, (bool, np.bool_)):
        raise EnvError(f"dmc option fast_step must be true or false, got {fast_step!r}.")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise EnvError(f"seed must be an integer or None, got {seed!r}.")
    domain, task = parse_dmc_id(env_id)
    suite = _suite()
    env = suite.load(
        domain,
        task,
        task_kwargs={"random": seed},
        environment_kwargs={"flat_observation": True},
    )
    physics = env.physics
    pixels = observation != "state"
    preset = None
    if pixels:
        model = physics.model
        if isinstance(camera, str):
            names = [model.id2name(i, "camera") for i in range(model.ncam)]
            if camera not in names:
                raise EnvError(f"dmc option camera {camera!r} is not a camera of {env_id}; cameras: {names}.")
        elif isinstance(camera, bool) or not isinstance(camera, (int, np.integer)) or not -1 <= camera < model.ncam:
            raise EnvError(
                f"dmc option camera must be a camera index in [-1, {model.ncam}) or name for {env_id}, got {camera!r}."
            )
        max_h, max_w = int(model.vis.global_.offheight), int(model.vis.global_.offwidth)
        if height > max_h or width > max_w:
            raise EnvError(
                f"dmc option size {[height, width]} exceeds the model's offscreen buffer "
                f"{[max_h, max_w]}; use a smaller size."
            )
        preset = render
        if preset == "auto":
            preset = "fast" if is_software_renderer() else "standard"
        if preset == "fast":
            # Must happen before the rendering contexts exist (the first render creates them).
            model.vis.quality.shadowsize = 0
            model.vis.quality.offsamples = 0
            # An offscreen buffer of the frame's size, not the suite's 640x480: the same
            # pixels, less memory per context (5-7% less CPU per frame here).
            model.vis.global_.offwidth = width
            model.vis.global_.offheight = height
            if coarse_shapes:
                # The triangles of the capsules, cylinders and spheres, not the pixels, are
                # most of a small frame's cost on llvmpipe.
                quality = model.vis.quality
                quality.numslices = min(int(quality.numslices), FAST_NUMSLICES)
                quality.numstacks = min(int(quality.numstacks), FAST_NUMSTACKS)
    inner: dm_env.Environment = env
    if fast_repeat and _supports_fast_repeat(env):
        inner = _ControlRepeat(
            env, int(action_repeat), observe=observation != "pixels", fast_reward=bool(fast_reward),
            fast_step=bool(fast_step),
        )
    elif action_repeat > 1:
        inner = ActionRepeat(inner, int(action_repeat))
    wrapped = DMCObservation(inner, physics, (height, width), camera, preset, observation, share_context)
    if pixels:
        wrapped.render()  # surfaces a missing OpenGL backend now, not at the first step
    return wrapped
