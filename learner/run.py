"""The learner process: gRPC service -> bounded queue -> batcher -> replicated V-trace step.

Also the learner-alone entry point for multi-host runs::

    python -m learner.run --env dmc/cartpole-swingup --bind 0.0.0.0 --port 50051 --token $SECRET
    python -m actors.run --learner-address LEARNER_HOST:50051 --actors 16 --token $SECRET   # on each actor host

:class:`Trainer` owns the loop: it builds the network, optimizer and replicated step,
restores the newest checkpoint of the logdir (unless told not to), serves actors, and
trains until the agent-step budget, the time budget or a stop request; it checkpoints by time with
``tf.train.CheckpointManager``, exports a TensorFlow-free policy beside every checkpoint,
and writes a progress line, ``metrics.jsonl`` and TensorBoard summaries. The gRPC service,
queue, batcher and parameter store (the intake) run in this process or, with ``--intake
process`` (the default on GPU and TPU learners), in a child process of their own
(:mod:`learner.intake`).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import numpy as np

from envs.dmc import recorded_env_kwargs
from impala_rep.config import (AUTO_SETTINGS, RunConfig, actor_view, frame_stack_keys, read_run_record,
                               resolve_intake, resolve_overlap_publish, resolve_param_refresh_lag)
from impala_rep.flags import check_logdir, configure_logging as configure_base_logging
from impala_rep.specs import ArraySpec, EnvSpec, core_state_spec, stacked_observation_specs, unroll_spec
from learner.summaries import ScalarWriter, trim_events_after

if TYPE_CHECKING:
    from learner.evaluator import EvalResult

__all__ = ["Trainer", "main", "make_learner_step", "start_trainer"]

log = logging.getLogger("impala_rep.learner")

# The loss metrics whose extreme over each logging window its record also holds, beside the
# window's last step (``loss/*``): ``window/<name>_<max|min>`` and, for the gradient norm, the
# learner step it came from (``window/grad_norm_max_step``). A transient collapse (docs/RESULTS.md,
# sixty-second session) lasts a few steps, which the last step of a 30-second window can miss.
WINDOW_EXTREMES = (("grad_norm", max), ("baseline_loss", max), ("entropy_mean", max), ("value_mean", min))

# What the divergence sentences advise, the same in each of them.
_DIVERGED_ADVICE = (
    "a lower --learning-rate or --clip-norm (or the rewards rescaled: --reward-scale, --reward-clip)"
)


def env_action_repeat(config: RunConfig) -> int:
    """Env frames per agent step (DM Control ids default to action repeat 4)."""
    if "action_repeat" in config.env_kwargs:
        return int(config.env_kwargs["action_repeat"])
    return 4 if config.env.startswith("dmc/") else 1


class Trainer:
    """Runs the learner side of a run (see module docstring)."""

    def __init__(self, config: RunConfig, env_spec: EnvSpec, replicator: Any = None):
        import tensorflow as tf

        from impala_rep.distributions import make_policy
        from impala_rep.networks import NetworkConfig
        from impala_rep.replicator import make_replicator
        self.config = config
        self.env_spec = env_spec
        self.frame_stack = frame_stack_keys(env_spec.observations, config.frame_stack)
        self.network_config = NetworkConfig(**config.network)
        self.policy = make_policy(env_spec.action, self.network_config)
        self.obs_specs = stacked_observation_specs(env_spec.observations, self.frame_stack)
        self.unroll_spec = unroll_spec(
            env_spec, config.unroll_length, self.frame_stack, core_state_spec(self.network_config), self.policy.action_spec
        )
        self.replicator = replicator or make_replicator(
            config.learner, num_replicas=config.replicas, tpu=config.tpu_address
        )
        self.step = make_learner_step(config, env_spec, self.replicator)
        self._checkpoint_options = checkpoint_options(config, self.replicator.kind)  # every save and restore
        if config.learner_precision != "float32":
            log.info("the learner's network computes in %s (mixed precision: variables, gradients and the "
                     "actors' parameters stay float32)", self.step.network.compute_dtype.name)
        if config.learner_precision == "bfloat16" and self.replicator.kind == "cpu" and cpu_has_bf16() is False:
            log.warning(
                "--learner-precision bfloat16 on a CPU without AVX512-BF16 or AMX: TensorFlow emulates bfloat16 "
                "here, so the learner step is likely slower than with float32 (the default)."
            )
        expected = {k for k in self.step.batch_spec}
        produced = {k for k in self.batch_spec()}
        if expected != produced:
            raise ValueError(
                f"internal mismatch between the learner step's batch spec and the transport's: "
                f"{sorted(expected ^ produced)}."
            )
        self._queue_capacity = config.queue_capacity
        if self._queue_capacity < config.batch_size:
            raise ValueError(
                f"--queue-unrolls {self._queue_capacity} is smaller than --batch-size {config.batch_size}; "
                "the queue must hold at least one batch."
            )
        self.agent_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="agent_steps")
        # (base seconds, monotonic start) while train() runs: see train_seconds().
        self._clock: Optional[tuple] = None
        self.checkpoint = tf.train.Checkpoint(agent_steps=self.agent_steps, **self.step.checkpoint_objects())
        check_logdir(config.logdir)  # the entry points checked it too, before their probes
        try:
            os.makedirs(config.logdir, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot create the run directory {config.logdir}: {exc.strerror or exc}.") from None
        self._lock_file = lock_run_dir(config.logdir)
        try:
            self._open_run(config)
        except BaseException:
            self._release()  # this process may go on (tests, notebooks): free the directory
            raise

    def _open_run(self, config: RunConfig) -> None:
        """The rest of __init__, run while holding the run directory: restore, queue, server,
        batcher, summaries, metrics and evaluator."""
        import tensorflow as tf

        from learner.batcher import Batcher, PrefetchingBatcher
        from learner.evaluator import PolicyEvaluator
        from learner.params import BackgroundPublisher, ParameterStore
        from learner.queue import UnrollQueue
        from learner.server import LearnerServer

        # --no-resume: the earlier run's parts are moved aside (one time stamp for all of them)
        # before anything of this run is written, so that the two runs do not mix.
        stamp = time.strftime("%Y%m%d-%H%M%S")
        if not config.resume:
            set_aside_earlier_run(config.logdir, stamp)
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, os.path.join(config.logdir, "checkpoints"), max_to_keep=config.keep_checkpoints
        )
        self.restored_from: Optional[str] = None
        if config.resume:
            if self.manager.latest_checkpoint is not None:
                check_resumed_settings(config, os.path.join(config.logdir, "config.json"), self.replicator.kind)
            self._restore(config)
        if self.restored_from:
            log.info(
                "resumed from %s at learner step %d (%d agent steps)",
                self.restored_from, self.learner_step, int(self.agent_steps.numpy()),
            )
            if self.done():
                log.warning(
                    "the run in %s has already trained %d agent steps in %.0f s, its whole budget (--total-steps "
                    "%d%s): there is nothing left to train. Raise --total-steps%s to go on with it, or pass "
                    "--no-resume to start over.", config.logdir, int(self.agent_steps.numpy()), self.train_seconds(),
                    config.total_steps, f", --time-budget {config.time_budget_s:.0f} s" if config.time_budget_s else "",
                    " or --time-budget" if config.time_budget_s else "")
        if config.resume:
            # Summaries an earlier run wrote after this checkpoint (or, with none, at all)
            # describe training that is lost; the resumed run writes its own at those steps.
            resumed_at = int(self.agent_steps.numpy())
            aside = os.path.join(config.logdir, f"after-checkpoint-{stamp}", "summaries")
            if trim_events_after(os.path.join(config.logdir, "summaries"), resumed_at, aside):
                log.info("the earlier run's summaries after the checkpoint's %d agent steps are moved to %s",
                         resumed_at, os.path.dirname(aside))
        # The learner step of the newest checkpoint: close() writes none again at the same step
        # (a run stopped before training, or one resumed with its budget spent).
        self._saved_step: Optional[int] = self.learner_step if self.restored_from else None
        self._evaluated_step: Optional[int] = self._saved_step  # the earlier run evaluated its own
        # --overlap-publish: each step's parameters are checked and encoded for the actors on a
        # thread of their own while the next step runs (auto: on GPU and TPU learners).
        self.overlap_publish = resolve_overlap_publish(config.overlap_publish, self.replicator.kind)
        # --intake: the gRPC service, queue, batcher and parameter store in this process
        # (thread) or a child process of their own (process; auto: on GPU and TPU learners).
        self.intake = resolve_intake(config.intake, self.replicator.kind)
        # --param-refresh-lag: auto is 1 on a CPU learner, 8 on GPU and TPU learners.
        self.param_refresh_lag = resolve_param_refresh_lag(config.param_refresh_lag, self.replicator.kind)
        server_options = dict(
            run_config=json.dumps(actor_view(config, self.frame_stack)),
            host=config.bind,
            port=config.port,
            token=config.token,
            tls_cert_file=config.tls_cert,
            tls_key_file=config.tls_key,
            refresh_lag=self.param_refresh_lag,
            max_streams=config.max_actor_streams,
        )
        self._submitted: collections.deque = collections.deque(maxlen=8)  # (version, metrics) handed to it
        if self.intake == "process":
            from learner.intake import ProcessIntake

            # The child checks and encodes every step's parameters (the publisher), serves the
            # actors (the server) and builds the batches (the batcher); params.version is the
            # newest version it serves. Without --overlap-publish each step waits for its publish.
            self.queue = None
            self.params = self.server = self.batcher = self._publisher = ProcessIntake(
                self.unroll_spec, config.unroll_length, batch_size=config.batch_size,
                queue_capacity=self._queue_capacity,
                initial_params=(self.learner_step + 1, self.step.get_params()[1]),
                frame_stack=self.frame_stack, replay_ratio=config.replay_ratio,
                replay_capacity=config.replay_capacity, seed=config.seed, server_options=server_options)
        else:
            self.queue = UnrollQueue(capacity=self._queue_capacity)
            self.params = ParameterStore()
            self.params.publish(self.step.get_params()[1], version=self.learner_step + 1)
            self._publisher: Optional[BackgroundPublisher] = (
                BackgroundPublisher(self.params, check=params_finite) if self.overlap_publish else None)
            self.server = LearnerServer(
                self.unroll_spec, config.unroll_length, self.queue, self.params,
                frame_stack=self.frame_stack, **server_options)
            self.batcher = PrefetchingBatcher(Batcher(
                self.queue, self.unroll_spec, config.batch_size, self.frame_stack,
                replay_ratio=config.replay_ratio, replay_capacity=config.replay_capacity, seed=config.seed))
        self.action_repeat = env_action_repeat(config)
        self._returns: collections.deque = collections.deque(maxlen=100)
        self._writer = tf.summary.create_file_writer(os.path.join(config.logdir, "summaries"))
        self._scalars = ScalarWriter(self._writer)
        self._metrics_file = open_metrics_log(os.path.join(config.logdir, "metrics.jsonl"),
                                             fresh=not config.resume, stamp=stamp)
        self._last_checkpoint = time.monotonic()
        # Set (to a sentence) when an update made the parameters non-finite: training stops and
        # nothing from that update on is saved, so the last checkpoint and export stay good.
        self.diverged: Optional[str] = None
        self.last_metrics: Dict[str, float] = {}
        self.evaluator: Optional[PolicyEvaluator] = None
        if config.eval_episodes:
            self.evaluator = PolicyEvaluator(config.logdir, config.eval_episodes, greedy=config.eval_greedy,
                                             seed=config.seed, nice=config.actor_nice)
        # --capture-spikes: the state and batches to replay a collapse of the policy with.
        self.capture = None
        if config.capture_spikes:
            from learner.capture import SpikeCapture

            self.capture = SpikeCapture(
                self.checkpoint, config.logdir, config.capture_spikes, options=self._checkpoint_options,
                describe={"config.json": config.dumps(), "env_spec.json": json.dumps(self.env_spec.to_json())})
        # Seconds of the current progress window spent waiting for a batch (queue and
        # batching), in the learner step, and publishing parameters.
        self._timing: Dict[str, float] = collections.defaultdict(float)

    def _restore(self, config: RunConfig) -> None:
        """Restores the newest checkpoint of the logdir, or says in a sentence why it cannot."""
        import tensorflow as tf

        directory = os.path.join(config.logdir, "checkpoints")
        latest = self.manager.latest_checkpoint
        if latest is None:
            saved = ([n for n in os.listdir(directory) if n.startswith("ckpt-") and n.endswith(".index")]
                     if os.path.isdir(directory) else [])
            if saved:
                raise ValueError(
                    f"{directory} holds checkpoints ({', '.join(sorted(saved)[-3:])}) but its index file "
                    "'checkpoint' names none of them (missing or corrupt): start with --no-resume or another "
                    "--logdir, or write the index back (a line: model_checkpoint_path: \"ckpt-N\")."
                )
            return
        checkpoint = self.checkpoint
        if not self._has_train_seconds(latest):
            # Written before runs recorded their training time: everything else is restored,
            # and the training time counts from 0 (a --time-budget starts in full).
            objects = dict(self.step.checkpoint_objects())
            objects.pop("train_seconds")
            checkpoint = tf.train.Checkpoint(agent_steps=self.agent_steps, **objects)
            log.info("%s does not record the training time (an older checkpoint): it counts from 0", latest)
        status = None
        try:
            status = checkpoint.restore(latest, options=self._checkpoint_options)
            status.assert_existing_objects_matched()
        except (AssertionError, ValueError, IndexError, tf.errors.OpError) as exc:
            if status is not None:  # the sentence below says what failed: no warnings about it at exit
                status.expect_partial()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(
                f"cannot resume from {latest}: it is corrupt or was written by a run with other settings "
                f"(network, env, --no-anneal, ...; TensorFlow says: {first[:300]}). Resume with the flags "
                "of the run that wrote it, or start with --no-resume or another --logdir."
            ) from None
        self.step.restore_configured_learning_rate()
        self.restored_from = latest

    @staticmethod
    def _has_train_seconds(path: str) -> bool:
        """Whether the checkpoint at ``path`` holds the training time (older ones do not);
        True when it cannot be read, so that the restore says why."""
        import tensorflow as tf

        try:
            return any(name.startswith("train_seconds/") for name, _ in tf.train.list_variables(path))
        except (tf.errors.OpError, ValueError):
            return True

    # ------------------------------------------------------------------ specs

    def batch_spec(self) -> Dict[str, ArraySpec]:
        """Spec of a learner batch [T+1, B, ...] (stacked keys as ``frames/<key>`` [T+K, B, ...])."""
        b = self.config.batch_size
        out = {}
        for key, spec in self.unroll_spec.items():
            if key.startswith("frame_prefix/"):
                continue
            if key.startswith("core_state/"):
                out[key] = spec.with_leading(b)
            elif key.startswith("observation/"):
                obs_key = key.split("/", 1)[1]
                k = self.frame_stack.get(obs_key, 1)
                if k > 1:  # the batcher's [T+K, B, H, W, C] single frames
                    name = f"frames/{obs_key}"
                    out[name] = self.env_spec.observations[obs_key].with_leading(spec.shape[0] + k - 1, b, name=name)
                else:
                    out[key] = self.obs_specs[obs_key].with_leading(spec.shape[0], b, name=key)
            else:
                out[key] = ArraySpec(key, (spec.shape[0], b) + spec.shape[1:], spec.dtype,
                                     spec.minimum, spec.maximum, spec.num_values)
        return out

    @property
    def learner_step(self) -> int:
        return int(self.step.step.numpy())

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        """Starts serving actors, then records the run's settings in LOGDIR/config.json.

        The record is written only once every start-up check has passed (a start that fails,
        e.g. on a port in use, leaves the earlier run's record as it was), and atomically.
        """
        self.server.start()
        path = os.path.join(self.config.logdir, "config.json")
        with open(path + ".tmp", "w") as f:
            f.write(self.config.dumps())
        os.replace(path + ".tmp", path)
        log.info("learner serving actors at %s; actors get new parameters every %d version(s)%s", self.server.address,
                 self.param_refresh_lag, " (--param-refresh-lag auto on a %s learner)" % self.replicator.kind
                 if self.config.param_refresh_lag == "auto" else "")
        return self.server.address

    def save(self) -> Optional[str]:
        """Writes a checkpoint and the policy export, and starts their evaluation (unless one
        still runs); None, and the run marked diverged, when the parameters are not finite."""
        from impala_rep.export import save_policy

        params = self.step.get_params()[1]
        if not params_finite(params):
            # Normally caught after the step; not when the intake process, which checks them
            # there, died before it had, or the run was interrupted between step and check.
            self.mark_diverged(f"the parameters at learner step {self.learner_step} are not finite")
            return None
        seconds = self.train_seconds()
        self.step.set_train_seconds(seconds)
        path = self.manager.save(checkpoint_number=self.learner_step, options=self._checkpoint_options)
        self._saved_step = self.learner_step
        save_policy(
            os.path.join(self.config.logdir, "policy"),
            params,
            {
                "env": self.config.env,
                "env_kwargs": dict(self.config.env_kwargs),
                "env_spec": self.env_spec.to_json(),
                "network": dict(self.config.network),
                "frame_stack": self.frame_stack,
                "learner_step": self.learner_step,
                "agent_steps": int(self.agent_steps.numpy()),
                "train_seconds": round(seconds, 1),
                "version": self.params.version,
                "checkpoint": os.path.basename(path),
            },
        )
        self._last_checkpoint = time.monotonic()
        log.info("checkpoint %s and policy export written", path)
        if self.evaluator is not None:
            self._report_eval(self.evaluator.poll())  # one that finished since the last poll is not lost
            if self.evaluator.start(self.learner_step):
                self._evaluated_step = self.learner_step
        return path

    # Seconds the last evaluation may take once training has stopped.
    FINAL_EVAL_TIMEOUT_S = 600.0
    # The shortest window that training's last record may cover (its rates divide by it).
    MIN_RECORD_WINDOW_S = 1e-3

    def _report_eval(self, result: Optional["EvalResult"]) -> None:
        import tensorflow as tf

        if result is None:
            return
        log.info("evaluation at learner step %d (%d agent steps): return %.1f ± %.1f over %d %s episodes",
                 result.learner_step, result.agent_steps, result.mean_return, result.std_return, result.episodes,
                 "greedy" if result.greedy else "sampled")
        with self._writer.as_default(step=result.agent_steps):
            tf.summary.scalar("eval/return", result.mean_return)
            tf.summary.scalar("eval/return_std", result.std_return)
        self._writer.flush()

    def close(self, save: bool = True) -> None:
        """Writes the final checkpoint and export (not again at the step of the newest one, and
        none after a divergence), then waits for their evaluation. The checkpoint comes first:
        a process killed while an evaluation runs (a container's stop deadline, a second
        Ctrl-C) has already saved everything."""
        self._announce_run_over()
        try:
            if save and self.diverged is None:
                if self._saved_step != self.learner_step:
                    self.save()
                if self.evaluator is not None and self.diverged is None:
                    self._report_eval(self.evaluator.wait(self.FINAL_EVAL_TIMEOUT_S))  # an earlier one, or the last
                    if self._saved_step == self.learner_step != self._evaluated_step:  # an earlier one ran: now the last
                        if self.evaluator.start(self.learner_step):
                            self._evaluated_step = self.learner_step
                            self._report_eval(self.evaluator.wait(self.FINAL_EVAL_TIMEOUT_S))
        finally:
            self._release()

    def _announce_run_over(self) -> None:
        """Tells the actors that the run is over before the final save and evaluation, which
        take seconds to minutes: an actor whose next call comes later than the server's drain
        at stop (a slow env, a long unroll) hears it now instead of retrying a learner that is
        gone. Not for a learner that never served (a failed start)."""
        server = getattr(self, "server", None)
        if server is None or server.port is None:
            return
        if self.intake == "thread":
            server.finish(drain=0.0)  # no wait here: the save and evaluation are the actors' time to hear it
        else:
            server.finish()  # the intake's child: it never waits

    def _release(self) -> None:
        """Closes what the trainer opened, the run directory's lock last; also after a start
        that failed part of the way (a part it did not reach is skipped)."""
        for name in ("_publisher", "evaluator", "server", "queue", "batcher", "capture", "_metrics_file", "_writer",
                     "_lock_file"):
            part = getattr(self, name, None)
            if part is not None:
                part.stop() if name == "server" else part.close()

    # ------------------------------------------------------------------ training

    def train_seconds(self) -> float:
        """Seconds spent in :meth:`train` over the run, resumes included (the checkpoints keep
        it): what ``--time-budget`` counts."""
        if self._clock is None:
            return float(self.step.train_seconds.numpy())
        base, started = self._clock
        return base + time.monotonic() - started

    def out_of_time(self) -> bool:
        return self.config.time_budget_s is not None and self.train_seconds() >= self.config.time_budget_s

    def done(self) -> bool:
        """Whether the run's budget is spent: its agent steps, or its --time-budget."""
        return int(self.agent_steps.numpy()) >= self.config.total_steps or self.out_of_time()

    def train(
        self,
        stop: Optional[threading.Event] = None,
        on_tick: Optional[Callable[[], Dict[str, Any]]] = None,
        max_learner_steps: Optional[int] = None,
    ) -> Dict[str, float]:
        """Trains until the budget (agent steps or time), ``stop``, or ``max_learner_steps`` more
        steps. The time from its call to its return adds to :meth:`train_seconds`."""
        self._clock = (float(self.step.train_seconds.numpy()), time.monotonic())
        try:
            return self._train(stop, on_tick, max_learner_steps)
        finally:
            self._settle_publisher()
            self.step.set_train_seconds(self.train_seconds())
            self._clock = None
            if self.out_of_time():
                log.info("time budget of %.0f s spent (%d agent steps trained on)",
                         self.config.time_budget_s, int(self.agent_steps.numpy()))

    def _train(self, stop, on_tick, max_learner_steps) -> Dict[str, float]:
        from learner.batcher import policy_lag
        from learner.queue import QueueClosed

        # With a time budget the learning rate anneals over the seconds trained: the variable
        # it reads is advanced about once a second.
        anneal_by_time = self.step.optimizer_config.anneal_seconds is not None
        clock_set = time.monotonic()
        cfg = self.config
        replayed = trained = 0  # unrolls in this logging window
        start_step = self.learner_step
        window_t, window_steps, window_agent = time.monotonic(), self.learner_step, int(self.agent_steps.numpy())
        extra: Dict[str, Any] = {}
        lag: Dict[str, float] = {}
        metrics: Dict[str, Any] = {}
        extremes: Dict[str, float] = {}  # this window's, by WINDOW_EXTREMES

        def close_window(now: float) -> None:
            """Writes the record and progress line of the window that ends ``now``."""
            nonlocal window_t, window_steps, window_agent, replayed, trained, extra
            elapsed = now - window_t
            steps = self.learner_step - window_steps
            agent = int(self.agent_steps.numpy()) - window_agent
            if cfg.replay_ratio > 0:
                extra = dict(extra, replayed_share=replayed / max(1, trained))
                replayed = trained = 0
            record = self._record(metrics, lag, dict(extra, **extremes), steps / elapsed, agent / elapsed)
            extremes.clear()
            self._log_progress(record)
            window_t, window_steps, window_agent = now, self.learner_step, int(self.agent_steps.numpy())

        while not self.done() and not (stop is not None and stop.is_set()):
            if max_learner_steps is not None and self.learner_step - start_step >= max_learner_steps:
                break
            if on_tick is not None:
                extra = on_tick() or {}
                if self.diverged is not None or (stop is not None and stop.is_set()):
                    break  # the tick found the run diverged or over: no step, and no save, after it
            t0 = time.perf_counter()
            try:
                batch = self.batcher.next_batch(timeout=1.0)
            except TimeoutError:
                self._timing["wait_batch"] += time.perf_counter() - t0
                continue
            except QueueClosed:
                break
            t1 = time.perf_counter()
            if anneal_by_time and time.monotonic() - clock_set >= 1.0:
                self.step.set_train_seconds(self.train_seconds())
                clock_set = time.monotonic()
            if self.capture is not None:
                self.capture.before_step(self.learner_step, batch.tensors, float(self.step.train_seconds.numpy()))
            # The step and the read of its parameters for the actors, in one call.
            metrics, (step, params) = self.step.train_and_read(batch.tensors)
            t2 = time.perf_counter()
            version = step + 1
            between = self._publisher is not None and not self.overlap_publish  # the process intake's
            if between:  # published (and checked) by the intake process before the next step
                self._publisher.submit(version, params)
                self._submitted.append((version, metrics))
                self._publisher.flush()
            if self._publisher is not None:
                if not self._settle_publisher(wait=False):
                    break  # this step's (between) or an earlier step's parameters were not finite
            elif not params_finite(params):
                self._stop_diverged(step, metrics)
                break
            if self.capture is not None:
                self.capture.after_step(metrics)
            # Agent steps count what the actors produced: replayed unrolls were counted when fresh.
            self.agent_steps.assign_add(cfg.unroll_length * batch.fresh)
            replayed += batch.batch_size - batch.fresh
            trained += batch.batch_size
            if self._publisher is None:
                self.params.publish(params, version=version)
            elif not between:
                self._publisher.submit(version, params)
                self._submitted.append((version, metrics))
            t3 = time.perf_counter()
            self._timing["wait_batch"] += t1 - t0
            self._timing["train"] += t2 - t1
            self._timing["publish"] += t3 - t2
            lag = policy_lag(batch.tensors["policy_version"], version - 1)
            self._returns.extend(float(r) for r in batch.episode_returns)
            for name, pick in WINDOW_EXTREMES:
                if name in metrics:
                    key = f"window/{name}_{pick.__name__}"
                    value = float(metrics[name])
                    if key not in extremes or pick(value, extremes[key]) != extremes[key]:
                        extremes[key] = value
                        if name == "grad_norm":
                            extremes["window/grad_norm_max_step"] = float(step)
            now = time.monotonic()
            if now - window_t >= cfg.log_interval_s:
                close_window(now)
            if now - self._last_checkpoint >= cfg.checkpoint_interval_s:
                if not self._settle_publisher():
                    break  # a checkpoint holds only parameters that passed the finite check
                if self.save() is None:
                    break  # not finite after all: nothing saved, the run stops
            if self.evaluator is not None:
                self._report_eval(self.evaluator.poll())
        # Training ended (budget, time budget, stop, or max_learner_steps): the steps trained since
        # the last record get a record of their own, so a run shorter than --log-interval records
        # what it did. Not with --log-interval never, nor after a divergence (nothing from the bad
        # step on is published; the publisher's check of the last steps is awaited first).
        if (self.learner_step > window_steps and math.isfinite(cfg.log_interval_s)
                and self._settle_publisher() and self.diverged is None):
            now = time.monotonic()
            if now - window_t >= self.MIN_RECORD_WINDOW_S:  # rates over a window this short mean nothing
                close_window(now)
        return self.last_metrics

    def _settle_publisher(self, wait: bool = True) -> bool:
        """With --overlap-publish: waits (unless not ``wait``) until the publisher has handled
        every step handed to it, and stops the run as diverged if one failed the finite check.
        True when training may go on (always without the publisher)."""
        if self._publisher is None:
            return True
        if wait:
            self._publisher.flush()
        failed = self._publisher.failed
        if failed is None:
            return True
        if self.diverged is None:
            metrics = next((m for v, m in self._submitted if v == failed), {})
            self._stop_diverged(failed - 1, metrics)
        return False

    def _stop_diverged(self, step: int, metrics) -> None:
        losses = ", ".join(f"{k} {float(np.asarray(v)):.4g}" for k, v in sorted(metrics.items()) if "loss" in k)
        self.mark_diverged(f"the update of learner step {step} made the network's parameters NaN or infinite ({losses})")

    def mark_diverged(self, what: str, version: Optional[int] = None) -> None:
        """Records that the run diverged (``what`` says how, a clause) and logs the sentence:
        :meth:`close` then saves nothing over the last checkpoint and export. Also for what the
        actors find (``impala_rep.launch``): parameters that are finite but so large that the
        policy's outputs overflow, which the learner's own check does not see; ``version`` is
        then the parameters version they overflowed with, when known."""
        if self.diverged is not None:
            return
        last = self.manager.latest_checkpoint
        # A checkpoint at learner step S holds the parameters of version S + 1: when the actors
        # found version V bad and the newest checkpoint is not older, resuming repeats it.
        if last and version is not None and self._saved_step is not None and self._saved_step + 1 >= version:
            earlier = [p for p in self.manager.checkpoints if int(p.rsplit("-", 1)[1]) + 1 < version]
            self.diverged = (
                f"{what}: the run diverged and stopped, and its last checkpoint ({os.path.basename(last)}) and "
                "exported policy already hold those parameters (or later ones), so resuming from it would diverge "
                "again. "
                + (f"Resume from {os.path.basename(earlier[-1])} (write model_checkpoint_path: \"{os.path.basename(earlier[-1])}\" "
                   f"as the first line of checkpoints/checkpoint) with {_DIVERGED_ADVICE}, or start again with "
                   "--no-resume." if earlier else
                   f"Start again with --no-resume and {_DIVERGED_ADVICE}.")
            )
            log.error("%s", self.diverged)
            return
        self.diverged = (
            f"{what}: the run diverged and stopped without saving, so "
            + (f"the last checkpoint ({os.path.basename(last)}) and exported policy are from before it. "
               if last else "no checkpoint was written. ")
            + f"Start again with {_DIVERGED_ADVICE}" + (" (it resumes from that checkpoint)." if last else ".")
        )
        log.error("%s", self.diverged)

    def _record(self, metrics, lag, extra, learner_sps: float, agent_sps: float) -> Dict[str, float]:
        record: Dict[str, Any] = {
            "time": time.time(),
            "learner_step": self.learner_step,
            "agent_steps": int(self.agent_steps.numpy()),
            "env_frames": int(self.agent_steps.numpy()) * self.action_repeat,
            "train_seconds": self.train_seconds(),
            "learner_steps_per_s": learner_sps,
            "agent_steps_per_s": agent_sps,
            "env_frames_per_s": agent_sps * self.action_repeat,
        }
        transport = self.server.snapshot_metrics()
        record["queue_fill"] = float(transport.get("queue_fill", 0.0))
        record.update({f"loss/{k}": float(np.asarray(v)) for k, v in metrics.items()})
        record.update({k: float(v) for k, v in lag.items()})
        if self._returns:  # the actors' last 100 episodes (a deque), not only this window's
            record["episode_return"] = float(np.mean(self._returns))
            record["episodes_in_return"] = len(self._returns)
        for k, v in transport.items():
            record[f"transport/{k}"] = float(v)
        record.update({k: float(v) for k, v in extra.items()})
        window = sum(self._timing.values()) or 1.0
        record.update({f"time_share/{k}": v / window for k, v in self._timing.items()})
        self._timing.clear()
        self.last_metrics = record
        self._metrics_file.write(json.dumps(record) + "\n")
        self._metrics_file.flush()
        self._scalars.write(record["agent_steps"], {k: v for k, v in record.items() if k != "time"})
        return record

    def _log_progress(self, r: Dict[str, float]) -> None:
        ret = f"{r['episode_return']:.1f}" if "episode_return" in r else "n/a"
        lag = r.get("policy_lag_mean", float("nan"))
        log.info(
            "step %d | agent steps %d | env frames/s %.0f | learner steps/s %.2f | return %s | "
            "policy lag %.1f | queue %.0f%%",
            r["learner_step"], r["agent_steps"], r["env_frames_per_s"], r["learner_steps_per_s"],
            ret, lag, 100 * r["queue_fill"],
        )


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> Optional[bool]:
    """Whether this CPU computes bfloat16 natively (the AVX512-BF16 or AMX-BF16 flag in
    ``cpuinfo``); None when that cannot be read (not Linux)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        return None
    return None


def make_learner_step(config: RunConfig, env_spec: EnvSpec, replicator: Any):
    """The replicated V-trace step a run of ``config`` trains with on ``env_spec`` (its network,
    frame stack, unroll, batch, loss and optimizer), replicated by ``replicator``."""
    from impala_rep.losses import LossConfig
    from impala_rep.networks import NetworkConfig
    from learner.step import LearnerStep, OptimizerConfig

    frame_stack = frame_stack_keys(env_spec.observations, config.frame_stack)
    return LearnerStep.from_config(
        replicator,
        NetworkConfig(**config.network),
        stacked_observation_specs(env_spec.observations, frame_stack),
        env_spec.action,
        unroll_length=config.unroll_length,
        batch_size=config.batch_size,
        loss_config=LossConfig(**config.loss),
        optimizer_config=OptimizerConfig(**config.optimizer),
        jit_compile=config.jit_compile,
        frame_stack=frame_stack,
        compute_dtype=config.learner_precision,
    )


def configure_threads(learner_threads: Optional[int], cpu_replicas: int = 1) -> None:
    """Sizes TensorFlow's thread pools (entry points only; before TF initialises).

    With ``cpu_replicas`` R > 1 (a CPU learner's logical devices), each replica's ops get
    ``learner_threads / R`` threads and R of them run at once (inter-op threads), so the
    replicas compute side by side instead of sharing one op's threads.
    """
    import tensorflow as tf

    if learner_threads:
        replicas = max(1, int(cpu_replicas))
        tf.config.threading.set_intra_op_parallelism_threads(max(1, learner_threads // replicas))
        tf.config.threading.set_inter_op_parallelism_threads(replicas if replicas > 1 else min(2, learner_threads))


# TensorFlow's environment in a process that runs the learner step, set by its entry points
# (the launcher, learner.run, the launcher's cost probe, scripts/bench_learner.py) before
# TensorFlow loads; a value already in the environment stays. TF_CPU_ALLOCATOR_USE_BFC: the
# step's CPU tensors come from TensorFlow's best-fit-with-coalescing pool, which keeps freed
# memory for the next step. Without it they come from malloc, which hands the step's large
# buffers back to the kernel and takes them again, zeroed page by page: a live synthetic run's
# learner took 30-43 page faults per agent step (0.3-0.4 with the pool), and the step on one
# replica and thread at batch 32 ran 842-951 frames/s against 1,010-1,277 with the pool, two
# CPU replicas 1,409-1,651 against 1,654-1,743 (forty-seventh session, docs/BENCHMARKS.md).
# TF_CPU_ALLOCATOR_USE_BFC=false restores malloc, except where TensorFlow turns its oneDNN
# operations on (by default on Intel hosts with AVX512 VNNI or AMX, as the fifty-second
# session's): their allocator pools CPU tensors whatever this says, and malloc takes
# TF_ENABLE_ONEDNN_OPTS=0 as well.
LEARNER_TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_CPU_ALLOCATOR_USE_BFC": "true"}


def configure_tensorflow_env() -> None:
    """Sets :data:`LEARNER_TF_ENV` where this process's environment leaves it unset (entry
    points only, before TensorFlow loads: it reads them once)."""
    for name, value in LEARNER_TF_ENV.items():
        os.environ.setdefault(name, value)


def tensorflow_cpu_memory() -> str:
    """Where this process's TensorFlow takes CPU tensors from: ``"pool"`` (its allocator keeps
    freed memory, :data:`LEARNER_TF_ENV`) or ``"malloc"``. Loads TensorFlow."""
    import tensorflow as tf

    try:
        tf.config.experimental.get_memory_info("CPU:0")  # only a pooling allocator keeps stats
    except ValueError:
        return "malloc"
    return "pool"


def configure_logging() -> None:
    configure_base_logging()  # TensorFlow's own log level: LEARNER_TF_ENV


def install_stop_handlers(stop: threading.Event) -> None:
    def handler(signum, _frame):
        if stop.is_set():
            raise KeyboardInterrupt
        log.info("received %s: stopping after the current step (again to abort)", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def lock_run_dir(logdir: str):
    """Takes the run directory for this learner (an exclusive ``flock`` on ``LOGDIR/.lock``,
    released when the process ends), so that a second learner on the same directory is a
    sentence at start. Returns the open lock file, or None where the file system cannot lock
    (a warning says so)."""
    import fcntl

    path = os.path.join(logdir, ".lock")
    try:
        lock = open(path, "a+")
    except OSError as exc:
        raise ValueError(f"cannot write {path} ({exc.strerror or exc}); give a run directory this user can write.") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise ValueError(
            f"{logdir} is in use by another learner ({holder}); two runs would overwrite each other's "
            "checkpoints. Stop it, or give this run another --logdir."
        ) from None
    except OSError as exc:  # a file system without flock (some NFS, Lustre or FUSE mounts)
        log.warning("cannot lock %s (%s): nothing stops a second learner from using this run directory",
                    path, exc.strerror or exc)
        lock.close()
        return None
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()}")
    lock.flush()
    return lock


# What --no-resume moves aside from an earlier run in the run directory, into before-<time>/
# (its metrics.jsonl is kept beside them as metrics-before-<time>.jsonl: open_metrics_log).
EARLIER_RUN_PARTS = ("checkpoints", "summaries", "policy", "eval", "exports")


def checkpoint_options(config: RunConfig, replicator_kind: str):
    """``tf.train.CheckpointOptions`` for this run's checkpoints: with a remote TPU
    (``--tpu-address grpc://...`` or a TPU name) the files are read and written by this host
    (``/job:localhost``), where --logdir is, not by the TPU worker that holds the variables
    (TensorFlow's default: each variable's host); None (TensorFlow's default) otherwise."""
    import tensorflow as tf

    if replicator_kind == "tpu" and config.tpu_address not in (None, "", "local"):
        return tf.train.CheckpointOptions(experimental_io_device="/job:localhost")
    return None


# Settings that name the task: a checkpoint is not resumed on another env (its specs may match,
# as cartpole-swingup's and cartpole-balance's do, and the restore would then succeed).
RESUME_TASK_KEYS = ("env", "env_kwargs")
# Settings that differ from one start of a run to the next without changing what it trains.
RESUME_IGNORED_KEYS = ("resume", "port", "token", "logdir", "bind", "tls_cert", "tls_key")


def check_resumed_settings(config: RunConfig, path: str, learner_kind: Optional[str] = None) -> List[str]:
    """Compares the settings of the run being resumed (its ``config.json`` at ``path``) with
    ``config``: raises ``ValueError`` with a sentence when the task differs, and logs (and
    returns) the other settings that changed, as ``"key: old -> new"``. Nothing to compare when
    the earlier run left no readable record. With ``learner_kind`` (this learner's: cpu, gpu,
    tpu), a setting of :data:`AUTO_SETTINGS` has not changed when both values mean the same
    there (an older run's ``param_refresh_lag`` of 1 and auto on a CPU learner)."""
    earlier = read_run_record(path)
    if earlier is None:
        return []
    now = json.loads(json.dumps(config.to_json()))  # tuples as lists, as in the file
    if "env_kwargs" in earlier:  # an earlier record without coarse_shapes: what it rendered
        earlier["env_kwargs"] = recorded_env_kwargs(earlier.get("env"), earlier["env_kwargs"])
    logdir = os.path.dirname(path)
    task = [k for k in RESUME_TASK_KEYS if k in earlier and earlier[k] != now.get(k)]
    if task:
        def describe(c):
            kwargs = c.get("env_kwargs") or {}
            return repr(c.get("env")) + (f" with {json.dumps(kwargs, sort_keys=True)}" if kwargs else "")

        raise ValueError(
            f"{logdir} holds a run of {describe(earlier)}, and this run is on {describe(now)}: resuming would go "
            "on training that checkpoint on another task. Pass another --logdir for a run of its own, or "
            "--no-resume to start over in this one (the earlier run is moved aside)."
        )
    def same(key):
        if earlier[key] == now[key]:
            return True
        resolve = AUTO_SETTINGS.get(key)
        if resolve is None or learner_kind is None:
            return False
        return resolve(earlier[key], learner_kind) == resolve(now[key], learner_kind)

    changed = [f"{k}: {json.dumps(earlier[k])} -> {json.dumps(now[k])}" for k in sorted(earlier)
               if k in now and k not in RESUME_IGNORED_KEYS and not same(k)]
    if changed:
        log.warning("resuming the run in %s with settings changed since its last start: %s", logdir, "; ".join(changed))
    return changed


def set_aside_earlier_run(logdir: str, stamp: str) -> Optional[str]:
    """--no-resume: moves the earlier run's checkpoints, summaries, policy export and evaluation
    reports (those of :data:`EARLIER_RUN_PARTS` that hold anything) into ``LOGDIR/before-<stamp>/``,
    so that a new run's checkpoints and TensorBoard events are not mixed with them; nothing is
    deleted. Returns that directory (None when there was nothing to move); raises ValueError
    with a sentence when a part cannot be moved, after putting back what was moved."""
    def holds_anything(path: str) -> bool:
        try:
            return bool(os.listdir(path))
        except OSError:  # unreadable: moving it says why, if it cannot
            return True

    parts = [part for part in EARLIER_RUN_PARTS
             if os.path.isdir(os.path.join(logdir, part)) and holds_anything(os.path.join(logdir, part))]
    if not parts:
        return None
    base = os.path.join(logdir, f"before-{stamp}")
    kept, n = base, 1
    while os.path.lexists(kept):  # two fresh starts in one second
        kept, n = f"{base}-{n}", n + 1
    moved = []
    try:
        os.mkdir(kept)
        for part in parts:
            os.rename(os.path.join(logdir, part), os.path.join(kept, part))
            moved.append(part)
    except OSError as exc:
        for part in reversed(moved):  # leave the run directory as it was
            try:
                os.rename(os.path.join(kept, part), os.path.join(logdir, part))
            except OSError:
                pass
        try:
            os.rmdir(kept)
        except OSError:
            pass
        raise ValueError(
            f"--no-resume cannot move the earlier run's {', '.join(parts)} aside into {kept} "
            f"({exc.strerror or exc}): move them away yourself, or give this run another --logdir."
        ) from None
    log.info("--no-resume: the earlier run's %s moved to %s", ", ".join(parts), kept)
    return kept


def open_metrics_log(path: str, fresh: bool = False, stamp: Optional[str] = None):
    """Opens ``metrics.jsonl`` for appending; a record that an earlier run left half-written
    (it was killed mid-line) is cut off first, so that the next record starts a line.

    ``fresh`` (a run started with --no-resume): an earlier run's records are kept, renamed to
    ``metrics-before-<stamp>.jsonl`` (``stamp`` defaults to the time now), instead of mixed with
    the new run's.
    """
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory, and the run writes its metrics there; move it away.")
    if fresh and os.path.isfile(path) and os.path.getsize(path) > 0:
        stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
        stem = os.path.join(os.path.dirname(path), f"metrics-before-{stamp}")
        kept, n = stem + ".jsonl", 1
        while os.path.exists(kept):  # two fresh starts in one second
            kept, n = f"{stem}-{n}.jsonl", n + 1
        os.replace(path, kept)
        log.info("--no-resume: the earlier run's metrics are kept in %s", kept)
    if os.path.isfile(path) and os.path.getsize(path) > 0:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - 65536))
            tail = f.read()
            if not tail.endswith(b"\n"):
                if b"\n" not in tail and size > len(tail):  # no record is this long: keep it, on its own line
                    f.write(b"\n")
                    return open(path, "a")
                keep = size - len(tail) + tail.rfind(b"\n") + 1 if b"\n" in tail else 0
                f.truncate(keep)
                log.warning("%s ended in a half-written record (%d bytes, from a run that was killed); "
                            "removed it", path, size - keep)
    return open(path, "a")


