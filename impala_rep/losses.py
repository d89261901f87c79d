"""The IMPALA loss: V-trace policy gradient, baseline and entropy terms (TensorFlow).

TensorFlow is imported inside :func:`impala_loss`; :class:`LossConfig` is TF-free.

Shape letters: ``T`` transitions per unroll (an unroll holds ``T+1`` steps), ``B`` batch.

Inputs follow the unroll layout of :mod:`impala_rep.specs` (time-major, ``[T+1, B, ...]``):
transition ``t -> t+1`` uses observation ``t``, action ``t``, reward ``t+1`` and discount
``t+1``, so ``gamma_t = config.discount * discount[t+1]`` and the bootstrap value is the
value of the last step. Episode ends follow dm_env:

* termination (discount 0 at a LAST step) cuts the bootstrap;
* truncation (a LAST step with discount > 0, e.g. a time limit) bootstraps from V of the
  LAST observation;
* a transition that *starts* at a LAST step (LAST -> FIRST of the next episode) is not a
  real transition: its importance weight is 0, so V-trace neither trains on it nor carries
  a trace across the episode boundary, and its policy-gradient, baseline and entropy
  terms are masked out.

Reductions (IMPALA's): every term is a *sum* over T and B, so the losses of replicas that
each hold part of the batch add up to the loss of the whole batch, and summed (all-reduced)
gradients equal single-replica gradients::

    loss = pg_loss + baseline_cost * baseline_loss + entropy_cost * entropy_loss
    pg_loss       = -sum_{t,b} mask * pg_advantage * log pi(a_t|x_t)
    baseline_loss = 0.5 * sum_{t,b} mask * (v_s - V(x_t))^2
    entropy_loss  = -sum_{t,b} mask * H(pi(.|x_t))

Usage in a learner step::

    policy_params, values = network.unroll(obs, first, initial_state)
    loss, metrics = impala_loss(policy, policy_params, values, batch, LossConfig())
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Dict, Mapping, Optional, Tuple

from impala_rep.specs import STEP_LAST

__all__ = ["LossConfig", "LossTerms", "impala_loss", "loss_terms", "BATCH_KEYS", "POPART_TERMS"]

BATCH_KEYS = ("action", "reward", "discount", "step_type", "behaviour_log_prob")
# The choices of LossConfig.popart_terms: the terms put on the scale of PopArt's sigma besides the
# baseline ("impala" also weighs the baseline by sigma).
POPART_TERMS = ("all", "policy", "baseline", "impala")

LossTerms = collections.namedtuple(
    "LossTerms",
    ["mask", "log_rhos", "target_log_prob", "entropy", "values", "vs", "pg_advantages"],
)
LossTerms.__doc__ = """Per-transition quantities of the loss, each [T, B].

