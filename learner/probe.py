"""Times a run's learner step on one TensorFlow thread, in a short-lived subprocess.

The launcher gives a CPU learner the share of the cores its work is of the whole
(:mod:`impala_rep.costs`). The actors' side (env step, NumPy forward pass) is timed by the
env probe (:mod:`impala_rep.probe`); this module times the other side: the run's own
replicated V-trace step (its network, frame stack, unroll and batch) on one CPU replica and
one TensorFlow thread, on a synthetic batch, in CPU seconds per agent step trained on.

It runs in a subprocess (``python -m learner.probe``) because TensorFlow's thread pools are
fixed once it initialises, and the launcher's learner must be sized after this measurement.
The ratio of this cost to the actors' forward pass is not a constant: it was 2.9-3.5 on the
2-core Intel host of the first sessions and about 1.5 on the AMD EPYC host of the eleventh
(docs/BENCHMARKS.md), where the fixed estimate gave the learner one thread too many.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, Mapping

import numpy as np

from impala_rep.config import RunConfig
from impala_rep.specs import ArraySpec, EnvSpec

__all__ = ["probe_learner_cost", "synthetic_batch", "time_learner_step"]

# What the launcher waits for at most; the measurement itself stops after a few steps.
PROBE_TIMEOUT_S = 180.0


def synthetic_batch(batch_spec: Mapping[str, ArraySpec], rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """A learner batch of ``batch_spec``'s shapes: random pixels and values, mid-episode steps.

    Laid out as the learner's batcher lays batches out (64-byte aligned), so a step on it
    costs what a step on actors' unrolls costs.
    """
    from impala_rep.framestack import aligned_empty

    batch = {}
    for key, spec in batch_spec.items():
        shape = tuple(spec.shape)
        if key.startswith(("observation/", "frames/")) and np.dtype(spec.dtype) == np.uint8:
            value = rng.integers(0, 256, size=shape, dtype=np.uint8)
        elif key == "step_type":
            value = np.ones(shape, np.uint8)  # MID: no episode boundaries
        elif key == "discount":
            value = np.ones(shape, np.float32)
        elif key == "behaviour_log_prob":
            value = np.full(shape, -1.5, np.float32)
        elif np.issubdtype(np.dtype(spec.dtype), np.integer):
            value = np.zeros(shape, spec.dtype)
        else:
            value = (0.3 * rng.normal(size=shape)).astype(spec.dtype)
        batch[key] = aligned_empty(shape, np.dtype(spec.dtype))
        batch[key][...] = value
    return batch


def time_learner_step(config: RunConfig, env_spec: EnvSpec, cpu_seconds: float = 1.0,
                      wall_limit: float = 60.0, min_steps: int = 2, seed: int = 0) -> Dict[str, Any]:
    """CPU seconds per agent step of ``config``'s learner step on one CPU replica.

    Per agent step the actors produce: with ``--replay-ratio`` a batch holds fewer fresh
    unrolls (:func:`impala_rep.config.replayed_per_batch`), so each fresh agent step costs the
    learner more (twice as much at 0.5), which the launcher's thread count must see.

    Call with TensorFlow's threads already sized (``_main`` sizes them to one). Two steps
    warm up (tracing, first allocations); then steps run until ``cpu_seconds`` of this
    process's CPU, at least ``min_steps``, stopping early at ``wall_limit`` seconds.
    """
    from impala_rep.replicator import make_replicator
    from learner.run import make_learner_step

    step = make_learner_step(config, env_spec, make_replicator("cpu", num_replicas=1))
    batch = synthetic_batch(step.batch_spec, np.random.default_rng(seed))
    wall0 = time.perf_counter()
    for _ in range(2):
        step.train(batch)
    warmup_s = time.perf_counter() - wall0
    steps = 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while steps < min_steps or (time.process_time() - cpu0 < cpu_seconds and time.perf_counter() - wall0 < wall_limit):
        step.train(batch)
        steps += 1
    cpu = time.process_time() - cpu0
    from impala_rep.config import replayed_per_batch

    per_step = config.unroll_length * (config.batch_size - replayed_per_batch(config.batch_size, config.replay_ratio))
    return {"steps": steps, "agent_steps_per_step": per_step,
            "cpu_seconds": cpu, "wall_seconds": time.perf_counter() - wall0, "warmup_seconds": warmup_s,
            "seconds_per_step": cpu / (steps * per_step)}


def probe_learner_cost(config: RunConfig, env_spec: EnvSpec, timeout: float = PROBE_TIMEOUT_S) -> Dict[str, Any]:
    """Runs :func:`time_learner_step` in a subprocess on one thread; its result or ``{"error": sentence}``.

    Advisory: the launcher falls back to an estimate when this fails, so nothing is raised.
    """
    payload = json.dumps({"config": config.to_json(), "spec": env_spec.to_json()})
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}  # as the learner runs
    try:
        proc = subprocess.run([sys.executable, "-m", "learner.probe"], input=payload, capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timing the learner step took more than {timeout:g} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"timing the learner step failed (exit code {proc.returncode}): {tail}"}
    try:
        result = json.loads(lines[-1])
    except ValueError:
        result = None
    if not isinstance(result, dict):
        return {"error": f"timing the learner step printed no result, but: {lines[-1][:200]}"}
    return result


def _main() -> int:
    from learner.run import configure_tensorflow_env, configure_threads, tensorflow_cpu_memory

    configure_tensorflow_env()  # as the learner runs
    request = json.loads(sys.stdin.read())
    config = RunConfig.from_json(request["config"])
    env_spec = EnvSpec.from_json(request["spec"])

    configure_threads(1)
    try:
        result = time_learner_step(config, env_spec)
        result["cpu_memory"] = tensorflow_cpu_memory()
    except Exception as exc:  # noqa: BLE001 (reported to the launcher, which falls back)
        result = {"error": f"could not time the learner step: {type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
