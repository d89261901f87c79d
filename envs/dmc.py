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
``model.vis.quality.shadowsize = 0`` and ``offsamples = 0`` before the first render and
turns the shadow, reflection and skybox scene flags off: about 20x faster on a software
renderer. ``auto`` (default) picks ``fast`` on a software renderer (llvmpipe, softpipe,
swrast, OSMesa) and ``standard`` on a GPU.

**Episodes.** Every DM Control episode ends by truncation at 1000 control steps (``LAST``
with discount 1.0), i.e. after ``1000 / action_repeat`` agent steps; rewards of repeated
steps are summed and discounts multiplied. ``seed`` seeds the task's random state: the same
seed gives the same episodes.
"""

from __future__ import annotations

import difflib
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import dm_env
import numpy as np
from dm_env import specs

from envs.errors import EnvError
from envs.wrappers import ActionRepeat, Wrapper

__all__ = [
    "RENDER_PRESETS",
    "OBSERVATION_MODES",
    "make_dmc",
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


class DMCObservation(Wrapper):
    """Exposes a dm_control suite env's observations as ``pixels`` and/or ``state``.

    Wraps a suite env loaded with ``flat_observation=True`` (possibly inside an
    :class:`ActionRepeat`). Renders with one persistent ``dm_control.mujoco.Camera``
    (``Physics.render`` builds a new camera and scene per call, about 2.5x slower at 84x84
    here); the frame is copied to a C-contiguous uint8 ``[H, W, 3]`` array.

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
    ):
        super().__init__(env)
        self._physics = physics
        self._height, self._width = size
        self._camera_id = camera
        self._pixels = observation in ("pixels", "pixels_state")
        self._state = observation in ("state", "pixels_state")
        self.render_preset = render_preset if self._pixels else None
        self._camera = None
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
            from dm_control.mujoco import engine  # pylint: disable=import-outside-toplevel

            try:
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
        else:
            frame = self._camera.render(render_flag_overrides=dict(self._flags))
        return np.ascontiguousarray(frame)

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
        super().close()


def make_dmc(
    env_id: str,
    seed: Optional[int] = None,
    size: Any = 84,
    camera: Any = 0,
    action_repeat: int = 4,
    render: str = "auto",
    observation: str = "pixels",
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

    Returns:
      A ``dm_env.Environment`` with flat-dict observations; ``render_preset`` holds the
      resolved preset.
    """
    height, width = _size_option(size)
    render = _choice_option("render", render, RENDER_PRESETS)
    observation = _choice_option("observation", observation, OBSERVATION_MODES)
    if isinstance(action_repeat, bool) or not isinstance(action_repeat, (int, np.integer)) or action_repeat < 1:
        raise EnvError(f"dmc option action_repeat must be an integer of at least 1, got {action_repeat!r}.")
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
    inner: dm_env.Environment = env
    if action_repeat > 1:
        inner = ActionRepeat(inner, int(action_repeat))
    wrapped = DMCObservation(inner, physics, (height, width), camera, preset, observation)
    if pixels:
        wrapped.render()  # surfaces a missing OpenGL backend now, not at the first step
    return wrapped
