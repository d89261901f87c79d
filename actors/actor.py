"""The actor loop: several envs per process, one batched NumPy inference per step.

TensorFlow-free. An :class:`Actor` steps ``E`` envs in lockstep, runs the NumPy policy once
per step on the batch of (frame-stacked) observations, cuts each env's experience into
unrolls of ``T+1`` steps (consecutive unrolls overlap by one step) and hands them to a
sink (the gRPC client in production, a list in tests). Between unrolls it refreshes its
parameters when the learner has a newer version.

Usage::

    actor = Actor(envs_list, network, policy, unroll_length=20, frame_stack={"pixels": 3},
                  sink=client.send_unroll, fetch_params=client.get_parameters)
    actor.run(stop=threading.Event())
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import dm_env
import numpy as np

from impala_rep.costs import random_actions

__all__ = ["Actor", "UnrollBatch", "ActorStats", "PHASES", "PolicyDivergedError"]

log = logging.getLogger(__name__)


class PolicyDivergedError(RuntimeError):
    """The policy's outputs came out NaN or infinite with the parameters the actor holds: the
    training run diverged. Acting on would only send unrolls the learner must reject."""


@dataclasses.dataclass
class UnrollBatch:
    """One unroll of one env, ready for the wire (layout: impala_rep.specs docstring)."""

    tensors: Dict[str, np.ndarray]
    policy_version: int
    episode_returns: List[float]
    episode_lengths: List[int]


# The parts of the loop whose CPU time ActorStats.cpu_s accounts.
PHASES = ("env", "policy", "emit", "other")


@dataclasses.dataclass
class ActorStats:
    steps: int = 0
    unrolls: int = 0
    episodes: int = 0
    param_updates: int = 0
    last_returns: List[float] = dataclasses.field(default_factory=list)
    # Seconds of this thread's CPU by part of the loop (PHASES): the policy (inference and
    # sampling), the envs' steps, emitting unrolls (assembly, the sink, parameter refreshes)
    # and the rest (batching observations, recording the step).
    cpu_s: Dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def snapshot(self) -> Tuple[int, Dict[str, float]]:
        """``(agent steps, {part: CPU seconds})`` now: two of them give a span's cost per step."""
        return self.steps, dict(self.cpu_s)


# sink(unroll) delivers one unroll, sink_many(unrolls) those cut at one step (one per env);
# fetch_params(have_version) -> (version, params or None).
Sink = Callable[[UnrollBatch], None]
SinkMany = Callable[[List[UnrollBatch]], None]
FetchParams = Callable[[int], Tuple[int, Optional[Mapping[str, np.ndarray]]]]


