"""Train: ``python -m impala_rep.launch --env ENV --actors N --learner cpu|gpu|tpu|auto``.

Reads like the architecture: probe the env's specs (in a subprocess: TensorFlow and
MuJoCo's renderer cannot share a process) -> plan actor processes from the cores and memory
seen -> start the learner (gRPC service, queue, replicated V-trace step) in this process ->
start supervised actor processes (fresh interpreters, no TensorFlow) pointed at it -> train
until the budget or Ctrl-C/SIGTERM -> final checkpoint and policy export -> stop actors.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Optional

from impala_rep.plan import actor_process_env

__all__ = ["main", "build_parser", "choose_actor_nice", "choose_actor_processes", "choose_learner_threads", "cpu_replicas", "fill_actor_processes"]

log = logging.getLogger("impala_rep.launch")


def build_parser() -> argparse.ArgumentParser:
    from impala_rep.flags import CommandLineParser, add_actor_flags, add_learner_flags

    parser = CommandLineParser(
        prog="python -m impala_rep.launch",
        description="Train an IMPALA agent: a learner in this process, actor processes beside it.",
    )
    add_learner_flags(parser)
    add_actor_flags(parser)
    parser.add_argument_group("learner threads").add_argument(
        "--learner-threads", type=parse_learner_threads, default="auto", metavar="N|auto",
        help="TensorFlow threads of the learner, which shares this machine's cores with the actor processes; "
             "auto (default) sizes them from the env and policy costs the probe measures")
    return parser


def parse_learner_threads(text: str):
    """``--learner-threads``: a positive count or 'auto' (argparse type)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of threads or 'auto', got {text!r}")
    return value


def choose_learner_threads(requested, cores: int, costs, fallback: int = 1) -> tuple:
    """The learner's TensorFlow threads and why: ``requested`` if a number, else from ``costs``.

    ``costs`` is what :func:`impala_rep.probe.probe_env` measured (``env``, ``policy``), with
    the learner step :func:`learner.probe.probe_learner_cost` measured under ``learner`` (or
    its sentence under ``learner_error``: the step is then estimated from the policy's cost).
    Without the actors' costs (None, or an ``error`` entry) the learner gets ``fallback``
    threads (the launcher: the cores the actor processes leave, at least one).
    """
    from impala_rep.costs import LEARNER_FACTOR, learner_share, learner_threads

    if requested != "auto":
        return requested, "--learner-threads"
    if not has_actor_costs(costs):
        reason = (costs or {}).get("error", "no step costs measured (the learner computes elsewhere)")
        return fallback, f"{reason}; the cores the actor processes leave"
    env_s, forward_s, learner_s = step_costs(costs)
    threads = learner_threads(cores, env_s, forward_s, learner_s)
    share = learner_share(cores, env_s, forward_s, learner_s)
    if learner_s is None:
        why = costs.get("learner_error", "the learner step was not timed")
        learner = f"the learner step an estimated {1e3 * LEARNER_FACTOR * forward_s:.2f} ms ({why})"
    else:
        learner = f"the learner step {1e3 * learner_s:.2f} ms"
    return threads, (f"per agent step the env costs {1e3 * env_s:.2f} ms, the policy {1e3 * forward_s:.2f} ms "
                     f"and {learner} of CPU, so the learner's share of the work is {share:.2f} of {cores} cores")


def choose_actor_processes(config, cores: int, costs, planned: int, by_cost: bool) -> tuple:
    """Actor processes and why: ``--actor-processes`` if given, else the actors' share of the
    cores by measured cost when the learner computes on them (``by_cost``), else ``planned``
    (one per core, as many as there are envs)."""
    from impala_rep.costs import LIVE_ACTOR_COST, actor_processes

    if config.actor_processes is not None:
        return config.actor_processes, "--actor-processes"
    if not by_cost or not has_actor_costs(costs):
        return planned, "one per core"
    processes = actor_processes(cores, config.actors, *step_costs(costs))
    return processes, (f"the cores the learner's share of the work leaves, times {LIVE_ACTOR_COST} for what live "
                       f"actors cost over their pieces, rounded up, are {processes}")


