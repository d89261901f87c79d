"""Peak memory and throughput of whole runs: ``python -m impala_rep.launch`` as users run it.

For each ``--actors`` value, starts the launcher (learner + actor processes, gRPC on
127.0.0.1, the launcher's own defaults plus any extra flags given here) on a temporary
logdir, samples the resident memory of the whole process tree every 0.5 s, and reads the
agent steps the learner trained on over a window after a warm-up from its
``metrics.jsonl`` (``scripts/benchmark.py``'s end-to-end machinery: same window rule, same
CPU accounting). Prints one line per configuration (``--json`` for JSON).

    .venv/bin/python scripts/bench_launch.py --env dmc/cartpole-swingup --actors 2 8 64 --seconds 60

Every run is bounded: it is stopped with SIGTERM once the window closes (SIGKILL if it
does not end within ``--stop-timeout`` more), or when ``--startup-timeout`` passes first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # entry point: sibling scripts


def main(argv=None) -> int:
    from benchmark import run_launch_window
    from impala_rep.flags import nonnegative_float, positive_float

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="dmc/cartpole-swingup")
    parser.add_argument("--actors", type=int, nargs="+", default=[2, 8, 64])
    parser.add_argument("--warmup", type=nonnegative_float, default=30.0, help="seconds after the first learner step before the window")
    parser.add_argument("--seconds", type=positive_float, default=60.0, help="measurement window")
    parser.add_argument("--log-interval", type=positive_float, default=2.0, help="the run's metrics interval in seconds")
    parser.add_argument("--startup-timeout", type=positive_float, default=300.0, help="seconds allowed until the window could open")
    parser.add_argument("--stop-timeout", type=positive_float, default=60.0, help="seconds allowed for a clean stop")
    parser.add_argument("--keep-logdir", action="store_true", help="keep each run's temporary directory")
    parser.add_argument("--json", action="store_true")
    args, extra = parser.parse_known_args(argv)
    if any(n < 1 for n in args.actors):
        parser.error(f"--actors values must be at least 1, got {args.actors}.")
    results = []
    for n in args.actors:
        r = {"env": args.env, "actors": n, **run_launch_window(["--env", args.env, "--actors", str(n), *extra], args)}
        results.append(r)
        if args.json:
            continue
        if "error" in r:
            print(f"{args.env} --actors {n}: ERROR {r['error']}", flush=True)
            continue
        cores = (f"; cores: learner {r['cores_learner']:.2f}, actors {r['cores_actors']:.2f}, machine {r['cores_machine']:.2f}"
                 if "cores_machine" in r else "")
        print(f"{args.env} --actors {n}: {r['agent_steps_per_s']:.0f} agent steps/s, "
              f"{r['learner_steps_per_s']:.2f} learner steps/s, peak RSS (all processes) {r['peak_rss_mb']} MB{cores}",
              flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    from benchmark import stop_on_sigterm

    stop_on_sigterm()
    sys.exit(main())
