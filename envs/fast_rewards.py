"""A faster ``dm_control.utils.rewards.tolerance`` for the small inputs the suite's rewards pass.

DM Control's tasks compute their reward with ``rewards.tolerance`` once to a few times per
control step, on a float or a one-element array. On inputs that small its NumPy calls cost far
more than the arithmetic: on a slow 2-core host, cartpole-swingup's ``get_reward`` took about
80 us of a control step's 110 us of Python (``physics.step`` about 25 us), so at action repeat 8
the reward alone cost more CPU per agent step than rendering the frame. :func:`tolerance`
computes the same function with Python's ``math`` on floats (and element by element on float64
arrays of up to :data:`MAX_FAST_SIZE` elements), in about a tenth of the time, and hands every
other input, and every input the original refuses, to dm_control's own function, which then
raises its own error.

**Scope.** :func:`install` puts :func:`tolerance` in place of ``rewards.tolerance`` for the
whole process (once; idempotent), but it takes the fast path only inside :data:`scope` on the
calling thread. ``envs.dmc`` envs made with ``fast_reward=True`` (the default) enter it around
their control steps; every other caller in the process, and those envs with
``fast_reward=False``, get dm_control's function as it is.

**Values.** The scale of each sigmoid is computed once per ``(sigmoid, value_at_margin)`` by
NumPy, as dm_control computes it, and the arithmetic runs in the same order, so the bounds
checks, ``margin == 0`` and the ``linear``, ``quadratic``, ``long_tail`` and ``reciprocal``
sigmoids give the same bits. The ``gaussian``, ``hyperbolic``, ``cosine`` and ``tanh_squared``
sigmoids end in one ``exp``/``cosh``/``cos``/``tanh`` of the same argument, from the C library
here and from NumPy's own loops there: the results may differ in the last bit or two (at most
1e-15 apart; ``tests/test_envs_fast_rewards.py`` checks every sigmoid on both paths).
Return types follow the original: a float for a scalar ``x``, an array of ``x``'s shape for
an array.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

# Float64 arrays up to this many elements take the fast path element by element; larger ones
# are cheaper through NumPy.
MAX_FAST_SIZE = 16

_original: Optional[Callable[..., Any]] = None  # dm_control's tolerance, kept by install()
_original_default: float = 0.1  # dm_control's _DEFAULT_VALUE_AT_MARGIN, read by install()
_scales: Dict[Tuple[str, float], float] = {}  # (sigmoid, value_at_margin) -> scale
_local = threading.local()
_DEFAULT = object()  # value_at_margin not given: dm_control's default
_NOT_HANDLED = object()
_SCALAR_TYPES = (float, int, np.float64)


class _Scope:
    """``with scope:`` turns the fast path on for this thread (re-entrant)."""

    def __enter__(self) -> None:
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc_info: Any) -> None:
        _local.depth -= 1


scope = _Scope()


def install() -> None:
    """Puts :func:`tolerance` in place of ``dm_control.utils.rewards.tolerance`` (once)."""
    global _original, _original_default
    from dm_control.utils import rewards  # pylint: disable=import-outside-toplevel

    if rewards.tolerance is tolerance:
        return
    _original = rewards.tolerance
    _original_default = getattr(rewards, "_DEFAULT_VALUE_AT_MARGIN", 0.1)
    rewards.tolerance = tolerance


def active() -> bool:
    """True while this thread is inside :data:`scope`."""
    return getattr(_local, "depth", 0) > 0


def tolerance(x, bounds=(0.0, 0.0), margin=0.0, sigmoid="gaussian", value_at_margin=_DEFAULT):
    """dm_control's ``rewards.tolerance``, faster on floats inside :data:`scope`."""
    if value_at_margin is _DEFAULT:
        value_at_margin = _original_default
    if getattr(_local, "depth", 0):
        value = _fast(x, bounds, margin, sigmoid, value_at_margin)
        if value is not _NOT_HANDLED:
            return value
    if _original is None:
        raise RuntimeError("envs.fast_rewards.tolerance was called before install().")
    return _original(x, bounds, margin, sigmoid, value_at_margin)