def params_finite(params) -> bool:
    """Whether every parameter is finite (no NaN, no inf): 0.21 ms for the shallow network's
    683k parameters on a 2-core Intel host, where the float64 sum per array this replaced
    took 0.70 ms (sixtieth session)."""
    return all(bool(np.isfinite(v).all()) for v in params.values())


def start_trainer(config: RunConfig, env_spec: EnvSpec):
    """Entry points: installs Ctrl-C/SIGTERM handlers, builds the Trainer and starts serving.

    Returns ``(trainer, stop_event)``; ``trainer`` is None after printing the sentence of a
    configuration error (no TPU, no GPU, indivisible batch, ...).
    """
    from impala_rep.flags import in_flag_terms
    from impala_rep.replicator import ReplicatorError

    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        trainer = Trainer(config, env_spec)
    except (ReplicatorError, ValueError) as exc:
        print(f"error: {in_flag_terms(str(exc))}", file=sys.stderr)
        return None, stop
    if config.learner == "cpu":
        log.info("TensorFlow's CPU tensors come from %s", "its pool" if tensorflow_cpu_memory() == "pool"
                 else "malloc (TF_CPU_ALLOCATOR_USE_BFC is not true and oneDNN's operations are off: each "
                      "step's large buffers are faulted in again)")
    from learner.intake import IntakeError  # TensorFlow-free

    try:
        trainer.start()
    except (OSError, IntakeError) as exc:  # the server could not listen (port in use, no such interface, bad TLS
        print(f"error: {exc}", file=sys.stderr)  # pair), or --intake process's child did not start
        trainer.close(save=False)
        return None, stop
    return trainer, stop