``mask`` is 0 for transitions that start at a LAST step, 1 elsewhere; ``log_rhos`` is
``-inf`` where masked; ``values`` are V(x_t) for t < T; ``vs`` and ``pg_advantages`` are
the (gradient-stopped) V-trace outputs."""


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Loss hyper-parameters (IMPALA's Atari defaults, DESIGN.md).

    Attributes:
      discount: the agent's discount, multiplied by the env discount.
      baseline_cost: weight of the baseline (value) loss.
      entropy_cost: weight of the entropy loss (a bonus for exploration).
      clip_rho_threshold: V-trace's rho-bar, or None for no clipping.
      clip_pg_rho_threshold: rho-bar of the policy-gradient advantages, or None.
      lambda_: V-trace's trace coefficient in [0, 1].
      reward_scale: rewards are multiplied by this before the loss sees them (e.g.
        1/action_repeat keeps DM Control's summed rewards in [0, 1]); returns reported by
        actors stay in the env's own units.
      reward_clip: after scaling, rewards are clipped to [-reward_clip, reward_clip]
        (IMPALA's Atari setting is 1); None leaves them as they are.
      baseline_torso_scale: the share in [0, 1] of the baseline loss's gradient that reaches
        the layers the value head shares with the policy (the torsos and the LSTM); the value
        head itself always gets all of it, and the forward pass is unchanged. 1 is IMPALA's
        shared network. The loss does not apply it: the network does
        (``TFNetwork(value_torso_scale=...)``, which ``LearnerStep.from_config`` passes on).
      popart: PopArt's step size in [0, 1] for the running statistics (mu, sigma) of the value
        targets, or 0 (default) for none. With it the network returns ``sigma * n + mu`` from
        a normalised value head ``n`` (``TFNetwork(popart=True)``), the baseline loss is on
        the normalised scale, ``0.5 * ((v_s - V) / sigma)^2``, and the learner step moves the
        statistics after each update, rescaling the head so its values stay as they were
        (``TFNetwork.update_value_stats``).
      popart_terms: with ``popart``, the terms put on sigma's scale besides the baseline:
        ``"all"`` (default) divides the policy-gradient advantages and the entropy term by
        sigma too, so the whole loss is IMPALA's divided by sigma: every term keeps IMPALA's
        weight, and only the value head's normalised form (and, on the smaller gradient, the
        clipping and RMSProp's epsilon) differ. ``"policy"`` divides the advantages only, as
        PopArt-IMPALA does (Hessel et al. 2019), so the entropy term weighs sigma times as much
        beside the rest. ``"baseline"`` leaves both in reward units, so the baseline weighs
        1/sigma as much beside them (on walker-walk its policy settled early at a return of
        100: docs/RESULTS.md, sixty-seventh session). ``"impala"`` is ``"all"`` with the baseline
        loss multiplied by sigma too: as a function of the network's outputs (the values in
        reward units and the policy's parameters) the loss is then exactly IMPALA's divided by
        sigma, so the layers the value head shares with the policy get IMPALA's gradient divided
        by sigma. Under ``"all"`` the baseline's part of that gradient is IMPALA's divided by
        sigma squared: beside the policy's, it weighs as a baseline cost of
        ``baseline_cost / sigma`` would (docs/RESULTS.md, seventy-third session). Only the value
        head's own layer learns on the normalised scale.
    """

    discount: float = 0.99
    baseline_cost: float = 0.5
    entropy_cost: float = 0.01
    clip_rho_threshold: Optional[float] = 1.0
    clip_pg_rho_threshold: Optional[float] = 1.0
    lambda_: float = 1.0
    reward_scale: float = 1.0
    reward_clip: Optional[float] = None
    baseline_torso_scale: float = 1.0
    popart: float = 0.0
    popart_terms: str = "all"

    def __post_init__(self):
        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"LossConfig.{name} must be a finite number, got {value!r}.")
            return float(value)

        if not 0.0 <= number("discount") <= 1.0:
            raise ValueError(f"LossConfig.discount must lie in [0, 1], got {self.discount}.")
        for name in ("baseline_cost", "entropy_cost"):
            if number(name) < 0.0:
                raise ValueError(f"LossConfig.{name} must be non-negative, got {getattr(self, name)}.")
        for name in ("clip_rho_threshold", "clip_pg_rho_threshold"):
            if getattr(self, name) is not None and not number(name) > 0.0:
                raise ValueError(
                    f"LossConfig.{name} must be positive, or None for no clipping; got {getattr(self, name)}."
                )
        if not 0.0 <= number("lambda_") <= 1.0:
            raise ValueError(f"LossConfig.lambda_ must lie in [0, 1], got {self.lambda_}.")
        if not 0.0 <= number("baseline_torso_scale") <= 1.0:
            raise ValueError(f"LossConfig.baseline_torso_scale must lie in [0, 1], got {self.baseline_torso_scale}.")
        if not 0.0 <= number("popart") <= 1.0:
            raise ValueError(f"LossConfig.popart must lie in [0, 1] (a step size; 0 for none), got {self.popart}.")
        if self.popart_terms not in POPART_TERMS:
            raise ValueError(f"LossConfig.popart_terms must be one of {', '.join(POPART_TERMS)}, got "
                             f"{self.popart_terms!r}.")
        if not number("reward_scale") > 0.0:
            raise ValueError(f"LossConfig.reward_scale must be positive, got {self.reward_scale}.")
        if self.reward_clip is not None and not number("reward_clip") > 0.0:
            raise ValueError(f"LossConfig.reward_clip must be positive, or None for no clipping; got {self.reward_clip}.")


def _shape_str(shape: Any) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape.as_list()) + "]"


