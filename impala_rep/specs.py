"""Array specs and the unroll (trajectory) layout shared by actors and learner.

TensorFlow-free: the actor side imports this module.

Shape letters used throughout the project:
  T  unroll length (number of transitions in one unroll; an unroll holds T+1 steps,
     consecutive unrolls overlap by one step, as in IMPALA's scalable_agent)
  B  batch (number of unrolls in a learner batch)
  K  frame stack depth

An *unroll* is a flat ``dict[str, np.ndarray]`` whose keys and shapes are given by
:func:`unroll_spec`:

  ``observation/<key>``   [T+1, *obs_shape]   per-step observations. For a key that the
                          agent frame-stacks (see :mod:`impala_rep.framestack`) only the
                          newest single frame of each step travels: [T+1, H, W, C].
  ``frame_prefix/<key>``  [K-1, H, W, C]      the K-1 frames that preceded step 0 (only for
                          frame-stacked keys); the learner rebuilds the stack from them.
  ``step_type``           [T+1] uint8         dm_env.StepType of each step (0 FIRST, 1 MID, 2 LAST)
  ``reward``              [T+1] float32       reward of the timestep (0 on FIRST steps)
  ``discount``            [T+1] float32       env discount of the timestep (0 only on termination)
  ``action``              [T+1, *action]      action the behaviour policy took at each step (for
                                              continuous actions the raw, unclipped sample)
  ``behaviour_log_prob``  [T+1] float32       log mu(action_t | x_t)
  ``core_state/<name>``   [*state_shape]      recurrent core state before step 0 (LSTM only)

Transition t -> t+1 uses observation t, action t, reward t+1 and discount t+1. A transition
that starts at a LAST step (LAST -> FIRST of the next episode) is not a real transition and
is masked by the loss.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

__all__ = [
    "ArraySpec",
    "EnvSpec",
    "STEP_FIRST",
    "STEP_MID",
    "STEP_LAST",
    "spec_from_dm_env",
    "env_spec_from_dm_env",
    "unroll_spec",
    "stacked_observation_specs",
    "validate_array",
]

STEP_FIRST, STEP_MID, STEP_LAST = 0, 1, 2

_ALLOWED_DTYPES = frozenset(
    np.dtype(d).name
    for d in ("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool")
)


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """Shape, dtype and optional inclusive bounds of a named array.

    ``minimum``/``maximum`` are scalars or tuples broadcastable to ``shape``; ``None`` means
    unbounded. ``num_values`` is set for discrete (categorical) arrays, whose values lie in
    ``[0, num_values)``.
    """

    name: str
    shape: Tuple[int, ...]
    dtype: str
    minimum: Optional[Any] = None
    maximum: Optional[Any] = None
    num_values: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        dtype = np.dtype(self.dtype).name
        if dtype not in _ALLOWED_DTYPES:
            raise ValueError(
                f"ArraySpec {self.name!r}: dtype {dtype} is not supported; use one of "
                f"{sorted(_ALLOWED_DTYPES)}."
            )
        object.__setattr__(self, "dtype", dtype)
        if any(d < 0 for d in self.shape):
            raise ValueError(f"ArraySpec {self.name!r}: shape {self.shape} has a negative dimension.")
        for bound in ("minimum", "maximum"):
            value = getattr(self, bound)
            if value is not None:
                arr = np.asarray(value, dtype=np.float64)
                object.__setattr__(self, bound, float(arr) if arr.ndim == 0 else tuple(arr.ravel().tolist()))

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * np.dtype(self.dtype).itemsize

    @property
    def is_discrete(self) -> bool:
        return self.num_values is not None

    def bounds(self) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
        """Bounds as float64 arrays broadcast to ``shape`` (``None`` where unbounded)."""

        def _b(v):
            if v is None:
                return None
            arr = np.asarray(v, dtype=np.float64)
            if arr.ndim:
                # Per-element bounds apply to the trailing dimensions (leading ones are
                # time/batch dimensions added by ``with_leading``).
                for n in range(len(self.shape) + 1):
                    trailing = self.shape[len(self.shape) - n:]
                    if math.prod(trailing) == arr.size:
                        arr = arr.reshape(trailing)
                        break
            return np.broadcast_to(arr, self.shape)

        return _b(self.minimum), _b(self.maximum)

    def with_leading(self, *dims: int, name: Optional[str] = None) -> "ArraySpec":
        return dataclasses.replace(self, shape=tuple(dims) + self.shape, name=name or self.name)

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ArraySpec":
        return cls(**dict(data))


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """What the agent needs to know about an environment.

    ``observations`` maps observation key -> per-step spec (an env whose observation is a
    single array is exposed under the key ``"observation"``).
    """

    observations: Mapping[str, ArraySpec]
    action: ArraySpec

    def to_json(self) -> Dict[str, Any]:
        return {
            "observations": {k: v.to_json() for k, v in self.observations.items()},
            "action": self.action.to_json(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "EnvSpec":
        return cls(
            observations={k: ArraySpec.from_json(v) for k, v in data["observations"].items()},
            action=ArraySpec.from_json(data["action"]),
        )


def spec_from_dm_env(spec: Any, name: Optional[str] = None) -> ArraySpec:
    """Converts a ``dm_env.specs.Array``/``BoundedArray``/``DiscreteArray`` to :class:`ArraySpec`."""
    name = name or getattr(spec, "name", None) or "array"
    num_values = getattr(spec, "num_values", None)
    minimum = getattr(spec, "minimum", None)
    maximum = getattr(spec, "maximum", None)
    return ArraySpec(
        name=name,
        shape=tuple(spec.shape),
        dtype=np.dtype(spec.dtype).name,
        minimum=None if minimum is None else np.asarray(minimum),
        maximum=None if maximum is None else np.asarray(maximum),
        num_values=None if num_values is None else int(num_values),
    )


def env_spec_from_dm_env(env: Any) -> EnvSpec:
    """Reads observation and action specs of a ``dm_env.Environment``.

    Raises ``ValueError`` when the specs are of a structure the agent cannot use: the
    observation must be one array or a flat mapping of arrays, the action one array, the
    reward and the discount one number each.
    """
    for what in ("reward", "discount"):
        spec = getattr(env, f"{what}_spec")()
        shape = getattr(spec, "shape", None)
        if shape is None or isinstance(spec, (Mapping, list, tuple)) or int(np.prod(shape)) != 1:
            described = f"of shape {list(shape)}" if shape is not None else f"a {type(spec).__name__}"
            raise ValueError(
                f"the env's {what} spec is {described}; impala_rep trains on one {what} per step (combine or "
                f"select the parts in your factory, and declare a scalar {what}_spec)."
            )
    obs = env.observation_spec()
    if isinstance(obs, Mapping):
        observations = {}
        for key, spec in obs.items():
            if isinstance(spec, (Mapping, list, tuple)):
                raise ValueError(
                    f"observation {key!r} is nested; impala_rep expects a flat mapping of arrays "
                    "(wrap the env to flatten it)."
                )
            observations[str(key)] = spec_from_dm_env(spec, name=str(key))
    elif isinstance(obs, (list, tuple)):
        raise ValueError("the observation spec is a sequence; impala_rep expects one array or a flat mapping.")
    else:
        observations = {"observation": spec_from_dm_env(obs, name="observation")}
    action = env.action_spec()
    if isinstance(action, (Mapping, list, tuple)):
        raise ValueError("the action spec is nested; impala_rep expects a single action array.")
    return EnvSpec(observations=observations, action=spec_from_dm_env(action, name="action"))


def stacked_observation_specs(
    observations: Mapping[str, ArraySpec], frame_stack: Mapping[str, int]
) -> Dict[str, ArraySpec]:
    """Per-step observation specs as the network sees them (stacked keys: channels x K)."""
    out = {}
    for key, spec in observations.items():
        k = int(frame_stack.get(key, 1))
        if k > 1:
            if len(spec.shape) != 3:
                raise ValueError(
                    f"frame stacking needs [H, W, C] observations; {key!r} has shape {spec.shape}."
                )
            h, w, c = spec.shape
            spec = dataclasses.replace(spec, shape=(h, w, c * k))
        out[key] = spec
    return out


def core_state_spec(network_config: Any) -> Dict[str, ArraySpec]:
    """The recurrent state one env carries in an unroll (``core_state/<name>``), by name, for a
    network of ``network_config`` (:class:`impala_rep.networks.NetworkConfig`); empty without
    an LSTM."""
    return {name: ArraySpec(name, shape, "float32") for name, shape in network_config.core_state_shapes().items()}


def unroll_spec(
    env_spec: EnvSpec,
    unroll_length: int,
    frame_stack: Optional[Mapping[str, int]] = None,
    core_state: Optional[Mapping[str, ArraySpec]] = None,
    policy_action: Optional[ArraySpec] = None,
) -> Dict[str, ArraySpec]:
    """The layout of one unroll as it travels from actor to learner (see module docstring).

    Args:
      env_spec: the env's per-step (single-frame) specs.
      unroll_length: T, transitions per unroll; the unroll holds T+1 steps.
      frame_stack: observation key -> K for keys the agent frame-stacks.
      core_state: name -> spec of the recurrent state (LSTM), or None.
      policy_action: the spec of the action the *policy* emits, when it differs from the
        env's action spec: an unbounded float spec for a Gaussian policy (raw samples are
        stored, the env gets them clipped), an int spec with ``num_values`` per dimension for
        a discretised policy. Defaults to the env's action spec.
    """
    if int(unroll_length) < 1:
        raise ValueError(f"unroll_length must be at least 1, got {unroll_length}.")
    frame_stack = dict(frame_stack or {})
    for key, k in frame_stack.items():
        if key not in env_spec.observations:
            raise ValueError(
                f"frame_stack names observation {key!r}, but the env has {sorted(env_spec.observations)}."
            )
        if int(k) < 1:
            raise ValueError(f"frame_stack for {key!r} must be at least 1, got {k}.")
    steps = int(unroll_length) + 1
    spec: Dict[str, ArraySpec] = {}
    for key, obs in env_spec.observations.items():
        spec[f"observation/{key}"] = obs.with_leading(steps, name=f"observation/{key}")
        k = int(frame_stack.get(key, 1))
        if k > 1:
            spec[f"frame_prefix/{key}"] = obs.with_leading(k - 1, name=f"frame_prefix/{key}")
    spec["step_type"] = ArraySpec("step_type", (steps,), "uint8", minimum=0, maximum=2)
    spec["reward"] = ArraySpec("reward", (steps,), "float32")
    spec["discount"] = ArraySpec("discount", (steps,), "float32", minimum=0.0, maximum=1.0)
    action = policy_action if policy_action is not None else env_spec.action
    spec["action"] = action.with_leading(steps, name="action")
    spec["behaviour_log_prob"] = ArraySpec("behaviour_log_prob", (steps,), "float32")
    for name, state in (core_state or {}).items():
        spec[f"core_state/{name}"] = dataclasses.replace(state, name=f"core_state/{name}")
    return spec


def validate_array(spec: ArraySpec, value: Any, check_bounds: bool = True) -> np.ndarray:
    """Checks ``value`` against ``spec``; returns it as an ndarray or raises ``ValueError``.

    Checks dtype (exact), shape (exact), finiteness of floats and, when ``check_bounds``,
    the spec's bounds (``num_values`` for discrete arrays).
    """
    arr = np.asarray(value)
    if arr.dtype.name != spec.dtype:
        raise ValueError(f"{spec.name}: expected dtype {spec.dtype}, got {arr.dtype.name}.")
    if tuple(arr.shape) != tuple(spec.shape):
        raise ValueError(f"{spec.name}: expected shape {list(spec.shape)}, got {list(arr.shape)}.")
    if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
        raise ValueError(f"{spec.name}: contains NaN or infinite values.")
    if check_bounds:
        if spec.num_values is not None:
            if arr.size and (arr.min() < 0 or arr.max() >= spec.num_values):
                raise ValueError(
                    f"{spec.name}: values must lie in [0, {spec.num_values}), got range "
                    f"[{arr.min()}, {arr.max()}]."
                )
        else:
            lo, hi = spec.bounds()
            if lo is not None and np.any(arr < lo):
                raise ValueError(f"{spec.name}: values below the minimum {spec.minimum}.")
            if hi is not None and np.any(arr > hi):
                raise ValueError(f"{spec.name}: values above the maximum {spec.maximum}.")
    return arr