def _scale(sigmoid: Any, value_at_1: Any) -> Any:
    """The sigmoid's scale as dm_control computes it (NumPy, float64), or _NOT_HANDLED."""
    if type(value_at_1) not in _SCALAR_TYPES or not isinstance(sigmoid, str):
        return _NOT_HANDLED
    key = (sigmoid, float(value_at_1))
    scale = _scales.get(key)
    if scale is not None:
        return scale
    if sigmoid in ("cosine", "linear", "quadratic"):
        valid = 0 <= value_at_1 < 1
    else:
        valid = 0 < value_at_1 < 1
    if not valid:
        return _NOT_HANDLED  # the original raises its own error
    v = value_at_1
    if sigmoid == "gaussian":
        scale = np.sqrt(-2 * np.log(v))
    elif sigmoid == "hyperbolic":
        scale = np.arccosh(1 / v)
    elif sigmoid == "long_tail":
        scale = np.sqrt(1 / v - 1)
    elif sigmoid == "reciprocal":
        scale = 1 / v - 1
    elif sigmoid == "cosine":
        scale = np.arccos(2 * v - 1) / np.pi
    elif sigmoid == "linear":
        scale = 1 - v
    elif sigmoid == "quadratic":
        scale = np.sqrt(1 - v)
    elif sigmoid == "tanh_squared":
        scale = np.arctanh(np.sqrt(1 - v))
    else:
        return _NOT_HANDLED  # unknown sigmoid: the original raises
    scale = float(scale)
    _scales[key] = scale
    return scale


def _sigmoid(d: float, scale: float, sigmoid: str) -> float:
    """dm_control's ``_sigmoids`` on one float ``d`` (>= 0 or NaN), with its scale given."""
    s = d * scale
    if sigmoid == "gaussian":
        return math.exp(-0.5 * (s * s))
    if sigmoid == "quadratic":
        return 1 - s * s if abs(s) < 1 else 0.0
    if sigmoid == "linear":
        return 1 - s if abs(s) < 1 else 0.0
    if sigmoid == "long_tail":
        return 1 / (s * s + 1)
    if sigmoid == "reciprocal":
        return 1 / (abs(d) * scale + 1)
    if sigmoid == "hyperbolic":
        try:
            return 1 / math.cosh(s)
        except OverflowError:  # NumPy: cosh -> inf, 1 / inf -> 0
            return 0.0
    if sigmoid == "cosine":
        return (1 + math.cos(math.pi * s)) / 2 if abs(s) < 1 else 0.0
    t = math.tanh(s)  # tanh_squared (_scale let no other name through)
    return 1 - t * t


def _fast_float(x: float, lower: Any, upper: Any, margin: Any, sigmoid: str, scale: Any) -> float:
    if lower <= x <= upper:
        return 1.0
    if margin == 0:
        return 0.0
    d = (lower - x if x < lower else x - upper) / margin
    return float(_sigmoid(d, scale, sigmoid))


def _fast(x: Any, bounds: Any, margin: Any, sigmoid: Any, value_at_margin: Any) -> Any:
    """The value for inputs the fast path handles, else _NOT_HANDLED."""
    kind = type(x)
    if kind is np.ndarray:
        if x.dtype != np.float64 or x.size > MAX_FAST_SIZE:
            return _NOT_HANDLED
    elif kind is not float and kind is not np.float64:
        return _NOT_HANDLED
    if type(bounds) is not tuple or len(bounds) != 2 or type(margin) not in _SCALAR_TYPES:
        return _NOT_HANDLED
    lower, upper = bounds
    if type(lower) not in _SCALAR_TYPES or type(upper) not in _SCALAR_TYPES:
        return _NOT_HANDLED
    if lower > upper or margin < 0:
        return _NOT_HANDLED  # the original raises
    scale = None
    if margin != 0:
        scale = _scale(sigmoid, value_at_margin)  # validated even when x is in bounds, as there
        if scale is _NOT_HANDLED:
            return _NOT_HANDLED
    if kind is np.ndarray:
        values = [_fast_float(v, lower, upper, margin, sigmoid, scale) for v in x.ravel().tolist()]
        return np.array(values, dtype=np.float64).reshape(x.shape)
    return _fast_float(float(x), lower, upper, margin, sigmoid, scale)