class Actor:
    """Runs ``len(envs)`` envs with one batched policy.

    Args:
      envs: dm_env environments with flat-dict observations (``envs.make`` guarantees it).
      network: a ``NumpyNetwork`` (``frame_stacks(frame_stack, batch)`` and
        ``step_frames(obs, state, first, stacks) -> (policy_params, value, state)``).
      policy: the ``Policy`` from ``impala_rep.distributions.make_policy``.
      unroll_length: T; each unroll holds T+1 steps.
      frame_stack: observation key -> K for keys the agent stacks (single frames travel).
      sink: called with each finished :class:`UnrollBatch`.
      sink_many: instead of ``sink``: called once per unroll boundary with the list of the
        envs' finished unrolls, in env order (a transport can pack them into few messages).
      fetch_params: called between unrolls with the version the actor holds.
      prefetch_params: called (no arguments) ``prefetch_lead`` steps before each unroll
        boundary, to start the fetch that ``fetch_params`` then completes at the boundary
        (``LearnerClient.prefetch_parameters``): the reply travels while the envs step.
      prefetch_lead: steps before the boundary at which ``prefetch_params`` is called, from 0
        (no prefetch: ``fetch_params`` asks at the boundary) to ``unroll_length - 1``.
      seed: seeds the action sampling.
      policy_version: the version of the parameters the network holds.
      desync_steps: before the first unroll, each env takes a random number in [0, N) of
        random-action steps that are not recorded, so that envs whose episodes all last the
        same number of steps are out of phase and each batch mixes all parts of an episode.
        The episode each env is in then is not reported (its return is partly random play).
    """

    def __init__(
        self,
        envs: Sequence[dm_env.Environment],
        network: Any,
        policy: Any,
        unroll_length: int,
        frame_stack: Mapping[str, int],
        sink: Optional[Sink] = None,
        fetch_params: Optional[FetchParams] = None,
        seed: Optional[int] = None,
        policy_version: int = 0,
        desync_steps: int = 0,
        sink_many: Optional[SinkMany] = None,
        prefetch_params: Optional[Callable[[], None]] = None,
        prefetch_lead: int = 0,
    ):
        if (sink is None) == (sink_many is None):
            raise ValueError("an actor needs exactly one of sink and sink_many.")
        if not envs:
            raise ValueError("an actor needs at least one env.")
        if int(unroll_length) < 1:
            raise ValueError(f"unroll_length must be at least 1, got {unroll_length}.")
        prefetch_lead = int(prefetch_lead)
        if not 0 <= prefetch_lead < int(unroll_length):
            raise ValueError(
                f"prefetch_lead must be from 0 to unroll_length - 1 ({int(unroll_length) - 1}) steps, got {prefetch_lead}."
            )
        if prefetch_lead and (prefetch_params is None or fetch_params is None):
            raise ValueError("a prefetch_lead above 0 needs both prefetch_params and fetch_params.")
        desync_steps = int(desync_steps)
        if desync_steps < 0:
            raise ValueError(f"desync_steps must be 0 or more, got {desync_steps}.")
        self._envs = list(envs)
        self._network = network
        self._policy = policy
        self._T = int(unroll_length)
        self._frame_stack = {k: int(v) for k, v in frame_stack.items() if int(v) > 1}
        self._sink = sink
        self._sink_many = sink_many
        self._fetch_params = fetch_params
        self._prefetch_params = prefetch_params
        # After appending the step that makes the buffer this long, prefetch (None: never).
        self._prefetch_at = self._T + 1 - prefetch_lead if prefetch_lead else None
        self._rng = np.random.default_rng(seed)
        self.policy_version = int(policy_version)
        self.stats = ActorStats()
        n = len(self._envs)
        self._stacks = network.frame_stacks(self._frame_stack, n)
        self._state = network.initial_state(n)
        self._timesteps: List[dm_env.TimeStep] = [env.reset() for env in self._envs]
        self._episode_return = np.zeros(n, np.float64)
        self._episode_length = np.zeros(n, np.int64)
        self._finished: List[List[Tuple[float, int]]] = [[] for _ in range(n)]
        # Envs whose current episode began with unrecorded random steps (not reported).
        self._partial = np.zeros(n, bool)
        if desync_steps > 0:
            self._desync(desync_steps)
        self._steps: List[Dict[str, np.ndarray]] = []  # per step: batched [E, ...] arrays
        # Frame prefix and core state of the unroll being filled, and of the next one
        # (recorded when its opening step, the current unroll's last, is taken).
        self._prefix: Dict[str, np.ndarray] = {}
        self._core_state: Dict[str, np.ndarray] = {}
        self._next_prefix: Dict[str, np.ndarray] = {}
        self._next_core_state: Dict[str, np.ndarray] = {}

    def _desync(self, max_steps: int) -> None:
        for i, env in enumerate(self._envs):
            spec = env.action_spec()
            for _ in range(int(self._rng.integers(0, max_steps))):
                ts = env.step(random_actions(spec, 1, self._rng)[0])
                self._timesteps[i] = env.reset() if ts.step_type == dm_env.StepType.LAST else ts
            self._partial[i] = self._timesteps[i].step_type != dm_env.StepType.FIRST

    # -- one step ---------------------------------------------------------------------

    def _observe(self) -> Tuple[Dict[str, np.ndarray], np.ndarray]:
        """Batches the current timesteps: (single-frame obs, first flags).

        At a step that opens an unroll, records the frame prefix: the K-1 frames before it.
        """
        first = np.array([ts.step_type == dm_env.StepType.FIRST for ts in self._timesteps])
        keys = self._timesteps[0].observation.keys()
        raw = {k: np.stack([np.asarray(ts.observation[k]) for ts in self._timesteps]) for k in keys}
        # This step opens an unroll when nothing is buffered (the very first unroll) or when
        # it will be the last step of the current one (consecutive unrolls share it).
        opening = self._opening_slot()
        if opening is not None:
            for key in self._frame_stack:
                opening[0][key] = self._stacks.prefix(key, raw[key])
        return raw, first

    def _opening_slot(self) -> Optional[Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]]:
        """(prefix, core state) dicts to fill for a step that opens an unroll, else None."""
        if not self._steps:
            return self._prefix, self._core_state
        if len(self._steps) == self._T:
            return self._next_prefix, self._next_core_state
        return None

    def step(self) -> None:
        """Acts once in every env; emits unrolls when T+1 steps are collected."""
        clock = time.thread_time
        cpu = self.stats.cpu_s
        t_start = clock()
        opening = self._opening_slot()
        raw, first = self._observe()
        if opening is not None:
            opening[1].update({k: np.array(v, copy=True) for k, v in self._state.items()})
        # The network stacks the frames itself (NumpyNetwork.step_frames); the raw batches
        # are shared with its FrameStacks and the unroll record, and never modified.
        t_policy = clock()
        policy_params, _, self._state = self._network.step_frames(raw, self._state, first, self._stacks)
        action, log_prob = self._policy.sample_np(policy_params, self._rng)
        if not np.isfinite(log_prob).all():
            self._diverged(raw)
        t_record = clock()
        cpu["policy"] += t_record - t_policy
        record = {f"observation/{k}": v for k, v in raw.items()}
        record["step_type"] = np.array([int(ts.step_type) for ts in self._timesteps], np.uint8)
        record["reward"] = np.array([0.0 if ts.reward is None else ts.reward for ts in self._timesteps], np.float32)
        record["discount"] = np.array([1.0 if ts.discount is None else ts.discount for ts in self._timesteps], np.float32)
        record["action"] = np.asarray(action)
        record["behaviour_log_prob"] = np.asarray(log_prob, np.float32)
        self._steps.append(record)
        emit_s = 0.0
        if len(self._steps) == self._prefetch_at:
            t_emit = clock()
            self._prefetch_params()
            emit_s += clock() - t_emit
        if len(self._steps) == self._T + 1:
            t_emit = clock()
            self._emit()
            emit_s += clock() - t_emit
        cpu["emit"] += emit_s
        env_actions = self._policy.to_env_action(np.asarray(action))
        t_env = clock()
        for i, env in enumerate(self._envs):
            ts = env.step(env_actions[i])
            if ts.step_type == dm_env.StepType.FIRST:
                self._episode_return[i] = 0.0
                self._episode_length[i] = 0
            else:
                self._episode_return[i] += ts.reward or 0.0
                self._episode_length[i] += 1
            if ts.step_type == dm_env.StepType.LAST and self._partial[i]:
                self._partial[i] = False
            elif ts.step_type == dm_env.StepType.LAST:
                self._finished[i].append((float(self._episode_return[i]), int(self._episode_length[i])))
                self.stats.episodes += 1
                self.stats.last_returns = (self.stats.last_returns + [float(self._episode_return[i])])[-100:]
            self._timesteps[i] = ts
        t_end = clock()
        cpu["env"] += t_end - t_env
        cpu["other"] += (t_policy - t_start) + (t_env - t_record - emit_s)
        self.stats.steps += len(self._envs)

    def _diverged(self, raw: Mapping[str, np.ndarray]) -> None:
        """Raises PolicyDivergedError, or ValueError when the env's observations are the cause."""
        for key, value in raw.items():
            if value.dtype.kind in "fc" and not np.isfinite(value).all():
                raise ValueError(
                    f"the env returned NaN or infinite values in observation {key!r}; fix the env "
                    "(or wrap it so that its observations are finite)."
                )
        raise PolicyDivergedError(
            f"the policy's log-probabilities came out NaN or infinite with parameters version "
            f"{self.policy_version} on finite observations: the training run diverged."
        )

    def _emit(self) -> None:
        steps = self._steps
        # Env-major, [E, T+1, ...]: each env's unroll is one contiguous block, a view the
        # transport reads in place (stacking time-major and copying each env's column out
        # costs a second copy of every frame).
        stacked = {k: np.stack([s[k] for s in steps], axis=1) for k in steps[0]}
        out: List[UnrollBatch] = []
        for i in range(len(self._envs)):
            tensors = {k: v[i] for k, v in stacked.items()}
            for key, prefix in self._prefix.items():
                tensors[f"frame_prefix/{key}"] = np.ascontiguousarray(prefix[:, i])
            for name, value in self._core_state.items():
                tensors[f"core_state/{name}"] = np.ascontiguousarray(value[i])
            finished, self._finished[i] = self._finished[i], []
            out.append(UnrollBatch(
                tensors=tensors,
                policy_version=self.policy_version,
                episode_returns=[r for r, _ in finished],
                episode_lengths=[n for _, n in finished],
            ))
        if self._sink_many is not None:
            self._sink_many(out)
        else:
            for unroll in out:
                self._sink(unroll)
        self.stats.unrolls += len(out)
        # The last step opens the next unroll, with the prefix and core state recorded
        # before it was taken.
        self._steps = [steps[-1]]
        self._prefix, self._next_prefix = self._next_prefix, {}
        self._core_state, self._next_core_state = self._next_core_state, {}
        self._refresh_params()

    def _refresh_params(self) -> None:
        if self._fetch_params is None:
            return
        version, params = self._fetch_params(self.policy_version)
        if params is not None:
            self._network.set_params(params)
            self.policy_version = int(version)
            self.stats.param_updates += 1

    # -- the loop ---------------------------------------------------------------------

    def run(self, stop: Optional[threading.Event] = None, max_steps: Optional[int] = None) -> ActorStats:
        """Steps until ``stop`` is set or ``max_steps`` agent steps (over all envs) are taken."""
        while not (stop is not None and stop.is_set()):
            if max_steps is not None and self.stats.steps >= max_steps:
                break
            self.step()
        return self.stats
