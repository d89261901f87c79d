"""Train: ``python -m impala_rep.launch --env ENV --actors N --learner cpu|gpu|tpu|auto``.

Reads like the architecture: probe the env's specs (in a subprocess: TensorFlow and
MuJoCo's renderer cannot share a process) -> plan actor processes from the cores and memory
seen -> start the learner (gRPC service, queue, replicated V-trace step) in this process ->
start supervised actor processes (fresh interpreters, no TensorFlow) pointed at it -> train
until the budget or Ctrl-C/SIGTERM -> final checkpoint and policy export -> stop actors.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional

__all__ = ["main", "build_parser", "actor_commands"]

log = logging.getLogger("impala_rep.launch")


def build_parser() -> argparse.ArgumentParser:
    from impala_rep.flags import add_actor_flags, add_learner_flags

    parser = argparse.ArgumentParser(
        prog="python -m impala_rep.launch",
        description="Train an IMPALA agent: a learner in this process, actor processes beside it.",
    )
    add_learner_flags(parser)
    add_actor_flags(parser)
    return parser


def actor_commands(
    address: str, envs_per_process: List[int], seed: int, token_env: bool, tls_ca: Optional[str], nice: int = 0
) -> List[List[str]]:
    commands = []
    for i, n in enumerate(envs_per_process):
        cmd = [sys.executable, "-m", "actors.run", "--learner-address", address, "--actors", str(n),
               "--actor-processes", "1", "--actor-id", f"actor-{i}", "--seed", str(seed + 1000 * (i + 1)),
               "--nice", str(nice)]
        if tls_ca:
            cmd += ["--tls-ca", tls_ca]
        commands.append(cmd)
    return commands


def actor_environment(token: Optional[str]) -> dict:
    """Environment of actor processes: one BLAS and one llvmpipe thread each, EGL, the token."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "LP_NUM_THREADS"):
        env[var] = "1"
    env.setdefault("MUJOCO_GL", "egl")
    if token:
        env["IMPALA_REP_TOKEN"] = token  # not on the command line, where ps would show it
    return env


def main(argv=None) -> int:
    from impala_rep.plan import PlanError, available_cores, plan_actors
    from impala_rep.probe import probe_env_spec
    from learner.run import configure_logging, configure_threads

    configure_logging()
    parser = build_parser()
    args = parser.parse_args(argv)
    from impala_rep.flags import config_from_args

    try:
        config = config_from_args(args)
        plan = plan_actors(config.actors, config.env, config.env_kwargs, config.actor_processes)
        env_spec = probe_env_spec(config.env, config.env_kwargs)
    except (ValueError, PlanError) as exc:
        parser.error(str(exc))
    log.info("plan: %s", plan.describe())

    # The learner gets the cores the actor processes leave (at least one). Measured on 2 cores
    # with the actors niced (docs/BENCHMARKS.md): pixel cartpole trains faster with 1 learner
    # thread than with 2 (546 vs 476 agent steps/s: the actors need the CPU), the env-free
    # synthetic workload with 2 (1,015 vs 804); IMPALA_REP_LEARNER_THREADS overrides.
    configure_threads(int(os.environ.get("IMPALA_REP_LEARNER_THREADS", max(1, available_cores() - plan.processes))))
    from actors.supervisor import ActorSupervisor
    from learner.run import start_trainer

    trainer, stop = start_trainer(config, env_spec)
    if trainer is None:
        return 2
    supervisor = ActorSupervisor(
        actor_commands(trainer.server.address, plan.envs_per_process, config.seed, bool(config.token), config.tls_cert,
                       nice=config.actor_nice),
        log_dir=os.path.join(config.logdir, "actors"),
        max_restarts=config.max_actor_restarts,
        env=actor_environment(config.token),
    )
    supervisor.start()

    def tick():
        supervisor.poll()
        if supervisor.all_given_up:
            log.error("every actor process failed past its restart limit; stopping (see %s/actors/*.log)", config.logdir)
            stop.set()
        return {"actor_processes_alive": supervisor.alive, "actor_restarts": supervisor.total_restarts}

    status = 0
    try:
        trainer.train(stop, on_tick=tick)
        if supervisor.all_given_up:
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
