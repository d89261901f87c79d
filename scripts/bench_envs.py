#!/usr/bin/env python
"""Env benchmark: agent steps per second of one process on one core.

For each task and render preset, makes the env (84x84 pixels, action repeat 4 by default),
resets, and steps it with uniformly random actions for at most ``--steps`` agent steps or
``--seconds`` seconds; reports agent steps/s (one render and ``action_repeat`` physics
control steps each), timed after make and the first reset.

One core: this entry point limits BLAS/OpenMP and Mesa's llvmpipe rasteriser to one thread
(``OMP_NUM_THREADS=1``, ``LP_NUM_THREADS=1``, unless already set) before NumPy and the
renderer load, and pins the process to one CPU with ``--cpu`` (default: no pinning).

Usage::

    MUJOCO_GL=egl python scripts/bench_envs.py            # table
    MUJOCO_GL=egl python scripts/bench_envs.py --json     # one JSON object
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), help="env ids to measure")
    parser.add_argument("--presets", nargs="+", default=["standard", "fast"], choices=["standard", "fast", "auto"])
    parser.add_argument("--size", type=int, default=84, help="image height and width")
    parser.add_argument("--action-repeat", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1000, help="at most this many agent steps per run")
    parser.add_argument("--seconds", type=float, default=15.0, help="at most this long per run")
    parser.add_argument("--cpu", type=int, default=None, help="pin the process to this CPU")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.seconds <= 0 or args.size < 1 or args.action_repeat < 1:
        parser.error("--steps, --seconds, --size and --action-repeat must be positive.")
    return args


def bench(env_id: str, preset: str, args) -> dict:
    import numpy as np  # after the thread limits are set

    import envs

    env = envs.make(env_id, seed=0, size=args.size, action_repeat=args.action_repeat, render=preset)
    spec = env.action_spec()
    rng = np.random.default_rng(0)
    lo = np.broadcast_to(spec.minimum, spec.shape)
    hi = np.broadcast_to(spec.maximum, spec.shape)
    actions = rng.uniform(lo, hi, size=(256,) + spec.shape).astype(spec.dtype)
    env.reset()
    steps = 0
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
    env.close()
    return {
        "env_id": env_id,
        "render": env.render_preset,
        "size": args.size,
        "action_repeat": args.action_repeat,
        "agent_steps": steps,
        "seconds": round(elapsed, 3),
        "agent_steps_per_s": round(steps / elapsed, 1),
        "control_steps_per_s": round(steps * args.action_repeat / elapsed, 1),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    os.environ.setdefault("LP_NUM_THREADS", "1")
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    import envs
    from envs import dmc

    try:
        results = [bench(env_id, preset, args) for env_id in args.tasks for preset in args.presets]
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
        print(f"{'env':28s} {'render':8s} {'agent steps/s':>14s} {'control steps/s':>16s} {'steps':>6s}")
        for r in results:
            print(
                f"{r['env_id']:28s} {r['render']:8s} {r['agent_steps_per_s']:14.1f} "
                f"{r['control_steps_per_s']:16.1f} {r['agent_steps']:6d}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
