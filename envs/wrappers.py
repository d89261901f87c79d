"""``dm_env`` wrappers users expect: action repeat, frame stacking, reward clipping, action
discretisation, observation selection, time limits, and the flat-dict observation adapter.

TensorFlow-free. Every wrapper is itself a ``dm_env.Environment`` and keeps dm_env episode
semantics:

* a ``FIRST`` step has ``reward=None`` and ``discount=None``;
* termination is ``LAST`` with discount 0; truncation (a time limit) is ``LAST`` with the
  env's discount kept (1.0 for every DM Control episode end);
* calling ``step`` after ``LAST`` starts a new episode and returns its ``FIRST`` step.

Observations handled by the wrappers below :class:`ObservationDict` are flat
``dict[str, np.ndarray]``; per-key contracts (``[H, W, C]`` uint8 pixels, ``[N]`` vectors)
are stated on each wrapper.

Usage::

    env = ObservationDict(my_env)                 # {"observation": ...} for single arrays
    env = ActionRepeat(env, 4)                    # rewards summed, discounts multiplied
    env = TimeLimit(env, 250)                     # truncation: LAST keeps the discount
    env = FrameStack(env, 3)                      # [H, W, C] -> [H, W, 3C]
    env = DiscretizeActions(env, bins=11)         # BoundedArray -> DiscreteArray / MultiDiscreteArray
    env = ClipReward(env)                         # rewards clipped to [-1, 1]
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Sequence

import dm_env
import numpy as np
from dm_env import specs

from envs.errors import EnvError
from impala_rep.framestack import FrameStacker

__all__ = [
    "Wrapper",
    "ObservationDict",
    "ActionRepeat",
    "TimeLimit",
    "FrameStack",
    "ClipReward",
    "DiscretizeActions",
    "MultiDiscreteArray",
    "IntegerActions",
    "SelectObservation",
]


class Wrapper(dm_env.Environment):
    """Delegates everything to the wrapped env; attribute look-ups fall through to it."""

    def __init__(self, env: dm_env.Environment):
        self._env = env

    @property
    def env(self) -> dm_env.Environment:
        """The wrapped environment."""
        return self._env

    @property
    def unwrapped(self) -> dm_env.Environment:
        """The innermost environment (below every :class:`Wrapper`)."""
        env = self._env
        while isinstance(env, Wrapper):
            env = env.env
        return env

    def reset(self) -> dm_env.TimeStep:
        return self._env.reset()

    def step(self, action) -> dm_env.TimeStep:
        return self._env.step(action)

    def observation_spec(self):
        return self._env.observation_spec()

    def action_spec(self):
        return self._env.action_spec()

    def reward_spec(self):
        return self._env.reward_spec()

    def discount_spec(self):
        return self._env.discount_spec()

    def close(self) -> None:
        self._env.close()

    def __getattr__(self, name: str) -> Any:
        # Only called when normal look-up fails; guard against recursion before __init__.
        if name.startswith("__") or name == "_env":
            raise AttributeError(name)
        return getattr(self._env, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._env!r})"


def _is_spec(spec: Any) -> bool:
    return isinstance(spec, specs.Array)


class ObservationDict(Wrapper):
    """Exposes observations as a flat ``dict[str, np.ndarray]``.

    A single-array observation becomes ``{"observation": array}``; a flat mapping is
    passed through as a ``dict`` with every value an ``np.ndarray`` (keys converted to
    ``str``). Nested observations raise :class:`EnvError` at construction.

    Each array is given its spec's dtype when it has another of the same kind (an env that
    declares float32 and returns float64, as NumPy computes by default; the learner accepts
    only the announced dtype). One the spec's dtype cannot hold without changing kind (floats
    for uint8 pixels), another shape, or other keys raise :class:`EnvError`.
    """

    def __init__(self, env: dm_env.Environment):
        super().__init__(env)
        spec = env.observation_spec()
        if isinstance(spec, Mapping):
            for key, value in spec.items():
                if not _is_spec(value):
                    raise EnvError(
                        f"observation {key!r} of the env is a {type(value).__name__}, not a "
                        "dm_env array spec; impala_rep accepts one array or a flat mapping of "
                        "arrays (flatten nested observations in your factory)."
                    )
            self._single = False
            self._spec = {str(k): v for k, v in spec.items()}
            self._exact = {k: (np.dtype(v.dtype), tuple(v.shape)) for k, v in self._spec.items()}
        elif _is_spec(spec):
            self._single = True
            self._spec = {"observation": spec}
            self._exact = {"observation": (np.dtype(spec.dtype), tuple(spec.shape))}
        else:
            raise EnvError(
                f"the env's observation spec is a {type(spec).__name__}; impala_rep accepts one "
                "dm_env array spec or a flat mapping of them."
            )

    def observation_spec(self) -> Dict[str, specs.Array]:
        return dict(self._spec)

    def _convert(self, timestep: dm_env.TimeStep) -> dm_env.TimeStep:
        obs = {"observation": timestep.observation} if self._single else timestep.observation
        if not (type(obs) is dict or isinstance(obs, Mapping)) or len(obs) != len(self._exact):
            keys = sorted(map(str, obs)) if isinstance(obs, Mapping) else type(obs).__name__
            raise EnvError(f"the env returned observation {keys}; its spec has {sorted(self._spec)}.")
        out = {}
        exact = self._exact
        for key, value in obs.items():
            want = exact.get(key)
            if want is not None and type(value) is np.ndarray and value.dtype is want[0] and value.shape == want[1]:
                out[key] = value  # the usual case, at a step's rate
            else:
                out[str(key)] = self._as_spec(str(key), value)
        return timestep._replace(observation=out)

    def _as_spec(self, key: str, value: Any) -> np.ndarray:
        spec = self._spec.get(key)
        if spec is None:
            raise EnvError(f"the env returned observation {key!r}, which its spec does not have "
                           f"({sorted(self._spec)}).")
        arr = np.asarray(value)
        if arr.dtype != spec.dtype:
            if not np.can_cast(arr.dtype, spec.dtype, casting="same_kind"):
                raise EnvError(
                    f"the env returned observation {key!r} as {arr.dtype}, which its spec's {spec.dtype} cannot "
                    f"hold; return {spec.dtype} arrays, or declare {arr.dtype} in the observation spec."
                )
            arr = arr.astype(spec.dtype)
        if arr.shape != spec.shape:
            raise EnvError(f"the env returned observation {key!r} of shape {list(arr.shape)}; its spec says "
                           f"{list(spec.shape)}.")
        return arr

    def reset(self) -> dm_env.TimeStep:
        return self._convert(self._env.reset())

    def step(self, action) -> dm_env.TimeStep:
        return self._convert(self._env.step(action))


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise EnvError(f"{name} must be an integer of at least {minimum}, got {value!r}.")
    return int(value)


class ActionRepeat(Wrapper):
    """Repeats each action ``repeat`` times.

    The returned step sums the rewards and multiplies the discounts of the inner steps and
    stops early at ``LAST`` (so a termination's discount 0 and a truncation's discount 1
    come through). Reward and discount are cast to the env's reward/discount spec dtype.
    """

    def __init__(self, env: dm_env.Environment, repeat: int):
        super().__init__(env)
        self._repeat = _check_int("action_repeat", repeat, 1)
        self._reward_dtype = np.dtype(env.reward_spec().dtype)
        self._discount_dtype = np.dtype(env.discount_spec().dtype)

    @property
    def repeat(self) -> int:
        return self._repeat

    def step(self, action) -> dm_env.TimeStep:
        timestep = self._env.step(action)
        if timestep.first():  # step after LAST started a new episode
            return timestep
        reward, discount = timestep.reward, timestep.discount
        for _ in range(self._repeat - 1):
            if timestep.last():
                break
            timestep = self._env.step(action)
            reward = reward + timestep.reward
            discount = discount * timestep.discount
        return timestep._replace(
            reward=self._reward_dtype.type(reward), discount=self._discount_dtype.type(discount)
        )


class TimeLimit(Wrapper):
    """Ends episodes after ``max_steps`` steps (counted at this wrapper) by truncation.

    The truncating step becomes ``LAST`` and keeps the env's discount (dm_env semantics:
    the agent bootstraps from the value of the last observation). An episode the inner env
    ends earlier ends as the inner env says.
    """

    def __init__(self, env: dm_env.Environment, max_steps: int):
        super().__init__(env)
        self._max_steps = _check_int("time_limit", max_steps, 1)
        self._t = 0
        self._needs_reset = True

    def reset(self) -> dm_env.TimeStep:
        self._t = 0
        self._needs_reset = False
        return self._env.reset()

    def step(self, action) -> dm_env.TimeStep:
        if self._needs_reset:
            return self.reset()
        timestep = self._env.step(action)
        if timestep.first():
            self._t = 0
            return timestep
        self._t += 1
        if timestep.last():
            self._needs_reset = True
        elif self._t >= self._max_steps:
            self._needs_reset = True
            timestep = timestep._replace(step_type=dm_env.StepType.LAST)
        return timestep


class SelectObservation(Wrapper):
    """Keeps only the observation ``keys`` (e.g. ``["pixels"]`` or ``["pixels", "state"]``).

    Needs a flat-dict observation (wrap with :class:`ObservationDict` first).
    """

    def __init__(self, env: dm_env.Environment, keys: Sequence[str]):
        super().__init__(env)
        if isinstance(keys, str):
            keys = [keys]
        keys = list(keys)
        spec = env.observation_spec()
        if not isinstance(spec, Mapping):
            raise EnvError("observation_keys needs a dict observation; wrap the env with ObservationDict first.")
        missing = [k for k in keys if k not in spec]
        if not keys or missing:
            raise EnvError(
                f"observation_keys {keys!r} must be a non-empty list of the env's observation "
                f"keys {sorted(spec)}."
            )
        self._keys = keys
        self._spec = {k: spec[k] for k in keys}

    def observation_spec(self) -> Dict[str, specs.Array]:
        return dict(self._spec)

    def _select(self, timestep: dm_env.TimeStep) -> dm_env.TimeStep:
        return timestep._replace(observation={k: timestep.observation[k] for k in self._keys})

    def reset(self) -> dm_env.TimeStep:
        return self._select(self._env.reset())

    def step(self, action) -> dm_env.TimeStep:
        return self._select(self._env.step(action))


class FrameStack(Wrapper):
    """Stacks the ``k`` newest frames of an episode along the channel axis.

    Applies to the ``[H, W, C]`` observation keys (all rank-3 keys by default, or ``keys``);
    they become ``[H, W, C*k]``, oldest frame in the lowest channels, and at the first step
    of an episode the missing older frames are copies of the first frame (the rule of
    :class:`impala_rep.framestack.FrameStacker`). Other keys pass through.

    Note: the training pipeline stacks frames on the agent side (frames travel once and the
    learner's network stacks them in its graph); this wrapper is for standalone use and evaluation.
    """

    def __init__(self, env: dm_env.Environment, k: int, keys: Optional[Iterable[str]] = None):
        super().__init__(env)
        self._k = _check_int("frame_stack", k, 1)
        spec = env.observation_spec()
        if not isinstance(spec, Mapping):
            raise EnvError("frame_stack needs a dict observation; wrap the env with ObservationDict first.")
        if keys is None:
            keys = [key for key, s in spec.items() if len(s.shape) == 3]
        keys = list(keys)
        bad = [key for key in keys if key not in spec or len(spec[key].shape) != 3]
        if not keys or bad:
            shapes = {key: tuple(s.shape) for key, s in spec.items()}
            raise EnvError(
                f"frame_stack needs [H, W, C] image observations, but the env's observations are "
                f"{shapes}; use frame_stack=1 or select image keys."
            )
        self._keys = keys
        self._spec = dict(spec)
        for key in keys:
            s = spec[key]
            h, w, c = s.shape
            self._spec[key] = specs.Array((h, w, c * self._k), s.dtype, name=s.name)
        self._stackers = {key: FrameStacker(self._k) for key in keys}

    def observation_spec(self) -> Dict[str, specs.Array]:
        return dict(self._spec)

    def _stack(self, timestep: dm_env.TimeStep) -> dm_env.TimeStep:
        obs = dict(timestep.observation)
        first = timestep.first()
        for key in self._keys:
            obs[key] = self._stackers[key].push(obs[key], first=first)
        return timestep._replace(observation=obs)

    def reset(self) -> dm_env.TimeStep:
        return self._stack(self._env.reset())

    def step(self, action) -> dm_env.TimeStep:
        return self._stack(self._env.step(action))


class ClipReward(Wrapper):
    """Clips rewards to ``[minimum, maximum]`` (default ``[-1, 1]``, as in IMPALA on Atari).

    ``FIRST`` steps keep ``reward=None``; the reward dtype is the env's reward spec dtype.
    """

    def __init__(self, env: dm_env.Environment, minimum: float = -1.0, maximum: float = 1.0):
        super().__init__(env)
        if not float(minimum) < float(maximum):
            raise EnvError(f"reward clipping needs minimum < maximum, got [{minimum}, {maximum}].")
        self._min, self._max = float(minimum), float(maximum)
        self._dtype = np.dtype(env.reward_spec().dtype)

    def _clip(self, timestep: dm_env.TimeStep) -> dm_env.TimeStep:
        if timestep.reward is None:
            return timestep
        reward = np.clip(np.asarray(timestep.reward, dtype=self._dtype), self._min, self._max)
        return timestep._replace(reward=reward[()] if reward.ndim == 0 else reward)

    def reset(self) -> dm_env.TimeStep:
        return self._clip(self._env.reset())

    def step(self, action) -> dm_env.TimeStep:
        return self._clip(self._env.step(action))


class MultiDiscreteArray(specs.BoundedArray):
    """An integer array spec whose every element takes ``num_values`` values ``[0, num_values)``.

    dm_env's ``DiscreteArray`` is scalar only; this is its per-dimension counterpart (like
    Gym's ``MultiDiscrete`` with one size). It is a ``BoundedArray`` (minimum 0, maximum
    ``num_values - 1``) with a ``num_values`` attribute, which
    :func:`impala_rep.specs.spec_from_dm_env` reads.
    """

    __slots__ = ("_num_values",)

    def __init__(self, shape, num_values: int, dtype=np.int32, name: Optional[str] = None):
        num_values = _check_int("num_values", num_values, 1)
        super().__init__(shape, dtype, minimum=0, maximum=num_values - 1, name=name)
        self._num_values = num_values

    @property
    def num_values(self) -> int:
        return self._num_values

    def __repr__(self) -> str:
        return (
            f"MultiDiscreteArray(shape={self.shape}, dtype={self.dtype}, name={self.name!r}, "
            f"num_values={self._num_values})"
        )

    def __reduce__(self):
        return MultiDiscreteArray, (self.shape, self._num_values, self.dtype, self.name)

    def replace(self, **kwargs):
        args = dict(shape=self.shape, num_values=self._num_values, dtype=self.dtype, name=self.name)
        args.update(kwargs)
        return MultiDiscreteArray(**args)


class DiscretizeActions(Wrapper):
    """Turns a continuous ``BoundedArray`` action into discrete choices on a grid.

    Each action dimension ``i`` gets ``bins`` evenly spaced values from ``minimum[i]`` to
    ``maximum[i]`` (both included; odd ``bins`` include the midpoint). The new action spec:

    * one action dimension: ``DiscreteArray(num_values=bins)`` (int32 scalar);
    * ``A > 1`` dimensions, ``joint=False`` (default): :class:`MultiDiscreteArray` of shape
      ``[A]``, int32, ``num_values=bins`` — one bin index per dimension (the form a
      factorised categorical policy uses);
    * ``A > 1`` dimensions, ``joint=True``: ``DiscreteArray(num_values=bins**A)`` over the
      full grid (index = row-major ``ravel_multi_index`` of the per-dimension bins); refused
      above 4096 choices.

    Actions outside the new spec raise ``ValueError``.
    """

    _MAX_JOINT = 4096

    def __init__(self, env: dm_env.Environment, bins: int, joint: bool = False):
        super().__init__(env)
        self._bins = _check_int("discretize (bins)", bins, 2)
        spec = env.action_spec()
        if not isinstance(spec, specs.BoundedArray) or isinstance(spec, specs.DiscreteArray) or not np.issubdtype(spec.dtype, np.floating):
            raise EnvError(
                f"discretize needs a continuous (float BoundedArray) action spec, but the env's is "
                f"{spec!r}; drop discretize for this env."
            )
        lo = np.broadcast_to(spec.minimum, spec.shape).astype(np.float64).ravel()
        hi = np.broadcast_to(spec.maximum, spec.shape).astype(np.float64).ravel()
        if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
            raise EnvError("discretize needs finite action bounds; the env's action spec is unbounded.")
        self._inner_spec = spec
        # [A, bins] grid of action values.
        self._grid = lo[:, None] + (hi - lo)[:, None] * np.linspace(0.0, 1.0, self._bins)[None, :]
        self._dims = lo.size
        self._joint = bool(joint) and self._dims > 1
        if self._dims == 1:
            self._spec = specs.DiscreteArray(self._bins, dtype=np.int32, name="action")
        elif self._joint:
            total = self._bins ** self._dims
            if total > self._MAX_JOINT:
                raise EnvError(
                    f"a joint discretisation of {self._dims} action dimensions with {self._bins} bins "
                    f"has {total} choices (at most {self._MAX_JOINT}); use joint=False or fewer bins."
                )
            self._spec = specs.DiscreteArray(total, dtype=np.int32, name="action")
        else:
            self._spec = MultiDiscreteArray((self._dims,), self._bins, dtype=np.int32, name="action")

    def action_spec(self):
        return self._spec

    def to_continuous(self, action) -> np.ndarray:
        """Maps a discrete action of this wrapper's spec to the inner env's action array."""
        index = np.asarray(action)
        if index.dtype.kind not in "iu":
            raise ValueError(f"discretised actions must be integers, got dtype {index.dtype}.")
        if self._joint:
            if index.shape != () or not 0 <= int(index) < self._spec.num_values:
                raise ValueError(f"action must be an integer in [0, {self._spec.num_values}), got {action!r}.")
            index = np.asarray(np.unravel_index(int(index), (self._bins,) * self._dims))
        else:
            index = index.reshape(-1)
            if index.size != self._dims or index.min() < 0 or index.max() >= self._bins:
                raise ValueError(
                    f"action must hold {self._dims} integer(s) in [0, {self._bins}), got {action!r}."
                )
        values = self._grid[np.arange(self._dims), index]
        return values.reshape(self._inner_spec.shape).astype(self._inner_spec.dtype)

    def step(self, action) -> dm_env.TimeStep:
        return self._env.step(self.to_continuous(action))


class IntegerActions(Wrapper):
    """Gives an integer ``BoundedArray`` action (Gym's ``Discrete``/``MultiDiscrete`` through
    adapters: values ``minimum..maximum``) a discrete spec the categorical policies take:
    ``DiscreteArray(maximum - minimum + 1)`` for a scalar, :class:`MultiDiscreteArray` for an
    array whose every element has the same range; the policy's index ``i`` is the env's
    ``minimum + i``. Ranges that differ between elements, or unbounded ones, raise
    :class:`EnvError`.
    """

    _MAX_VALUES = 1 << 16

    def __init__(self, env: dm_env.Environment):
        super().__init__(env)
        spec = env.action_spec()
        lo = np.broadcast_to(spec.minimum, spec.shape).ravel()
        hi = np.broadcast_to(spec.maximum, spec.shape).ravel()
        sizes = np.unique(hi.astype(np.int64) - lo.astype(np.int64) + 1) if lo.size else np.array([], np.int64)
        if lo.size == 0 or sizes.size != 1 or not 1 <= int(sizes[0]) <= self._MAX_VALUES:
            raise EnvError(
                f"the env's integer action spec {spec!r} has "
                + ("no elements" if lo.size == 0 else f"ranges of {sorted(set(sizes.tolist()))[:5]} values")
                + f"; impala_rep's categorical policies need one range of 1 to {self._MAX_VALUES} values for every "
                "element (wrap the env so its action is a dm_env DiscreteArray, or one range per element)."
            )
        n = int(sizes[0])
        self._inner_spec = spec
        self._offset = np.broadcast_to(spec.minimum, spec.shape).astype(spec.dtype)
        self._spec = (specs.DiscreteArray(n, dtype=np.int32, name="action") if spec.shape == ()
                      else MultiDiscreteArray(spec.shape, n, dtype=np.int32, name="action"))

    def action_spec(self):
        return self._spec

    def step(self, action) -> dm_env.TimeStep:
        return self._env.step((np.asarray(action) + self._offset).astype(self._inner_spec.dtype))


def needs_integer_actions(spec: Any) -> bool:
    """Whether ``spec`` is an integer ``BoundedArray`` without ``num_values`` (not a
    ``DiscreteArray`` or :class:`MultiDiscreteArray`): :class:`IntegerActions` makes it one."""
    return (isinstance(spec, specs.BoundedArray) and np.issubdtype(spec.dtype, np.integer)
            and getattr(spec, "num_values", None) is None)