# The actors' nice value under a CPU learner whose threads fill every core (see choose_actor_nice).
FILL_NICE = 19


def choose_actor_nice(requested: Optional[int], learner: str, threads: int, cores: int) -> tuple:
    """The actor processes' nice value and why: ``--actor-nice`` if given; else, when the learner
    computes on these cores (``learner``, resolved: ``cpu``) with a thread for every core,
    :data:`FILL_NICE`, so that the actors run in the learner's gaps (its replicas waiting for
    each other, its Python between steps) and, when it waits for unrolls, on every core (with
    one actor process per core: :func:`fill_actor_processes`); else :data:`DEFAULT_ACTOR_NICE`,
    so that the learner runs first on the cores it shares with the actors.

    Measured (docs/BENCHMARKS.md): niced actors in *one* process starve such a learner (the
    twentieth session: 2,195 agent steps/s niced, 2,870 not, the learner waiting half the time
    while one core idled); in one process per core, niced 19, they fill it (the twenty-seventh
    session, synthetic on an AMD host: 1,506 against 1,411 agent steps/s for one process at
    nice 0, five alternating pairs, and the machine busier).
    """
    from impala_rep.config import DEFAULT_ACTOR_NICE

    if requested is not None:
        return requested, "--actor-nice"
    if learner_fills_cores(learner, threads, cores):
        if cores == 1:
            return FILL_NICE, "the learner's thread fills the one core: the actors run in its gaps, while it waits for unrolls"
        return FILL_NICE, (f"the learner's {threads} threads fill the {cores} cores: the actors run in its gaps "
                           "and, while it waits for unrolls, on every core")
    return DEFAULT_ACTOR_NICE, "the learner runs first on the cores it shares with the actors"


def learner_fills_cores(learner: str, threads: int, cores: int) -> bool:
    """Whether the learner computes on this machine's cores with a thread for every one of them.

    ``learner`` is the resolved kind (``cpu``, ``gpu`` or ``tpu``; ``resolve_auto_learner`` runs
    first): ``auto`` is refused, since it may yet become a GPU learner whose threads only feed it.
    """
    if learner not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"learner_fills_cores needs the resolved learner (cpu, gpu or tpu), got {learner!r}.")
    return learner == "cpu" and threads >= cores


def fill_actor_processes(config, cores: int, processes: int, processes_why: str, filling: bool) -> tuple:
    """Actor processes once the nice value is known: when the actors were niced to fill a learner
    whose threads fill every core (``filling``: :func:`choose_actor_nice` chose :data:`FILL_NICE`
    for them), one process per core (at most one per env), so that every core has an actor to
    run while the learner waits for unrolls; ``--actor-processes`` still decides when given.
    Else ``processes`` unchanged."""
    wanted = min(cores, config.actors)
    if config.actor_processes is not None or not filling or wanted <= processes:
        return processes, processes_why
    return wanted, "one per core: niced actors fill the cores the learner's threads leave idle"


def has_actor_costs(costs) -> bool:
    """Whether the env probe timed both the env step and the policy (the thread count's inputs)."""
    return bool(costs) and "env" in costs and "policy" in costs


def step_costs(costs) -> tuple:
    """``(env, policy, learner)`` CPU seconds per agent step from probed costs that
    :func:`has_actor_costs`; ``learner`` is None when the learner step was not timed."""
    learner_s = (costs.get("learner") or {}).get("seconds_per_step")
    return costs["env"]["seconds_per_step"], costs["policy"]["seconds_per_step"], learner_s


def time_learner(config, env_spec, costs) -> None:
    """Adds the learner step's measured cost to ``costs`` (``learner``), or why not (``learner_error``)."""
    from learner.probe import probe_learner_cost

    if not has_actor_costs(costs):
        return  # the thread count will not come from costs anyway
    result = probe_learner_cost(config, env_spec)
    if "error" in result:
        costs["learner_error"] = result["error"]
    else:
        costs["learner"] = result


