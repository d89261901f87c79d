"""Actor entry point: ``python -m actors.run --learner-address HOST:PORT --actors N``.

Hosts N envs in one process with batched NumPy inference (``--actor-processes P`` starts P
supervised processes sharing the N envs instead). Everything else — env id and arguments,
network, unroll length, frame stacking — comes from the learner's handshake, so an actor
host needs only the address (and the token, via ``--token`` or ``$IMPALA_REP_TOKEN``).
Never imports TensorFlow.
"""

import os

from impala_rep.config import DEFAULT_PARAM_PREFETCH_STEPS, DEFAULT_UNROLLS_PER_MESSAGE  # the standard library only
from impala_rep.plan import ACTOR_THREAD_ENV  # TensorFlow- and NumPy-free

# Entry point: one BLAS/OpenMP thread per actor process and llvmpipe rendering in the
# calling thread, set before NumPy or Mesa load (a value already set stays).
for _var, _value in ACTOR_THREAD_ENV.items():
    os.environ.setdefault(_var, _value)

import argparse  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from typing import List, Optional  # noqa: E402

__all__ = ["main", "build_actor", "build_parser", "lower_priority", "stats_line", "StatsReporter", "STATS_INTERVAL_S"]

log = logging.getLogger("impala_rep.actor")

# How often an actor process logs its rate and the CPU its loop spends per agent step on each
# part (env, policy, emit, other). scripts/benchmark.py reads these lines.
STATS_INTERVAL_S = 20.0


def stats_line(actor_id: str, before, after, seconds: float) -> Optional[str]:
    """The periodic report between two snapshots of an actor's stats
    (:meth:`actors.actor.ActorStats.snapshot`), or None when it took no step (it waited for the learner)."""
    steps = after[0] - before[0]
    if steps <= 0 or seconds <= 0:
        return None
    parts = ", ".join(f"{k} {1e3 * (after[1][k] - before[1][k]) / steps:.3f}" for k in after[1])
    return (f"{actor_id}: {steps} agent steps in {seconds:.1f} s ({steps / seconds:.1f}/s); "
            f"CPU ms per agent step: {parts}")


class StatsReporter(threading.Thread):
    """Logs :func:`stats_line` for ``stats`` (an :class:`actors.actor.ActorStats` the actor's
    thread updates) every ``interval`` seconds until ``stop`` is set."""

    def __init__(self, actor_id: str, stats, stop: threading.Event, interval: float = STATS_INTERVAL_S):
        super().__init__(name="actor-stats", daemon=True)
        self._id, self._stats, self._halt, self._interval = actor_id, stats, stop, float(interval)

    def run(self) -> None:
        import time

        before, t0 = self._stats.snapshot(), time.monotonic()
        while not self._halt.wait(self._interval):
            after, t1 = self._stats.snapshot(), time.monotonic()
            line = stats_line(self._id, before, after, t1 - t0)
            if line:
                log.info("%s", line)
            before, t0 = after, t1


