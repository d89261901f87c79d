"""Command-line flags shared by ``impala_rep.launch`` and ``learner.run`` (TensorFlow-free)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
from typing import Any, Dict, List, Optional

from impala_rep.losses import POPART_TERMS
from impala_rep.config import ACCELERATOR_PARAM_REFRESH_LAG, CPU_PARAM_REFRESH_LAG, DEFAULT_ACTOR_NICE, DEFAULT_MAX_ACTOR_STREAMS, DEFAULT_PARAM_REFRESH_LAG, MAX_ACTOR_STREAMS, DEFAULT_UNROLLS_PER_MESSAGE, MAX_PARAM_REFRESH_LAG, LEARNER_KINDS, LEARNER_PRECISIONS, INTAKES, NEVER_KEYS, OVERLAP_PUBLISH, RMSPROP_EPSILON, RMSPROP_EPSILON_SCALES, RunConfig, read_run_record, replayed_per_batch

__all__ = ["add_learner_flags", "add_actor_flags", "config_from_args", "ignored_flags", "check_logdir", "check_output_path", "seed_flag", "seed_type", "MAX_SEED", "MAX_ACTOR_SEED", "positive_float", "interval_seconds", "duration_seconds", "nonnegative_float", "int_at_least", "UsageError", "in_flag_terms", "CommandLineParser", "parse_flags", "read_config_file", "config_file_flags", "CONFIG_NOT_CARRIED", "resumed_env_kwargs"]

log = logging.getLogger(__name__)


# make_replicator's errors name its arguments (kind=, tpu=, num_replicas=); on the command line
# the same advice is a flag.
_ARGUMENTS_AS_FLAGS = (
    (re.compile(r"kind='(\w+)' or '(\w+)'"), r"--learner \1 or --learner \2"),
    (re.compile(r"kind='(\w+)'"), r"--learner \1"),
    (re.compile(r"tpu='([^']*)'"), r"--tpu-address \1"),
    (re.compile(r"num_replicas<=(\d+)"), r"--replicas \1 or fewer"),
    (re.compile(r"leave num_replicas unset"), "leave --replicas out"),
    (re.compile(r"num_replicas=(\d+)"), r"--replicas \1"),
    (re.compile(r"\bnum_replicas\b"), "--replicas"),
)


LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
# Libraries that log at INFO when imported or first used: dm_control's OpenGL and MuJoCo
# banners (through absl), PyOpenGL's missing accelerator, TensorFlow's and h5py's notes.
QUIET_LOGGERS = ("absl", "OpenGL", "tensorflow", "h5py")


class OnceFilter(logging.Filter):
    """Passes each distinct message once. MuJoCo warns through absl on every model it compiles
    (dm_control's cheetah: "compiler attribute 'settotalmass' is deprecated", once per env, 16
    times in an actor process); once says it. Remembers ``limit`` messages, then passes all."""

    def __init__(self, limit: int = 1000):
        super().__init__()
        self._seen: set = set()
        self._limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.levelno, record.getMessage())
        if key in self._seen:
            return False
        if len(self._seen) < self._limit:
            self._seen.add(key)
        return True


def configure_logging(fmt: str = LOG_FORMAT) -> None:
    """The entry points' logging: INFO and above to stderr in ``fmt``, the libraries named in
    :data:`QUIET_LOGGERS` from WARNING only (their start-up lines are noise before an error),
    and absl's (MuJoCo's, dm_control's) repeated warnings once (:class:`OnceFilter`)."""
    logging.basicConfig(level=logging.INFO, format=fmt, datefmt="%H:%M:%S")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    absl = logging.getLogger("absl")
    if not any(isinstance(f, OnceFilter) for f in absl.filters):
        absl.addFilter(OnceFilter())


def in_flag_terms(message: str) -> str:
    """``message`` (an error of :func:`impala_rep.replicator.make_replicator` or the learner's
    set-up) with the arguments it names as the launcher's flags: ``kind='cpu'`` becomes
    ``--learner cpu``, ``tpu='grpc://HOST:PORT'`` ``--tpu-address grpc://HOST:PORT``,
    ``num_replicas`` ``--replicas``."""
    for pattern, flag in _ARGUMENTS_AS_FLAGS:
        message = pattern.sub(flag, message)
    return message


class CommandLineParser(argparse.ArgumentParser):
    """The entry points' parser: a bad flag is the one sentence that says what is wrong and
    where the flags are listed, without argparse's usage block (dozens of lines of flags) in
    front of it."""

    # Where the flags being parsed come from, when not the command line (--config's file).
    source: Optional[str] = None

    def error(self, message: str):
        if self.source:
            message = f"{message} (in the settings {self.source} gives; edit them there or give the flag yourself)"
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the flags.)\n")


class UsageError(ValueError):
    """A flag value is invalid; the message says which and what is accepted."""


