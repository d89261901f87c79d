"""Policy distributions for every action spec, in NumPy (actors) and TensorFlow (learner).

TensorFlow-free at import: the actor side imports this module. The ``*_tf`` methods import
TensorFlow inside themselves, so only the learner pays for it.

Shapes: distribution parameters carry any leading dimensions ``[...]`` (``[B]`` on an
actor, ``[T, B]`` on the learner) followed by the per-step shapes in
``policy.param_shapes``; actions carry the same leading dimensions followed by
``policy.action_spec.shape``; log-probabilities and entropies have the leading dimensions
only (summed over action dimensions).

Policies (:func:`make_policy` picks one from the env's action spec and the network config):

* :class:`CategoricalPolicy` for discrete actions (``num_values`` set): parameters
  ``{"logits": (N,)}``, actions int32 scalars.
* :class:`GaussianPolicy` for bounded continuous actions: a diagonal Gaussian whose mean
  and log standard deviation are both network outputs (state-dependent). The network's raw
  ``log_std`` output is soft-clamped to ``[LOG_STD_MIN, LOG_STD_MAX]`` (within 1e-3) by
  :meth:`GaussianPolicy.params_from_head_np`/``_tf`` (smooth, so gradients never vanish at
  a hard edge). Sampled actions are stored and scored *unclipped*; only
  :meth:`to_env_action` clips them to the env's bounds.
* :class:`DiscretisedPolicy`: a factorised categorical over ``bins`` evenly spaced values
  per continuous action dimension: parameters ``{"logits": (A, bins)}``, actions int32
  ``[A]`` bin indices, mapped to values by :meth:`to_env_action`.

Usage on an actor::

    policy = make_policy(env_spec.action, NetworkConfig())
    params, value, state = numpy_net.step(obs, state, first)
    action, log_prob = policy.sample_np(params, rng)     # stored in the unroll
    timestep = env.step(policy.to_env_action(action[i]))
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Tuple

import numpy as np

from impala_rep.specs import ArraySpec, spec_from_dm_env

__all__ = [
    "Policy",
    "CategoricalPolicy",
    "GaussianPolicy",
    "DiscretisedPolicy",
    "MultiCategoricalPolicy",
    "make_policy",
    "LOG_STD_MIN",
    "LOG_STD_MAX",
]

LOG_STD_MIN = -5.0
LOG_STD_MAX = 2.0
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _log_softmax_np(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float32)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _softplus_np(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(np.float32(0.0), x).astype(np.float32)


class Policy:
    """A distribution over actions given per-step parameters (see the module docstring).

    Attributes:
      env_action_spec: the env's action spec.
      action_spec: what the policy emits and the unroll stores.
      param_shapes: ``{name: per-step shape}`` of the distribution parameters.
      kind: ``"categorical"``, ``"gaussian"`` or ``"discretised"``.
    """

    kind: str = ""
    env_action_spec: ArraySpec
    action_spec: ArraySpec
    param_shapes: Dict[str, Tuple[int, ...]]

    # -- network head post-processing (identity unless a policy overrides it) --
    def params_from_head_np(self, raw: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """Maps the network's linear head outputs to distribution parameters (NumPy)."""
        return dict(raw)

    def params_from_head_tf(self, raw: Mapping[str, Any]) -> Dict[str, Any]:
        """Maps the network's linear head outputs to distribution parameters (TF)."""
        return dict(raw)

    # -- NumPy --
    def sample_np(self, params: Mapping[str, np.ndarray], rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
        """Samples ``(action, log_prob)``; action as in ``action_spec``, log_prob float32."""
        raise NotImplementedError

    def mode_np(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        """The most likely action (greedy evaluation)."""
        raise NotImplementedError

    def log_prob_np(self, params: Mapping[str, np.ndarray], action: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def entropy_np(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError

    def to_env_action(self, action: np.ndarray) -> np.ndarray:
        """Maps a policy action (one or a batch) to what the env's ``step`` accepts."""
        raise NotImplementedError

    # -- TensorFlow --
    def log_prob_tf(self, params: Mapping[str, Any], action: Any) -> Any:
        """log pi(action | params), float32 with the leading dimensions of ``action``."""
        raise NotImplementedError

    def entropy_tf(self, params: Mapping[str, Any]) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(param_shapes={self.param_shapes}, action_spec={self.action_spec})"


class CategoricalPolicy(Policy):
    """Categorical over ``num_values`` discrete actions."""

    kind = "categorical"

    def __init__(self, env_action_spec: ArraySpec):
        if env_action_spec.num_values is None or env_action_spec.shape != ():
            raise ValueError(
                f"the categorical policy needs a scalar discrete action spec (num_values set, shape ()), "
                f"got shape {env_action_spec.shape} with num_values={env_action_spec.num_values}."
            )
        n = int(env_action_spec.num_values)
        self.env_action_spec = env_action_spec
        self.num_actions = n
        self.action_spec = ArraySpec("action", (), "int32", minimum=0, maximum=n - 1, num_values=n)
        self.param_shapes = {"logits": (n,)}

    def sample_np(self, params, rng):
        logp = _log_softmax_np(params["logits"])
        gumbel = rng.gumbel(size=logp.shape).astype(np.float32)
        action = np.argmax(logp + gumbel, axis=-1).astype(np.int32)
        return action, np.take_along_axis(logp, action[..., None], axis=-1)[..., 0]

    def mode_np(self, params):
        return np.argmax(np.asarray(params["logits"]), axis=-1).astype(np.int32)

    def log_prob_np(self, params, action):
        logp = _log_softmax_np(params["logits"])
        action = np.asarray(action, dtype=np.int64)
        return np.take_along_axis(logp, action[..., None], axis=-1)[..., 0]

    def entropy_np(self, params):
        logp = _log_softmax_np(params["logits"])
        return -(np.exp(logp) * logp).sum(axis=-1)

    def to_env_action(self, action):
        return np.asarray(action).astype(self.env_action_spec.dtype)

    def log_prob_tf(self, params, action):
        import tensorflow as tf

        logits = tf.convert_to_tensor(params["logits"], tf.float32)
        action = tf.cast(action, tf.int32)
        return -tf.nn.sparse_softmax_cross_entropy_with_logits(labels=action, logits=logits)

    def entropy_tf(self, params):
        import tensorflow as tf

        logits = tf.convert_to_tensor(params["logits"], tf.float32)
        logp = tf.nn.log_softmax(logits, axis=-1)
        return -tf.reduce_sum(tf.exp(logp) * logp, axis=-1)


class DiscretisedPolicy(Policy):
    """Factorised categorical over ``bins`` evenly spaced values per action dimension."""

    kind = "discretised"

    def __init__(self, env_action_spec: ArraySpec, bins: int):
        lo, hi = _finite_bounds(env_action_spec, "discretised")
        if int(bins) < 2:
            raise ValueError(f"the discretised policy needs at least 2 bins, got {bins}.")
        self.env_action_spec = env_action_spec
        self.bins = int(bins)
        self.num_dims = int(math.prod(env_action_spec.shape))
        self._lo = lo.reshape(-1)
        self._hi = hi.reshape(-1)
        a = self.num_dims
        self.action_spec = ArraySpec(
            "action", (a,), "int32", minimum=0, maximum=self.bins - 1, num_values=self.bins
        )
        self.param_shapes = {"logits": (a, self.bins)}

    mode_np = CategoricalPolicy.mode_np

    def sample_np(self, params, rng):
        action, logp = CategoricalPolicy.sample_np(self, params, rng)
        return action, logp.sum(axis=-1)

    def log_prob_np(self, params, action):
        return CategoricalPolicy.log_prob_np(self, params, action).sum(axis=-1)

    def entropy_np(self, params):
        return CategoricalPolicy.entropy_np(self, params).sum(axis=-1)

    def to_env_action(self, action):
        action = np.asarray(action)
        frac = action.astype(np.float64) / (self.bins - 1)
        value = self._lo + frac * (self._hi - self._lo)
        lead = action.shape[:-1]
        return value.reshape(lead + self.env_action_spec.shape).astype(self.env_action_spec.dtype)

    def log_prob_tf(self, params, action):
        import tensorflow as tf

        return tf.reduce_sum(CategoricalPolicy.log_prob_tf(self, params, action), axis=-1)

    def entropy_tf(self, params):
        import tensorflow as tf

        return tf.reduce_sum(CategoricalPolicy.entropy_tf(self, params), axis=-1)


class MultiCategoricalPolicy(DiscretisedPolicy):
    """Factorised categorical over an integer action array ``[A...]`` with ``num_values`` each
    (e.g. ``envs.wrappers.DiscretizeActions`` over several dimensions): the env gets the
    chosen indices themselves."""

    kind = "categorical"

    def __init__(self, env_action_spec: ArraySpec):
        if env_action_spec.num_values is None or not env_action_spec.shape:
            raise ValueError(
                f"the multi-categorical policy needs a discrete action array (num_values set, shape [A]), "
                f"got shape {env_action_spec.shape} with num_values={env_action_spec.num_values}."
            )
        self.env_action_spec = env_action_spec
        self.bins = int(env_action_spec.num_values)
        self.num_dims = int(math.prod(env_action_spec.shape))
        a = self.num_dims
        self.action_spec = ArraySpec("action", (a,), "int32", minimum=0, maximum=self.bins - 1, num_values=self.bins)
        self.param_shapes = {"logits": (a, self.bins)}

    def to_env_action(self, action):
        action = np.asarray(action)
        return action.reshape(action.shape[:-1] + self.env_action_spec.shape).astype(self.env_action_spec.dtype)


class GaussianPolicy(Policy):
    """Diagonal Gaussian with state-dependent mean and (soft-clamped) log standard deviation."""

    kind = "gaussian"

    def __init__(self, env_action_spec: ArraySpec):
        lo, hi = _finite_bounds(env_action_spec, "gaussian")
        self.env_action_spec = env_action_spec
        self.num_dims = int(math.prod(env_action_spec.shape))
        self._lo = lo.reshape(-1)
        self._hi = hi.reshape(-1)
        a = self.num_dims
        self.action_spec = ArraySpec("action", (a,), "float32")
        self.param_shapes = {"mean": (a,), "log_std": (a,)}

    # Soft clamp: log_std = MIN + softplus(MAX - softplus(MAX - raw) - MIN).
    def params_from_head_np(self, raw):
        out = dict(raw)
        x = np.asarray(raw["log_std"], dtype=np.float32)
        x = np.float32(LOG_STD_MAX) - _softplus_np(np.float32(LOG_STD_MAX) - x)
        out["log_std"] = np.float32(LOG_STD_MIN) + _softplus_np(x - np.float32(LOG_STD_MIN))
        return out

    def params_from_head_tf(self, raw):
        import tensorflow as tf

        out = dict(raw)
        x = tf.convert_to_tensor(raw["log_std"], tf.float32)
        x = LOG_STD_MAX - tf.nn.softplus(LOG_STD_MAX - x)
        out["log_std"] = LOG_STD_MIN + tf.nn.softplus(x - LOG_STD_MIN)
        return out

    def sample_np(self, params, rng):
        mean = np.asarray(params["mean"], dtype=np.float32)
        log_std = np.asarray(params["log_std"], dtype=np.float32)
        noise = rng.standard_normal(size=mean.shape).astype(np.float32)
        action = mean + np.exp(log_std) * noise
        logp = (-0.5 * noise * noise - log_std - np.float32(_HALF_LOG_2PI)).sum(axis=-1)
        return action.astype(np.float32), logp.astype(np.float32)

    def mode_np(self, params):
        return np.asarray(params["mean"], dtype=np.float32)

    def log_prob_np(self, params, action):
        mean = np.asarray(params["mean"], dtype=np.float32)
        log_std = np.asarray(params["log_std"], dtype=np.float32)
        z = (np.asarray(action, dtype=np.float32) - mean) * np.exp(-log_std)
        return (-0.5 * z * z - log_std - np.float32(_HALF_LOG_2PI)).sum(axis=-1)

    def entropy_np(self, params):
        log_std = np.asarray(params["log_std"], dtype=np.float32)
        return (log_std + np.float32(0.5 + _HALF_LOG_2PI)).sum(axis=-1)

    def to_env_action(self, action):
        action = np.asarray(action, dtype=np.float64)
        clipped = np.clip(action, self._lo, self._hi)
        lead = action.shape[:-1]
        return clipped.reshape(lead + self.env_action_spec.shape).astype(self.env_action_spec.dtype)

    def log_prob_tf(self, params, action):
        import tensorflow as tf

        mean = tf.convert_to_tensor(params["mean"], tf.float32)
        log_std = tf.convert_to_tensor(params["log_std"], tf.float32)
        z = (tf.cast(action, tf.float32) - mean) * tf.exp(-log_std)
        return tf.reduce_sum(-0.5 * tf.square(z) - log_std - _HALF_LOG_2PI, axis=-1)

    def entropy_tf(self, params):
        import tensorflow as tf

        log_std = tf.convert_to_tensor(params["log_std"], tf.float32)
        return tf.reduce_sum(log_std + (0.5 + _HALF_LOG_2PI), axis=-1)


def _finite_bounds(spec: ArraySpec, kind: str) -> Tuple[np.ndarray, np.ndarray]:
    if np.dtype(spec.dtype).kind != "f":
        raise ValueError(
            f"the {kind} policy needs a floating-point action spec, got dtype {spec.dtype}."
        )
    lo, hi = spec.bounds()
    if lo is None or hi is None or not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        raise ValueError(
            f"the {kind} policy needs finite action bounds (a BoundedArray), got minimum="
            f"{spec.minimum} and maximum={spec.maximum}."
        )
    if np.any(lo > hi):
        raise ValueError(f"action spec minimum {spec.minimum} exceeds its maximum {spec.maximum}.")
    if math.prod(spec.shape) < 1:
        raise ValueError(f"the {kind} policy needs at least one action dimension, got shape {spec.shape}.")
    return lo.astype(np.float64), hi.astype(np.float64)


def make_policy(action_spec: Any, config: Any = None) -> Policy:
    """The policy for ``action_spec`` chosen by ``config.policy`` (and ``config.bins``).

    Args:
      action_spec: the env's action spec, an :class:`~impala_rep.specs.ArraySpec` or a
        ``dm_env.specs`` array.
      config: a :class:`~impala_rep.networks.config.NetworkConfig` (default: ``auto``).

    ``auto`` gives a categorical policy for discrete specs and a Gaussian for bounded
    floating-point specs. Raises ``ValueError`` when the spec does not fit the policy.
    """
    if not isinstance(action_spec, ArraySpec):
        if not hasattr(action_spec, "shape") or not hasattr(action_spec, "dtype"):
            raise TypeError(
                f"action_spec must be an ArraySpec or a dm_env spec, got {type(action_spec).__name__}."
            )
        action_spec = spec_from_dm_env(action_spec, name="action")
    if config is None:
        from impala_rep.networks.config import NetworkConfig

        config = NetworkConfig()
    kind = getattr(config, "policy", None)
    bins = getattr(config, "bins", 11)
    if kind == "auto":
        if action_spec.num_values is not None:
            kind = "categorical"
        elif np.dtype(action_spec.dtype).kind == "f":
            kind = "gaussian"
        else:
            raise ValueError(
                f"cannot choose a policy for action spec {action_spec}: it is neither discrete "
                "(num_values set) nor floating-point; set NetworkConfig.policy explicitly."
            )
    if kind == "categorical":
        if action_spec.shape != () and action_spec.num_values is not None:
            return MultiCategoricalPolicy(action_spec)
        return CategoricalPolicy(action_spec)
    if kind == "gaussian":
        return GaussianPolicy(action_spec)
    if kind == "discretised":
        return DiscretisedPolicy(action_spec, bins)
    raise ValueError(
        f"config.policy must be one of auto, categorical, gaussian, discretised; got {kind!r}."
    )
