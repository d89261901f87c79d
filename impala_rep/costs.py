"""What one agent step costs the actors and the learner, and the learner threads that follow (TensorFlow-free).

When the learner shares a machine's cores with local actor processes, it should get the share
of the cores that its work is of the whole. Per agent step, an actor pays the env step ``E``
and the policy's forward pass ``F`` (NumPy, at the batch one actor process runs), and the
learner pays its V-trace step ``L`` (a forward and a backward pass on the same input, on one
thread). The env probe (``impala_rep.probe``) measures ``E`` and ``F`` in its short-lived
subprocess with :func:`time_env_step` and :func:`time_policy_step`; the learner probe
(``learner.probe``, TensorFlow) measures ``L``. All CPU time, so a busy machine slows the
measurement but does not skew it.

Without a measured ``L``, it is estimated as ``LEARNER_FACTOR * F`` (a backward pass costs
about two forwards). That held on the 2-core Intel host of the first sessions (the shallow
CNN's learner step cost 2.9-3.5 times the actor's forward pass per agent step) but not on
the AMD EPYC host of the eleventh (about 1.5: TensorFlow's kernels gained more than NumPy's
there), where the estimate gave the learner a thread too many.
"""

from __future__ import annotations

import math
import time
from typing import Any, Dict, Mapping, Optional

import numpy as np

__all__ = ["LEARNER_FACTOR", "LIVE_ACTOR_COST", "actor_processes", "learner_share", "learner_threads", "random_actions", "random_observations", "time_env_step", "time_policy_step"]

LEARNER_FACTOR = 3.0
# A learner given fewer threads than its share caps the whole pipeline; one given an extra
# thread only loses what that thread spins. So round up once the share passes a whole number
# by more than this much of a core. It was a quarter core until the twenty-eighth session:
# then synthetic on 2 cores (share 1.21-1.23) kept 1 thread, and 2 (which fill the cores, so
# the actors run niced in their gaps) trained on 5-7% more agent steps/s (docs/BENCHMARKS.md).
_ROUND_UP_PAST = 0.1


def learner_share(cores: int, env_seconds: float, forward_seconds: float,
                  learner_seconds: Optional[float] = None) -> float:
    """The cores the learner's work is of the whole: ``cores * L / (E + F + L)``.

    ``env_seconds``, ``forward_seconds`` and ``learner_seconds`` are CPU seconds per agent step
    of the env step, the actor's policy forward pass and the learner step (``L``; None:
    ``LEARNER_FACTOR * F``). Nothing costing anything gives the learner every core.
    """
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be a positive integer, got {cores!r}.")
    named = [("env_seconds", env_seconds), ("forward_seconds", forward_seconds)]
    if learner_seconds is not None:
        named.append(("learner_seconds", learner_seconds))
    for name, value in named:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number of seconds (0 or more), got {value!r}.")
    learner = LEARNER_FACTOR * forward_seconds if learner_seconds is None else learner_seconds
    total = env_seconds + forward_seconds + learner
    return float(cores) if total <= 0 else cores * learner / total


def learner_threads(cores: int, env_seconds: float, forward_seconds: float,
                    learner_seconds: Optional[float] = None) -> int:
    """TensorFlow threads for a learner sharing ``cores`` with the actors: its :func:`learner_share`,
    rounded up once it passes a whole number by a tenth of a core, at least 1 and at most ``cores``."""
    share = learner_share(cores, env_seconds, forward_seconds, learner_seconds)
    return max(1, min(cores, math.ceil(share - _ROUND_UP_PAST)))


# An actor process runs its envs and its policy on one thread, so the actors' share of the
# cores is the processes they need; more only time-share the same cores. The share comes from
# the pieces timed alone, and live actors cost more than that: pixel cartpole on 2 Zen 3 cores,
# the env, the policy and the actors' own work 0.24-0.27 ms per agent step over their pieces'
# 1.07 (forty-seventh session), the actors' main threads 1.57-1.61 ms against 1.18-1.23
# (forty-ninth): 20-33% more. So the share is scaled by this before it is rounded up. Rounding
# the bare share, one process of 32 envs at a share of 1.08 (a tenth of a core of slack, the
# forty-seventh session) and at 1.00 (the forty-ninth: the probe timed the env at 0.71 ms
# against 1.08 in the run before) left the machine 1.70-1.71 cores busy at 0.711 and 0.751 of
# the ceiling, against 0.787-0.852 with 2 processes at shares of 1.11-1.14 (0.816 against
# 0.819 at 1.02-1.04 in the forty-sixth session: level there).
LIVE_ACTOR_COST = 1.25