def build_actor(client, num_envs: int, seed: int, prefetch_lead: int = DEFAULT_PARAM_PREFETCH_STEPS):
    """Makes envs, network and policy from the handshake; returns an :class:`Actor`.

    ``prefetch_lead``: the steps before each unroll boundary at which the actor asks for newer
    parameters (0: at the boundary, waiting for the reply); at most the unroll length - 1.
    """
    import envs
    from actors.actor import Actor
    from impala_rep.distributions import make_policy
    from impala_rep.networks import NetworkConfig
    from impala_rep.networks.numpy_backend import NumpyNetwork
    from impala_rep.specs import env_spec_from_dm_env, stacked_observation_specs, unroll_spec

    hs = client.connect()
    cfg = hs.run_config_dict()
    for key in ("env", "env_kwargs", "network"):
        if key not in cfg:
            raise ValueError(
                f"the learner's run_config lacks {key!r}; is {client.address} an impala_rep learner of this version?"
            )
    from impala_rep.config import MAX_DESYNC_STEPS, valid_desync_steps

    desync = cfg.get("desync_steps", 0)
    if not valid_desync_steps(desync):
        raise ValueError(
            f"the learner's run_config has desync_steps={desync!r}; expected a whole number of agent steps "
            f"from 0 to {MAX_DESYNC_STEPS}. Is {client.address} an impala_rep learner of this version?"
        )
    env_list = [envs.make(cfg["env"], seed=seed + i, **cfg["env_kwargs"]) for i in range(num_envs)]
    env_spec = env_spec_from_dm_env(env_list[0])
    try:
        net_config = NetworkConfig(**cfg["network"])
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"the learner's network settings {cfg['network']!r} are not ones this actor can build ({exc}); "
            f"is {client.address} an impala_rep learner of this version?"
        ) from None
    policy = make_policy(env_spec.action, net_config)
    frame_stack = dict(hs.frame_stack)
    network = NumpyNetwork(net_config, stacked_observation_specs(env_spec.observations, frame_stack), env_spec.action)
    core_state = {
        name: hs.unroll_spec[f"core_state/{name}"] for name in network.initial_state(1)
        if f"core_state/{name}" in hs.unroll_spec
    }
    local = unroll_spec(env_spec, hs.unroll_length, frame_stack, core_state, policy.action_spec)
    mismatched = sorted(
        k for k in set(local) | set(hs.unroll_spec)
        if k not in local or k not in hs.unroll_spec
        or (local[k].shape, local[k].dtype) != (hs.unroll_spec[k].shape, hs.unroll_spec[k].dtype)
    )
    if mismatched:
        raise ValueError(
            f"the env {cfg['env']!r} made on this host does not match the learner's unroll spec "
            f"(differing tensors: {mismatched}); use the same impala_rep version and env arguments on both."
        )
    version = 0
    fresh = client.get_parameters()
    if fresh is not None:
        version, params = fresh
        network.set_params(params)

    def sink_many(unrolls):
        client.send_many([(u.tensors, u.policy_version, u.episode_returns, u.episode_lengths) for u in unrolls])

    def fetch(have_version):
        fresh = client.get_parameters()
        return (have_version, None) if fresh is None else fresh

    lead = min(int(prefetch_lead), hs.unroll_length - 1)
    return Actor(env_list, network, policy, hs.unroll_length, frame_stack, sink_many=sink_many, fetch_params=fetch,
                 seed=seed, policy_version=version, desync_steps=desync,
                 prefetch_params=client.prefetch_parameters, prefetch_lead=lead)


def lower_priority(nice: int) -> str:
    """Lowers this process's CPU priority by ``nice`` (0-19); returns what was done.

    Actors produce faster than a shared-core learner consumes, and the queue between them is
    bounded, so the learner should get the CPU first: it then runs as fast as it can and the
    actors fill the rest (when the learner waits for data, it sleeps and the actors get
    everything). Call it before any thread starts; threads inherit the value.

    With Linux autogroup scheduling, CPU is shared between *sessions* first and nice only
    orders threads inside one session. An actor process that leads its own session (as the
    launcher starts them) therefore also sets its session group's nice
    (``/proc/self/autogroup``); one that shares a session with other processes (say, a shell's
    learner) does not, since that would slow them down too. Measured on 2 cores
    (docs/BENCHMARKS.md): without it the learner's compute thread got 0.52 of a core and
    waited runnable 0.40, because 3 sessions split 2 cores.
    """
    if nice <= 0:
        return "normal priority"
    os.nice(nice)
    done = f"nice +{nice}"
    autogroup = "/proc/self/autogroup"
    if os.getsid(0) == os.getpid() and os.path.exists(autogroup):
        try:
            with open(autogroup, "w") as f:
                f.write(str(nice))
            done += ", session group too"
        except OSError as exc:  # e.g. a kernel or container that refuses the write
            done += f" (session group unchanged: {exc.strerror})"
    return done


