"""TensorFlow backend of the agent network: ``[T+1, B]`` unrolls for the learner.

Built with ``tf_keras`` layers (Keras 2; Keras 3 breaks inside ``MirroredStrategy`` custom
loops on TF 2.21, see DESIGN.md) from the same plan as the NumPy backend
(:func:`~impala_rep.networks.config.plan_network`), with the same parameter names. All
variables are created in the constructor, so construct the network inside
``replicator.scope()`` / ``strategy.scope()``; :meth:`TFNetwork.unroll` can then run in
``strategy.run``, under ``tf.function`` and with XLA.

Mixed precision: with ``compute_dtype="bfloat16"`` the torsos (the convolutions and the
torso's dense layer: nearly all of the arithmetic) compute in bfloat16 on bfloat16 copies of
the float32 variables; the core, the heads and everything after them stay float32, and the
variables, their gradients and the parameters the actors get are float32 either way.

Shape letters: ``T`` transitions per unroll (``T+1`` steps), ``B`` batch.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np
import tensorflow as tf
import tf_keras

from impala_rep.config import LEARNER_PRECISIONS
from impala_rep.distributions import make_policy
from impala_rep.networks.config import (
    DEEP_SECTIONS,
    RESIDUAL_BLOCKS,
    SHALLOW_CONVS,
    NetworkConfig,
    plan_network,
)

__all__ = ["COMPUTE_DTYPES", "TFNetwork", "stack_sources"]

_layers = tf_keras.layers

# The dtypes the torsos may compute in (``TFNetwork(compute_dtype=...)``): the run's
# ``--learner-precision`` choices.
COMPUTE_DTYPES = LEARNER_PRECISIONS
# PopArt's bounds on sigma (van Hasselt et al. 2016's).
POPART_SIGMA_RANGE = (1e-4, 1e6)


def popart_sigma(mean: Any, mean_square: Any) -> tf.Tensor:
    """PopArt's sigma from the value targets' running ``mean`` and ``mean_square`` (tensors or
    arrays, e.g. read from a checkpoint): ``sqrt(max(mean_square - mean^2, 0))`` clipped to
    :data:`POPART_SIGMA_RANGE`."""
    variance = tf.maximum(mean_square - tf.square(mean), 0.0)
    return tf.clip_by_value(tf.sqrt(variance), POPART_SIGMA_RANGE[0], POPART_SIGMA_RANGE[1])


class TFNetwork(tf.Module):
    """The agent network in TensorFlow (see ``impala_rep.networks.config`` for the architecture).

    Args:
      config: the :class:`NetworkConfig`.
      obs_specs: ``{key: ArraySpec}`` per-step observations as the network sees them.
      action_spec: the env's action spec (the policy is ``make_policy(action_spec, config)``).
      compute_dtype: ``"float32"`` (default) or ``"bfloat16"``, the dtype the torsos compute
        in (see the module docstring); the variables are float32 either way.
      value_torso_scale: the share in [0, 1] of the value head's gradient that flows on into
        the layers it shares with the policy heads (``LossConfig.baseline_torso_scale``); the
        value head's own gradient and every output are unchanged. 1 (default) is IMPALA's
        shared network, 0 trains the shared layers on the policy's loss alone.
      popart: PopArt (van Hasselt et al. 2016; Hessel et al. 2019): the value head outputs a
        normalised value ``n`` and the network returns ``sigma * n + mu``, with ``mu`` and
        ``sigma`` running statistics of the value targets (:meth:`update_value_stats`, which
        also rescales the head so that the values it returns are unchanged). The statistics
        are variables of this module (checkpointed with it, not trained); the parameters it
        exports (``get_params``, ``param_tensors``) fold them into ``value/kernel`` and
        ``value/bias``, so the NumPy backend computes the same values without them.

    Usage in a learner::

        with replicator.scope():
            net = TFNetwork(NetworkConfig(), obs_specs, env_spec.action)
        policy_params, values = net.unroll(obs, first, initial_state)
    """

    def __init__(self, config: NetworkConfig, obs_specs: Mapping[str, Any], action_spec: Any, name: str = "agent",
                 compute_dtype: str = "float32", value_torso_scale: float = 1.0, popart: bool = False):
        super().__init__(name=name)
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {compute_dtype!r}.")
        if (isinstance(value_torso_scale, bool) or not isinstance(value_torso_scale, (int, float))
                or not 0.0 <= value_torso_scale <= 1.0):
            raise ValueError(f"value_torso_scale must be a number in [0, 1], got {value_torso_scale!r}.")
        self.value_torso_scale = float(value_torso_scale)
        if not isinstance(popart, bool):
            raise TypeError(f"popart must be True or False, got {popart!r}.")
        self.popart = popart
        self.compute_dtype = tf.as_dtype(compute_dtype)
        self.config = config
        self.policy = make_policy(action_spec, config)
        self.plan = plan_network(config, obs_specs, self.policy)
        self._named: Dict[str, tf.Variable] = {}
        self._torso_layers: Dict[str, list] = {}
        for t in self.plan.torsos:
            self._torso_layers[t.key] = self._build_torso(t)
        self._lstm = None
        if self.plan.lstm_size is not None:
            self._lstm = _layers.LSTMCell(self.plan.lstm_size, name="lstm")
            self._lstm.build((None, self.plan.core_input_size))
            self._named["core/lstm/kernel"] = self._lstm.kernel
            self._named["core/lstm/recurrent_kernel"] = self._lstm.recurrent_kernel
            self._named["core/lstm/bias"] = self._lstm.bias
        self._policy_heads = {}
        for pname, shape in self.plan.head_shapes.items():
            self._policy_heads[pname] = self._dense(f"policy/{pname}", self.plan.head_input_size, int(math.prod(shape)))
        self._value_head = self._dense("value", self.plan.head_input_size, 1)
        if popart:
            # The targets' mean, their mean square and how many batches those average (0: none
            # yet, which gives mu 0 and sigma 1, the plain value head).
            self._value_stats = {
                name: tf.Variable(init, dtype=tf.float32, trainable=False, name=f"popart_{name}")
                for name, init in (("mean", 0.0), ("mean_square", 1.0), ("updates", 0.0))
            }
        if set(self._named) != set(self.plan.param_shapes):
            raise RuntimeError("TFNetwork: built variables do not match the network plan (a bug).")
        for pname, shape in self.plan.param_shapes.items():
            if tuple(self._named[pname].shape) != tuple(shape):
                raise RuntimeError(f"TFNetwork: variable {pname} has shape {self._named[pname].shape}, plan says {shape}.")

    # -- construction --
    def _register(self, prefix: str, layer) -> None:
        self._named[f"{prefix}/kernel"] = layer.kernel
        self._named[f"{prefix}/bias"] = layer.bias

    def _dense(self, prefix: str, n_in: int, n_out: int):
        layer = _layers.Dense(n_out, name=prefix.replace("/", "_"))
        layer.build((None, n_in))
        self._register(prefix, layer)
        return layer

    def _conv(self, prefix: str, shape_in: Tuple[int, int, int], filters: int, k: int, s: int, padding: str):
        layer = _layers.Conv2D(filters, k, strides=s, padding=padding, name=prefix.replace("/", "_"))
        layer.build((None,) + tuple(shape_in))
        self._register(prefix, layer)
        return layer

    def _build_torso(self, t) -> list:
        pre = f"torso/{t.key}"
        if t.kind == "mlp":
            layers = []
            n_in = int(math.prod(t.input_shape))
            for i, size in enumerate(self.config.mlp_sizes):
                layers.append(self._dense(f"{pre}/dense_{i}", n_in, size))
                n_in = size
            return layers
        h, w, c = t.input_shape
        if t.kind == "shallow":
            convs = []
            for i, (filters, k, s) in enumerate(SHALLOW_CONVS):
                convs.append(self._conv(f"{pre}/conv_{i}", (h, w, c), filters, k, s, "valid"))
                h, w, c = (h - k) // s + 1, (w - k) // s + 1, filters
            dense = self._dense(f"{pre}/dense", h * w * c, self.config.hidden_size)
            return [convs, dense]
        sections = []
        for si, filters in enumerate(DEEP_SECTIONS):
            sp = f"{pre}/section_{si}"
            conv = self._conv(f"{sp}/conv", (h, w, c), filters, 3, 1, "same")
            c = filters
            h, w = -(-h // 2), -(-w // 2)
            blocks = []
            for r in range(RESIDUAL_BLOCKS):
                blocks.append(
                    [self._conv(f"{sp}/res_{r}/conv_{j}", (h, w, c), c, 3, 1, "same") for j in range(2)]
                )
            sections.append((conv, blocks))
        dense = self._dense(f"{pre}/dense", h * w * c, self.config.hidden_size)
        return [sections, dense]

    # -- parameters --
    @property
    def named_variables(self) -> Dict[str, tf.Variable]:
        """``{name: tf.Variable}`` in plan order (names as in the NumPy backend)."""
        return {name: self._named[name] for name in self.plan.param_shapes}

    @property
    def trainable_variables(self):
        return tuple(self.named_variables.values())

    @property
    def variables(self):
        return self.trainable_variables

    def param_tensors(self) -> Dict[str, tf.Tensor]:
        """``{name: tensor}``: the parameters as the NumPy backend takes them. The variables,
        except that with ``popart`` the value head's carry the statistics (``sigma * kernel``
        and ``sigma * bias + mu``), so that it outputs the value itself."""
        params = {name: tf.identity(v) for name, v in self.named_variables.items()}
        if self.popart:
            mu, sigma = self.value_stats()
            params["value/kernel"] = params["value/kernel"] * sigma
            params["value/bias"] = params["value/bias"] * sigma + mu
        return params

    def get_params(self) -> Dict[str, np.ndarray]:
        """The parameters as ``{name: float32 ndarray}`` (the NumPy backend's names; :meth:`param_tensors`)."""
        return {name: np.asarray(v.numpy(), dtype=np.float32) for name, v in self.param_tensors().items()}

    def set_params(self, params: Mapping[str, Any]) -> None:
        """Assigns every parameter (as :meth:`get_params` gives them; with ``popart``, the value
        head's are divided back out by the current statistics); raises ``ValueError`` on
        missing, extra or misshapen ones."""
        checked = dict(self.plan.check_params(params))
        if self.popart:
            mu, sigma = (float(x) for x in self.value_stats())
            checked["value/kernel"] = np.asarray(checked["value/kernel"], np.float32) / sigma
            checked["value/bias"] = (np.asarray(checked["value/bias"], np.float32) - mu) / sigma
        for name, var in self.named_variables.items():
            var.assign(checked[name])

    # -- PopArt --
    def value_stats(self) -> Tuple[tf.Tensor, tf.Tensor]:
        """``(mu, sigma)``: the value targets' running mean and standard deviation (``popart``)."""
        if not self.popart:
            raise ValueError("this network was built without popart, so it keeps no value statistics.")
        stats = self._value_stats
        mu = tf.identity(stats["mean"])
        return mu, popart_sigma(mu, stats["mean_square"])

    def update_value_stats(self, mean: Any, mean_square: Any, step_size: float) -> Tuple[tf.Tensor, tf.Tensor]:
        """Moves the statistics towards a batch of value targets and rescales the value head
        so that every value it returns stays as it was (PopArt's "preserving outputs").

        ``mean`` and ``mean_square``: the batch's mean target and mean squared target. The
        statistics are averages over the batches so far until ``1/updates`` falls below
        ``step_size``, and exponential moving averages with ``step_size`` from then on.
        Returns the new ``(mu, sigma)``.
        """
        old_mu, old_sigma = self.value_stats()  # a sentence for a network without popart
        stats = self._value_stats
        updates = stats["updates"] + 1.0
        rate = tf.maximum(tf.constant(float(step_size), tf.float32), 1.0 / updates)
        stats["mean"].assign(stats["mean"] + rate * (tf.cast(mean, tf.float32) - stats["mean"]))
        stats["mean_square"].assign(
            stats["mean_square"] + rate * (tf.cast(mean_square, tf.float32) - stats["mean_square"]))
        stats["updates"].assign(updates)
        mu, sigma = self.value_stats()
        kernel, bias = self._named["value/kernel"], self._named["value/bias"]
        kernel.assign(kernel * (old_sigma / sigma))
        bias.assign((bias * old_sigma + old_mu - mu) / sigma)
        return mu, sigma

    def initial_state(self, batch: int) -> Dict[str, tf.Tensor]:
        """Zero LSTM state ``{"h": [B, H], "c": [B, H]}``; empty without an LSTM."""
        return {name: tf.zeros((batch,) + shape, tf.float32) for name, shape in self.config.core_state_shapes().items()}

    # -- forward --
    def _scaled(self, t, x: tf.Tensor) -> tf.Tensor:
        x = tf.cast(x, self.compute_dtype)  # uint8 pixels are exact in bfloat16 too
        return x * t.scale if t.scale is not None else x

    def _cast(self, variable) -> tf.Tensor:
        return variable if self.compute_dtype == tf.float32 else tf.cast(variable, self.compute_dtype)

    def _apply(self, layer, h: tf.Tensor) -> tf.Tensor:
        """``layer(h)`` in the compute dtype (a Dense or Conv2D layer of the torso)."""
        if self.compute_dtype == tf.float32:
            return layer(h)
        if isinstance(layer, _layers.Conv2D):
            y = tf.nn.conv2d(h, self._cast(layer.kernel), strides=list(layer.strides), padding=layer.padding.upper())
        else:
            y = tf.matmul(h, self._cast(layer.kernel))
        return tf.nn.bias_add(y, self._cast(layer.bias))

    def _first_conv(self, t):
        body = self._torso_layers[t.key][0]
        return body[0] if t.kind == "shallow" else body[0][0]

    def _torso(self, t, x: tf.Tensor, first_conv=None) -> tf.Tensor:
        """x: [N, *input_shape] scaled (:meth:`_scaled`) -> [N, output_size] float32.

        ``first_conv`` (CNN torsos): a callable that replaces the first convolution (bias
        included, before its ReLU); it is called with ``x``.
        """
        layers = self._torso_layers[t.key]
        if t.kind == "mlp":
            h = tf.reshape(x, [-1, int(math.prod(t.input_shape))])
            for layer in layers:
                h = tf.nn.relu(self._apply(layer, h))
            return tf.cast(h, tf.float32)
        body, dense = layers
        if t.kind == "shallow":
            h = x
            for i, conv in enumerate(body):
                h = tf.nn.relu(first_conv(h) if i == 0 and first_conv is not None else self._apply(conv, h))
        else:
            h = x
            for i, (conv, blocks) in enumerate(body):
                h = first_conv(h) if i == 0 and first_conv is not None else self._apply(conv, h)
                h = tf.nn.max_pool2d(h, ksize=3, strides=2, padding="SAME")
                for conv_0, conv_1 in blocks:
                    y = self._apply(conv_0, tf.nn.relu(h))
                    y = self._apply(conv_1, tf.nn.relu(y))
                    h = h + y
            h = tf.nn.relu(h)
        h = tf.reshape(h, [-1, int(math.prod(h.shape[1:]))])
        return tf.cast(tf.nn.relu(self._apply(dense, h)), tf.float32)

    def _stacked_feats(self, t, frames: tf.Tensor, first: tf.Tensor, k: int):
        """Torso features [(T+1)*B, F] and lead shape [T+1, B] from frames [T+K, B, H, W, C]."""
        h, w, kc = t.input_shape
        if kc % k:
            raise ValueError(f"obs[{t.key!r}] is stacked {k} deep, but the network's input has {kc} channels.")
        frame_shape = (h, w, kc // k)
        if frames.shape.rank != 5 or not frames.shape[2:].is_compatible_with(frame_shape):
            raise ValueError(
                f"obs[{t.key!r}] must hold single frames [T+{k}, B, {', '.join(map(str, frame_shape))}] "
                f"(frame_stack={k}), got {frames.shape.as_list() if frames.shape.rank is not None else 'unknown rank'}."
            )
        b = tf.shape(frames)[1]
        src = stack_sources(first, k)  # [T+1, B, K] time indices into frames
        rows = tf.reshape(src * b + tf.range(b)[None, :, None], [-1, k])
        folded = tf.reshape(frames, [-1, *frame_shape])  # [(T+K)*B, H, W, C]
        return self._stacked_torso(t, folded, rows, k), tf.shape(first)

    def _stacked_torso(self, t, frames: tf.Tensor, rows: tf.Tensor, k: int) -> tf.Tensor:
        """The torso on frame stacks that are never built.

        frames: [N, H, W, C] single frames; rows: [M, K] int, the frames (rows of
        ``frames``) that make up each of M stacked observations, oldest first. Returns
        [M, output_size], what :meth:`_torso` gives on the stacked [M, H, W, C*K] input.

        A convolution is linear in its input channels, so the first convolution of a stack
        is the sum over the K slots of the frame's convolution with that slot's slice of the
        kernel. Each frame is convolved once (with all K slices at once) and the K partial
        results are gathered and added; the [M, H, W, C*K] stack (42 MB for a batch of 32
        unrolls of 21 84x84x3 frames, K=3) is never materialised. Same arithmetic as the
        stacked convolution, summed in a different order. MLP torsos gather the stack.
        """
        x = self._scaled(t, frames)
        if t.kind == "mlp":
            return self._torso(t, tf.concat([tf.gather(x, rows[:, j]) for j in range(k)], axis=-1))
        conv = self._first_conv(t)
        kh, kw, kc, filters = conv.kernel.shape
        c = kc // k
        # [kh, kw, K*C, F] (slot-major input channels) -> [kh, kw, C, K*F] (slot-major outputs)
        kernel = tf.reshape(tf.transpose(tf.reshape(self._cast(conv.kernel), [kh, kw, k, c, filters]), [0, 1, 3, 2, 4]),
                            [kh, kw, c, k * filters])
        strides = list(conv.strides)
        padding = conv.padding.upper()

        def first_conv(_):
            y = tf.nn.conv2d(x, kernel, strides=strides, padding=padding)  # [N, h, w, K*F]
            slots = tf.split(y, k, axis=-1)
            return tf.add_n([tf.gather(slots[j], rows[:, j]) for j in range(k)]) + self._cast(conv.bias)

        return self._torso(t, x, first_conv)

    def unroll(
        self,
        obs: Mapping[str, Any],
        first: Any,
        initial_state: Mapping[str, Any],
        frame_stack: Optional[Mapping[str, int]] = None,
    ) -> Tuple[Dict[str, tf.Tensor], tf.Tensor]:
        """Runs the network over a batch of unrolls.

        Args:
          obs: ``{key: [T+1, B, *obs_shape]}`` (uint8 pixels are converted here); for a key
            in ``frame_stack``, the single frames ``[T+K, B, H, W, C]`` instead: the K-1
            frames before step 0 (the unroll's frame prefix), then the T+1 steps' newest
            frames. The network stacks them by :mod:`impala_rep.framestack`'s rule (the
            frames of the current episode, the first repeated at its start), which needs
            ``first``, and the stack itself is never built (:meth:`_stacked_torso`).
          first: [T+1, B] bool, true where a step starts an episode (resets the LSTM).
          initial_state: ``{name: [B, ...]}`` core state before step 0 (``{}`` without LSTM).
          frame_stack: ``{key: K}`` for keys given as single frames (K > 1).

        Returns:
          ``(policy_params {name: [T+1, B, *param_shape]}, values [T+1, B])``.
        """
        missing = [t.key for t in self.plan.torsos if t.key not in obs]
        if missing:
            raise ValueError(f"obs lacks keys {missing}; the network needs {[t.key for t in self.plan.torsos]}.")
        frame_stack = {key: int(k) for key, k in (frame_stack or {}).items() if int(k) > 1}
        unknown = sorted(set(frame_stack) - {t.key for t in self.plan.torsos})
        if unknown:
            raise ValueError(f"frame_stack names {unknown}, which the network has no torso for.")
        first = tf.cast(tf.convert_to_tensor(first), tf.bool)
        if (self._lstm is not None or frame_stack) and first.shape.rank != 2:  # both read it per step
            raise ValueError(f"first must have shape [T+1, B], got {first.shape.as_list()}.")
        feats = []
        lead = None
        for t in self.plan.torsos:
            x = tf.convert_to_tensor(obs[t.key])
            if t.key in frame_stack:
                feat, lead = self._stacked_feats(t, x, first, frame_stack[t.key])
                feats.append(feat)
                continue
            expected_rank = 2 + len(t.input_shape)
            if x.shape.rank != expected_rank or not x.shape[2:].is_compatible_with(t.input_shape):
                raise ValueError(
                    f"obs[{t.key!r}] must have shape [T+1, B, {', '.join(map(str, t.input_shape))}], "
                    f"got {x.shape.as_list() if x.shape.rank is not None else 'unknown rank'}."
                )
            if lead is None:
                lead = tf.shape(x)[:2]
            folded = tf.reshape(x, tf.concat([[-1], t.input_shape], axis=0))  # [(T+1)*B, ...]
            feats.append(self._torso(t, self._scaled(t, folded)))
        h = feats[0] if len(feats) == 1 else tf.concat(feats, axis=-1)
        n_feat = h.shape[-1]
        h = tf.reshape(h, tf.concat([lead, [n_feat]], axis=0))  # [T+1, B, F]
        if self._lstm is not None:
            for key in ("h", "c"):
                if key not in initial_state:
                    raise ValueError(f"initial_state lacks {key!r}; an LSTM network needs 'h' and 'c', each [B, {self.plan.lstm_size}].")
            h0 = tf.cast(initial_state["h"], tf.float32)
            c0 = tf.cast(initial_state["c"], tf.float32)
            cell = self._lstm

            def step(carry, inputs):
                _, h_prev, c_prev = carry
                x_t, first_t = inputs
                keep = tf.cast(tf.logical_not(first_t), tf.float32)[:, None]
                out, (h_new, c_new) = cell(x_t, [h_prev * keep, c_prev * keep])
                return out, h_new, c_new

            outputs, _, _ = tf.scan(step, (h, first), initializer=(tf.zeros_like(h0), h0, c0))
            h = outputs  # [T+1, B, H]
        n_in = h.shape[-1]
        flat = tf.reshape(h, [-1, n_in])
        raw = {}
        for pname, shape in self.plan.head_shapes.items():
            out = self._policy_heads[pname](flat)
            raw[pname] = tf.reshape(out, tf.concat([lead, list(shape)], axis=0))
        policy_params = self.policy.params_from_head_tf(raw)
        values = tf.reshape(self._value_head(self._value_input(flat)), lead)
        if self.popart:
            mu, sigma = self.value_stats()
            values = values * sigma + mu
        return policy_params, values

    def _value_input(self, flat: tf.Tensor) -> tf.Tensor:
        """The shared features as the value head sees them: the same values, with the
        gradient that flows back through them scaled by ``value_torso_scale``."""
        k = self.value_torso_scale
        if k == 1.0:
            return flat
        held = tf.stop_gradient(flat)
        return held if k == 0.0 else held + k * (flat - held)


def stack_sources(first: Any, k: int) -> tf.Tensor:
    """Where each slot of each frame stack comes from: [T+1, B, K] int32.

    ``first`` [T+1, B] bool marks episode starts. For step t and slot j (oldest first), the
    result indexes the time axis of the unroll's [T+K] single frames (K-1 prefix frames,
    then the T+1 steps): frame ``t + j``, or the episode's first frame where that lies
    before the episode's start, i.e. ``max(t + j, s + K - 1)`` with s the latest start at
    or before t. The same rule as :class:`impala_rep.framestack.FrameStacker` and
    :func:`~impala_rep.framestack.rebuild_stack`.
    """
    first = tf.cast(first, tf.bool)
    steps = tf.shape(first)[0]
    t = tf.range(steps)
    starts = tf.where(first, t[:, None], -k)  # [T+1, B]
    earlier = t[None, :] <= t[:, None]  # [T+1 (t), T+1 (t')]: t' <= t
    latest = tf.reduce_max(tf.where(earlier[:, :, None], starts[None], -k), axis=1)  # [T+1, B]
    return tf.maximum(t[:, None, None] + tf.range(k), latest[:, :, None] + k - 1)
