#!/usr/bin/env python
"""CPU cost of the actor loop per agent step, against its env and inference parts alone.

Runs one :class:`actors.actor.Actor` in this process, on one thread, the way an actor
process runs it: ``--envs`` envs of a ``scripts/benchmark.py`` workload stepped in lockstep,
the NumPy network stacking the frames itself (``step_frames``), unrolls of ``T+1`` steps cut
and serialized to the wire format (``encode_unroll_bytes``, what ``LearnerClient.send``
queues), and, with ``--refresh``, new parameters after every unroll (the most a learner can
hand out). No gRPC: the sender thread and the learner are not part of it.

It also times, in the same process and in turns with the loop, the two parts the
benchmark's ceiling counts: the envs alone (random actions) and the inference alone
(``step_frames`` and ``sample_np`` on the same batch). ``overhead`` is the loop's CPU per agent step beyond those two: frame prefixes,
unroll assembly, encoding, parameter refreshes and Python bookkeeping.

Alternation (``--alternation``). An actor process runs its env steps and its policy in turn on
one thread, while the ceiling's pieces run each back to back. This also times each part right
after the other part and right after itself, the four conditions in turn call by call (so that a
drifting host touches them alike); ``alternation`` is what running in turn adds per agent step:
(env after inference - env after env) + (inference after env - inference after inference). On
the forty-eighth session's Zen 3 host, cartpole at 16 envs: the env +0.048-0.050 ms per agent
step after the policy (as much as after 16 MB of other writes: the policy's working set evicts
the envs' data), the policy +0.020-0.027 after the env (``docs/BENCHMARKS.md``).

Page faults. Each part's minor page faults per agent step are reported beside its CPU. By
default (``--malloc reuse``) this process's glibc keeps freed memory mapped for reuse, the
steady state of a live actor process: in the twenty-ninth session's launcher runs (synthetic,
32 actors in 2 processes) an actor process took at most 0.16 page faults per agent step of its
own, with glibc's defaults or these settings alike, its heap already holding the pages an
unroll boundary needs. This loop alone, with glibc's defaults (``--malloc system``), hands the
top of its heap back to the kernel after every unroll boundary and faults it in again: at 16
envs about 9.5 faults per agent step, and the loop's own accounting of ``emit`` 0.028-0.031 ms
per agent step against 0.008-0.010 with reuse (the live actors' emit, with their gRPC outbox and
parameter fetches, was 0.016-0.017 either way). Until the twenty-ninth session this script
ran with glibc's defaults, so its ``overhead`` figures before then include those faults. Since
the thirty-second session (33b0e33) the actor assembles a boundary's unrolls with one copy of
the frames instead of two, and the loop keeps its heap with glibc's defaults too: 0.14-0.21
faults per agent step against 9.2-9.6 before (16 envs, 1-3 s runs), so the two settings now
give the same figures.

    .venv/bin/python scripts/bench_actor.py --workload synthetic --envs 16 --seconds 10
    .venv/bin/python scripts/bench_actor.py --workload dmc/cartpole-swingup --envs 16 --refresh --json
    .venv/bin/python scripts/bench_actor.py --workload dmc/cartpole-swingup --envs 16 --alternation --seconds 60
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent


# mallopt parameters (glibc malloc.h) and the values --malloc reuse sets: blocks below 32 MiB
# (glibc's own ceiling for its adaptive threshold) come from the heap, which keeps up to
# 128 MiB free at its top instead of handing it back to the kernel.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_REUSE = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 128 << 20))


def keep_freed_memory() -> bool:
    """Sets glibc's mmap and trim thresholds for this process (module docstring); False where
    the C library is not glibc or refuses them."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # only glibc has it  # noqa: B018
    except (OSError, AttributeError):
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in _REUSE)


