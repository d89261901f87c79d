"""The network definition shared by both backends (TensorFlow-free).

:class:`NetworkConfig` chooses the architecture; :func:`plan_network` turns it, the
per-step observation specs and the policy into a :class:`NetworkPlan`: the torso of every
observation key and the name and shape of every parameter. The TensorFlow backend
(:mod:`impala_rep.networks.tf_backend`) and the NumPy backend
(:mod:`impala_rep.networks.numpy_backend`) are both built from the plan, which is what keeps
their parameter names and layouts identical.

Architecture (one step; observation keys in sorted order):

* pixel keys (rank-3 ``[H, W, C]``) go through a CNN torso:
    - ``shallow`` (IMPALA's shallow net, after Mnih et al. 2015): conv 16 8x8 stride 4,
      ReLU, conv 32 4x4 stride 2, ReLU (both VALID padding), flatten, dense ``hidden_size``,
      ReLU. Needs images of at least 20x20.
    - ``deep`` (IMPALA ResNet): 3 sections with 16/32/32 channels, each conv 3x3 (SAME) +
      max-pool 3x3 stride 2 (SAME) + 2 residual blocks (ReLU, conv 3x3, ReLU, conv 3x3, add);
      then ReLU, flatten, dense ``hidden_size``, ReLU.
* every other key (and every key when ``torso="mlp"``) is flattened and goes through an
  MLP torso: dense layers of ``mlp_sizes``, each followed by a ReLU.
* uint8 inputs are converted to float32 and divided by 255 (on the device, in TF).
* the torso outputs are concatenated; an optional LSTM core (``lstm_size``) follows, its
  state reset to zero wherever ``first`` is true (the step starts a new episode).
* a linear policy head per distribution parameter (``policy.param_shapes``, post-processed
  by ``policy.params_from_head_*``) and a linear value head.

Parameter names (``/``-separated) and layouts (Keras conventions: conv kernels
``[kh, kw, in, out]``, dense kernels ``[in, out]``, LSTM gates ``i, f, c, o``):

  ``torso/<key>/conv_<i>/{kernel,bias}``                      shallow convs
  ``torso/<key>/section_<s>/conv/{kernel,bias}``              deep section conv
  ``torso/<key>/section_<s>/res_<r>/conv_<j>/{kernel,bias}``  deep residual convs
  ``torso/<key>/dense/{kernel,bias}``                         CNN dense layer
  ``torso/<key>/dense_<i>/{kernel,bias}``                     MLP layers
  ``core/lstm/{kernel,recurrent_kernel,bias}``                LSTM
  ``policy/<param>/{kernel,bias}``, ``value/{kernel,bias}``   heads
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

__all__ = [
    "NetworkConfig",
    "TorsoPlan",
    "NetworkPlan",
    "plan_network",
    "TORSOS",
    "POLICIES",
    "SHALLOW_CONVS",
    "DEEP_SECTIONS",
    "RESIDUAL_BLOCKS",
]

TORSOS = ("auto", "shallow", "deep", "mlp")
POLICIES = ("auto", "categorical", "gaussian", "discretised")

# (filters, kernel, stride) of the shallow CNN, VALID padding.
SHALLOW_CONVS = ((16, 8, 4), (32, 4, 2))
# Channels of the deep ResNet's sections.
DEEP_SECTIONS = (16, 32, 32)
RESIDUAL_BLOCKS = 2


@dataclasses.dataclass(frozen=True)
class NetworkConfig:
    """Architecture of the agent network (see the module docstring).

    Attributes:
      torso: ``auto`` (shallow CNN for pixel keys, MLP for the rest), ``shallow``, ``deep``
        (the CNN used for pixel keys) or ``mlp`` (every key flattened into an MLP).
      hidden_size: width of the dense layer that ends each CNN torso.
      mlp_sizes: widths of the MLP torso's layers.
      lstm_size: width of the LSTM core, or ``None`` for a feed-forward agent.
      policy: ``auto`` (categorical for discrete actions, Gaussian for bounded continuous
        ones), ``categorical``, ``gaussian`` or ``discretised``.
      bins: number of values per action dimension of the ``discretised`` policy.
    """

    torso: str = "auto"
    hidden_size: int = 256
    mlp_sizes: Tuple[int, ...] = (256, 256)
    lstm_size: Optional[int] = None
    policy: str = "auto"
    bins: int = 11

    def __post_init__(self):
        if self.torso not in TORSOS:
            raise ValueError(f"NetworkConfig.torso must be one of {TORSOS}, got {self.torso!r}.")
        if self.policy not in POLICIES:
            raise ValueError(f"NetworkConfig.policy must be one of {POLICIES}, got {self.policy!r}.")
        if not _is_int(self.hidden_size) or self.hidden_size < 1:
            raise ValueError(f"NetworkConfig.hidden_size must be a positive integer, got {self.hidden_size!r}.")
        try:
            sizes = tuple(self.mlp_sizes)
        except TypeError:
            raise TypeError(
                f"NetworkConfig.mlp_sizes must be a sequence of positive integers, got {self.mlp_sizes!r}."
            ) from None
        if not sizes or not all(_is_int(s) and s >= 1 for s in sizes):
            raise ValueError(
                f"NetworkConfig.mlp_sizes must be a non-empty sequence of positive integers, got {self.mlp_sizes!r}."
            )
        object.__setattr__(self, "mlp_sizes", tuple(int(s) for s in sizes))
        if self.lstm_size is not None and (not _is_int(self.lstm_size) or self.lstm_size < 1):
            raise ValueError(
                f"NetworkConfig.lstm_size must be a positive integer or None (no LSTM), got {self.lstm_size!r}."
            )
        if not _is_int(self.bins) or self.bins < 2:
            raise ValueError(f"NetworkConfig.bins must be an integer of at least 2, got {self.bins!r}.")

    def core_state_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """The recurrent state one env carries, float32, by name: ``h`` and ``c`` of
        ``[lstm_size]`` each; empty without an LSTM. Both backends' ``initial_state`` are zeros
        of these shapes with a batch dimension in front."""
        if self.lstm_size is None:
            return {}
        return {"h": (int(self.lstm_size),), "c": (int(self.lstm_size),)}


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class TorsoPlan:
    """The torso of one observation key."""

    key: str
    kind: str  # "shallow" | "deep" | "mlp"
    input_shape: Tuple[int, ...]  # per-step shape, without batch
    scale: Optional[float]  # 1/255 for uint8 inputs, else None
    output_size: int


@dataclasses.dataclass(frozen=True)
class NetworkPlan:
    """Everything both backends need to build the same network."""

    config: NetworkConfig
    torsos: Tuple[TorsoPlan, ...]
    core_input_size: int
    head_input_size: int
    lstm_size: Optional[int]
    head_shapes: Mapping[str, Tuple[int, ...]]
    param_shapes: Mapping[str, Tuple[int, ...]]  # insertion-ordered

    def check_params(self, params: Mapping[str, Any]) -> Dict[str, np.ndarray]:
        """``params`` as float32 arrays, checked against :attr:`param_shapes`.

        Raises ``ValueError`` on missing, extra or misshapen parameters (both backends'
        ``set_params`` and exported-policy loading use this one check).
        """
        expected = self.param_shapes
        missing = sorted(set(expected) - set(params))
        extra = sorted(set(params) - set(expected))
        if missing or extra:
            raise ValueError(
                f"set_params: parameter names do not match the network; missing {missing}, unexpected {extra}."
            )
        out = {}
        for name, shape in expected.items():
            value = np.asarray(params[name], dtype=np.float32)
            if value.shape != tuple(shape):
                raise ValueError(f"set_params: {name!r} must have shape {list(shape)}, got {list(value.shape)}.")
            out[name] = value
        return out


def _valid_out(size: int, kernel: int, stride: int) -> int:
    return (size - kernel) // stride + 1


def _same_out(size: int, stride: int) -> int:
    return -(-size // stride)


def plan_network(config: NetworkConfig, obs_specs: Mapping[str, Any], policy: Any) -> NetworkPlan:
    """Plans the network for ``obs_specs`` (per-step, stacked specs) and ``policy``.

    Raises ``ValueError`` when an observation cannot go through the chosen torso.
    """
    if not isinstance(config, NetworkConfig):
        raise TypeError(f"config must be a NetworkConfig, got {type(config).__name__}.")
    if not obs_specs:
        raise ValueError("obs_specs is empty; the network needs at least one observation key.")
    params: Dict[str, Tuple[int, ...]] = {}

    def dense(prefix: str, n_in: int, n_out: int) -> None:
        params[f"{prefix}/kernel"] = (n_in, n_out)
        params[f"{prefix}/bias"] = (n_out,)

    def conv(prefix: str, k: int, c_in: int, c_out: int) -> None:
        params[f"{prefix}/kernel"] = (k, k, c_in, c_out)
        params[f"{prefix}/bias"] = (c_out,)

    if config.torso in ("shallow", "deep") and not any(len(spec.shape) == 3 for spec in obs_specs.values()):
        found = ", ".join(f"{k!r} {list(int(d) for d in obs_specs[k].shape)}" for k in sorted(obs_specs))
        raise ValueError(
            f"the {config.torso} torso is a CNN for image observations (height, width, channels), and "
            f"this env has none ({found}); use the mlp torso (--network mlp, or auto)."
        )
    torsos = []
    for key in sorted(obs_specs):
        spec = obs_specs[key]
        shape = tuple(int(d) for d in spec.shape)
        dtype = np.dtype(spec.dtype)
        scale = 1.0 / 255.0 if dtype == np.uint8 else None
        pixel = len(shape) == 3 and config.torso != "mlp"
        if pixel:
            h, w, c = shape
            kind = "deep" if config.torso == "deep" else "shallow"
            if kind == "shallow":
                for i, (filters, k, s) in enumerate(SHALLOW_CONVS):
                    if h < k or w < k:
                        raise ValueError(
                            f"observation {key!r} of shape {list(shape)} is too small for the shallow "
                            f"CNN (it needs at least 20x20 pixels); use torso='deep' or a larger image."
                        )
                    conv(f"torso/{key}/conv_{i}", k, c, filters)
                    h, w, c = _valid_out(h, k, s), _valid_out(w, k, s), filters
            else:
                for s_idx, filters in enumerate(DEEP_SECTIONS):
                    conv(f"torso/{key}/section_{s_idx}/conv", 3, c, filters)
                    c = filters
                    h, w = _same_out(h, 2), _same_out(w, 2)
                    for r in range(RESIDUAL_BLOCKS):
                        for j in range(2):
                            conv(f"torso/{key}/section_{s_idx}/res_{r}/conv_{j}", 3, c, c)
            dense(f"torso/{key}/dense", h * w * c, config.hidden_size)
            out = config.hidden_size
        else:
            kind = "mlp"
            n_in = int(math.prod(shape))
            for i, size in enumerate(config.mlp_sizes):
                dense(f"torso/{key}/dense_{i}", n_in, size)
                n_in = size
            out = n_in
        torsos.append(TorsoPlan(key=key, kind=kind, input_shape=shape, scale=scale, output_size=out))

    core_in = sum(t.output_size for t in torsos)
    head_in = core_in
    if config.lstm_size is not None:
        n = config.lstm_size
        params["core/lstm/kernel"] = (core_in, 4 * n)
        params["core/lstm/recurrent_kernel"] = (n, 4 * n)
        params["core/lstm/bias"] = (4 * n,)
        head_in = n
    head_shapes = {name: tuple(int(d) for d in shape) for name, shape in policy.param_shapes.items()}
    for name, shape in head_shapes.items():
        dense(f"policy/{name}", head_in, int(math.prod(shape)))
    dense("value", head_in, 1)
    return NetworkPlan(
        config=config,
        torsos=tuple(torsos),
        core_input_size=core_in,
        head_input_size=head_in,
        lstm_size=config.lstm_size,
        head_shapes=head_shapes,
        param_shapes=params,
    )
