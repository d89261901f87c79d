"""The replicated learner step: V-trace loss, all-reduced gradients, clipped RMSProp.

Shape letters: ``T`` transitions per unroll (an unroll holds ``T+1`` steps), ``B`` the
*global* batch (unrolls per learner step), ``N`` replicas; each replica gets ``B / N``.

One :class:`LearnerStep` owns the network, a ``tf_keras.optimizers.RMSprop`` (both created
in the replicator's scope, so their variables are mirrored on every replica), the step
counter (the optimizer's ``iterations``) and a compiled ``tf.function`` with a fixed input
signature (from the batch spec) that, per call:

1. splits the global ``[T+1, B, ...]`` batch (and ``[B, ...]`` core states) along ``B``
   (:meth:`Replicator.distribute`);
2. on every replica unrolls the network over its ``B / N`` unrolls and computes the loss
   and its gradients (``loss_fn``; the loss is a *sum* over T and B, so per-replica losses
   add up to the global loss);
3. all-reduces the gradients with a sum (so they equal the one-replica gradient of the
   global batch), clips them by global norm and applies them with RMSProp
   (:class:`~impala_rep.replicator.ReplicatedOptimizer`);
4. returns metrics reduced over replicas (sums; ``<name>_sum`` metrics also get a
   ``<name>_mean`` = sum / num_transitions).

``jit_compile=True`` compiles each replica's forward and backward pass (network unroll,
loss, gradients: nearly all of the work) with XLA. That part has static shapes and no host
round-trips, which is what a TPU needs; on a TPU, ``TPUStrategy`` compiles the whole step,
collectives and optimizer included. On CPU/GPU ``MirroredStrategy`` the all-reduce and the
optimizer update run outside the XLA cluster (cross-device collectives are not XLA ops there).

Parameters for actors: :meth:`LearnerStep.get_params` returns ``(version, {name:
np.ndarray})`` read from the first replica's copy of the mirrored variables. Reads and the
update are serialised by a lock, so a snapshot is never torn (never half an update), and
the read is a device-to-host copy of the weights (well under a millisecond for the shallow
network on CPU): the training loop calls it between steps, on the learner thread, every
few steps, and publishes the result to the parameter store; actors never touch the
variables, so serving them never stalls the step.

Usage::

    replicator = make_replicator("cpu", num_replicas=2)
    learner = LearnerStep.from_config(replicator, NetworkConfig(), obs_specs, env_action_spec,
                                      unroll_length=20, batch_size=32)
    ckpt = tf.train.Checkpoint(**learner.checkpoint_objects())
    for batch in batches:                       # {"frames/pixels": [23, 32, 84, 84, 3], ...}
        metrics = learner.train(batch)          # {"loss": ..., "grad_norm": ..., ...}
        version, params = learner.get_params()  # publish to actors
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np

from impala_rep.config import RMSPROP_EPSILON, RMSPROP_EPSILON_SCALES
from impala_rep.framestack import ALIGNMENT
from impala_rep.specs import STEP_FIRST, ArraySpec

__all__ = [
    "LearnerStep",
    "LossFn",
    "OptimizerConfig",
    "make_batch_spec",
    "shared_tensor",
]

# Below this, a copy costs less than the DLPack hand-off.
_SHARE_MIN_BYTES = 1 << 20


def shared_tensor(value: Any) -> Any:
    """A TensorFlow tensor on a NumPy array's memory (no copy) when TensorFlow can use it in place.

    That takes a writeable, C-contiguous array of at least 1 MiB whose data starts on a
    64-byte boundary (``impala_rep.framestack.aligned_empty``; TensorFlow aborts the process
    on a misaligned tensor, so this is checked first). Anything else is returned unchanged
    and copied by the step's call as before. Measured: ``tf.constant`` on a 42 MB
    84x84x9 batch takes 37-43 ms (5-6% of a one-thread learner step), DLPack under 0.1 ms.
    The caller must not write to the array while the step runs; the learner's batches are
    fresh arrays.
    """
    if not (isinstance(value, np.ndarray) and value.nbytes >= _SHARE_MIN_BYTES and value.flags.c_contiguous
            and value.flags.writeable and value.ctypes.data % ALIGNMENT == 0):
        return value
    import tensorflow as tf

    try:
        return tf.experimental.dlpack.from_dlpack(value.__dlpack__())
    except (BufferError, TypeError, ValueError, tf.errors.OpError):  # e.g. a dtype DLPack does not carry
        return value

# loss_fn(policy, policy_params {name: [T+1, B/N, ...]}, values [T+1, B/N], batch) ->
#   (scalar loss summed over the replica's batch, {name: scalar metric summed likewise})
LossFn = Callable[[Any, Mapping[str, Any], Any, Mapping[str, Any]], Tuple[Any, Dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """RMSProp with global-norm gradient clipping (IMPALA's Atari settings by default).

    Attributes:
      learning_rate: initial learning rate.
      decay: RMSProp's moving-average decay of squared gradients (Keras ``rho``).
      momentum: RMSProp momentum.
      epsilon: added to the mean square *inside* the square root, as in TF1's RMSProp that
        IMPALA used (``tf_keras.optimizers.RMSprop`` does the same). A weight whose gradient's
        mean square is well below it takes SGD-like steps of ``lr * g / sqrt(epsilon)``.
      epsilon_scale: ``"fixed"`` (default): ``epsilon`` at every update; ``"sigma"``:
        ``epsilon / sigma**2`` with PopArt's sigma before each update (needs a loss with
        ``popart``). PopArt's loss is on the scale of the value targets over sigma, so its
        gradients' mean squares fall as ``1/sigma**2``; a fixed epsilon then governs ever more
        weights as sigma grows, and this keeps its weight where it was at sigma 1.
      clip_norm: global-norm clipping threshold of the all-reduced gradients, or ``None``.
      anneal_steps: anneal the learning rate linearly to 0 over this many learner steps
        (then keep it at 0), or ``None`` for a constant rate.
      anneal_seconds: anneal it linearly to 0 over this many seconds of training as well
        (``LearnerStep.train_seconds``, which the trainer advances); with both, the rate
        follows whichever of the two is further along. ``None``: steps only.
      warmup_steps: ramp the learning rate up linearly over the first this many learner
        steps (0: none). RMSProp's mean square starts at 0, so without a warm-up its first
        updates are up to ``1/sqrt(1 - decay)`` (10x at decay 0.99) larger than later ones.
    """

    learning_rate: float = 6e-4
    decay: float = 0.99
    momentum: float = 0.0
    epsilon: float = RMSPROP_EPSILON
    epsilon_scale: str = "fixed"
    clip_norm: Optional[float] = 40.0
    anneal_steps: Optional[int] = None
    warmup_steps: int = 0
    anneal_seconds: Optional[float] = None

    def __post_init__(self):
        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"OptimizerConfig.{name} must be a finite number, got {value!r}.")
            return float(value)

        if not number("learning_rate") > 0:
            raise ValueError(f"OptimizerConfig.learning_rate must be positive, got {self.learning_rate}.")
        if not 0.0 <= number("decay") < 1.0:
            raise ValueError(f"OptimizerConfig.decay must lie in [0, 1), got {self.decay}.")
        if not 0.0 <= number("momentum") < 1.0:
            raise ValueError(f"OptimizerConfig.momentum must lie in [0, 1), got {self.momentum}.")
        if not number("epsilon") > 0:
            raise ValueError(f"OptimizerConfig.epsilon must be positive, got {self.epsilon}.")
        if self.epsilon_scale not in RMSPROP_EPSILON_SCALES:
            raise ValueError(f"OptimizerConfig.epsilon_scale must be one of {', '.join(RMSPROP_EPSILON_SCALES)}, "
                             f"got {self.epsilon_scale!r}.")
        if self.clip_norm is not None and not number("clip_norm") > 0:
            raise ValueError(
                f"OptimizerConfig.clip_norm must be positive, or None for no clipping; got {self.clip_norm}."
            )
        if self.anneal_steps is not None:
            if isinstance(self.anneal_steps, bool) or not isinstance(self.anneal_steps, int):
                raise TypeError(
                    f"OptimizerConfig.anneal_steps must be an int or None, got {self.anneal_steps!r}."
                )
            if self.anneal_steps < 1:
                raise ValueError(
                    f"OptimizerConfig.anneal_steps must be at least 1, or None for a constant "
                    f"learning rate; got {self.anneal_steps}."
                )
        if self.anneal_seconds is not None and not number("anneal_seconds") > 0:
            raise ValueError(
                f"OptimizerConfig.anneal_seconds must be positive, or None to anneal by steps only; "
                f"got {self.anneal_seconds}."
            )

        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(
                f"OptimizerConfig.warmup_steps must be a whole number of learner steps (0 for none), "
                f"got {self.warmup_steps!r}."
            )

    def learning_rate_schedule(self, train_seconds=None):
        """The learning rate as a float, or a ``tf_keras`` schedule (warm-up, then linear to 0).

        ``train_seconds``: the variable of seconds trained that ``anneal_seconds`` anneals over
        (``LearnerStep.train_seconds``); needed when ``anneal_seconds`` is set.
        """
        if self.anneal_seconds is not None and train_seconds is None:
            raise ValueError("OptimizerConfig.anneal_seconds needs the train_seconds variable to anneal over.")
        if self.anneal_steps is None and self.anneal_seconds is None and not self.warmup_steps:
            return float(self.learning_rate)
        return _make_schedule(float(self.learning_rate), int(self.warmup_steps), self.anneal_steps,
                              self.anneal_seconds, train_seconds)

    def make_optimizer(self, train_seconds=None):
        """A ``tf_keras.optimizers.RMSprop`` (create it inside the replicator's scope)."""
        import tf_keras

        return tf_keras.optimizers.RMSprop(
            learning_rate=self.learning_rate_schedule(train_seconds),
            rho=float(self.decay),
            momentum=float(self.momentum),
            epsilon=float(self.epsilon),
            centered=False,
        )


def _make_schedule(learning_rate: float, warmup_steps: int, anneal_steps: Optional[int],
                   anneal_seconds: Optional[float] = None, train_seconds=None):
    """lr x min(1, (step+1)/warmup) x max(0, 1 - max(step/anneal, seconds/anneal_seconds)) as a
    ``tf_keras`` schedule of the optimizer's step count (0-based) and the ``train_seconds``
    variable; a term is left out when its steps are 0 / ``None``."""
    import tensorflow as tf
    import tf_keras

    class WarmupLinearDecay(tf_keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            step = tf.cast(step, tf.float32)
            lr = tf.constant(learning_rate, tf.float32)
            if warmup_steps:
                lr *= tf.minimum(1.0, (step + 1.0) / float(warmup_steps))
            done = []  # the share of each budget used
            if anneal_steps is not None:
                done.append(step / float(anneal_steps))
            if anneal_seconds is not None:
                done.append(tf.cast(train_seconds, tf.float32) / float(anneal_seconds))
            if done:
                lr *= tf.maximum(0.0, 1.0 - tf.reduce_max(tf.stack(done)))
            return lr

        def get_config(self):
            return {"learning_rate": learning_rate, "warmup_steps": warmup_steps, "anneal_steps": anneal_steps,
                    "anneal_seconds": anneal_seconds}

    return WarmupLinearDecay()


def make_batch_spec(
    observation_specs: Mapping[str, ArraySpec],
    action_spec: ArraySpec,
    unroll_length: int,
    batch_size: int,
    core_state: Optional[Mapping[str, ArraySpec]] = None,
    frame_stack: Optional[Mapping[str, int]] = None,
) -> Dict[str, ArraySpec]:
    """The spec of a learner batch, as ``learner.batcher`` produces it (global ``B``).

    Args:
      observation_specs: per-step observation specs as the network sees them (stacked).
      action_spec: the spec of the action the *policy* emits (``policy.action_spec``).
      unroll_length: T.
      batch_size: B, the global batch.
      core_state: name -> per-unroll recurrent state spec (without the batch dimension).
      frame_stack: observation key -> K for keys stacked K deep: the batch carries their
        single frames, ``frames/<key>`` ``[T+K, B, H, W, C]`` (the K-1 frames before step 0,
        then the T+1 steps), and the network stacks them (``TFNetwork.unroll``).

    Keys: ``observation/<key>`` ``[T+1, B, *obs]`` (or ``frames/<key>``), ``step_type`` (uint8), ``reward``,
    ``discount``, ``behaviour_log_prob`` (float32) ``[T+1, B]``, ``action`` ``[T+1, B,
    *action]``, ``core_state/<name>`` ``[B, *state]``. (``policy_version`` is host-side
    bookkeeping and not part of the step's input.)
    """
    for name, value in (("unroll_length", unroll_length), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    steps, b = unroll_length + 1, batch_size
    frame_stack = {key: int(k) for key, k in (frame_stack or {}).items() if int(k) > 1}
    unknown = sorted(set(frame_stack) - set(observation_specs))
    if unknown:
        raise ValueError(f"frame_stack names {unknown}, which are not observation keys {sorted(observation_specs)}.")
    spec: Dict[str, ArraySpec] = {}
    for key, obs in observation_specs.items():
        k = frame_stack.get(key)
        if k is None:
            spec[f"observation/{key}"] = obs.with_leading(steps, b, name=f"observation/{key}")
            continue
        if len(obs.shape) != 3 or obs.shape[-1] % k:
            raise ValueError(
                f"observation {key!r} of shape {obs.shape} cannot be {k} stacked frames; a stacked "
                "observation is [H, W, C*K]."
            )
        h, w, kc = obs.shape
        frame = dataclasses.replace(obs, shape=(h, w, kc // k))
        spec[f"frames/{key}"] = frame.with_leading(steps + k - 1, b, name=f"frames/{key}")
    spec["step_type"] = ArraySpec("step_type", (steps, b), "uint8", minimum=0, maximum=2)
    spec["reward"] = ArraySpec("reward", (steps, b), "float32")
    spec["discount"] = ArraySpec("discount", (steps, b), "float32", minimum=0.0, maximum=1.0)
    spec["action"] = action_spec.with_leading(steps, b, name="action")
    spec["behaviour_log_prob"] = ArraySpec("behaviour_log_prob", (steps, b), "float32")
    for name, state in (core_state or {}).items():
        spec[f"core_state/{name}"] = state.with_leading(b, name=f"core_state/{name}")
    return spec


def _impala_loss_fn(loss_config, value_scale: Optional[Callable[[], Any]] = None) -> LossFn:
    """The default loss; ``value_scale`` returns PopArt's sigma (``LossConfig.popart``)."""
    from impala_rep.losses import impala_loss

    def loss_fn(policy, policy_params, values, batch):
        scale = value_scale() if value_scale is not None else None
        return impala_loss(policy, policy_params, values, batch, loss_config, value_scale=scale)

    return loss_fn


class LearnerStep:
    """The replicated, compiled learner update (see the module docstring).

    Args:
      replicator: an :class:`~impala_rep.replicator.Replicator`.
      make_network: called once inside the replicator's scope; returns an object with
        ``unroll(obs {key: [T+1, B, ...]}, first [T+1, B] bool, initial_state {name: [B,
        ...]}) -> (policy_params {name: [T+1, B, ...]}, values [T+1, B])`` and
        ``trainable_variables`` (created at construction), and optionally ``get_params()``
        (e.g. :class:`impala_rep.networks.tf_backend.TFNetwork`). With ``frames/<key>`` in
        the batch spec, ``unroll`` also gets ``frame_stack={key: K}`` and those keys' frames.
      policy: the :class:`~impala_rep.distributions.Policy` passed to ``loss_fn``.
      batch_spec: the global batch spec (:func:`make_batch_spec`); fixes the input signature.
      loss_fn: a :data:`LossFn`; default :func:`impala_rep.losses.impala_loss` with
        ``loss_config``. Its loss and metrics must be sums over the replica's batch.
      loss_config: a :class:`impala_rep.losses.LossConfig` for the default loss.
      optimizer_config: an :class:`OptimizerConfig`.
      jit_compile: compile each replica's forward/backward pass with XLA.
    """

    def __init__(
        self,
        replicator,
        make_network: Callable[[], Any],
        policy: Any,
        batch_spec: Mapping[str, ArraySpec],
        loss_fn: Optional[LossFn] = None,
        loss_config: Any = None,
        optimizer_config: OptimizerConfig = OptimizerConfig(),
        jit_compile: bool = False,
    ):
        import tensorflow as tf

        from impala_rep.replicator import Replicator

        if not isinstance(replicator, Replicator):
            raise TypeError(f"replicator must be a Replicator (make_replicator), got {type(replicator).__name__}.")
        if not isinstance(optimizer_config, OptimizerConfig):
            raise TypeError(f"optimizer_config must be an OptimizerConfig, got {type(optimizer_config).__name__}.")
        if loss_fn is not None and loss_config is not None:
            raise ValueError("give loss_fn or loss_config, not both (loss_config configures the default IMPALA loss).")
        # PopArt's step size (0: none): the network keeps the value statistics, and _train
        # moves them after each update.
        self._popart = float(getattr(loss_config, "popart", 0.0) or 0.0)
        if loss_fn is None:
            from impala_rep.losses import LossConfig

            loss_fn = _impala_loss_fn(loss_config if loss_config is not None else LossConfig(),
                                      (lambda: self.network.value_stats()[1]) if self._popart else None)
        self._check_batch_spec(batch_spec, replicator.num_replicas, getattr(replicator, "kind", None))
        # RMSProp's epsilon over PopArt's sigma squared, set before each update (_train).
        self._epsilon_over_sigma = optimizer_config.epsilon_scale == "sigma"
        if self._epsilon_over_sigma and not self._popart:
            raise ValueError(
                "optimizer_config.epsilon_scale is 'sigma', but the loss keeps no PopArt sigma to divide "
                "epsilon by: give loss_config a popart step size (e.g. LossConfig(popart=3e-4); --popart), or "
                "use epsilon_scale 'fixed'."
            )

        self.replicator = replicator
        self.policy = policy
        self.batch_spec = dict(batch_spec)
        self.optimizer_config = optimizer_config
        self.jit_compile = bool(jit_compile)
        self._loss_fn = loss_fn
        self._obs_keys = sorted(k for k in batch_spec if k.startswith(("observation/", "frames/")))
        steps = batch_spec["reward"].shape[0]
        # Keys given as single frames: K = (T+K) - (T+1) + 1.
        self.frame_stack = {k.split("/", 1)[1]: spec.shape[0] - steps + 1
                            for k, spec in batch_spec.items() if k.startswith("frames/")}
        self._state_keys = sorted(k.split("/", 1)[1] for k in batch_spec if k.startswith("core_state/"))
        self._lock = threading.Lock()

        with replicator.scope():
            self.network = make_network()
            torso_scale = getattr(loss_config, "baseline_torso_scale", 1.0)
            applied = getattr(self.network, "value_torso_scale", 1.0)
            if applied != torso_scale:
                raise ValueError(
                    f"loss_config.baseline_torso_scale is {torso_scale}, but the network applies "
                    f"{applied}: the network scales the value head's gradient "
                    "into its shared layers, so build it with the same value_torso_scale (TFNetwork's), or leave "
                    "baseline_torso_scale at 1 for a network without one."
                )
            if bool(self._popart) != bool(getattr(self.network, "popart", False)):
                raise ValueError(
                    f"loss_config.popart is {self._popart}, but the network was built "
                    f"{'without' if self._popart else 'with'} popart: PopArt needs both, a network that keeps "
                    "the value statistics (TFNetwork(popart=True)) and a loss that normalises the baseline "
                    "(LossConfig(popart=step size)); build them together, or neither."
                )
            variables = list(self.network.trainable_variables)
            if not variables:
                raise ValueError(
                    "the network has no trainable variables after construction; create its "
                    "variables in __init__ (build it) so they are mirrored on every replica."
                )
            # Seconds trained, as the caller counts them (set_train_seconds); checkpointed, and
            # what OptimizerConfig.anneal_seconds anneals over.
            self.train_seconds = tf.Variable(0.0, dtype=tf.float32, trainable=False, name="train_seconds")
            self.optimizer = optimizer_config.make_optimizer(self.train_seconds)
            self.rmsprop_epsilon = None
            if self._epsilon_over_sigma:
                # The optimizer adds ``self.epsilon`` to each mean square in its update, so a
                # variable there is read at every update. It is derived from the checkpointed
                # sigma before each update, so it stays out of the checkpoint: a run's
                # checkpoints are the same with either scale.
                self.rmsprop_epsilon = tf.Variable(float(optimizer_config.epsilon), dtype=tf.float32,
                                                   trainable=False, name="rmsprop_epsilon")
                self.optimizer._self_setattr_tracking = False
                try:
                    self.optimizer.epsilon = self.rmsprop_epsilon
                finally:
                    self.optimizer._self_setattr_tracking = True
            self.optimizer.build(variables)
        self._variables = variables
        self._replicated_optimizer = replicator.wrap_optimizer(self.optimizer, clip_norm=optimizer_config.clip_norm)
        self._lr_schedule = optimizer_config.learning_rate_schedule(self.train_seconds)

        self._grad_fn = tf.function(self._loss_and_grads, jit_compile=self.jit_compile, autograph=False)
        # get_params reads every parameter (named as the network's get_params names them) and
        # then the step counter in one call, instead of one eager read per distributed
        # variable: on 2 CPU replicas the shallow network's 12 reads took 7.2-9.2 ms and the
        # one call 3.8-4.5 ms, copies included (the learner publishes after every step, on
        # its critical path). A network with a get_params of its own and no named_variables
        # is asked instead (None).
        named = getattr(self.network, "named_variables", None)
        if named is None and hasattr(self.network, "get_params"):
            self._params_reader = None
        else:
            named = dict(named) if named is not None else {v.name: v for v in variables}
            self._param_reads = list(named.values()) + [self.optimizer.iterations]
            self._params_reader = (list(named), tf.function(self._read_params, autograph=False))
            # A network that exports its parameters other than as its variables (TFNetwork's
            # param_tensors: PopArt's statistics folded into the value head) is read that way.
            self._param_tensors = getattr(self.network, "param_tensors", None)
        signature = {
            key: tf.TensorSpec(spec.shape, tf.as_dtype(spec.dtype), name=key.replace("/", "_"))
            for key, spec in self.batch_spec.items()
        }
        self.train_fn = tf.function(self._train, input_signature=[signature], autograph=False)
        # train_and_read's step: the update and then the read of every parameter in one call
        # (traced on first use only).
        self._train_read_fn = None
        if self._params_reader is not None:
            self._train_read_fn = tf.function(self._train_and_read, input_signature=[signature], autograph=False)

    # -- construction helpers ----------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        replicator,
        network_config,
        observation_specs: Mapping[str, ArraySpec],
        env_action_spec: ArraySpec,
        unroll_length: int,
        batch_size: int,
        loss_config: Any = None,
        optimizer_config: OptimizerConfig = OptimizerConfig(),
        jit_compile: bool = False,
        frame_stack: Optional[Mapping[str, int]] = None,
        compute_dtype: str = "float32",
    ) -> "LearnerStep":
        """Builds the IMPALA learner from a ``NetworkConfig`` and the (stacked) observation specs.

        ``frame_stack`` (``{key: K}``): keys whose batches carry single frames
        (:func:`make_batch_spec`), as ``learner.batcher`` produces them. ``compute_dtype``:
        ``"float32"`` or ``"bfloat16"`` (mixed precision: the network's torsos compute in
        bfloat16, variables and gradients stay float32; :class:`TFNetwork`).
        """
        from impala_rep.distributions import make_policy
        from impala_rep.networks.tf_backend import TFNetwork

        from impala_rep.networks.tf_backend import COMPUTE_DTYPES

        if compute_dtype not in COMPUTE_DTYPES:  # before any variable is built
            raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {compute_dtype!r}.")
        policy = make_policy(env_action_spec, network_config)

        torso_scale = getattr(loss_config, "baseline_torso_scale", 1.0)
        popart = bool(getattr(loss_config, "popart", 0.0))

        def make_network():
            return TFNetwork(network_config, observation_specs, env_action_spec, compute_dtype=compute_dtype,
                             value_torso_scale=torso_scale, popart=popart)

        core_state = None
        lstm = getattr(network_config, "lstm_size", None)
        if lstm:
            core_state = {
                "h": ArraySpec("h", (lstm,), "float32"),
                "c": ArraySpec("c", (lstm,), "float32"),
            }
        batch_spec = make_batch_spec(observation_specs, policy.action_spec, unroll_length, batch_size, core_state,
                                     frame_stack=frame_stack)
        return cls(
            replicator,
            make_network,
            policy,
            batch_spec,
            loss_config=loss_config,
            optimizer_config=optimizer_config,
            jit_compile=jit_compile,
        )

    @staticmethod
    def _check_batch_spec(batch_spec: Mapping[str, ArraySpec], num_replicas: int, kind: Optional[str] = None) -> None:
        required = ("step_type", "reward", "discount", "action", "behaviour_log_prob")
        missing = [k for k in required if k not in batch_spec]
        if missing or not any(k.startswith(("observation/", "frames/")) for k in batch_spec):
            raise ValueError(
                f"batch_spec lacks {missing or ['observation/<key>']}; build it with make_batch_spec."
            )
        b = batch_spec["reward"].shape[1]
        if b % num_replicas:
            raise ValueError(
                f"the batch size {b} is not divisible by the {num_replicas} replicas: use a batch "
                f"size that is a multiple of {num_replicas} (e.g. {max(num_replicas, b // num_replicas * num_replicas)})"
                + (": a TPU runs one replica per core." if kind == "tpu" else " or change num_replicas.")
            )

    # -- the step ------------------------------------------------------------------------

    def _loss_and_grads(self, batch):
        """One replica's forward and backward pass on its [T+1, B/N] shard."""
        import tensorflow as tf

        obs = {key.split("/", 1)[1]: batch[key] for key in self._obs_keys}
        first = tf.equal(tf.cast(batch["step_type"], tf.int32), STEP_FIRST)
        state = {key: batch[f"core_state/{key}"] for key in self._state_keys}
        # Only networks that take single frames get the argument (custom ones need not).
        stacking = {"frame_stack": self.frame_stack} if self.frame_stack else {}
        with tf.GradientTape() as tape:
            policy_params, values = self.network.unroll(obs, first, state, **stacking)
            loss, metrics = self._loss_fn(self.policy, policy_params, values, batch)
        grads = tape.gradient(loss, self._variables)
        metrics = dict(metrics)
        metrics.setdefault("loss", loss)
        return grads, metrics

    def _replica_step(self, batch):
        import tensorflow as tf

        grads, metrics = self._grad_fn(batch)
        step = tf.cast(self.optimizer.iterations, tf.float32)
        grad_norm = self._replicated_optimizer.apply_gradients(zip(grads, self._variables))
        metrics = {k: tf.cast(v, tf.float32) for k, v in metrics.items()}
        # Identical on every replica; divided by N here so that the SUM reduction below
        # returns them unchanged.
        n = float(self.replicator.num_replicas)
        lr = self._lr_schedule(step) if callable(self._lr_schedule) else tf.constant(self._lr_schedule)
        metrics["grad_norm"] = grad_norm / n
        metrics["learning_rate"] = tf.cast(lr, tf.float32) / n
        return metrics

    def _train(self, batch):
        import tensorflow as tf

        # B is axis 1 of [T+1, B, ...] entries and axis 0 of recurrent states [B, ...].
        axes = {key: 0 if key.startswith("core_state/") else 1 for key in batch}
        epsilon = None
        if self._epsilon_over_sigma:  # before the update that reads it (program order)
            sigma = self.network.value_stats()[1]
            epsilon = self.rmsprop_epsilon.assign(float(self.optimizer_config.epsilon) / tf.square(sigma))
        per_replica = self.replicator.run(self._replica_step, (self.replicator.distribute(batch, axis=axes),))
        metrics = self.replicator.reduce("sum", per_replica)
        if "num_transitions" in metrics:
            count = tf.maximum(metrics["num_transitions"], 1.0)
            for key in list(metrics):
                if key.endswith("_sum"):
                    metrics[key[: -len("_sum")] + "_mean"] = metrics[key] / count
        if self._popart:  # after the update (the variables' reads and writes keep program order)
            mu, sigma = self.network.update_value_stats(metrics["vs_mean"], metrics["vs_square_mean"], self._popart)
            metrics["popart_mu"], metrics["popart_sigma"] = mu, sigma
        if epsilon is not None:
            metrics["rmsprop_epsilon"] = tf.identity(epsilon)
        metrics["step"] = tf.cast(self.optimizer.iterations, tf.float32)
        return metrics

    def _read_params(self):
        import tensorflow as tf

        if self._param_tensors is not None:
            tensors = self._param_tensors()
            return [tensors[name] for name in self._params_reader[0]] + [tf.identity(self.optimizer.iterations)]
        return [tf.identity(v) for v in self._param_reads]

    def _train_and_read(self, batch):
        metrics = self._train(batch)
        # Automatic control dependencies order these reads after the update above, and a
        # read is an immutable snapshot (a later update copies the variable rather than
        # writing under it), so the values are this step's parameters.
        return metrics, self._read_params()

    def train(self, batch: Mapping[str, Any]) -> Dict[str, float]:
        """One learner step on a global numpy batch ``{key: [T+1, B, ...]}``; returns metrics.

        Keys of the batch spec are required (dtype and shape exact); other keys (e.g.
        ``policy_version``) are ignored. Raises ``ValueError`` naming the first mismatch.
        """
        inputs = self._inputs(batch)
        with self._lock:
            metrics = self.train_fn(inputs)
            return {k: float(v) for k, v in metrics.items()}

    def train_and_read(self, batch: Mapping[str, Any]) -> Tuple[Dict[str, float], Tuple[int, Dict[str, np.ndarray]]]:
        """``train(batch)`` and then ``get_params()``, in one call to the device: ``(metrics, (version, params))``.

        What the training loop publishes after every step. The parameters are the ones this
        step produced, read in the same compiled call as the update (measured on the
        synthetic benchmark, 2 cores: the separate ``get_params`` call took 1.0-1.6% of the
        learner's time, 1.7-2.5 ms a step, against 0.27 ms when the machine is idle: each
        extra call waits for the compute thread and then for the GIL). The arrays are
        read-only views of the step's output (no copy); publishing copies them. Networks
        without ``named_variables`` get the two calls.
        """
        if self._train_read_fn is None:
            metrics = self.train(batch)
            return metrics, self.get_params()
        inputs = self._inputs(batch)
        with self._lock:
            metrics, values = self._train_read_fn(inputs)
            return {k: float(v) for k, v in metrics.items()}, self._snapshot(values, copy=False)

    def _snapshot(self, values, copy: bool) -> Tuple[int, Dict[str, np.ndarray]]:
        """``(version, params)`` from the values the parameter read returned (every variable,
        then the step counter): copies, or read-only views of the read's output."""
        names, _ = self._params_reader
        params = {}
        for name, value in zip(names, values):
            params[name] = np.array(value.numpy(), copy=True) if copy else value.numpy()
            if not copy:
                params[name].setflags(write=False)
        return int(values[-1].numpy()), params

    def _inputs(self, batch: Mapping[str, Any]) -> Dict[str, Any]:
        """The step's inputs from ``batch``, checked against the batch spec (``ValueError`` naming a mismatch)."""
        inputs = {}
        for key, spec in self.batch_spec.items():
            if key not in batch:
                raise ValueError(f"the batch lacks {key!r}; the learner step needs {sorted(self.batch_spec)}.")
            value = batch[key]
            dtype = getattr(value, "dtype", None)
            if dtype is None or np.dtype(getattr(dtype, "as_numpy_dtype", dtype)).name != spec.dtype:
                raise ValueError(
                    f"batch[{key!r}] has dtype {getattr(dtype, 'name', dtype)}, but the learner step "
                    f"expects {spec.dtype}."
                )
            if tuple(value.shape) != tuple(spec.shape):
                raise ValueError(
                    f"batch[{key!r}] has shape {list(value.shape)}, but the learner step expects "
                    f"{list(spec.shape)} ([T+1, B, ...] with the global B the step was built for)."
                )
            inputs[key] = shared_tensor(value)
        return inputs

    # -- parameters and checkpoints ------------------------------------------------------

    @property
    def step(self):
        """The learner step counter (a variable: the optimizer's ``iterations``)."""
        return self.optimizer.iterations

    def get_params(self) -> Tuple[int, Dict[str, np.ndarray]]:
        """``(version, {name: np.ndarray})``: a consistent snapshot of the parameters.

        ``version`` is the number of learner steps applied. Never taken mid-update (the
        update and the read share a lock); see the module docstring for why this does not
        stall training.
        """
        with self._lock:
            if self._params_reader is not None:
                _, read = self._params_reader
                return self._snapshot(read(), copy=True)  # every variable and the step counter in one call
            version = int(self.optimizer.iterations.numpy())
            params = self.network.get_params()
            return version, {k: np.array(v, copy=True) for k, v in params.items()}

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        """Loads network parameters (e.g. from an exported policy) on every replica."""
        with self._lock:
            if hasattr(self.network, "set_params"):
                self.network.set_params(params)
            else:
                by_name = {v.name: v for v in self._variables}
                unknown = sorted(set(params) - set(by_name))
                if unknown:
                    raise ValueError(f"unknown parameter(s) {unknown}; the network has {sorted(by_name)}.")
                for name, value in params.items():
                    by_name[name].assign(value)

    def set_train_seconds(self, seconds: float) -> None:
        """Sets the seconds trained (``train_seconds``), which the learning rate anneals over
        when ``OptimizerConfig.anneal_seconds`` is set; the caller advances it as it trains."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
                or seconds < 0:
            raise ValueError(f"train_seconds must be a finite number of seconds, 0 or more; got {seconds!r}.")
        with self._lock:
            self.train_seconds.assign(float(seconds))

    def restore_configured_learning_rate(self) -> None:
        """After a checkpoint restore: a constant learning rate is an optimizer variable, so
        the restore brought back the rate of the run that wrote it; this puts this run's back
        (a schedule is not state: it follows the restored step counter)."""
        if isinstance(self._lr_schedule, float):
            self.optimizer.learning_rate.assign(self._lr_schedule)

    def checkpoint_objects(self) -> Dict[str, Any]:
        """What to checkpoint: ``tf.train.Checkpoint(**learner.checkpoint_objects())``.

        ``network`` and ``optimizer`` (whose slots and ``iterations`` hold the optimiser
        state and the step counter); ``step`` is the same counter, named for readers;
        ``train_seconds`` the seconds trained.
        """
        return {"network": self.network, "optimizer": self.optimizer, "step": self.optimizer.iterations,
                "train_seconds": self.train_seconds}