def _minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _cpu_per_step(run, seconds: float, steps_per_call: int, prepare=None):
    """(ms of process CPU per agent step, calls, minor page faults) of ``run()`` repeated for
    ``seconds``; ``prepare()``, if given, runs untimed before each call."""
    calls, spent, faults, wall0 = 0, 0.0, 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - wall0 < seconds:
        if prepare is not None:
            prepare()
        faults0, cpu0 = _minor_faults(), time.process_time()
        run()
        spent += time.process_time() - cpu0
        faults += _minor_faults() - faults0
        calls += 1
    return 1e3 * spent / (calls * steps_per_call), calls, faults


# The conditions --alternation times: (the part timed, the part run untimed just before it).
ALTERNATION = (("env", "env"), ("env", "inference"), ("inference", "inference"), ("inference", "env"))


def _alternate(parts, seconds: float, totals) -> None:
    """Adds to ``totals[(timed, before)] = [CPU s, calls]`` for ``seconds``, in whole turns: the
    :data:`ALTERNATION` conditions in turn, one timed call each, ``parts[name]()`` the calls."""
    wall0, i = time.perf_counter(), 0
    while i % len(ALTERNATION) or i == 0 or time.perf_counter() - wall0 < seconds:
        timed, before = ALTERNATION[i % len(ALTERNATION)]
        parts[before]()
        cpu0 = time.process_time()
        parts[timed]()
        totals[(timed, before)][0] += time.process_time() - cpu0
        totals[(timed, before)][1] += 1
        i += 1


def env_and_inference_parts(env_list, spec, frame_stack, network, policy, rng):
    """The two parts the benchmark's ceiling counts, as calls: ``(step_envs, infer)``.

    ``step_envs()`` steps every env of ``env_list`` once with uniformly random actions
    (resetting those whose episode ends); ``infer()`` runs the actor's policy once on the batch
    (``step_frames`` and ``sample_np``) on the envs' first frames, which it takes now (each env
    is reset). ``spec`` is the envs' ``EnvSpec``; the rest as ``benchmark.actor_network`` gives.
    """
    import numpy as np

    from impala_rep.costs import random_actions

    envs = len(env_list)
    action_spec = env_list[0].action_spec()

    def step_envs():
        actions = random_actions(action_spec, envs, rng)
        for env, action in zip(env_list, actions):
            if env.step(action).last():
                env.reset()

    obs = {k: np.stack([np.asarray(env.reset().observation[k]) for env in env_list]) for k in spec.observations}
    stacks = network.frame_stacks(frame_stack, envs)
    state, first = network.initial_state(envs), np.zeros(envs, bool)

    def infer():
        nonlocal state
        out, _, state = network.step_frames(obs, state, first, stacks)
        policy.sample_np(out, rng)

    return step_envs, infer


