"""Learner throughput: frames/s of the replicated V-trace step on synthetic pixel batches.

frames = T x B per learner step (T=20 transitions, B=32 unrolls by default), observations
84x84x3 uint8 frames by default, one per step (``--frame-stack 3`` is what the launcher's learner
gets: single frames that its network stacks 3 deep, about twice the work), a 2-D bounded continuous action
(``--action-dims``; Gaussian policy, as on DM Control). Each
(network, replicas) configuration runs in its own subprocess, because logical CPU devices
are fixed once TensorFlow initialises. Warm-up and measurement are bounded in both steps
and seconds.

    .venv/bin/python scripts/bench_learner.py                      # shallow+deep x 1,2,4 CPU replicas
    .venv/bin/python scripts/bench_learner.py --kind gpu --replicas 1 --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_one(args) -> dict:
    from impala_rep.replicator import make_replicator

    import numpy as np

    from learner.run import configure_threads, tensorflow_cpu_memory

    # Thread pools must be sized before TensorFlow initialises (make_replicator does), as the
    # launcher sizes them: CPU replicas split the threads and run side by side.
    torso, replicas = args.torso[0], args.replicas[0]
    configure_threads(args.threads, replicas if args.kind == "cpu" else 1)
    replicator = make_replicator(args.kind, num_replicas=None if args.kind == "gpu" and replicas == 0 else replicas)

    from impala_rep.networks import NetworkConfig
    from impala_rep.specs import ArraySpec
    from learner.probe import synthetic_batch
    from learner.step import LearnerStep

    h, w, c = args.obs_shape
    obs = {"pixels": ArraySpec("pixels", (h, w, c * args.frame_stack), "uint8")}
    action = ArraySpec("action", (args.action_dims,), "float32", minimum=-1.0, maximum=1.0)
    learner = LearnerStep.from_config(
        replicator, NetworkConfig(torso=torso), obs, action, args.unroll_length, args.batch_size,
        jit_compile=args.xla, frame_stack={"pixels": args.frame_stack}, compute_dtype=args.precision,
    )
    batch = synthetic_batch(learner.batch_spec, np.random.default_rng(0))  # laid out as the batcher lays it out

    start = time.perf_counter()
    learner.train(batch)  # trace + compile
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.warmup_steps):
        learner.train(batch)
        if time.perf_counter() - start > args.warmup_seconds:
            break
    steps, start = 0, time.perf_counter()
    while steps < args.max_steps and (steps < args.min_steps or time.perf_counter() - start < args.seconds):
        learner.train(batch)
        steps += 1
    elapsed = time.perf_counter() - start
    snap_start = time.perf_counter()
    learner.get_params()
    snapshot_ms = 1e3 * (time.perf_counter() - snap_start)
    frames = args.unroll_length * args.batch_size
    return {
        "torso": torso,
        "kind": args.kind,
        "replicas": replicator.num_replicas,
        "xla": args.xla,
        "precision": args.precision,
        "obs_shape": list(args.obs_shape),
        "frame_stack": args.frame_stack,
        "action_dims": args.action_dims,
        "T": args.unroll_length,
        "B": args.batch_size,
        "steps": steps,
        "seconds": round(elapsed, 3),
        "step_ms": round(1e3 * elapsed / steps, 1),
        "frames_per_s": round(frames * steps / elapsed, 1),
        "first_step_s": round(compile_s, 2),
        "get_params_ms": round(snapshot_ms, 2),
        "num_params": int(sum(v.shape.num_elements() for v in learner.network.trainable_variables)),
        "cpu_memory": tensorflow_cpu_memory(),
    }


def main(argv=None) -> int:
    from impala_rep.flags import nonnegative_float, positive_float

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torso", nargs="+", default=["shallow", "deep"], choices=["shallow", "deep"])
    parser.add_argument("--replicas", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--kind", default="cpu", choices=["cpu", "gpu", "tpu", "auto"])
    parser.add_argument("--unroll-length", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--obs-shape", nargs=3, type=int, default=[84, 84, 3], metavar=("H", "W", "C"),
        help="one uint8 pixel frame (the env's observation)",
    )
    parser.add_argument(
        "--frame-stack", type=int, default=1, metavar="K",
        help="the network sees K stacked frames, [H, W, C*K], and the batch carries single frames "
             "[T+K, B, H, W, C] as the launcher's learner gets them (its default: 3)",
    )
    parser.add_argument("--action-dims", type=int, default=2, help="dimensions of the bounded continuous action")
    parser.add_argument("--xla", action="store_true", help="XLA-compile each replica's forward/backward pass")
    parser.add_argument("--precision", choices=["float32", "bfloat16"], default="float32",
                        help="what the network's torsos compute in (the launcher's --learner-precision; default float32)")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--warmup-seconds", type=nonnegative_float, default=20.0)
    parser.add_argument("--min-steps", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--seconds", type=positive_float, default=15.0, help="measurement window (after min-steps)")
    parser.add_argument("--threads", type=int, default=0, help="the learner's TensorFlow threads, split over CPU replicas as the launcher splits them (0: TF default)")
    parser.add_argument("--timeout", type=positive_float, default=600.0, help="per-configuration subprocess limit")
    parser.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("unroll_length", "batch_size", "min_steps", "max_steps", "action_dims", "frame_stack"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1.")
    if any(d < 1 for d in args.obs_shape):
        parser.error("--obs-shape takes three positive sizes: H W C.")
    if any(r < 1 for r in args.replicas):
        parser.error("--replicas must be positive.")

    if args.child:
        sys.path.insert(0, str(REPO))
        from learner.run import configure_tensorflow_env

        configure_tensorflow_env()  # as the learner runs
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return 0

    results = []
    for torso in args.torso:
        for replicas in args.replicas:
            if args.batch_size % replicas:
                results.append({"torso": torso, "replicas": replicas, "error": f"batch {args.batch_size} not divisible"})
                continue
            cmd = [sys.executable, __file__, "--child", "--torso", torso, "--replicas", str(replicas)]
            for name in ("kind", "unroll_length", "batch_size", "warmup_steps", "warmup_seconds", "min_steps",
                         "max_steps", "seconds", "threads", "action_dims", "frame_stack", "precision"):
                cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            cmd += ["--obs-shape"] + [str(d) for d in args.obs_shape]
            if args.xla:
                cmd.append("--xla")
            env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            except subprocess.TimeoutExpired:
                results.append({"torso": torso, "replicas": replicas, "error": f"timed out after {args.timeout:.0f} s"})
                continue
            lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode or not lines:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                results.append({"torso": torso, "replicas": replicas, "error": tail})
            else:
                results.append(json.loads(lines[-1][len("RESULT "):]))
            if not args.json:
                r = results[-1]
                if "error" in r:
                    print(f"{torso:8s} {replicas} replica(s): ERROR {r['error']}", flush=True)
                else:
                    print(
                        f"{torso:8s} {r['replicas']} {r['kind']} replica(s), {r['precision']}: {r['frames_per_s']:8.0f} frames/s "
                        f"({r['step_ms']:.0f} ms/step over {r['steps']} steps; first step {r['first_step_s']} s; "
                        f"get_params {r['get_params_ms']} ms)",
                        flush=True,
                    )
    if args.json:
        print(json.dumps(results, indent=2))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