def main(argv=None) -> int:
    from impala_rep.flags import CommandLineParser, add_learner_flags, config_from_args, ignored_flags, parse_flags
    from impala_rep.probe import probe_env_spec

    configure_logging()
    configure_tensorflow_env()
    parser = CommandLineParser(
        prog="python -m learner.run",
        description="Run the learner alone; start actors elsewhere with python -m actors.run --learner-address HOST:PORT.",
    )
    add_learner_flags(parser)
    args, settings_file, carried = parse_flags(parser, argv)
    if settings_file:
        log.info("settings from %s (the flags given here override them): %s", settings_file, " ".join(carried))
    try:
        config = config_from_args(args)
        for note in ignored_flags(config):
            log.warning("%s", note)
        env_spec = probe_env_spec(config.env, config.env_kwargs)
        from impala_rep.plan import check_learner_memory, unroll_memory
        check_learner_memory(unroll_memory(config, env_spec))
    except ValueError as exc:  # PlanError too
        parser.error(str(exc))
    if config.learner == "cpu":
        # Alone on its host, a CPU learner computes on every core, in replicas side by side as
        # the launcher lays them out (one per thread that divides the batch).
        import dataclasses

        from impala_rep.launch import cpu_replicas
        from impala_rep.plan import available_cores

        threads = available_cores()
        replicas, why = cpu_replicas(config, threads)
        log.info("learner threads: %d (this host's cores); replicas: %d (%s)", threads, replicas, why)
        config = dataclasses.replace(config, replicas=replicas)
        configure_threads(threads, replicas)
    trainer, stop = start_trainer(config, env_spec)
    if trainer is None:
        return 2
    print(f"learner listening on {trainer.server.address}", flush=True)
    from learner.intake import IntakeError

    try:
        trainer.train(stop)
        return_code = 1 if trainer.diverged else 0
    except IntakeError as exc:  # --intake process: the child serving the actors is gone; save what was learned
        log.error("%s Stopping; the learner's last parameters are saved.", exc)
        return_code = 1
    except KeyboardInterrupt:  # a second Ctrl-C: stop now (close() below still saves)
        log.warning("aborted")
        return_code = 130
    finally:
        trainer.close()
    return return_code


if __name__ == "__main__":
    sys.exit(main())