def impala_loss(
    policy: Any,
    policy_params: Mapping[str, Any],
    values: Any,
    batch: Mapping[str, Any],
    config: LossConfig,
    value_scale: Any = None,
) -> Tuple[Any, Dict[str, Any]]:
    """The IMPALA loss of one (replica's) batch.

    Computes :func:`loss_terms` and reduces them as in the module docstring.

    Args:
      policy: a :class:`~impala_rep.distributions.Policy`.
      policy_params: the learner's distribution parameters ``{name: [T+1, B, *shape]}``
        (the last step's are unused).
      values: [T+1, B] float32, ``V(x_t)`` for every step (the last is the bootstrap).
      batch: ``action`` [T+1, B, *action_shape], ``reward`` [T+1, B], ``discount``
        [T+1, B], ``step_type`` [T+1, B] (uint8/int), ``behaviour_log_prob`` [T+1, B].
      config: a :class:`LossConfig`.
      value_scale: with ``config.popart``, PopArt's sigma (a scalar): the baseline loss is
        ``0.5 * sum mask * ((v_s - V) / sigma)^2``, and the metrics include ``vs_square_sum``
        for the statistics' update. Required then, and unused otherwise.

    Returns:
      ``(loss, metrics)``: the scalar float32 loss and a dict of float32 scalars. Metrics
      ending in ``_sum`` and the loss terms are sums over the batch; divide by
      ``num_transitions`` (also summed over replicas) for means.

    Raises:
      TypeError/ValueError: a missing batch key, a wrong config type or shapes that do not
        agree (the message names the argument and both shapes).
    """
    import tensorflow as tf

    terms = loss_terms(policy, policy_params, values, batch, config)  # checks the config's type first
    if config.popart and value_scale is None:
        raise ValueError("LossConfig.popart is set, so impala_loss needs value_scale (the network's sigma, "
                         "TFNetwork.value_stats()).")
    with tf.name_scope("impala_loss"):
        mask = terms.mask
        advantages = terms.pg_advantages
        errors = terms.vs - terms.values
        if config.popart:
            sigma = tf.stop_gradient(tf.cast(value_scale, tf.float32))
            errors = errors / sigma
            if config.popart_terms != "baseline":
                advantages = advantages / sigma
        pg_loss = -tf.reduce_sum(mask * advantages * terms.target_log_prob)
        baseline_loss = 0.5 * tf.reduce_sum(mask * tf.square(errors))
        entropy_loss = -tf.reduce_sum(mask * terms.entropy)
        entropy_cost = config.entropy_cost
        if config.popart and config.popart_terms in ("all", "impala"):
            entropy_cost = entropy_cost / sigma
        baseline_cost = config.baseline_cost
        if config.popart and config.popart_terms == "impala":
            baseline_cost = baseline_cost * sigma
        loss = pg_loss + baseline_cost * baseline_loss + entropy_cost * entropy_loss

        log_rhos = tf.stop_gradient(terms.log_rhos)  # -inf where masked
        rhos = tf.exp(log_rhos)  # 0 where masked
        metrics = {
            "loss": loss,
            "pg_loss": pg_loss,
            "baseline_loss": baseline_loss,
            "entropy_loss": entropy_loss,
            "num_transitions": tf.reduce_sum(mask),
            "entropy_sum": tf.reduce_sum(mask * tf.stop_gradient(terms.entropy)),
            "rho_sum": tf.reduce_sum(rhos),
            # How far the data are off-policy: 0 when the actors acted with the learner's
            # parameters (policy lag 0) and the two backends agree.
            "abs_log_rho_sum": tf.reduce_sum(tf.where(mask > 0, tf.abs(log_rhos), tf.zeros_like(mask))),
            "clipped_rho_sum": (
                tf.reduce_sum(mask * tf.cast(rhos > config.clip_rho_threshold, tf.float32))
                if config.clip_rho_threshold is not None
                else tf.zeros([], tf.float32)
            ),
            "value_sum": tf.reduce_sum(mask * tf.stop_gradient(terms.values)),
            "vs_sum": tf.reduce_sum(mask * terms.vs),
            "pg_advantage_sum": tf.reduce_sum(mask * terms.pg_advantages),
        }
        if config.popart:
            metrics["vs_square_sum"] = tf.reduce_sum(mask * tf.square(terms.vs))
        return loss, metrics