def cpu_replicas(config, threads: int) -> tuple:
    """Replicas of a CPU learner given ``threads`` and why: one per thread unless ``--replicas`` says.

    TensorFlow splits one replica's ops over its intra-op threads poorly: on this 2-core
    machine the shallow learner step ran 1.30-1.47x faster on 2 threads than on 1. Two
    replicas of one thread each, half the batch apiece with all-reduced gradients (the same
    update), ran 1.94x faster (docs/BENCHMARKS.md). So a CPU learner with N threads gets the
    largest replica count up to N that divides the batch. Returns ``(replicas, reason)``;
    ``replicas`` is None (the learner's own default) for GPU, TPU and auto learners.
    """
    if config.learner != "cpu":
        return config.replicas, "not a CPU learner"
    if config.replicas is not None:
        return config.replicas, "--replicas"
    replicas = max(r for r in range(1, max(1, threads) + 1) if config.batch_size % r == 0)
    return replicas, f"one per learner thread that divides the batch of {config.batch_size}"


def actor_environment(token: Optional[str]) -> dict:
    """Environment of actor processes: one BLAS and one llvmpipe thread each, EGL, the token."""
    env = actor_process_env()
    if token:
        env["IMPALA_REP_TOKEN"] = token  # not on the command line, where ps would show it
    return env


def resolve_auto_learner(config, list_devices=None):
    """``config`` with ``--learner auto`` made the kind it resolves to (TPU, else GPUs, else
    CPU, as :func:`impala_rep.replicator.make_replicator` resolves it), and why; so that a
    host without an accelerator plans its threads, replicas and actors as ``--learner cpu``
    does (replicas side by side, actors sized by cost), and one with a GPU not as a CPU
    learner. ``list_devices(kind)`` lists physical devices (default TensorFlow's, which does
    not fix TensorFlow's thread pools yet)."""
    if config.learner != "auto":
        return config, None
    if list_devices is None:
        import tensorflow as tf

        list_devices = tf.config.list_physical_devices
    if config.tpu_address not in (None, "", "local"):
        kind, why = "tpu", f"--tpu-address {config.tpu_address}"
    elif list_devices("TPU"):
        kind, why = "tpu", "a TPU is attached"
    elif list_devices("GPU"):
        kind, why = "gpu", f"{len(list_devices('GPU'))} GPU(s)"
    else:
        kind, why = "cpu", "no TPU or GPU on this host"
    return dataclasses.replace(config, learner=kind), f"--learner auto: {why}"