# --------------------------------------------------------------------------- whole rewards


class TaskReward:
    """A task's reward computed directly (:func:`task_reward`): call it for the reward of the
    current state; :meth:`applies` says whether the task and physics still have the methods it
    stands for (none replaced since, on the instance or the class)."""

    def __init__(self, compute: Callable[[], float], methods: Tuple[Tuple[Any, str, Any], ...]):
        self._compute = compute
        self._methods = methods  # (object, name, the class attribute found when built)

    def __call__(self) -> float:
        return self._compute()

    def applies(self) -> bool:
        for obj, name, function in self._methods:
            if name in vars(obj) or getattr(type(obj), name, None) is not function:
                return False
        return True


def task_reward(task: Any, physics: Any) -> Optional[TaskReward]:
    """The task's reward computed directly, for the tasks it knows, or ``None`` (the caller
    then calls ``task.get_reward``).

    Known: cartpole's ``Balance`` with one pole (``balance``, ``balance_sparse``, ``swingup``,
    ``swingup_sparse``), walker's ``PlanarWalker`` (``stand``, ``walk``, ``run``) and cheetah's
    ``Cheetah`` (``run``). Their ``get_reward`` reads the state through dm_control's named
    indexing and runs NumPy operations on one-element arrays, tens of microseconds per control
    step on a slow host; the function returned here reads the same values from
    ``physics.data`` by index and does the same arithmetic on Python floats in the same order,
    with :func:`tolerance`'s fast path for each ``rewards.tolerance``: the value equals
    ``task.get_reward(physics)`` inside :data:`scope` bit for bit
    (``tests/test_envs_fast_rewards.py``), and dm_control's to within 1e-15 as :func:`tolerance`
    does. Needs :func:`install` (for dm_control's default ``value_at_margin``). The state is
    read when the function is called, so it stays valid across resets; a physics reloaded with
    another model needs a new one. Not for a task or physics whose reward methods were replaced
    by other code (see :meth:`TaskReward.applies`).
    """
    from dm_control.suite import cartpole, cheetah, walker  # pylint: disable=import-outside-toplevel

    known = {
        (cartpole.Balance, cartpole.Physics): (
            ("get_reward", "_get_reward"), ("cart_position", "pole_angle_cosine", "angular_vel", "control"),
            _cartpole_reward),
        (walker.PlanarWalker, walker.Physics): (
            ("get_reward",), ("torso_height", "torso_upright", "horizontal_velocity"), _walker_reward),
        (cheetah.Cheetah, cheetah.Physics): (("get_reward",), ("speed",), _cheetah_reward),
    }
    entry = known.get((type(task), type(physics)))
    if entry is None:
        return None
    task_methods, physics_methods, build = entry
    methods = _dm_control_methods(task, task_methods, physics, physics_methods)
    if methods is None:
        return None
    compute = build(task, physics)
    return None if compute is None else TaskReward(compute, methods)


def _dm_control_methods(
    task: Any, task_methods: Tuple[str, ...], physics: Any, physics_methods: Tuple[str, ...]
) -> Optional[Tuple[Tuple[Any, str, Any], ...]]:
    """``(object, name, class attribute)`` for each method a reward reads, or ``None`` where one
    is replaced on the instance or comes from another module than dm_control's."""
    found = []
    for obj, names in ((task, task_methods), (physics, physics_methods)):
        for name in names:
            function = getattr(type(obj), name, None)
            if name in vars(obj) or not getattr(function, "__module__", "").startswith("dm_control."):
                return None
            found.append((obj, name, function))
    return tuple(found)