def int_at_least(minimum: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


MAX_SEED = 2**31 - 1  # the run's --seed; actors derive theirs from it (below)
# An actor process's --seed: the launcher gives process i seed + 1000 * (i + 1), and env j of
# a process seed + j. NumPy's RandomState takes seeds below 2**32.
MAX_ACTOR_SEED = 2**32 - 2**20


def seed_type(maximum: int = MAX_SEED):
    """An argparse type for a seed: a whole number from 0 to ``maximum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number from 0 to {maximum}, got {text!r}") from None
        if not 0 <= value <= maximum:
            raise argparse.ArgumentTypeError(f"expected a whole number from 0 to {maximum}, got {value}")
        return value

    return parse


seed_flag = seed_type(MAX_SEED)


_positive_int = int_at_least(1, "a positive integer")
_nonnegative_int = int_at_least(0, "a whole number (0 or more)")


def _refresh_lag(text: str):
    """``--param-refresh-lag``: 'auto' or a whole number from 1 to MAX_PARAM_REFRESH_LAG."""
    if text == "auto":
        return text
    what = f"'auto' or a whole number of learner versions from 1 to {MAX_PARAM_REFRESH_LAG}"
    value = int_at_least(1, what)(text)
    if value > MAX_PARAM_REFRESH_LAG:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def _float_in(what: str, low: Optional[float] = None, high: Optional[float] = None, low_open: bool = False):
    """An argparse type: a finite float within [low, high] (or (low, high] with ``low_open``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {what} (a finite number), got {text!r}")
        if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value:g}")
        return value

    return parse


positive_float = _float_in("a positive number", 0.0, low_open=True)


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def duration_seconds(text: str) -> float:
    """An argparse type: a positive, finite duration in seconds, written as GNU ``timeout``
    takes it: a number with an optional unit, s (the default), m or h (``3000``, ``50m``,
    ``1.5h``)."""
    body = text.strip().lower()
    scale = _DURATION_UNITS.get(body[-1:], None) if body else None
    number = body[:-1] if scale is not None else body
    try:
        value = float(number) * (scale or 1.0)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive duration: seconds, or a number with a unit s, m or h (50m, 1.5h), got {text!r}")
    return value


def interval_seconds(text: str) -> float:
    """An argparse type: a positive number of seconds, or ``inf``/``never`` (``math.inf``)."""
    if text.strip().lower() in ("inf", "infinity", "never"):
        return math.inf
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds or 'never', got {text!r}") from None


nonnegative_float = _float_in("a number of 0 or more", 0.0)
_finite_float = _float_in("a number")


def add_learner_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("environment")
    g.add_argument("--env", default="dmc/cartpole-swingup",
                   help="env id: dmc/DOMAIN-TASK (pixels), a built-in such as catch, or package.module:callable")
    g.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the env factory (value parsed as JSON where it parses); repeatable")

    g = parser.add_argument_group("learner")
    g.add_argument("--learner", choices=LEARNER_KINDS, default="cpu",
                   help="where the learner runs: cpu (logical CPU replicas), gpu, tpu, or auto (TPU, else GPUs, else CPU)")
    g.add_argument("--replicas", type=_positive_int, default=None,
                   help="number of replicas (cpu: logical CPU devices; gpu: how many GPUs); default: on cpu, one per learner "
                        "thread that divides the batch with impala_rep.launch and 1 with learner.run; otherwise all devices")
    g.add_argument("--tpu-address", default=None, help="TPU address (grpc://host:port or a TPU name); default: the local TPU")
    g.add_argument("--unroll-length", type=_positive_int, default=20, help="T: transitions per unroll (default 20)")
    g.add_argument("--batch-size", type=_positive_int, default=32, help="B: unrolls per learner batch (default 32)")
    g.add_argument("--frame-stack", type=_positive_int, default=3, help="frames stacked for pixel observations (default 3)")
    g.add_argument("--network", choices=("auto", "shallow", "deep", "mlp"), default="auto",
                   help="torso: shallow IMPALA CNN, deep IMPALA ResNet, MLP; auto = shallow for pixels, mlp for vectors")
    g.add_argument("--lstm-size", type=_positive_int, default=None, help="add an LSTM core of this size (default: none)")
    g.add_argument("--policy", choices=("auto", "categorical", "gaussian", "discretised"), default="auto",
                   help="policy head; auto = categorical for discrete actions, gaussian for continuous")
    g.add_argument("--bins", type=int_at_least(2, "an integer of at least 2"), default=11,
                   help="bins per action dimension for --policy discretised (at least 2)")
    g.add_argument("--discount", type=_float_in("a discount from 0 to 1", 0.0, 1.0), default=0.99)
    g.add_argument("--learning-rate", type=positive_float, default=6e-4)
    g.add_argument("--entropy-cost", type=nonnegative_float, default=0.01)
    g.add_argument("--baseline-cost", type=nonnegative_float, default=0.5)
    g.add_argument("--baseline-torso-scale", type=_float_in("a share from 0 to 1", 0.0, 1.0), default=1.0,
                   help="share of the baseline loss's gradient that reaches the torso the value head shares with "
                        "the policy (the value head gets all of it; 1 = IMPALA's shared network)")
    g.add_argument("--popart", type=_float_in("a step size from 0 to 1", 0.0, 1.0), default=0.0,
                   metavar="STEP_SIZE",
                   help="PopArt: learn the value on the scale of running statistics of its targets, moved with this "
                        "step size (e.g. 3e-4), keeping the values as they were; 0 (default) for none")
    g.add_argument("--popart-terms", choices=POPART_TERMS, default="all",
                   help="with --popart, the loss terms on the statistics' scale: all (default: the value's, the "
                        "advantages and the entropy term, every term's weight as IMPALA's), policy (the value's and "
                        "the advantages, as PopArt-IMPALA), baseline (only the value's) or impala (as all, with the value's "
                        "loss times sigma, so the shared layers get IMPALA's gradient divided by sigma)")
    g.add_argument("--reward-scale", type=positive_float, default=None,
                   help="multiply rewards in the loss (default: 1/action-repeat for dmc/ ids, whose repeated "
                        "rewards are summed, else 1)")
    g.add_argument("--reward-clip", type=positive_float, default=None,
                   help="clip (scaled) rewards to [-x, x] in the loss (IMPALA's Atari setting: 1)")
    g.add_argument("--clip-norm", type=positive_float, default=40.0, help="global-norm gradient clip")
    g.add_argument("--rmsprop-epsilon", type=positive_float, default=RMSPROP_EPSILON, metavar="EPSILON",
                   help="RMSProp's epsilon, added to the mean square of each weight's gradient inside the square "
                        "root (default 0.01, IMPALA's); weights whose mean square is below it take smaller steps")
    g.add_argument("--rmsprop-epsilon-scale", choices=RMSPROP_EPSILON_SCALES, default="fixed",
                   help="fixed (default): --rmsprop-epsilon at every update; sigma: --rmsprop-epsilon over PopArt's "
                        "sigma squared at each update (needs --popart), which keeps epsilon's weight against the "
                        "mean squares of PopArt's gradients as sigma grows")
    g.add_argument("--no-anneal", action="store_true", help="keep the learning rate constant instead of annealing it to 0")
    g.add_argument("--anneal", dest="no_anneal", action="store_false", default=argparse.SUPPRESS,
                   help="anneal the learning rate (the default; undoes a --no-anneal that --config carries)")
    g.add_argument("--lr-warmup", type=_nonnegative_int, default=None, metavar="STEPS",
                   help="ramp the learning rate up linearly over the first STEPS learner steps (default: 100, or "
                        "5%% of the run's learner steps if that is fewer; 0: none)")
    g.add_argument("--jit", action=argparse.BooleanOptionalAction, default=False,
                   help="compile the learner step with XLA (default: not)")
    g.add_argument("--learner-precision", choices=LEARNER_PRECISIONS, default="float32",
                   help="what the learner network's torsos compute in: float32 (default) or bfloat16 (mixed "
                        "precision: variables, gradients and the actors' parameters stay float32). bfloat16 is "
                        "fast on TPUs, recent GPUs and CPUs with AVX512-BF16 or AMX, and slow where it is emulated")
    g.add_argument("--overlap-publish", choices=OVERLAP_PUBLISH, default="auto",
                   help="check and encode each step's parameters for the actors on a thread of their own, while "
                        "the next step runs: auto (default) does on GPU and TPU learners, whose device would "
                        "otherwise wait for the host; on CPUs, whose cores the step already fills, it does not")
    g.add_argument("--intake", choices=INTAKES, default="auto",
                   help="where the learner's gRPC service, unroll queue, batcher and parameter store run: "
                        "thread (in the learner's process) or process (a child process of their own, handing "
                        "batches and parameters over "
                        "shared memory, so that their Python does not hold up the training loop's); auto "
                        "(default) is process for GPU and TPU learners and thread on CPUs")
    g.add_argument("--replay-ratio", type=_finite_float, default=0.0, metavar="R",
                   help="share of each batch drawn from recently trained-on unrolls, 0 <= R < 1 (IMPALA's "
                        "experience replay; V-trace corrects for the older policies); default 0: none")
    g.add_argument("--replay-unrolls", type=_positive_int, default=None, metavar="N",
                   help="unrolls the replay buffer keeps, newest first (default: 8 batches)")
    g.add_argument("--total-steps", type=_positive_int, default=2_000_000,
                   help="budget in agent steps trained on (each is action-repeat env frames; a replayed "
                        "unroll counts once, when fresh)")
    g.add_argument("--time-budget", type=duration_seconds, default=None, metavar="DURATION",
                   help="also stop after this long in the training loop (seconds, or with a unit: 50m, 1.5h; "
                        "counted across resumes; start-up and the final save and evaluation come on top), "
                        "whichever of it and --total-steps comes first; unless --no-anneal, the learning "
                        "rate anneals over whichever of the two is further along (default: none)")
    g.add_argument("--seed", type=seed_flag, default=0)
    g.add_argument("--queue-unrolls", type=_positive_int, default=None,
                   help="bound of the learner's unroll queue (default: 2 batches)")
    g.add_argument("--desync-steps", type=_nonnegative_int, default=None, metavar="N",
                   help="before its first unroll each env takes a random number (0..N-1) of unrecorded random-action "
                        "steps, so that envs whose episodes all last the same number of steps do not start and end "
                        "together and each batch mixes all phases of an episode (default: the episode length, "
                        "1000/action_repeat, for dmc/ ids; 0, off, for others)")

    g = parser.add_argument_group("run directory")
    g.add_argument("--config", default=None, metavar="RUN_DIR|FILE",
                   help="start from the settings of an earlier run (its directory, or its config.json); flags "
                        "given here override them. Not carried: where the run writes and how it is served "
                        "(--logdir, --no-resume, --bind, --port, --token, TLS) and the plan the launcher makes "
                        "for this host's cores (actor processes, their niceness, CPU replicas)")
    g.add_argument("--logdir", default="runs/default", help="checkpoints, policy, summaries, metrics.jsonl, config.json")
    g.add_argument("--checkpoint-interval", type=interval_seconds, default=600.0,
                   help="seconds between checkpoints, or never (a checkpoint is still written when the run ends or is stopped)")
    g.add_argument("--keep-checkpoints", type=_positive_int, default=3)
    g.add_argument("--no-resume", action="store_true", help="start fresh even if the logdir holds a checkpoint")
    g.add_argument("--log-interval", type=interval_seconds, default=5.0,
                   help="seconds between progress lines and metrics records, or never")
    g.add_argument("--eval-episodes", type=_nonnegative_int, default=0, metavar="N",
                   help="evaluate each exported policy (every checkpoint and the last) on N episodes in a "
                        "separate process: eval/eval-STEP.json, eval/return in TensorBoard, a log line "
                        "(default 0: none)")
    g.add_argument("--capture-spikes", type=_nonnegative_int, default=0, metavar="N",
                   help="keep the learner's state from N to 2N steps ago and the batches trained on since in "
                        "memory, and write them to captures/step-S when a step's policy entropy rises above their "
                        "median by over 2 nats and over that median (a collapse), for scripts/replay_capture.py to "
                        "replay (default 0: none)")
    g.add_argument("--eval-greedy", action=argparse.BooleanOptionalAction, default=False,
                   help="those evaluations act with the policy's mode (default: they sample)")

    g = parser.add_argument_group("network service")
    g.add_argument("--bind", default="127.0.0.1", help="interface the learner listens on (default loopback only)")
    g.add_argument("--port", type=int, default=0, help="port the learner listens on (0: pick a free one)")
    g.add_argument("--token", default=None,
                   help="shared secret actors must send (default: $IMPALA_REP_TOKEN if set)")
    g.add_argument("--tls-cert", default=None, help="PEM certificate for TLS (with --tls-key)")
    g.add_argument("--tls-key", default=None, help="PEM private key for TLS (with --tls-cert)")
    g.add_argument("--param-refresh-lag", type=_refresh_lag, default=DEFAULT_PARAM_REFRESH_LAG, metavar="K|auto",
                   help="learner versions an actor process may fall behind before the learner sends it new parameters "
                        f"(at most {MAX_PARAM_REFRESH_LAG}; default auto: {CPU_PARAM_REFRESH_LAG}, every new version, "
                        f"on a CPU learner, {ACCELERATOR_PARAM_REFRESH_LAG} on GPU and TPU learners): "
                        "K above 1 sends actors about 1/K of the parameter traffic, for a policy lag "
                        "up to K-1 versions longer, which V-trace corrects for")
    g.add_argument("--max-actor-streams", type=_positive_int, default=DEFAULT_MAX_ACTOR_STREAMS, metavar="N",
                   help=f"actor processes the learner serves at once, one unroll stream each (default "
                        f"{DEFAULT_MAX_ACTOR_STREAMS}, at most {MAX_ACTOR_STREAMS}); more are refused and retry until "
                        "one ends, so give the number of actor processes on all hosts when it is larger")


def add_actor_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("actors")
    g.add_argument("--actors", type=_positive_int, default=8, help="number of envs acting in parallel (default 8)")
    g.add_argument("--actor-processes", type=_positive_int, default=None,
                   help="processes hosting the actors (default: for a CPU learner sized by cost, the cores its "
                        "measured share of the work leaves, or one per core when its threads fill every core; "
                        "otherwise one per core)")
    g.add_argument("--max-actor-restarts", type=int, default=10, help="restarts per actor process before giving up")
    g.add_argument("--actor-nice", type=int, default=None,
                   help="CPU priority the actor processes give up, 0-19, so the learner sharing their cores runs "
                        "first (default 10, or 19 when a CPU learner's threads fill every core: the actors, one "
                        "process per core, then run in its gaps and while it waits for unrolls; 0 keeps them equal)")
    g.add_argument("--unrolls-per-message", type=_positive_int, default=DEFAULT_UNROLLS_PER_MESSAGE,
                   help="unrolls an actor process packs into one gRPC message "
                        f"(default {DEFAULT_UNROLLS_PER_MESSAGE}; 1: one per message): "
                        "fewer, larger messages cost gRPC less CPU per byte")



def parse_env_kwargs(items: List[str]) -> Dict[str, Any]:
    import envs

    return envs.parse_env_args(items)


def _action_repeat(env_id: str, env_kwargs: Dict[str, Any]) -> Optional[int]:
    """The env's action repeat (its ``action_repeat`` argument, else 4 for dmc/ ids, else 1);
    None when the argument is not a whole number of at least 1 (the env factory rejects it)."""
    repeat = env_kwargs.get("action_repeat", 4 if env_id.startswith("dmc/") else 1)
    return repeat if isinstance(repeat, int) and not isinstance(repeat, bool) and repeat >= 1 else None


def _default_reward_scale(env_id: str, env_kwargs: Dict[str, Any]) -> float:
    """--reward-scale's default: 1/action-repeat (DM Control sums the repeated rewards), else 1."""
    repeat = _action_repeat(env_id, env_kwargs)
    return 1.0 / repeat if repeat is not None else 1.0


def _default_desync_steps(env_id: str, env_kwargs: Dict[str, Any]) -> int:
    """--desync-steps' default: one episode of a dmc/ task (1000 control steps), else 0."""
    repeat = _action_repeat(env_id, env_kwargs)
    return -(-1000 // repeat) if env_id.startswith("dmc/") and repeat is not None else 0


def _learner_updates(total_steps: int, unroll_length: int, batch_size: int, replay_ratio: float) -> int:
    """Learner steps in a run of ``total_steps`` agent steps: each batch advances them by its
    fresh share only."""
    fresh = batch_size - replayed_per_batch(batch_size, replay_ratio)
    return -(-total_steps // (unroll_length * fresh))


def _default_lr_warmup(updates: int) -> int:
    """--lr-warmup's default: 100 learner steps, or 5% of the run's if that is fewer."""
    return min(100, updates // 20)


# Settings of a run's config.json that --config does not carry into a new run: where the run
# writes and how it is served, which the new run gives itself, and the launcher's plan for the
# cores of the host it ran on (actor processes, their niceness, CPU replicas), which it makes
# again for the host it runs on.
CONFIG_NOT_CARRIED = ("logdir", "resume", "bind", "port", "token", "tls_cert", "tls_key",
                      "actor_processes", "actor_nice", "replicas")
# The keys of config.json's nested settings (config_from_args writes them).
_CONFIG_NESTED = {
    "network": ("torso", "policy", "bins", "lstm_size"),
    "loss": ("discount", "entropy_cost", "baseline_cost", "reward_scale", "reward_clip", "baseline_torso_scale",
             "popart", "popart_terms"),
    "optimizer": ("learning_rate", "clip_norm", "epsilon", "epsilon_scale", "anneal_steps", "anneal_seconds", "warmup_steps"),
}
# Settings carried as the flag of the same name (underscores as dashes), and renamed ones.
_CONFIG_AS_FLAG = (
    "env", "actors", "learner", "tpu_address", "unroll_length", "batch_size", "frame_stack", "total_steps", "seed",
    "keep_checkpoints", "queue_unrolls", "max_actor_restarts", "unrolls_per_message", "param_refresh_lag",
    "max_actor_streams", "learner_precision", "overlap_publish", "intake", "replay_ratio", "replay_unrolls",
    "eval_episodes", "capture_spikes",
)
_CONFIG_RENAMED = {"time_budget_s": "--time-budget", "checkpoint_interval_s": "--checkpoint-interval",
                   "log_interval_s": "--log-interval"}
_CONFIG_NESTED_FLAGS = {
    ("network", "torso"): "--network", ("network", "policy"): "--policy", ("network", "bins"): "--bins",
    ("network", "lstm_size"): "--lstm-size", ("loss", "discount"): "--discount",
    ("loss", "entropy_cost"): "--entropy-cost", ("loss", "baseline_cost"): "--baseline-cost",
    ("loss", "reward_clip"): "--reward-clip", ("loss", "baseline_torso_scale"): "--baseline-torso-scale",
    ("loss", "popart"): "--popart", ("loss", "popart_terms"): "--popart-terms",
    ("optimizer", "learning_rate"): "--learning-rate",
    ("optimizer", "clip_norm"): "--clip-norm", ("optimizer", "epsilon"): "--rmsprop-epsilon",
    ("optimizer", "epsilon_scale"): "--rmsprop-epsilon-scale",
}
_CONFIG_SWITCHES = {"jit_compile": "--jit", "eval_greedy": "--eval-greedy"}


def read_config_file(path: str) -> "tuple[str, Dict[str, Any]]":
    """The file ``--config path`` names (``path/config.json`` for a run directory) and the
    settings in it, checked for shape: a JSON object of RunConfig's keys (nested ones too).
    Raises UsageError with a sentence otherwise; values are checked as flags later."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        where = (f"the run directory {path} holds no config.json (a run writes it once its learner serves)"
                 if os.path.isdir(path) else f"{path} is not a file or a directory")
        raise UsageError(f"--config {path}: {where}; give an earlier run's directory or its config.json.")
    try:
        with open(file, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--config {file} cannot be read ({exc}).") from None
    except ValueError as exc:
        raise UsageError(f"--config {file} is not JSON ({exc}); give a run's config.json.") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {file} holds a JSON {type(data).__name__}, not an object of settings; "
                         "give a run's config.json.")
    known = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UsageError(f"--config {file} has settings this version does not know: {', '.join(unknown)}; "
                         f"the known ones are {', '.join(sorted(known))}.")
    for key, subkeys in _CONFIG_NESTED.items():
        if key not in data:
            continue
        if not isinstance(data[key], dict):
            raise UsageError(f"--config {file}: {key} must be an object of {', '.join(subkeys)}, got {data[key]!r}.")
        unknown = sorted(set(data[key]) - set(subkeys))
        if unknown:
            raise UsageError(f"--config {file}: {key} has settings this version does not know: "
                             f"{', '.join(unknown)}; the known ones are {', '.join(subkeys)}.")
    if not isinstance(data.get("env", ""), str):
        raise UsageError(f"--config {file}: env must be an env id such as dmc/cartpole-swingup, got {data['env']!r}.")
    if not isinstance(data.get("env_kwargs", {}), dict):
        raise UsageError(f"--config {file}: env_kwargs must be an object of env arguments, got {data['env_kwargs']!r}.")
    return file, data


def _flag_text(value: Any) -> str:
    """A setting as the command line writes it (floats exactly, as repr does)."""
    return repr(value) if isinstance(value, float) else str(value)


def config_file_flags(data: Dict[str, Any], env: Optional[str], env_args: List[str]) -> List[str]:
    """The flags (``--flag=value`` or a switch) that give a new run the settings ``data`` (a
    run's config.json) holds, except those in CONFIG_NOT_CARRIED. ``env`` is the env the new run's command line names (None if
    it names none) and ``env_args`` its ``--env-arg`` items: the earlier run's env arguments are
    carried only to the same env, and only for keys the command line does not give. Settings
    that the flags derive by default (the reward scale, the learning rate's warm-up, the desync
    steps) are carried only where the earlier run's differ from that default, so that they are
    derived again when the new run's env or budget differs."""
    flags: List[str] = []

    def add(flag: str, value: Any) -> None:
        if value is not None:  # FLAG=VALUE: a value that starts with a dash stays a value
            flags.append(f"{flag}={_flag_text(value)}")

    for key in _CONFIG_AS_FLAG:
        if key in data and not (key == "env" and env is not None):
            add("--" + key.replace("_", "-"), data[key])
    for key, flag in _CONFIG_RENAMED.items():
        if key in data:
            add(flag, "never" if key in NEVER_KEYS and data[key] is None else data[key])
    for (outer, inner), flag in _CONFIG_NESTED_FLAGS.items():
        add(flag, data.get(outer, {}).get(inner))
    for key, flag in _CONFIG_SWITCHES.items():
        if data.get(key) is True:
            flags.append(flag)
    if "optimizer" in data and "anneal_steps" not in data["optimizer"]:
        flags.append("--no-anneal")
    run_env = data.get("env", "dmc/cartpole-swingup")
    from envs.dmc import recorded_env_kwargs  # an earlier record without coarse_shapes: what it rendered

    env_kwargs = recorded_env_kwargs(run_env, data.get("env_kwargs", {}))
    if env is None or env == run_env:
        given = {item.partition("=")[0].strip() for item in env_args}
        for key, value in env_kwargs.items():
            if key not in given:
                add("--env-arg", f"{key}={json.dumps(value)}")
    # Derived by default: carried where the earlier run's differ from what its own settings derive.
    if _action_repeat(run_env, env_kwargs) is not None:
        scale = data.get("loss", {}).get("reward_scale")
        if scale is not None and scale != _default_reward_scale(run_env, env_kwargs):
            add("--reward-scale", scale)
        if "desync_steps" in data and data["desync_steps"] != _default_desync_steps(run_env, env_kwargs):
            add("--desync-steps", data["desync_steps"])
    warmup = data.get("optimizer", {}).get("warmup_steps")
    if warmup is not None:
        try:
            derived = _default_lr_warmup(_learner_updates(
                data.get("total_steps", 2_000_000), data.get("unroll_length", 20), data.get("batch_size", 32),
                data.get("replay_ratio", 0.0)))
        except (TypeError, ValueError, ZeroDivisionError):  # bad values: the flags say which
            derived = None
        if warmup != derived:
            add("--lr-warmup", warmup)
    return flags


def parse_flags(parser: "CommandLineParser", argv: Optional[List[str]] = None) -> "tuple[argparse.Namespace, Optional[str], List[str]]":
    """Parses the command line; with ``--config``, the earlier run's settings (as flags) are
    added where the command line does not give them. Returns the arguments, the
    settings file (or None) and the flags it gave. A bad file or setting in it exits with a
    sentence, as a bad flag does."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is None:
        return args, None, []
    dests = {option: action.dest for action in parser._actions for option in action.option_strings}
    # Which flags the command line gives: those it leaves out keep the marker (appended ones,
    # --env-arg, are the command line's alone in ``args``).
    unset = object()
    marked = {action.dest for action in parser._actions if not isinstance(action, argparse._AppendAction)}
    parsed = vars(parser.parse_args(argv, namespace=argparse.Namespace(**{dest: unset for dest in marked})))
    given = {dest for dest in marked if parsed[dest] is not unset}
    try:
        file, data = read_config_file(args.config)
    except UsageError as exc:
        parser.error(str(exc))
    carried = config_file_flags(data, args.env if "env" in given else None, args.env_arg)
    # Left out: what the command line gives, and what the parser lacks (learner.run has no
    # actor flags).
    carried = [flag for flag in carried
               if flag.partition("=")[0] in dests and dests[flag.partition("=")[0]] not in given]
    parser.source = file
    try:  # a bad setting in the file is named as coming from it
        parser.parse_args(carried)
    finally:
        parser.source = None
    return parser.parse_args(carried + argv), file, carried


def check_output_path(path: str, flag: str, directory: bool = False) -> None:
    """Raises UsageError with a sentence when ``path`` cannot be written as ``flag``'s output.

    Checked before the work starts, without creating anything: ``path`` must be an existing
    directory (``directory``) or file, or not exist under a directory that can be written.
    """
    kind = "a directory" if directory else "a file"
    if not path:
        raise UsageError(f"{flag} is empty; give {kind}.")
    if os.path.islink(path) and not os.path.exists(path):
        raise UsageError(f"{flag} {path} is a broken symbolic link (to {os.readlink(path)}); create its target "
                         f"or give another path.")
    if os.path.exists(path) and os.path.isdir(path) != directory:
        raise UsageError(f"{flag} {path} exists and is not {kind}; give {kind}.")
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):  # the nearest existing ancestor is where it will be made
        probe = os.path.dirname(probe)
    target = probe if probe != os.path.abspath(path) or directory else os.path.dirname(probe)
    if not os.path.isdir(target):
        raise UsageError(f"{flag} {path} cannot be created: {target} is not a directory.")
    if not os.access(target, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path} cannot be written: {target} is not writable by this user.")


# The directories a run writes in its logdir.
RUN_DIR_PARTS = ("checkpoints", "policy", "summaries", "eval", "actors", "exports")


def check_logdir(path: str) -> None:
    """Raises UsageError with a sentence when ``path`` cannot be (or hold) a run directory: a
    file where one of its parts' directories goes would let a run train and then lose its
    final save."""
    check_output_path(path, "--logdir", directory=True)
    for part in RUN_DIR_PARTS:
        part_path = os.path.join(path, part)
        if os.path.lexists(part_path) and not os.path.isdir(part_path):
            raise UsageError(f"{part_path} is not a directory, and the run writes one there; move it away.")


def ignored_flags(config: RunConfig) -> List[str]:
    """Sentences for flags given that this run's other settings make do nothing (the entry
    points log them as warnings)."""
    notes = []
    if config.tpu_address and config.learner not in ("tpu", "auto"):
        notes.append(f"--tpu-address is for --learner tpu or auto; this run's learner is {config.learner}, so it "
                     "is not used.")
    if config.eval_greedy and not config.eval_episodes:
        notes.append("--eval-greedy applies to the evaluations of --eval-episodes N, and there are none "
                     "(--eval-episodes 0).")
    if config.replay_unrolls is not None and not config.replay_ratio:
        notes.append("--replay-unrolls sizes the buffer of --replay-ratio, which is 0: nothing is replayed.")
    return notes


def resumed_env_kwargs(env_id: str, env_kwargs: Dict[str, Any], logdir: str, resume: bool) -> Dict[str, Any]:
    """The env arguments of a ``dmc/`` run resumed in ``logdir`` without ``--env-arg
    coarse_shapes``: the shapes its ``config.json`` holds (a record without them: the coarse
    shapes it rendered), so that a task's default changed since the run started does not stop
    it resuming. ``env_kwargs`` as they are for a new run (no record of the same env there, or
    ``--no-resume``), which takes the task's default."""
    if not resume or "coarse_shapes" in env_kwargs or not str(env_id).startswith("dmc/"):
        return env_kwargs
    earlier = read_run_record(os.path.join(logdir, "config.json"))
    if earlier is None or earlier.get("env") != env_id:
        return env_kwargs  # no record (a new run), or another task's (the learner refuses to resume it)
    from envs.dmc import default_coarse_shapes, recorded_env_kwargs  # TF-free and light

    recorded = recorded_env_kwargs(env_id, earlier.get("env_kwargs", {}))
    shapes = recorded.get("coarse_shapes") if isinstance(recorded, dict) else None
    if not isinstance(shapes, bool):
        return env_kwargs
    default = default_coarse_shapes(env_id)
    if shapes != default:
        log.info("resuming the run in %s with coarse_shapes=%s, as it started (a new run of %s defaults to %s)",
                 logdir, str(shapes).lower(), env_id, str(default).lower())
    return {**env_kwargs, "coarse_shapes": shapes}


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Builds the RunConfig (raises ConfigError/EnvError/UsageError with a sentence on bad values)."""
    check_logdir(args.logdir)
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is not None and not os.path.isfile(path):
            raise UsageError(f"{flag} {path} is not a file; give a PEM file (README: Transport and security).")
    network: Dict[str, Any] = {"torso": args.network, "policy": args.policy, "bins": args.bins}
    if args.lstm_size is not None:
        network["lstm_size"] = args.lstm_size
    env_kwargs = resumed_env_kwargs(args.env, parse_env_kwargs(args.env_arg), args.logdir, not args.no_resume)
    reward_scale = args.reward_scale
    if reward_scale is None:
        reward_scale = _default_reward_scale(args.env, env_kwargs)
    loss = {"discount": args.discount, "entropy_cost": args.entropy_cost, "baseline_cost": args.baseline_cost,
            "reward_scale": reward_scale}
    if args.reward_clip is not None:
        loss["reward_clip"] = args.reward_clip
    if args.baseline_torso_scale != 1.0:  # runs at IMPALA's shared network keep their config.json as it was
        loss["baseline_torso_scale"] = args.baseline_torso_scale
    if args.popart:
        loss["popart"] = args.popart
        if args.popart_terms != "all":
            loss["popart_terms"] = args.popart_terms
    elif args.popart_terms != "all":
        raise UsageError(f"--popart-terms {args.popart_terms} needs --popart STEP_SIZE (e.g. 3e-4): without it "
                         "there is no sigma to put the terms on the scale of.")
    optimizer: Dict[str, Any] = {"learning_rate": args.learning_rate, "clip_norm": args.clip_norm}
    if args.rmsprop_epsilon != RMSPROP_EPSILON:  # runs at the default keep their config.json as it was
        optimizer["epsilon"] = args.rmsprop_epsilon
    if args.rmsprop_epsilon_scale != "fixed":
        if not args.popart:
            raise UsageError(f"--rmsprop-epsilon-scale {args.rmsprop_epsilon_scale} needs --popart STEP_SIZE (e.g. "
                             "3e-4): without it there is no sigma to divide epsilon by. To run without PopArt (e.g. "
                             "scripts/train.sh with --popart 0), give --rmsprop-epsilon-scale fixed as well.")
        optimizer["epsilon_scale"] = args.rmsprop_epsilon_scale
    updates = _learner_updates(args.total_steps, args.unroll_length, args.batch_size, args.replay_ratio)
    time_budget = getattr(args, "time_budget", None)
    if not args.no_anneal:
        optimizer["anneal_steps"] = updates
        if time_budget is not None:
            optimizer["anneal_seconds"] = time_budget
    optimizer["warmup_steps"] = _default_lr_warmup(updates) if args.lr_warmup is None else args.lr_warmup
    token: Optional[str] = args.token or os.environ.get("IMPALA_REP_TOKEN") or None
    return RunConfig(
        env=args.env,
        env_kwargs=env_kwargs,
        actors=getattr(args, "actors", 1),
        actor_processes=getattr(args, "actor_processes", None),
        learner=args.learner,
        replicas=args.replicas,
        tpu_address=args.tpu_address,
        unroll_length=args.unroll_length,
        batch_size=args.batch_size,
        frame_stack=args.frame_stack,
        network=network,
        loss=loss,
        optimizer=optimizer,
        total_steps=args.total_steps,
        time_budget_s=time_budget,
        seed=args.seed,
        logdir=args.logdir,
        checkpoint_interval_s=args.checkpoint_interval,
        keep_checkpoints=args.keep_checkpoints,
        resume=not args.no_resume,
        bind=args.bind,
        port=args.port,
        token=token,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        queue_unrolls=args.queue_unrolls,
        log_interval_s=args.log_interval,
        max_actor_restarts=getattr(args, "max_actor_restarts", 10),
        actor_nice=DEFAULT_ACTOR_NICE if getattr(args, "actor_nice", None) is None else args.actor_nice,
        unrolls_per_message=getattr(args, "unrolls_per_message", DEFAULT_UNROLLS_PER_MESSAGE),
        param_refresh_lag=getattr(args, "param_refresh_lag", DEFAULT_PARAM_REFRESH_LAG),
        max_actor_streams=getattr(args, "max_actor_streams", DEFAULT_MAX_ACTOR_STREAMS),
        jit_compile=args.jit,
        learner_precision=args.learner_precision,
        overlap_publish=getattr(args, "overlap_publish", "auto"),
        intake=getattr(args, "intake", "auto"),
        replay_ratio=args.replay_ratio,
        replay_unrolls=args.replay_unrolls,
        eval_episodes=args.eval_episodes,
        eval_greedy=args.eval_greedy,
        capture_spikes=args.capture_spikes,
        desync_steps=(_default_desync_steps(args.env, env_kwargs) if getattr(args, "desync_steps", None) is None
                      else args.desync_steps),
    )
