"""How many actor processes, and how many envs each: chosen from the cores and memory seen.

TensorFlow-free. Figures measured on a 2-core, 24 GiB machine (DESIGN.md and
``scripts/bench_launch.py``): an actor process with NumPy, dm_control and gRPC is about
210 MB resident before its envs; each rendered 84x84 DM Control env adds about 15 MB with
either render preset while the envs share their rendering contexts (``envs.render_share``,
the default; measured with 17 walker-walk envs in one process), and with contexts of their
own (``share_context=false``) about 45 MB with ``fast`` and about 80 MB with ``standard``
(MuJoCo's offscreen buffers: the 2048-texel shadow map and multisampling); a TensorFlow
learner is about 1.2 GB. The unrolls (:class:`UnrollMemory`) come on top, counted from
their sizes: the run's observations and buffer lengths. For the benchmark's cartpole run (32
envs in 2 processes, 84x84 pixels, batches of 32) that gives 2.4 GiB in all, where the
launcher's processes peaked at 2.2 GiB together (forty-third session).
Batched inference amortises per-call cost, so fewer processes hosting many envs each beat
many single-env processes; more processes than cores only adds switching.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import List, Optional

__all__ = ["ActorPlan", "UnrollMemory", "unroll_memory", "check_learner_memory", "plan_actors", "split_envs", "available_memory_mb", "available_cores", "PlanError", "ACTOR_THREAD_ENV",
           "actor_process_env"]

# Set in every actor process (and in the env probe, which times the actors' work, and the
# benchmark's pieces), since the plan runs a process per core: one BLAS/OpenMP thread, and
# Mesa's llvmpipe rasterising in the calling thread (LP_NUM_THREADS=0: no render thread).
# Measured on 2-core hosts (84x84, `fast` preset, one process): a render thread (=1) costs
# the handoff to it on every frame; without it, the same pixels, bit for bit, and
# cartpole-swingup 1,830-1,900 agent steps per CPU second against 1,380-1,600,
# walker-walk 1,319 against 1,164, cheetah-run 1,644 against 1,423.
ACTOR_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LP_NUM_THREADS": "0"}


def actor_process_env() -> dict:
    """This process's environment for a child that runs envs as the actors do (actor processes,
    the env probe, the evaluator): :data:`ACTOR_THREAD_ENV`, MuJoCo on EGL unless set."""
    env = dict(os.environ)
    env.update(ACTOR_THREAD_ENV)
    env.setdefault("MUJOCO_GL", "egl")
    return env

PROCESS_BASE_MB = 210
LEARNER_MB = 1200
ENV_MB = {"dmc-shared": 15, "dmc-fast": 45, "dmc-standard": 80, "small": 2}
MEMORY_HEADROOM = 0.85  # plan to use at most this share of the memory available


@dataclasses.dataclass(frozen=True)
class UnrollMemory:
    """What a run's unrolls take in memory, which grows with the observation size and the
    buffers' lengths (:data:`LEARNER_MB` and :data:`ENV_MB` do not). ``unroll_bytes``: one unroll
    as it travels; ``learner_unrolls``: how many the learner holds at most, apart from the actors'
    streams (its queue, its replay buffer, and the batches being filled, handed over and trained
    on); ``per_stream``: the unrolls of one message, which an actor process holds while sending
    and the learner's handler for its stream while the queue is full; ``input_bytes``: the
    learner step's float input, frames stacked (a batch of observations, 4 bytes an element).
    An unroll is as the learner's spec has it: with the recurrent state (an LSTM's) and the
    action as the policy emits it."""

    unroll_bytes: int
    learner_unrolls: int
    per_stream: int
    input_bytes: int = 0

    # Messages one actor process's stream holds at most: in the actor, the one being built,
    # its client's outbox (4) and those sent but not yet acknowledged (5, resent after a
    # reconnect: actors/client.py); in the learner, 2 (learner/queue.py: a queued unroll keeps
    # its message alive).
    MESSAGES_PER_STREAM = 1 + 4 + 5 + 2

    def mb(self, actors: int, processes: int) -> int:
        """MiB for ``actors`` envs in ``processes`` processes: each env builds one unroll."""
        unrolls = self.learner_unrolls + self.MESSAGES_PER_STREAM * processes * self.per_stream + actors
        return math.ceil((unrolls * self.unroll_bytes + self.input_bytes) / 2**20)


def _buffers_hint(held_mb: float, unrolls: UnrollMemory) -> str:
    return (f"the learner's buffers alone hold about {held_mb / 1024:.1f} GiB of "
            f"{unrolls.unroll_bytes / 2**20:.2f}-MB unrolls: use a smaller --replay-unrolls, "
            "--queue-unrolls, --batch-size or --unroll-length, or smaller observations")


def check_learner_memory(unrolls: UnrollMemory, memory_mb: Optional[int] = None) -> None:
    """Raises :class:`PlanError` when a learner alone on this host (``learner.run``; its actors
    elsewhere) cannot hold its buffers: the learner's share of :func:`plan_actors`'s check."""
    memory_mb = available_memory_mb() if memory_mb is None else memory_mb
    held = unrolls.mb(actors=0, processes=0)
    if LEARNER_MB + held > int(memory_mb * MEMORY_HEADROOM):
        raise PlanError(
            f"the learner needs about {(LEARNER_MB + held) / 1024:.1f} GiB ({LEARNER_MB} MB, and {held} MB for its "
            f"buffers), but only {memory_mb / 1024:.1f} GiB is available: {_buffers_hint(held, unrolls)}."
        )


def unroll_memory(config, env_spec) -> UnrollMemory:
    """The :class:`UnrollMemory` of ``config`` (a :class:`impala_rep.config.RunConfig`) on an
    env of ``env_spec`` (:class:`impala_rep.specs.EnvSpec`)."""
    from impala_rep.config import frame_stack_keys
    from impala_rep.distributions import make_policy
    from impala_rep.networks import NetworkConfig
    from impala_rep.specs import core_state_spec, unroll_spec

    stacks = frame_stack_keys(env_spec.observations, config.frame_stack)
    network = NetworkConfig(**config.network)
    spec = unroll_spec(env_spec, config.unroll_length, stacks, core_state_spec(network),
                       make_policy(env_spec.action, network).action_spec)
    steps = config.unroll_length + 1
    frames = sum(math.prod(obs.shape) * stacks.get(key, 1) for key, obs in env_spec.observations.items())
    return UnrollMemory(
        unroll_bytes=sum(s.nbytes for s in spec.values()),
        learner_unrolls=config.queue_capacity + config.replay_capacity + 4 * config.batch_size,
        per_stream=config.unrolls_per_message,
        input_bytes=steps * config.batch_size * frames * 4,
    )


class PlanError(ValueError):
    """The requested run cannot fit on this machine; the message says what would."""


@dataclasses.dataclass(frozen=True)
class ActorPlan:
    processes: int
    envs_per_process: List[int]
    estimated_mb: int
    available_mb: int

    def describe(self) -> str:
        envs = sum(self.envs_per_process)
        sizes = sorted(set(self.envs_per_process))
        per = "/".join(str(s) for s in sizes)
        return (
            f"{envs} actors in {self.processes} process(es) ({per} envs each); "
            f"estimated memory {self.estimated_mb / 1024:.1f} GiB of {self.available_mb / 1024:.1f} GiB available"
        )


CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _cgroup_dirs(controller: str, root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> List[str]:
    """The directories of this process's cgroup that hold ``controller``'s limits, innermost
    first up to the mount's root: cgroup v2's unified tree, or v1's ``root/controller``. A
    container sees its own cgroup as the mount's root, where the path named in ``proc_cgroup``
    (the host's) does not exist: the root is then the one directory."""
    lines = (_read(proc_cgroup) or "").splitlines()
    unified = os.path.exists(os.path.join(root, "cgroup.controllers"))
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if unified and controllers == "":
            mount = root
        elif not unified and controller in controllers.split(","):
            mount = os.path.join(root, controller)
        else:
            continue
        dirs, here = [], os.path.normpath(os.path.join(mount, path.lstrip("/")))
        if not os.path.isdir(here):
            here = mount
        while True:
            dirs.append(here)
            if os.path.normpath(here) == os.path.normpath(mount):
                return dirs
            here = os.path.dirname(here)
    return []


def cgroup_cpu_limit(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> Optional[float]:
    """The CPU quota of this process's cgroups in cores (cgroup v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), the smallest along the path; None if none."""
    limits = []
    for d in _cgroup_dirs("cpu", root, proc_cgroup):
        v2 = _read(os.path.join(d, "cpu.max"))
        if v2 is not None:
            quota, _, period = v2.partition(" ")
        else:
            quota, period = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
        try:
            q, p = float(quota), float(period)
        except (TypeError, ValueError):  # "max", or nothing there
            continue
        if q > 0 and p > 0:
            limits.append(q / p)
    return min(limits) if limits else None


def cgroup_memory_available_mb(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> Optional[int]:
    """What this process's cgroups leave of their memory limit, in MiB (the limit less the
    usage, reclaimable inactive file pages not counted as used); None if no limit is set."""
    left = []
    for d in _cgroup_dirs("memory", root, proc_cgroup):
        v2 = _read(os.path.join(d, "memory.max"))
        limit = v2 if v2 is not None else _read(os.path.join(d, "memory.limit_in_bytes"))
        usage = _read(os.path.join(d, "memory.current" if v2 is not None else "memory.usage_in_bytes"))
        try:
            limit_b, usage_b = int(limit), int(usage)
        except (TypeError, ValueError):  # "max", or nothing there
            continue
        if limit_b >= 2**60:  # cgroup v1's "no limit"
            continue
        inactive = 0
        for line in (_read(os.path.join(d, "memory.stat")) or "").splitlines():
            key, _, value = line.partition(" ")
            if key in ("inactive_file", "total_inactive_file") and value.isdigit():
                inactive = max(inactive, int(value))
        left.append(max(0, limit_b - max(0, usage_b - inactive)) // (1024 * 1024))
    return min(left) if left else None


def available_memory_mb() -> int:
    """MemAvailable from /proc/meminfo (falls back to total physical memory), or less where
    this process's cgroup (a container's memory limit) leaves less."""
    host = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    host = int(line.split()[1]) // 1024
                    break
    except OSError:
        pass
    if host is None:
        host = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024))
    limited = cgroup_memory_available_mb()
    return host if limited is None else min(host, limited)


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), or fewer where its cgroup's CPU
    quota (a container's --cpus) allows fewer: the quota rounded up, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return cores


def env_memory_kind(env_id: str, env_kwargs: dict) -> str:
    if env_id.startswith("dmc/") and env_kwargs.get("observation", "pixels") != "state":
        if env_kwargs.get("share_context", True) is not False:
            return "dmc-shared"
        return "dmc-standard" if env_kwargs.get("render") == "standard" else "dmc-fast"
    return "small"


def split_envs(actors: int, processes: int) -> List[int]:
    """``actors`` envs over ``processes`` processes, as evenly as possible (the first ones get the rest)."""
    base, rest = divmod(actors, processes)
    return [base + (1 if i < rest else 0) for i in range(processes)]


def plan_actors(
    actors: int,
    env_id: str,
    env_kwargs: Optional[dict] = None,
    processes: Optional[int] = None,
    cores: Optional[int] = None,
    memory_mb: Optional[int] = None,
    check_memory: bool = True,
    unrolls: Optional[UnrollMemory] = None,
) -> ActorPlan:
    """Splits ``actors`` envs over processes; raises :class:`PlanError` if it cannot fit
    (``check_memory=False``: a first plan whose process count may still change). ``unrolls``:
    what the run's unrolls take (:func:`unroll_memory`), counted on top when given."""
    if actors < 1:
        raise PlanError(f"--actors must be at least 1, got {actors}.")
    cores = available_cores() if cores is None else cores
    memory_mb = available_memory_mb() if memory_mb is None else memory_mb
    if processes is None:
        processes = max(1, min(actors, cores))
    if processes > actors:
        raise PlanError(f"--actor-processes {processes} exceeds --actors {actors}; each process hosts at least one env.")
    envs = split_envs(actors, processes)
    per_env = ENV_MB[env_memory_kind(env_id, env_kwargs or {})]
    buffers = unrolls.mb(actors, processes) if unrolls is not None else 0
    estimate = LEARNER_MB + processes * PROCESS_BASE_MB + actors * per_env + buffers
    budget = int(memory_mb * MEMORY_HEADROOM)
    if check_memory and estimate > budget:
        # The envs' share of the unrolls, per env, to size the hints by.
        env_unroll_mb = 0 if unrolls is None else unrolls.unroll_bytes / 2**20
        # What does not shrink with fewer envs: the learner's buffers and the streams' messages.
        held, held_one = (0, 0) if unrolls is None else (unrolls.mb(0, processes), unrolls.mb(0, 1))
        fit = max(0, int((budget - LEARNER_MB - processes * PROCESS_BASE_MB - held) // (per_env + env_unroll_mb)))
        in_one = max(0, int((budget - LEARNER_MB - PROCESS_BASE_MB - held_one) // (per_env + env_unroll_mb)))
        if unrolls is not None and LEARNER_MB + PROCESS_BASE_MB + per_env + unrolls.mb(1, 1) > budget:
            hint = _buffers_hint(unrolls.mb(0, 0), unrolls)  # not one env in one process fits beside them
        elif fit >= processes:
            hint = f"use --actors {fit} or fewer"
        elif in_one >= 1:
            hint = f"use fewer actor processes: --actor-processes 1 fits --actors {in_one} or fewer"
        else:
            hint = "free memory or use a machine with more"
        raise PlanError(
            f"{actors} actors of {env_id} need about {estimate / 1024:.1f} GiB "
            f"({per_env} MB per env, {PROCESS_BASE_MB} MB per process, {LEARNER_MB} MB for the learner"
            + (f", {buffers} MB for the unrolls in flight and the learner's buffers" if unrolls is not None else "")
            + "), "
            f"but only {memory_mb / 1024:.1f} GiB is available: {hint}."
        )
    return ActorPlan(processes=processes, envs_per_process=envs, estimated_mb=estimate, available_mb=memory_mb)
