"""Peak memory and throughput of whole runs: ``python -m impala_rep.launch`` as users run it.

For each ``--actors`` value, starts the launcher (learner + actor processes, gRPC on
127.0.0.1) with a temporary logdir, samples the resident memory of the whole process tree
every 0.5 s, and after a warm-up reads the agent steps the learner trained on over a fixed
window from its ``metrics.jsonl``. Prints one line per configuration (``--json`` for JSON).

    .venv/bin/python scripts/bench_launch.py --env dmc/cartpole-swingup --actors 2 8 64 --seconds 60

Every run is bounded: it is stopped with SIGTERM after warm-up + window (SIGKILL if it
does not end within 60 s more).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # entry point: sibling scripts


def tree_rss_mb(root: int) -> float:
    """Sum of VmRSS over ``root`` and all its descendants (Linux /proc)."""
    from benchmark import _descendants  # scripts/benchmark.py: the same process-tree walk

    total_kb = 0
    for pid in [root, *_descendants(root)]:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total_kb += int(line.split()[1])
                        break
        except OSError:
            pass
    return total_kb / 1024


def read_metrics(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_one(env_id: str, actors: int, warmup: float, seconds: float, extra: List[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as logdir:
        cmd = [sys.executable, "-m", "impala_rep.launch", "--env", env_id, "--actors", str(actors),
               "--logdir", logdir, "--log-interval", "2", "--total-steps", str(10**9), *extra]
        env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"))
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        peak, start = 0.0, time.monotonic()
        window_start = None
        try:
            while time.monotonic() - start < warmup + seconds + 600:
                if proc.poll() is not None:
                    raise RuntimeError(f"the launcher exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
                peak = max(peak, tree_rss_mb(proc.pid))
                records = read_metrics(os.path.join(logdir, "metrics.jsonl"))
                if window_start is None and records and time.monotonic() - start >= warmup:
                    window_start = (time.monotonic(), records[-1]["agent_steps"], records[-1]["learner_step"])
                if window_start is not None and time.monotonic() - window_start[0] >= seconds:
                    break
                time.sleep(0.5)
            if window_start is None:
                raise RuntimeError("no progress record appeared; is the learner training?")
            last = read_metrics(os.path.join(logdir, "metrics.jsonl"))[-1]
            elapsed = time.monotonic() - window_start[0]
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        agent = last["agent_steps"] - window_start[1]
        return {
            "env": env_id,
            "actors": actors,
            "peak_rss_mb": round(peak),
            "agent_steps_per_s": agent / elapsed,
            "learner_steps_per_s": (last["learner_step"] - window_start[2]) / elapsed,
            "window_s": elapsed,
        }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="dmc/cartpole-swingup")
    parser.add_argument("--actors", type=int, nargs="+", default=[2, 8, 64])
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds before the window")
    parser.add_argument("--seconds", type=float, default=60.0, help="measurement window")
    parser.add_argument("--json", action="store_true")
    args, extra = parser.parse_known_args(argv)
    results = []
    for n in args.actors:
        r = run_one(args.env, n, args.warmup, args.seconds, extra)
        results.append(r)
        if not args.json:
            print(f"{r['env']} --actors {n}: {r['agent_steps_per_s']:.0f} agent steps/s, "
                  f"{r['learner_steps_per_s']:.2f} learner steps/s, peak RSS (all processes) {r['peak_rss_mb']} MB",
                  flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