def main(argv=None) -> int:
    from impala_rep.plan import PlanError, available_cores, plan_actors, unroll_memory
    from impala_rep.probe import probe_env
    from learner.run import configure_logging, configure_tensorflow_env, configure_threads

    configure_logging()
    configure_tensorflow_env()  # the learner runs in this process
    parser = build_parser()
    from impala_rep.flags import config_from_args, ignored_flags, parse_flags

    args, settings_file, carried = parse_flags(parser, argv)
    if settings_file:
        log.info("settings from %s (the flags given here override them): %s", settings_file, " ".join(carried))

    cores = available_cores()
    try:
        config = config_from_args(args)
        for note in ignored_flags(config):
            log.warning("%s", note)
        config, auto_why = resolve_auto_learner(config)
        if auto_why:
            log.info("learner: %s (%s)", config.learner, auto_why)
        # A first plan for the probes; its memory is checked once the process count is chosen.
        plan = plan_actors(config.actors, config.env, config.env_kwargs, config.actor_processes, check_memory=False)
        # Sized by cost only when the learner computes on these cores (a GPU or TPU learner's
        # threads only feed it; auto is resolved above).
        by_cost = args.learner_threads == "auto" and config.learner == "cpu"
        wanted = None if not by_cost else {
            "network": dict(config.network), "frame_stack": config.frame_stack, "batch": max(plan.envs_per_process)}
        env_spec, costs = probe_env(config.env, config.env_kwargs, costs=wanted)
        if by_cost:
            time_learner(config, env_spec, costs)
        processes, processes_why = choose_actor_processes(config, cores, costs, plan.processes, by_cost)
        unrolls = unroll_memory(config, env_spec)
        plan = plan_actors(config.actors, config.env, config.env_kwargs, processes, unrolls=unrolls)
    except (ValueError, PlanError) as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:  # Ctrl-C while probing: nothing has started yet
        log.warning("interrupted before training started")
        return 130
    log.info("plan: %s (%s)", plan.describe(), processes_why)

    # The learner gets its share of the cores by cost (impala_rep.costs). Measured on 2 cores
    # with the actors niced (docs/BENCHMARKS.md): pixel cartpole trains faster with 1 learner
    # thread than with 2 (546 vs 476 agent steps/s: the actors need the CPU), the env-free
    # synthetic workload with 2 (1,015 vs 804).
    threads, why = choose_learner_threads(args.learner_threads, cores, costs, fallback=max(1, cores - plan.processes))
    log.info("learner threads: %d (%s)", threads, why)
    nice, nice_why = choose_actor_nice(args.actor_nice, config.learner, threads, cores)
    log.info("actor nice: %d (%s)", nice, nice_why)
    filling = args.actor_nice is None and learner_fills_cores(config.learner, threads, cores)
    filled, filled_why = fill_actor_processes(config, cores, plan.processes, processes_why, filling)
    if filled != plan.processes:
        try:
            plan = plan_actors(config.actors, config.env, config.env_kwargs, filled, unrolls=unrolls)
            log.info("plan: %s (%s)", plan.describe(), filled_why)  # supersedes the first (scripts read the last)
        except PlanError as exc:  # more processes than memory allows: keep the plan that fits
            log.warning("keeping %d actor process(es): %s", plan.processes, exc)
    config = dataclasses.replace(config, actor_nice=nice, actor_processes=plan.processes)  # config.json: what ran
    replicas, replicas_why = cpu_replicas(config, threads)
    if config.learner == "cpu":
        log.info("learner replicas: %d (%s)", replicas, replicas_why)
        config = dataclasses.replace(config, replicas=replicas)
    configure_threads(threads, config.replicas if config.learner == "cpu" else 1)
    from actors.supervisor import ActorSupervisor, actor_process_commands
    from learner.run import start_trainer

    trainer, stop = start_trainer(config, env_spec)
    if trainer is None:
        return 2
    supervisor = ActorSupervisor(
        actor_process_commands(trainer.server.address, plan.envs_per_process, config.seed, nice=config.actor_nice,
                               tls_ca=config.tls_cert, unrolls_per_message=config.unrolls_per_message),
        log_dir=os.path.join(config.logdir, "actors"),
        max_restarts=config.max_actor_restarts,
        env=actor_environment(config.token),
    )
    supervisor.start()

    def tick():
        supervisor.poll()
        if supervisor.diverged is not None:
            trainer.mark_diverged(supervisor.diverged, version=supervisor.diverged_version)
            stop.set()
        elif supervisor.all_given_up:
            log.error("every actor process failed past its restart limit; stopping (see %s/actors/*.log)", config.logdir)
            stop.set()
        return {"actor_processes_alive": supervisor.alive, "actor_restarts": supervisor.total_restarts}

    from learner.intake import IntakeError

    status = 0
    try:
        trainer.train(stop, on_tick=tick)
        if supervisor.all_given_up or trainer.diverged:
            status = 1
    except IntakeError as exc:  # --intake process: the child serving the actors is gone; save what was learned
        log.error("%s Stopping; the learner's last parameters are saved.", exc)
        status = 1
    except KeyboardInterrupt:
        log.warning("aborted")
        status = 130
    finally:
        supervisor.stop()
        trainer.close()
    log.info("done: %d learner steps, %d agent steps; run directory %s",
             trainer.learner_step, int(trainer.agent_steps.numpy()), config.logdir)
    return status


if __name__ == "__main__":
    sys.exit(main())
