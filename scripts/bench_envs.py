#!/usr/bin/env python
"""Env benchmark: agent steps per second of one process on one core.

For each task and render preset, makes the env (84x84 pixels, action repeat 4 by default),
resets, and steps it with uniformly random actions for at most ``--steps`` agent steps or
``--seconds`` seconds; reports agent steps/s (one render and ``action_repeat`` physics
control steps each), timed after make and the first reset, by the wall clock and per
second of the process's CPU time (steadier when other processes share the cores). With
``--repeats N`` the runs go in N rounds of one run per configuration, and the best of each
configuration's runs is reported: on a host whose speed drifts, compare within one call.

One core: this entry point limits BLAS/OpenMP to one thread and has Mesa's llvmpipe
rasterise in the calling thread, as the actor processes do (``OMP_NUM_THREADS=1``,
``LP_NUM_THREADS=0``, unless already set) before NumPy and the renderer load, and pins the
process to one CPU with ``--cpu`` (default: no pinning).

Usage::

    MUJOCO_GL=egl python scripts/bench_envs.py            # table
    MUJOCO_GL=egl python scripts/bench_envs.py --json     # one JSON object
    MUJOCO_GL=egl python scripts/bench_envs.py --presets fast --fast-repeat both --repeats 3
    MUJOCO_GL=egl python scripts/bench_envs.py --presets fast --fast-reward both --repeats 3
    MUJOCO_GL=egl python scripts/bench_envs.py --presets fast --coarse-shapes both --repeats 3
    MUJOCO_GL=egl python scripts/bench_envs.py --presets fast --fast-step both --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

DEFAULT_TASKS = ("dmc/cartpole-swingup", "dmc/walker-walk", "dmc/cheetah-run")


def parse_args(argv=None) -> argparse.Namespace:
    from impala_rep.flags import positive_float

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), help="env ids to measure")
    parser.add_argument("--presets", nargs="+", default=["standard", "fast"], choices=["standard", "fast", "auto"])
    parser.add_argument("--size", type=int, default=84, help="image height and width")
    parser.add_argument("--action-repeat", type=int, default=4)
    parser.add_argument(
        "--observation", default="pixels", choices=["pixels", "pixels_state", "state"],
        help="dmc observation mode (state: no rendering)",
    )
    parser.add_argument(
        "--fast-repeat", default="on", choices=["on", "off", "both"],
        help="dmc fast action repeat (off: dm_control's own env.step per repeat; both: measure each)",
    )
    parser.add_argument(
        "--fast-reward", default="on", choices=["on", "off", "both"],
        help="dmc fast rewards, with fast repeat (off: dm_control's own rewards.tolerance; both: measure each)",
    )
    parser.add_argument(
        "--coarse-shapes", default="on", choices=["on", "off", "both"],
        help="dmc coarse shapes under the fast preset (off: the model's tessellation; both: measure each)",
    )
    parser.add_argument(
        "--fast-step", default="on", choices=["on", "off", "both"],
        help="dmc fast physics step, with fast repeat (off: dm_control's own Physics.step; both: measure each)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="runs per configuration, in rounds of one run of each; the best is reported",
    )
    parser.add_argument(
        "--best-by", default="agent_steps_per_s", choices=["agent_steps_per_s", "agent_steps_per_cpu_s"],
        help="which rate picks the best of --repeats (CPU time is steadier on a busy machine)",
    )
    parser.add_argument("--steps", type=int, default=1000, help="at most this many agent steps per run")
    parser.add_argument("--seconds", type=positive_float, default=15.0, help="at most this long per run")
    parser.add_argument("--cpu", type=int, default=None, help="pin the process to this CPU")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.seconds <= 0 or args.size < 1 or args.action_repeat < 1 or args.repeats < 1:
        parser.error("--steps, --seconds, --size, --action-repeat and --repeats must be positive.")
    return args


def bench(configs, args) -> list:
    """The best of ``args.repeats`` runs of each ``(env_id, preset, fast_repeat, fast_reward,
    coarse_shapes, fast_step)``.

    The runs go in rounds, one of each configuration per round, so that a host whose speed
    drifts over minutes slows every configuration alike.
    """
    runs = [[] for _ in configs]
    for _ in range(args.repeats):
        for i, config in enumerate(configs):
            runs[i].append(_bench_once(*config, args))
    return [max(r, key=lambda run: run[args.best_by]) for r in runs]


def _bench_once(env_id: str, preset: str, fast_repeat: bool, fast_reward: bool, coarse_shapes: bool, fast_step: bool,
                args) -> dict:
    import numpy as np  # after the thread limits are set

    import envs

    kwargs = {}
    if env_id.startswith("dmc/"):
        kwargs = dict(
            observation=args.observation, fast_repeat=fast_repeat, fast_reward=fast_reward,
            coarse_shapes=coarse_shapes, fast_step=fast_step, size=args.size, render=preset,
        )
    env = envs.make(env_id, seed=0, action_repeat=args.action_repeat, **kwargs)
    spec = env.action_spec()
    rng = np.random.default_rng(0)
    lo = np.broadcast_to(spec.minimum, spec.shape)
    hi = np.broadcast_to(spec.maximum, spec.shape)
    actions = rng.uniform(lo, hi, size=(256,) + spec.shape).astype(spec.dtype)
    env.reset()
    steps = 0
    cpu_start = time.process_time()
    start = time.perf_counter()
    deadline = start + args.seconds
    while steps < args.steps:
        timestep = env.step(actions[steps % len(actions)])
        steps += 1
        if timestep.last():
            env.reset()  # counted in the time: episodes restart in real runs too
        if (steps & 15) == 0 and time.perf_counter() > deadline:
            break
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    env.close()
    return {
        "env_id": env_id,
        "render": getattr(env, "render_preset", None),
        "observation": args.observation if env_id.startswith("dmc/") else None,
        "fast_repeat": fast_repeat if env_id.startswith("dmc/") else None,
        "fast_reward": fast_reward if env_id.startswith("dmc/") else None,
        "coarse_shapes": coarse_shapes if getattr(env, "render_preset", None) == "fast" else None,
        "fast_step": fast_step if env_id.startswith("dmc/") else None,
        "size": args.size,
        "action_repeat": args.action_repeat,
        "agent_steps": steps,
        "seconds": round(elapsed, 3),
        "agent_steps_per_s": round(steps / elapsed, 1),
        "control_steps_per_s": round(steps * args.action_repeat / elapsed, 1),
        "cpu_seconds": round(cpu, 3),
        "agent_steps_per_cpu_s": round(steps / cpu, 1),
    }


def main(argv=None) -> int:
    # Before parse_args: its impala_rep.flags imports NumPy (through impala_rep.specs), and OpenBLAS
    # reads its thread count when NumPy loads.
    from impala_rep.plan import ACTOR_THREAD_ENV

    for name, value in ACTOR_THREAD_ENV.items():
        os.environ.setdefault(name, value)
    args = parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    import envs
    from envs import dmc

    try:
        choices = {"on": [True], "off": [False], "both": [False, True]}
        configs = [
            (env_id, preset, fast, fast_reward, coarse, fast_step)
            for env_id in args.tasks
            for preset in args.presets
            for fast in choices[args.fast_repeat]
            for fast_reward in choices[args.fast_reward]
            for coarse in (choices[args.coarse_shapes] if preset != "standard" else [True])  # no effect there
            for fast_step in choices[args.fast_step]
        ]
        results = bench(configs, args)
        renderer = dmc.renderer_name()
    except envs.EnvError as exc:
        print(f"bench_envs: {exc}", file=sys.stderr)
        return 2
    report = {
        "renderer": renderer,
        "mujoco_gl": os.environ.get("MUJOCO_GL"),
        "lp_num_threads": os.environ.get("LP_NUM_THREADS"),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"renderer: {renderer} (MUJOCO_GL={report['mujoco_gl']}, LP_NUM_THREADS={report['lp_num_threads']})")
        print(
            f"{'env':28s} {'render':8s} {'observation':12s} {'fast_repeat':11s} {'fast_reward':11s} {'coarse':6s} {'fast_step':9s} "
            f"{'agent steps/s':>14s} "
            f"{'control steps/s':>16s} {'steps/cpu-s':>12s} {'steps':>6s}"
        )
        for r in results:
            print(
                f"{r['env_id']:28s} {str(r['render']):8s} {str(r['observation']):12s} {str(r['fast_repeat']):11s} "
                f"{str(r['fast_reward']):11s} {str(r['coarse_shapes']):6s} {str(r['fast_step']):9s} "
                f"{r['agent_steps_per_s']:14.1f} "
                f"{r['control_steps_per_s']:16.1f} {r['agent_steps_per_cpu_s']:12.1f} {r['agent_steps']:6d}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