def actor_processes(cores: int, actors: int, env_seconds: float, forward_seconds: float,
                    learner_seconds: Optional[float] = None) -> int:
    """Actor processes for ``actors`` envs sharing ``cores`` with the learner: the cores left of
    :func:`learner_share`, times :data:`LIVE_ACTOR_COST`, rounded up (at least 1, at most
    ``cores`` and ``actors``): a share of 0.8 cores or less takes one process.

    Measured on the synthetic benchmark, 2 cores, learner share 1.2: 32 envs in one process
    ran 0.78 of the ceiling (4,249 agent steps/s), in two processes (one per core, the
    launcher's choice before) 0.73-0.76: three busy processes on two cores switch and
    refill their caches, two do not.
    """
    if isinstance(actors, bool) or not isinstance(actors, int) or actors < 1:
        raise ValueError(f"actors must be a positive integer, got {actors!r}.")
    share = cores - learner_share(cores, env_seconds, forward_seconds, learner_seconds)
    return max(1, min(cores, actors, math.ceil(round(share * LIVE_ACTOR_COST, 9))))


def random_actions(spec: Any, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` random actions within a dm_env action spec (bounded or not, discrete or not)."""
    shape = (count,) + tuple(spec.shape)
    dtype = np.dtype(spec.dtype)
    lo = getattr(spec, "minimum", None)
    hi = getattr(spec, "maximum", None)
    if np.issubdtype(dtype, np.integer):
        lo = np.broadcast_to(0 if lo is None else lo, spec.shape)
        hi = np.broadcast_to(1 if hi is None else hi, spec.shape)
        return rng.integers(lo, hi, size=shape, endpoint=True).astype(dtype)
    if lo is None or hi is None or not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        return rng.standard_normal(size=shape).astype(dtype)
    return rng.uniform(np.broadcast_to(lo, spec.shape), np.broadcast_to(hi, spec.shape), size=shape).astype(dtype)


def random_observations(observation_specs: Mapping[str, Any], batch: int, rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """A batch of random observations: uniform bytes for uint8 (pixels), standard normal otherwise."""
    obs = {}
    for key, spec in observation_specs.items():
        shape = (batch,) + tuple(spec.shape)
        if np.dtype(spec.dtype) == np.uint8:
            obs[key] = rng.integers(0, 256, size=shape, dtype=np.uint8)
        else:
            obs[key] = rng.standard_normal(size=shape).astype(spec.dtype)
    return obs


def _timed(step, cpu_seconds: float, wall_limit: float, min_calls: int) -> Dict[str, float]:
    """Calls ``step(i)`` until ``cpu_seconds`` of this process's CPU (or ``wall_limit``) are spent."""
    calls = 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while True:
        step(calls)
        calls += 1
        if calls >= min_calls and (time.process_time() - cpu0 >= cpu_seconds or time.perf_counter() - wall0 >= wall_limit):
            break
    return {"calls": calls, "cpu_seconds": time.process_time() - cpu0, "wall_seconds": time.perf_counter() - wall0}


def time_env_step(env: Any, cpu_seconds: float = 0.5, wall_limit: float = 10.0, seed: int = 0) -> Dict[str, float]:
    """CPU seconds per step of a dm_env ``env`` under random actions (episodes reset as they end)."""
    actions = random_actions(env.action_spec(), 64, np.random.default_rng(seed))
    env.reset()
    for i in range(3):  # the first steps pay one-off costs (first render, caches)
        if env.step(actions[i]).last():
            env.reset()

    def step(i):
        if env.step(actions[i % len(actions)]).last():
            env.reset()

    out = _timed(step, cpu_seconds, wall_limit, min_calls=5)
    out["seconds_per_step"] = out["cpu_seconds"] / out["calls"]
    return out


def time_policy_step(network: Any, policy: Any, observation_specs: Mapping[str, Any], batch: int,
                     cpu_seconds: float = 0.5, wall_limit: float = 10.0, seed: int = 0) -> Dict[str, float]:
    """CPU seconds per agent step of an actor's policy: ``network.step`` + ``policy.sample_np`` at ``batch``."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}.")
    rng = np.random.default_rng(seed)
    obs = random_observations(observation_specs, batch, rng)
    first = np.zeros(batch, bool)
    state = [network.initial_state(batch)]

    def step(_):
        params, _, state[0] = network.step(obs, state[0], first)
        policy.sample_np(params, rng)

    step(0)  # warm-up
    out = _timed(step, cpu_seconds, wall_limit, min_calls=3)
    out["batch"] = batch
    out["seconds_per_step"] = out["cpu_seconds"] / (out["calls"] * batch)
    return out