def check_address(address: str) -> Optional[str]:
    """None for a usable HOST:PORT (``[::1]:PORT`` for IPv6), else the sentence saying why not."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or host in ("[", "[]"):
        return f"--learner-address must be HOST:PORT, got {address!r}."
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"--learner-address {address!r}: the port must be a number from 1 to 65535, got {port!r}."
    return None


def build_parser() -> argparse.ArgumentParser:
    from impala_rep.flags import MAX_ACTOR_SEED, CommandLineParser, seed_type  # TensorFlow-free

    parser = CommandLineParser(prog="python -m actors.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--learner-address", required=True, help="HOST:PORT of the learner")
    parser.add_argument("--actors", type=int, default=1, help="envs acting in parallel (default 1)")
    parser.add_argument("--actor-processes", type=int, default=1, help="processes sharing the envs (default 1)")
    parser.add_argument("--actor-id", default=None, help="name in the learner's metrics (default actor-PID)")
    parser.add_argument("--seed", type=seed_type(MAX_ACTOR_SEED), default=None,
                        help="seeds the envs and the action sampling (default: drawn at random and logged, so that "
                             "actor hosts started alike do not act alike; give it to repeat a run)")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="with --actor-processes above 1: each process logs to DIR/actor-I.log, and a crash "
                             "quotes its last lines (default: they log to this process's output)")
    parser.add_argument("--token", default=None, help="the learner's shared token (default $IMPALA_REP_TOKEN)")
    parser.add_argument("--tls-ca", default=None, help="PEM certificate to trust; enables TLS")
    parser.add_argument("--give-up-after", type=float, default=300.0,
                        help="seconds without the learner before exiting (default 300; inf: never)")
    parser.add_argument("--max-actor-restarts", type=int, default=10)
    parser.add_argument("--unrolls-per-message", type=int, default=DEFAULT_UNROLLS_PER_MESSAGE,
                        help=f"unrolls packed into one gRPC message (default {DEFAULT_UNROLLS_PER_MESSAGE}; "
                             "1: one per message)")
    parser.add_argument("--param-prefetch-steps", type=int, default=DEFAULT_PARAM_PREFETCH_STEPS, metavar="N",
                        help=f"ask the learner for newer parameters N agent steps before each unroll boundary, so "
                             f"the reply arrives while the envs step (default {DEFAULT_PARAM_PREFETCH_STEPS}; 0: ask at "
                             "the boundary and wait for it; at most the unroll length - 1 is used)")
    parser.add_argument("--nice", type=int, default=0,
                        help="lower the actor processes' CPU priority by this much, 0-19, so that a learner on "
                             "the same machine gets the CPU first (default 0; the launcher passes 10)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    from impala_rep.flags import MAX_ACTOR_SEED, configure_logging  # TensorFlow-free

    configure_logging()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.actors < 1:
        parser.error(f"--actors must be at least 1, got {args.actors}.")
    if not 1 <= args.actor_processes <= args.actors:
        parser.error(f"--actor-processes must be between 1 and --actors ({args.actors}), got {args.actor_processes}.")
    address_problem = check_address(args.learner_address)
    if address_problem:
        parser.error(address_problem)
    if not 0 <= args.nice <= 19:
        parser.error(f"--nice must be between 0 and 19, got {args.nice}.")
    if args.unrolls_per_message < 1:
        parser.error(f"--unrolls-per-message must be at least 1, got {args.unrolls_per_message}.")
    if args.param_prefetch_steps < 0:
        parser.error(f"--param-prefetch-steps must be 0 or more agent steps, got {args.param_prefetch_steps}.")
    if not args.give_up_after > 0:  # NaN and 0 too; inf is "never"
        parser.error(f"--give-up-after must be a positive number of seconds (or inf: never), got {args.give_up_after}.")
    if args.max_actor_restarts < 0:
        parser.error(f"--max-actor-restarts must be 0 or more, got {args.max_actor_restarts}.")
    if args.tls_ca is not None and not os.path.isfile(args.tls_ca):
        parser.error(f"--tls-ca {args.tls_ca} is not a file; give the learner's PEM certificate.")
    if args.seed is None:
        import secrets

        # Room for the supervised processes' offsets (seed + 1000 * (i + 1)).
        args.seed = secrets.randbelow(MAX_ACTOR_SEED - 1000 * (args.actor_processes + 1))
        log.info("seed %d (drawn at random; --seed %d repeats it)", args.seed, args.seed)
    elif args.actor_processes > 1 and args.seed + 1000 * args.actor_processes > MAX_ACTOR_SEED:
        parser.error(f"--seed {args.seed} leaves no room for the {args.actor_processes} actor processes' seeds "
                     f"(process i gets seed + 1000 * (i + 1)); give a seed of at most "
                     f"{MAX_ACTOR_SEED - 1000 * args.actor_processes}.")
    if args.log_dir is not None and args.actor_processes == 1:
        parser.error("--log-dir names where --actor-processes' processes log; with one process the output is "
                     "this process's own (redirect it instead).")
    token = args.token or os.environ.get("IMPALA_REP_TOKEN") or None

    if args.actor_processes > 1:
        return _supervise(args, token)
    priority = lower_priority(args.nice)  # before any thread starts

    from actors.actor import PolicyDivergedError
    from actors.client import LearnerClient, LearnerFinishedError, LearnerUnavailableError, TransportError
    from actors.supervisor import DIVERGED_EXIT_CODE, FINISHED_EXIT_CODE, SUPERVISED_ENV

    stop = threading.Event()
    actor_id = args.actor_id or f"actor-{os.getpid()}"
    client = LearnerClient(args.learner_address, token=token, root_certificates=args.tls_ca,
                           actor_id=actor_id, unrolls_per_message=args.unrolls_per_message,
                           give_up_after_s=None if math.isinf(args.give_up_after) else args.give_up_after)

    def on_signal(*_):
        # From a thread: Event.set() inside a handler can deadlock on a lock the interrupted
        # main thread holds. interrupt() ends a wait for an absent learner, which stop alone
        # would not (the handshake retries for --give-up-after seconds).
        threading.Thread(target=lambda: (stop.set(), client.interrupt()), daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        actor = build_actor(client, args.actors, args.seed, args.param_prefetch_steps)
        log.info("%s: %d env(s), policy version %d, streaming to %s, %s",
                 actor_id, args.actors, actor.policy_version, args.learner_address, priority)
        StatsReporter(actor_id, actor.stats, stop).start()
        actor.run(stop)
    except LearnerUnavailableError as exc:
        log.error("%s", exc)
        return 3
    except LearnerFinishedError as exc:
        log.info("%s: %s Stopping.", actor_id, exc)
        return FINISHED_EXIT_CODE if os.environ.get(SUPERVISED_ENV) == "1" else 0
    except PolicyDivergedError as exc:
        log.error("%s", exc)
        return DIVERGED_EXIT_CODE
    except (TransportError, ValueError) as exc:
        if stop.is_set() and isinstance(exc, TransportError):
            log.info("%s: stopped while waiting for the learner at %s", actor_id, args.learner_address)
            return 0
        log.error("%s", exc)
        return 2
    finally:
        client.close(drain=False, timeout=2.0)
    return 0


def _supervise(args, token: Optional[str]) -> int:
    import time

    from actors.supervisor import DIVERGED_EXIT_CODE, ActorSupervisor, actor_process_commands
    from impala_rep.plan import split_envs

    # This mostly idle parent keeps its own priority.
    commands = actor_process_commands(
        args.learner_address, split_envs(args.actors, args.actor_processes), args.seed,
        id_prefix=args.actor_id or f"actor-{os.getpid()}", nice=args.nice, tls_ca=args.tls_ca, give_up_after=args.give_up_after,
        unrolls_per_message=args.unrolls_per_message, param_prefetch_steps=args.param_prefetch_steps)
    env = dict(os.environ)
    if token:
        env["IMPALA_REP_TOKEN"] = token
    try:
        sup = ActorSupervisor(commands, log_dir=args.log_dir, max_restarts=args.max_actor_restarts, env=env)
    except OSError as exc:
        log.error("cannot write the actor processes' logs in --log-dir %s (%s); give a writable directory.",
                  args.log_dir, exc.strerror or exc)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    sup.start()
    try:
        while not stop.is_set() and not sup.all_done and sup.diverged is None:
            sup.poll()
            time.sleep(1.0)
    finally:
        sup.stop()
    if sup.diverged is not None:
        log.error("%s; stopping every actor process.", sup.diverged)
        return DIVERGED_EXIT_CODE
    if sup.all_finished:
        log.info("the learner's run is over; every actor process has stopped.")
        return 0
    return 1 if sup.all_done else 0


if __name__ == "__main__":
    sys.exit(main())