def loss_terms(
    policy: Any,
    policy_params: Mapping[str, Any],
    values: Any,
    batch: Mapping[str, Any],
    config: LossConfig,
) -> LossTerms:
    """Validates the inputs of :func:`impala_loss` and computes its per-transition terms.

    Arguments as in :func:`impala_loss`; returns :class:`LossTerms`, each [T, B].
    """
    import tensorflow as tf

    from impala_rep import vtrace

    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a LossConfig, got {type(config).__name__}.")
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing}; impala_loss needs {list(BATCH_KEYS)}, each [T+1, B, ...].")
    missing = [k for k in policy.param_shapes if k not in policy_params]
    if missing:
        raise ValueError(f"policy_params lack {missing}; the policy needs {sorted(policy.param_shapes)}.")

    with tf.name_scope("impala_loss_terms"):
        values = tf.convert_to_tensor(values, tf.float32)
        if values.shape.rank != 2:
            raise ValueError(f"values must have shape [T+1, B], got {_shape_str(values.shape)}.")
        if values.shape[0] is not None and values.shape[0] < 2:
            raise ValueError(f"values must hold at least 2 steps (T >= 1), got shape {_shape_str(values.shape)}.")
        tb = values.shape
        reward = tf.cast(batch["reward"], tf.float32)
        discount = tf.cast(batch["discount"], tf.float32)
        step_type = tf.convert_to_tensor(batch["step_type"])
        behaviour_log_prob = tf.cast(batch["behaviour_log_prob"], tf.float32)
        action = tf.convert_to_tensor(batch["action"])
        for arg_name, arg in (
            ("batch['reward']", reward),
            ("batch['discount']", discount),
            ("batch['step_type']", step_type),
            ("batch['behaviour_log_prob']", behaviour_log_prob),
        ):
            if arg.shape.rank != 2 or not arg.shape.is_compatible_with(tb):
                raise ValueError(f"{arg_name} must have the shape of values [T+1, B] = {_shape_str(tb)}, got {_shape_str(arg.shape)}.")
        action_shape = tuple(policy.action_spec.shape)
        if action.shape.rank != 2 + len(action_shape) or not action.shape.is_compatible_with(tb.concatenate(action_shape)):
            raise ValueError(
                f"batch['action'] must have shape [T+1, B, *action_shape] = "
                f"{_shape_str(tb.concatenate(action_shape))}, got {_shape_str(action.shape)}."
            )
        params_tm = {}
        for name, shape in policy.param_shapes.items():
            p = tf.convert_to_tensor(policy_params[name], tf.float32)
            expected = tb.concatenate(tuple(shape))
            if p.shape.rank != expected.rank or not p.shape.is_compatible_with(expected):
                raise ValueError(
                    f"policy_params[{name!r}] must have shape [T+1, B, *param_shape] = "
                    f"{_shape_str(expected)}, got {_shape_str(p.shape)}."
                )
            params_tm[name] = p[:-1]

        # Transition t -> t+1, t in [0, T).
        mask = tf.cast(tf.not_equal(tf.cast(step_type[:-1], tf.int32), STEP_LAST), tf.float32)
        target_log_prob = policy.log_prob_tf(params_tm, action[:-1])  # [T, B]
        entropy = policy.entropy_tf(params_tm)  # [T, B]
        log_rhos = target_log_prob - behaviour_log_prob[:-1]
        # Importance weight 0 for transitions that start at a LAST step.
        log_rhos = tf.where(mask > 0, log_rhos, tf.fill(tf.shape(log_rhos), -math.inf))
        discounts = config.discount * discount[1:]
        rewards = reward[1:] * config.reward_scale
        if config.reward_clip is not None:
            rewards = tf.clip_by_value(rewards, -config.reward_clip, config.reward_clip)
        values_t = values[:-1]
        vt = vtrace.from_importance_weights(
            log_rhos=log_rhos,
            discounts=discounts,
            rewards=rewards,
            values=values_t,
            bootstrap_value=values[-1],
            clip_rho_threshold=config.clip_rho_threshold,
            clip_pg_rho_threshold=config.clip_pg_rho_threshold,
            lambda_=config.lambda_,
        )
        return LossTerms(
            mask=mask,
            log_rhos=log_rhos,
            target_log_prob=target_log_prob,
            entropy=entropy,
            values=values_t,
            vs=vt.vs,
            pg_advantages=vt.pg_advantages,
        )