def measure(workload: str, envs: int, seconds: float, unroll_length: int = 20, refresh: bool = False,
            seed: int = 0, evict_mb: float = 0.0, alternation: bool = False):
    import numpy as np

    import envs as envs_lib
    from actors.actor import Actor
    from benchmark import WORKLOADS, actor_network
    from impala_rep.specs import env_spec_from_dm_env
    from impala_rep.wire import encode_unroll_bytes

    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {sorted(WORKLOADS)}.")
    if envs < 1 or unroll_length < 1 or seconds <= 0:
        raise ValueError("--envs and --unroll-length must be at least 1 and --seconds positive.")
    if not 0 <= evict_mb <= 4096:
        raise ValueError(f"--evict-mb must be between 0 and 4096, got {evict_mb:g}.")
    w = WORKLOADS[workload]
    env_list = [envs_lib.make(w.env_id, seed=seed + i, **w.env_kwargs) for i in range(envs)]
    spec = env_spec_from_dm_env(env_list[0])
    frame_stack, _, network, policy = actor_network(spec)
    params = network.params
    payload_bytes = []

    def sink(unroll):
        payload = encode_unroll_bytes("bench", unroll.policy_version, unroll.tensors,
                                      unroll.episode_returns, unroll.episode_lengths)
        payload_bytes.append(len(payload))

    def fetch(version):
        return (version + 1, params) if refresh else (version, None)

    actor = Actor(env_list, network, policy, unroll_length, frame_stack, sink=sink, fetch_params=fetch, seed=seed)
    actor.run(max_steps=2 * envs * (unroll_length + 1))  # warm-up

    rng = np.random.default_rng(seed)
    step_envs, infer = env_and_inference_parts(env_list, spec, frame_stack, network, policy, rng)

    # Memory written between inference calls (untimed), as the envs' and other processes' work
    # evicts the policy's parameters and frame blocks from the caches between two live calls.
    evict = np.ones(int(evict_mb * 2 ** 20) // 8) if evict_mb > 0 else None
    parts = [("loop", actor.step, 0.5, None), ("env", step_envs, 0.25, None), ("inference", infer, 0.25, None)]
    if evict is not None:
        parts = [(name, run, 0.4 if name == "loop" else 0.2, None) for name, run, _, _ in parts]
        parts.append(("inference_evicted", infer, 0.2, lambda: np.add(evict, 1.0, out=evict)))
    # The parts in turn, a few rounds, so that a drifting machine affects them alike. Only
    # the loop steps the actor, so its stats' span is the loop's own accounting.
    # --alternation's calls run untimed half the time, so it gets as much wall-clock time as the loop.
    alternation_share = 0.4 if alternation else 0.0
    parts = [(name, run, share * (1 - alternation_share), prepare) for name, run, share, prepare in parts]
    alternated = {key: [0.0, 0] for key in ALTERNATION}
    totals = {name: [0.0, 0, 0] for name, _, _, _ in parts}
    stats_before = actor.stats.snapshot()
    rounds = 3
    for _ in range(rounds):
        for name, run, share, prepare in parts:
            ms, calls, faults = _cpu_per_step(run, seconds * share / rounds, envs, prepare)
            totals[name][0] += ms * calls
            totals[name][1] += calls
            totals[name][2] += faults
        if alternation:
            _alternate({"env": step_envs, "inference": infer}, seconds * alternation_share / rounds, alternated)
    stats_after = actor.stats.snapshot()
    loop_steps = stats_after[0] - stats_before[0]
    loop_cpu = {k: v - stats_before[1][k] for k, v in stats_after[1].items()}
    loop_ms, env_ms, inference_ms = (totals[k][0] / totals[k][1] for k in ("loop", "env", "inference"))
    calls = totals["loop"][1]
    for env in env_list:
        close = getattr(env, "close", None)
        if close is not None:
            close()
    extra = {}
    if evict is not None:
        extra = {"evict_mb": evict_mb, "inference_evicted_ms_per_step": totals["inference_evicted"][0] / totals["inference_evicted"][1]}
    if alternation:
        named = {f"{timed}_after_{before}": spent for (timed, before), spent in alternated.items()}
        after = {name: 1e3 * cpu / (calls * envs) for name, (cpu, calls) in named.items()}
        extra["alternated_ms_per_step"] = after
        extra["alternation_calls"] = {name: calls for name, (_, calls) in named.items()}
        extra["alternation_ms_per_step"] = (after["env_after_inference"] - after["env_after_env"]
                                            + after["inference_after_env"] - after["inference_after_inference"])
    return {
        **extra,
        # The loop's own accounting of its parts (actors.actor.ActorStats.cpu_s), as an actor process logs it.
        "loop_parts_ms_per_step": {k: 1e3 * v / loop_steps for k, v in loop_cpu.items()},
        "workload": workload, "envs": envs, "unroll_length": unroll_length, "refresh": refresh,
        "loop_ms_per_step": loop_ms, "env_ms_per_step": env_ms, "inference_ms_per_step": inference_ms,
        "overhead_ms_per_step": loop_ms - env_ms - inference_ms,
        "overhead_share": (loop_ms - env_ms - inference_ms) / loop_ms,
        "page_faults_per_step": {k: faults / (n * envs) for k, (_, n, faults) in totals.items()},
        "loop_calls": calls, "unrolls": actor.stats.unrolls, "param_updates": actor.stats.param_updates,
        "unroll_bytes": int(np.mean(payload_bytes)) if payload_bytes else 0,
    }


def main(argv=None) -> int:
    sys.path[:0] = [str(SCRIPTS), str(REPO)]
    # One thread (llvmpipe in it), like the benchmark's ceiling pieces and the launcher's actor processes: set
    # before NumPy or MuJoCo is imported, and so before impala_rep.flags, which imports NumPy (through
    # impala_rep.specs): after it, OpenBLAS had already started a thread per core.
    from impala_rep.plan import ACTOR_THREAD_ENV

    os.environ.update(ACTOR_THREAD_ENV)
    os.environ.setdefault("MUJOCO_GL", "egl")
    from impala_rep.flags import positive_float

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="synthetic", help="a scripts/benchmark.py workload (default synthetic)")
    parser.add_argument("--envs", type=int, default=16, help="envs stepped together, as in one actor process (default 16)")
    parser.add_argument("--unroll-length", type=int, default=20)
    parser.add_argument("--seconds", type=positive_float, default=10.0,
                        help="timed seconds in all: half for the loop, a quarter for each part, in 3 rounds "
                             "(with --alternation, 0.4 of it for the alternation and the rest shared so)")
    parser.add_argument("--refresh", action="store_true", help="new parameters after every unroll")
    parser.add_argument("--evict-mb", type=float, default=0.0,
                        help="also time the inference with this many MB of other memory written before each call, "
                             "as live envs and processes evict the policy's state between calls (default 0: not timed)")
    parser.add_argument("--alternation", action="store_true",
                        help="also time the env and the inference each right after the other and right after "
                             "itself, call by call: what running them in turn on one thread adds per agent step")
    parser.add_argument("--malloc", choices=("reuse", "system"), default="reuse",
                        help="reuse (default): glibc keeps freed memory mapped, as a live actor process's heap "
                             "does; system: glibc's defaults, under which this loop alone faults its unroll "
                             "buffers in again at every boundary")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    malloc = "system"
    if args.malloc == "reuse":
        malloc = "reuse" if keep_freed_memory() else "system (not glibc, or mallopt refused)"
    try:
        result = measure(args.workload, args.envs, args.seconds, args.unroll_length, args.refresh,
                         evict_mb=args.evict_mb, alternation=args.alternation)
    except ValueError as e:
        print(f"bench_actor: {e}", file=sys.stderr)
        return 2
    result["malloc"] = malloc
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['workload']}, {result['envs']} envs, unroll {result['unroll_length']}"
              f"{', new parameters every unroll' if args.refresh else ''}, malloc {malloc} "
              "(ms of CPU per agent step; page faults per agent step):")
        faults = result["page_faults_per_step"]
        for key in ("loop", "env", "inference", "overhead"):
            print(f"  {key:<10} {result[key + '_ms_per_step']:.3f}" + (f"  {faults[key]:.2f}" if key in faults else ""))
        print(f"  overhead share of the loop: {result['overhead_share']:.0%}")
        print("  the loop's own accounting: " + ", ".join(f"{k} {v:.3f}" for k, v in result["loop_parts_ms_per_step"].items()))
        if "inference_evicted_ms_per_step" in result:
            print(f"  inference after {args.evict_mb:g} MB of other writes: {result['inference_evicted_ms_per_step']:.3f}")
        if "alternation_ms_per_step" in result:
            after = result["alternated_ms_per_step"]
            print(f"  env after the env {after['env_after_env']:.3f}, after the inference {after['env_after_inference']:.3f}; "
                  f"inference after the inference {after['inference_after_inference']:.3f}, after the env "
                  f"{after['inference_after_env']:.3f}")
            print(f"  what running them in turn adds: {result['alternation_ms_per_step']:+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
