"""Run configuration: what a training run is, as one frozen, validated, JSON-able object.

TensorFlow-free. The launcher builds a :class:`RunConfig` from its flags, writes it as
``config.json`` in the logdir, and the learner hands the actor-relevant part to actors in
the handshake (``run_config`` JSON), so a remote actor needs only the learner's address.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Dict, Mapping, Optional, Union

__all__ = ["RunConfig", "DEFAULT_ACTOR_NICE", "DEFAULT_UNROLLS_PER_MESSAGE", "DEFAULT_PARAM_PREFETCH_STEPS", "DEFAULT_PARAM_REFRESH_LAG", "MAX_PARAM_REFRESH_LAG", "resolve_param_refresh_lag", "resolve_overlap_publish", "resolve_intake", "AUTO_SETTINGS", "NEVER_KEYS", "LEARNER_KINDS", "LEARNER_PRECISIONS", "MAX_DESYNC_STEPS", "valid_desync_steps", "actor_view", "read_run_record", "frame_stack_keys", "replayed_per_batch", "ConfigError"]

# What actor processes give up in CPU priority unless told (the launcher may choose 0).
DEFAULT_ACTOR_NICE = 10
# Unrolls an actor process packs into one gRPC message unless told (docs/BENCHMARKS.md,
# twenty-fifth session: fewer, larger messages cost gRPC less CPU per byte).
DEFAULT_UNROLLS_PER_MESSAGE = 8
# Agent steps before each unroll boundary at which an actor asks for newer parameters, so the
# reply (megabytes) travels while its envs step instead of while it waits at the boundary
# (``actors.run --param-prefetch-steps``; 0: ask at the boundary and wait).
DEFAULT_PARAM_PREFETCH_STEPS = 2
# Versions an actor may fall behind the learner before it is sent new parameters
# (``--param-refresh-lag``; learner/params.py); the bound keeps a mistyped lag from leaving
# actors on their first parameters for a whole run. auto (the default) is 1 on a CPU learner
# and 8 on GPU and TPU learners: on a lent H200 (fiftieth session, synthetic, 128 actors in 16
# processes, --jit) lag 8 trained on 11.8% more agent steps/s than lag 1 over four pairs of
# runs (32,988 against 29,494 on average), the intake process sending fewer 2.7-MB parameter
# replies, with no longer a policy lag; on 2 CPU cores lag 2 gained nothing (thirtieth session).
DEFAULT_PARAM_REFRESH_LAG = "auto"
CPU_PARAM_REFRESH_LAG = 1
ACCELERATOR_PARAM_REFRESH_LAG = 8
MAX_PARAM_REFRESH_LAG = 1000
# Unroll streams a learner serves at once (one per actor process); more are refused and retry.
DEFAULT_MAX_ACTOR_STREAMS = 64
MAX_ACTOR_STREAMS = 4096
# Intervals that may be infinite (never); config.json writes them as null.
NEVER_KEYS = ("checkpoint_interval_s", "log_interval_s")

LEARNER_KINDS = ("cpu", "gpu", "tpu", "auto")
# What the learner's network torsos compute in; variables and gradients are float32 either way.
LEARNER_PRECISIONS = ("float32", "bfloat16")
# Whether the learner publishes each step's parameters on a thread of its own, overlapping
# the next step (``--overlap-publish``): auto is on for GPU and TPU learners, off on CPUs.
OVERLAP_PUBLISH = ("auto", "on", "off")
# Where the learner's intake (gRPC service, unroll queue, batcher, parameter store) runs
# (``--intake``): in the learner's process (thread) or a child process of its own (process);
# auto is process for GPU and TPU learners, thread on CPUs.
INTAKES = ("auto", "thread", "process")
# RMSProp's epsilon (``--rmsprop-epsilon``), added inside the square root: IMPALA's 0.01.
RMSPROP_EPSILON = 0.01
# How that epsilon is applied (``--rmsprop-epsilon-scale``): as given at every update (fixed),
# or divided by PopArt's sigma squared at each update (sigma), which keeps its weight against
# the mean squares of PopArt's gradients, whose scale falls as 1/sigma.
RMSPROP_EPSILON_SCALES = ("fixed", "sigma")


class ConfigError(ValueError):
    """A run configuration value is out of range; the message says which and why."""


def _positive(name: str, value: Optional[float], allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or not value > 0:  # NaN is not > 0 either
        raise ConfigError(f"{name} must be a positive number, got {value!r}.")


def replayed_per_batch(batch_size: int, replay_ratio: float) -> int:
    """Replayed unrolls in each batch at ``replay_ratio``: the nearest whole number, leaving at
    least one fresh unroll. The rest of the batch (the fresh unrolls) is what advances the run's
    agent steps, so a run of N agent steps takes N / (unroll length x fresh unrolls) learner steps."""
    return min(int(batch_size) - 1, int(round(replay_ratio * int(batch_size))))


# The most unrecorded steps an env takes to get out of phase (desync_steps): longer than any
# episode worth desynchronising, short enough to bound an actor's start-up.
MAX_DESYNC_STEPS = 100_000


def resolve_param_refresh_lag(value: Union[int, str], learner_kind: str) -> int:
    """``--param-refresh-lag`` for a learner of ``learner_kind`` (cpu, gpu, tpu): a number
    stays; auto is 1 on a CPU learner and 8 on GPU and TPU learners."""
    if value != "auto":
        return value
    return CPU_PARAM_REFRESH_LAG if learner_kind == "cpu" else ACCELERATOR_PARAM_REFRESH_LAG


def resolve_overlap_publish(value: str, learner_kind: str) -> bool:
    """``--overlap-publish`` for a learner of ``learner_kind``: on or off stays; auto is on for
    GPU and TPU learners and off on CPUs."""
    return value == "on" or (value == "auto" and learner_kind != "cpu")


def resolve_intake(value: str, learner_kind: str) -> str:
    """``--intake`` for a learner of ``learner_kind``: thread or process stays; auto is process
    for GPU and TPU learners and thread on CPUs."""
    if value != "auto":
        return value
    return "process" if learner_kind != "cpu" else "thread"


# The settings whose value may be auto, with what each means on a learner of a given kind: a
# resumed run compares these (1 in an older run's config.json and auto on a CPU learner are the
# same setting).
AUTO_SETTINGS = {
    "param_refresh_lag": resolve_param_refresh_lag,
    "overlap_publish": resolve_overlap_publish,
    "intake": resolve_intake,
}


def valid_desync_steps(value: Any) -> bool:
    """Whether ``value`` is a desync_steps setting: a whole number from 0 to MAX_DESYNC_STEPS."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_DESYNC_STEPS


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run. See ``python -m impala_rep.launch --help``."""

    env: str = "dmc/cartpole-swingup"
    env_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    actors: int = 8
    actor_processes: Optional[int] = None
    learner: str = "cpu"
    replicas: Optional[int] = None
    tpu_address: Optional[str] = None
    unroll_length: int = 20
    batch_size: int = 32
    frame_stack: int = 3
    network: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    loss: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    optimizer: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    total_steps: int = 1_000_000
    time_budget_s: Optional[float] = None
    seed: int = 0
    logdir: str = "runs/default"
    checkpoint_interval_s: float = 600.0
    keep_checkpoints: int = 3
    resume: bool = True
    bind: str = "127.0.0.1"
    port: int = 0
    token: Optional[str] = None
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    queue_unrolls: Optional[int] = None
    log_interval_s: float = 5.0
    max_actor_restarts: int = 10
    actor_nice: int = DEFAULT_ACTOR_NICE
    unrolls_per_message: int = DEFAULT_UNROLLS_PER_MESSAGE
    param_refresh_lag: Union[int, str] = DEFAULT_PARAM_REFRESH_LAG  # or "auto"
    max_actor_streams: int = DEFAULT_MAX_ACTOR_STREAMS
    jit_compile: bool = False
    learner_precision: str = "float32"
    overlap_publish: str = "auto"
    intake: str = "auto"
    replay_ratio: float = 0.0
    replay_unrolls: Optional[int] = None
    eval_episodes: int = 0
    eval_greedy: bool = False
    desync_steps: int = 0
    capture_spikes: int = 0

    def __post_init__(self):
        if not isinstance(self.env, str) or not self.env:
            raise ConfigError("env must be a non-empty env id such as dmc/cartpole-swingup or catch.")
        for name in ("actors", "unroll_length", "batch_size", "frame_stack", "total_steps", "keep_checkpoints"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}.")
        for name in ("actor_processes", "replicas", "queue_unrolls", "replay_unrolls"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}.")
        if self.actor_processes is not None and self.actor_processes > self.actors:
            raise ConfigError(
                f"actor-processes ({self.actor_processes}) cannot exceed actors ({self.actors}): "
                "each process hosts at least one env."
            )
        if self.learner not in LEARNER_KINDS:
            raise ConfigError(f"learner must be one of {', '.join(LEARNER_KINDS)}, got {self.learner!r}.")
        if self.learner_precision not in LEARNER_PRECISIONS:
            raise ConfigError(
                f"learner-precision must be one of {', '.join(LEARNER_PRECISIONS)}, got {self.learner_precision!r}."
            )
        if self.overlap_publish not in OVERLAP_PUBLISH:
            raise ConfigError(
                f"overlap-publish must be one of {', '.join(OVERLAP_PUBLISH)}, got {self.overlap_publish!r}."
            )
        if self.intake not in INTAKES:
            raise ConfigError(f"intake must be one of {', '.join(INTAKES)}, got {self.intake!r}.")
        if self.replicas is not None and self.batch_size % self.replicas:
            raise ConfigError(
                f"batch-size {self.batch_size} is not divisible by replicas {self.replicas}; "
                "choose a batch size that is a multiple of the replica count."
            )
        if self.time_budget_s is not None and (
                isinstance(self.time_budget_s, bool) or not isinstance(self.time_budget_s, (int, float))
                or not math.isfinite(self.time_budget_s) or not self.time_budget_s > 0):
            raise ConfigError(
                f"time-budget must be a positive, finite number of seconds (or None for none), "
                f"got {self.time_budget_s!r}."
            )
        _positive("checkpoint-interval", self.checkpoint_interval_s)
        _positive("log-interval", self.log_interval_s)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535 (0 picks a free port), got {self.port}.")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("TLS needs both --tls-cert and --tls-key.")
        if self.max_actor_restarts < 0:
            raise ConfigError(f"max-actor-restarts must be 0 or more, got {self.max_actor_restarts}.")
        if isinstance(self.replay_ratio, bool) or not isinstance(self.replay_ratio, (int, float)) \
                or not 0 <= self.replay_ratio < 1:
            raise ConfigError(
                f"replay-ratio must be at least 0 and below 1 (the share of each batch replayed; every batch "
                f"keeps a fresh unroll), got {self.replay_ratio!r}."
            )
        replayed = replayed_per_batch(self.batch_size, self.replay_ratio)
        if self.replay_ratio > 0 and replayed == 0:
            raise ConfigError(
                f"replay-ratio {self.replay_ratio:g} of a batch of {self.batch_size} unrolls replays none of them "
                f"(the nearest whole number); use a replay-ratio of at least {0.5 / self.batch_size:.3g}, or 0."
            )
        if self.replay_unrolls is not None and self.replay_unrolls < replayed:
            raise ConfigError(
                f"replay-unrolls {self.replay_unrolls} holds fewer than the {replayed} unrolls each batch replays "
                f"(replay-ratio {self.replay_ratio:g} of {self.batch_size}); give at least {replayed}."
            )
        if isinstance(self.eval_episodes, bool) or not isinstance(self.eval_episodes, int) or self.eval_episodes < 0:
            raise ConfigError(
                f"eval-episodes must be a whole number of episodes to evaluate each exported policy on "
                f"(0: no evaluation during training), got {self.eval_episodes!r}."
            )
        if not valid_desync_steps(self.desync_steps):
            raise ConfigError(
                f"desync-steps must be a whole number of agent steps from 0 (every env starts its first episode "
                f"at once) to {MAX_DESYNC_STEPS}, got {self.desync_steps!r}."
            )
        if isinstance(self.capture_spikes, bool) or not isinstance(self.capture_spikes, int) \
                or self.capture_spikes < 0:
            raise ConfigError(
                f"capture-spikes must be a whole number of learner steps to keep replayable (0: none), "
                f"got {self.capture_spikes!r}."
            )
        if not 0 <= self.actor_nice <= 19:
            raise ConfigError(f"actor-nice must be between 0 and 19, got {self.actor_nice}.")
        if isinstance(self.unrolls_per_message, bool) or not isinstance(self.unrolls_per_message, int) \
                or self.unrolls_per_message < 1:
            raise ConfigError(f"unrolls-per-message must be a whole number of at least 1, got {self.unrolls_per_message!r}.")
        if self.param_refresh_lag != "auto" and (
                isinstance(self.param_refresh_lag, bool) or not isinstance(self.param_refresh_lag, int)
                or not 1 <= self.param_refresh_lag <= MAX_PARAM_REFRESH_LAG):
            raise ConfigError(
                f"param-refresh-lag must be 'auto' or a whole number of learner versions from 1 (actors get every "
                f"new version) to {MAX_PARAM_REFRESH_LAG}, got {self.param_refresh_lag!r}."
            )
        if isinstance(self.max_actor_streams, bool) or not isinstance(self.max_actor_streams, int) \
                or not 1 <= self.max_actor_streams <= MAX_ACTOR_STREAMS:
            raise ConfigError(
                f"max-actor-streams must be a whole number of actor processes from 1 to {MAX_ACTOR_STREAMS}, "
                f"got {self.max_actor_streams!r}."
            )
        if not isinstance(self.env_kwargs, Mapping):
            raise ConfigError(f"env_kwargs must be a mapping of env arguments, got {self.env_kwargs!r}.")
        from envs.dmc import run_env_kwargs  # TF-free, and light: dm_control loads when an env is made

        object.__setattr__(self, "env_kwargs", run_env_kwargs(self.env, dict(self.env_kwargs)))
        object.__setattr__(self, "network", dict(self.network))
        object.__setattr__(self, "loss", dict(self.loss))
        object.__setattr__(self, "optimizer", dict(self.optimizer))

    @property
    def unrolls_per_batch(self) -> int:
        return self.batch_size

    @property
    def queue_capacity(self) -> int:
        """Unrolls the learner's queue holds: ``queue_unrolls``, by default two batches."""
        return self.queue_unrolls or 2 * self.batch_size

    @property
    def replay_capacity(self) -> int:
        """Unrolls the replay buffer keeps: ``replay_unrolls``, by default 8 batches; 0 without replay."""
        if not replayed_per_batch(self.batch_size, self.replay_ratio):
            return 0
        return self.replay_unrolls or 8 * self.batch_size

    def to_json(self, include_secrets: bool = False) -> Dict[str, Any]:
        """The config as JSON-safe values: an interval of ``inf`` (never) is ``None``."""
        data = dataclasses.asdict(self)
        if not include_secrets and data.get("token"):
            data["token"] = "<set>"
        for key in NEVER_KEYS:
            if data.get(key) == math.inf:
                data[key] = None
        return data

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "RunConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; known keys are {sorted(known)}.")
        data = dict(data)
        for key in NEVER_KEYS:
            if key in data and data[key] is None:
                data[key] = math.inf
        return cls(**data)


def read_run_record(path: str) -> Optional[Dict[str, Any]]:
    """The settings an earlier run's ``config.json`` at ``path`` holds, or None when there is no
    readable JSON object there (no earlier run to compare with or carry from)."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    return record if isinstance(record, dict) else None


def actor_view(config: RunConfig, frame_stack: Mapping[str, int]) -> Dict[str, Any]:
    """The part of the config an actor needs, sent in the handshake's ``run_config``."""
    return {
        "env": config.env,
        "env_kwargs": dict(config.env_kwargs),
        "unroll_length": config.unroll_length,
        "frame_stack": dict(frame_stack),
        "network": dict(config.network),
        "seed": config.seed,
        "desync_steps": config.desync_steps,
    }


def frame_stack_keys(observations: Mapping[str, Any], depth: int) -> Dict[str, int]:
    """Which observation keys the agent stacks: every uint8 [H, W, C] key, ``depth`` deep."""
    if depth <= 1:
        return {}
    return {
        key: depth
        for key, spec in observations.items()
        if len(spec.shape) == 3 and spec.dtype == "uint8"
    }