def _cartpole_reward(task: Any, physics: Any) -> Optional[Callable[[], float]]:
    model = physics.model
    if model.nbody != 3 or model.nv != 2 or model.nu != 1:
        return None  # two or three poles: NumPy's mean over the poles sums in its own order
    slider = int(model.jnt_qposadr[model.name2id("slider", "joint")])
    pole = int(model.name2id("pole_1", "body"))
    # cartpole.Physics: cart_position = qpos['slider'][0]; pole_angle_cosine = xmat[2:, 'zz']
    # (body 2 is pole_1; 'zz' is element 8 of the row-major 3x3); angular_vel = qvel[1:].
    if pole != 2:
        return None
    if task._sparse:  # pylint: disable=protected-access
        cart_lo, cart_hi = task._CART_RANGE  # pylint: disable=protected-access
        cos_lo, cos_hi = task._ANGLE_COSINE_RANGE  # pylint: disable=protected-access

        def sparse_reward() -> float:
            data = physics.data.ptr  # mujoco.MjData, read at each call (physics may reload it)
            cart_in_bounds = _fast_float(float(data.qpos[slider]), cart_lo, cart_hi, 0.0, "gaussian", None)
            angle_in_bounds = _fast_float(float(data.xmat[2, 8]), cos_lo, cos_hi, 0.0, "gaussian", None)
            return cart_in_bounds * angle_in_bounds

        return sparse_reward
    gaussian = _scale("gaussian", _original_default)
    quadratic = _scale("quadratic", 0.0)
    if gaussian is _NOT_HANDLED or quadratic is _NOT_HANDLED:
        return None

    def smooth_reward() -> float:
        data = physics.data.ptr
        upright = (float(data.xmat[2, 8]) + 1) / 2
        centered = (1 + _fast_float(float(data.qpos[slider]), 0.0, 0.0, 2, "gaussian", gaussian)) / 2
        small_control = (4 + _fast_float(float(data.ctrl[0]), 0.0, 0.0, 1, "quadratic", quadratic)) / 5
        small_velocity = (1 + _fast_float(float(data.qvel[1]), 0.0, 0.0, 5, "gaussian", gaussian)) / 2
        return upright * small_control * small_velocity * centered

    return smooth_reward


def _sensor_address(model: Any, name: str) -> int:
    return int(model.sensor_adr[model.name2id(name, "sensor")])


def _walker_reward(task: Any, physics: Any) -> Optional[Callable[[], float]]:
    from dm_control.suite import walker  # pylint: disable=import-outside-toplevel

    model = physics.model
    # walker.Physics: torso_height = xpos['torso', 'z']; torso_upright = xmat['torso', 'zz'];
    # horizontal_velocity = sensordata['torso_subtreelinvel'][0].
    torso = int(model.name2id("torso", "body"))
    velocity = _sensor_address(model, "torso_subtreelinvel")
    stand_height = walker._STAND_HEIGHT  # pylint: disable=protected-access
    move_speed = task._move_speed  # pylint: disable=protected-access
    stand_margin = stand_height / 2
    gaussian = _scale("gaussian", _original_default)
    linear = _scale("linear", 0.5)
    if gaussian is _NOT_HANDLED or linear is _NOT_HANDLED or type(move_speed) not in _SCALAR_TYPES:
        return None
    inf = float("inf")
    move_margin = move_speed / 2

    def reward() -> float:
        data = physics.data.ptr
        standing = _fast_float(float(data.xpos[torso, 2]), stand_height, inf, stand_margin, "gaussian", gaussian)
        upright = (1 + float(data.xmat[torso, 8])) / 2
        stand_reward = (3 * standing + upright) / 4
        if move_speed == 0:
            return stand_reward
        move_reward = _fast_float(float(data.sensordata[velocity]), move_speed, inf, move_margin, "linear", linear)
        return stand_reward * (5 * move_reward + 1) / 6

    return reward


def _cheetah_reward(task: Any, physics: Any) -> Optional[Callable[[], float]]:
    from dm_control.suite import cheetah  # pylint: disable=import-outside-toplevel

    # cheetah.Physics: speed = sensordata['torso_subtreelinvel'][0].
    velocity = _sensor_address(physics.model, "torso_subtreelinvel")
    run_speed = cheetah._RUN_SPEED  # pylint: disable=protected-access
    linear = _scale("linear", 0)
    if linear is _NOT_HANDLED or type(run_speed) not in _SCALAR_TYPES:
        return None
    inf = float("inf")

    def reward() -> float:
        speed = float(physics.data.ptr.sensordata[velocity])
        return _fast_float(speed, run_speed, inf, run_speed, "linear", linear)

    return reward
