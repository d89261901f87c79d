#!/usr/bin/env python
"""Throughput benchmark: the ceiling pieces in isolation, the end-to-end rate, and their ratio.

Two workloads, both with the shallow IMPALA network, unroll length T=20, batch B=32 and
3 stacked frames (the launcher's defaults):

* ``synthetic``: a constant 84x84x3 uint8 observation under ``pixels``, one continuous
  action in [-1, 1], reward 0, episodes truncated after 1000 steps, no env cost (the
  factory :func:`synthetic_env` in this file, loaded as ``benchmark:synthetic_env`` with
  ``scripts/`` on ``PYTHONPATH``);
* ``dmc/cartpole-swingup``: 84x84 pixels, action repeat 4, ``render=fast``.

For each workload it measures:

1. The ceiling pieces, each in its own process on one thread:
   * ``env``: bare env agent steps/s (one env, uniformly random actions, episodes reset
     inside the timed loop);
   * ``inference``: policy inference agent steps/s, i.e. what an actor runs per step,
     ``NumpyNetwork.step_frames`` (single frames, which the network stacks itself) plus
     ``policy.sample_np``, on a batch the size of one actor process's envs, times the batch;
   * ``learner``: learner frames/s (= agent steps trained on per second; one frame is one
     of the T x B transitions of a batch) of the replicated V-trace step on one CPU replica
     with one TensorFlow thread, through ``scripts/bench_learner.py``, on the input the
     learner trains on: the frames of the observation the inference piece reports, stacked
     as deep as it stacks them (3 RGB frames of 84x84x3, which the learner's network stacks
     itself), and its action size.
2. The end-to-end rate: agent steps per second *trained on by the learner* through the real
   launcher (``python -m impala_rep.launch`` with real actor processes and gRPC on
   127.0.0.1, a temporary ``--logdir``). The rate is read from the run's ``metrics.jsonl``
   (``agent_steps`` = learner steps x T x B): the window opens at the first record written
   ``--warmup`` seconds after the first learner step, and closes at the first record
   ``--seconds`` later; rate = difference of ``agent_steps`` / difference of ``time``.
3. The ratio of (2) to the ceiling (1) implies for the cores used.

The pieces run while the end-to-end run is paused, right beside the window they are
compared with: the window is cut into ``--slices`` slices (default 3, of ``--seconds /
slices`` each), and the whole process tree (launcher and actor processes) is stopped with
SIGSTOP for a round of the pieces after the warm-up and after each slice, then resumed with
SIGCONT (each slice opens at the first metrics record written a second after the resume,
so no slice spans a pause). This host's speed drifts by tens of percent over minutes (the
same actor loop took 3.6 and 5.0 ms per step ten minutes apart in the tenth session, on an
idle machine); pieces measured minutes away from the window gave ratios from 0.79 to 0.98
for end-to-end rates within a few percent of each other (eighth and ninth sessions). Each
piece's rate is the harmonic mean of its rounds (the mean core-seconds per agent step, which
is what the ceiling adds up), the end-to-end rate is the slices' agent steps over their
seconds, and the JSON keeps every round, every slice, and each slice's ratio to the
ceiling of the two rounds beside it. With ``--parts ceiling`` alone, the pieces run in
``--rounds`` rounds (default 2).

The ceiling. Every agent step costs core-seconds in three places: the actor steps the env
(``1 / env_rate``) and runs the policy (``1 / inference_rate``), and the learner trains on
it (``1 / learner_rate``, measured on one core). With ``C`` cores shared by actors and
learner and nothing else to pay for (no transport, no serialisation, no frame stacking,
no idle time), the most agent steps per second they can sustain is::

    ceiling(C) = C / (1 / env_rate + 1 / inference_rate + 1 / learner_rate_per_core)

It assumes work can be split over cores freely and the learner scales linearly with cores,
so it is an upper bound: the end-to-end rate divided by it is the share of the machine's
work the real pipeline turns into training.

Usage (from the repo root)::

    .venv/bin/python scripts/benchmark.py --json > bench.json
    .venv/bin/python scripts/benchmark.py --workloads synthetic --actors 32 --seconds 60 --warmup 30
    .venv/bin/python scripts/benchmark.py --parts ceiling --piece-seconds 5   # the pieces only
    .venv/bin/python scripts/benchmark.py --slices 5   # 5 slices of the window, 6 rounds of pieces

Every subprocess is bounded by a timeout; the learner listens on loopback only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent

UNROLL_LENGTH = 20
BATCH_SIZE = 32
FRAME_STACK = 3
NETWORK = "shallow"


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    env_id: str
    env_kwargs: Mapping[str, Any]

    def env_args(self) -> List[str]:
        """The workload's env kwargs as repeated ``--env-arg key=value`` values."""
        return [f"{k}={json.dumps(v)}" for k, v in sorted(self.env_kwargs.items())]


WORKLOADS: Dict[str, Workload] = {
    "synthetic": Workload("synthetic", "benchmark:synthetic_env", {}),
    "dmc/cartpole-swingup": Workload(
        "dmc/cartpole-swingup", "dmc/cartpole-swingup", {"size": 84, "action_repeat": 4, "render": "fast"}
    ),
}


# --------------------------------------------------------------------------- synthetic env


@functools.lru_cache(maxsize=None)
def _synthetic_env_class():
    import dm_env
    import numpy as np
    from dm_env import specs

    class SyntheticEnv(dm_env.Environment):
        """Constant ``pixels`` [size, size, 3] uint8, one continuous action, reward 0.

        Episodes are truncated (discount kept) after ``episode_length`` steps, as DM Control
        episodes are. Stepping costs nothing but the ``dm_env.TimeStep`` it returns: the
        observation is one shared read-only array.
        """

        def __init__(self, size: int = 84, episode_length: int = 1000, seed: Optional[int] = None):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"size must be a positive integer, got {size!r}.")
            if isinstance(episode_length, bool) or not isinstance(episode_length, int) or episode_length < 1:
                raise ValueError(f"episode_length must be a positive integer, got {episode_length!r}.")
            value = int(np.random.default_rng(seed).integers(256))
            self._pixels = np.full((size, size, 3), value, np.uint8)
            self._pixels.setflags(write=False)
            self._obs = {"pixels": self._pixels}
            self._length = episode_length
            self._t = 0

        def observation_spec(self):
            return {"pixels": specs.Array(self._pixels.shape, np.uint8, name="pixels")}

        def action_spec(self):
            return specs.BoundedArray((1,), np.float32, -1.0, 1.0, name="action")

        def reset(self):
            self._t = 0
            return dm_env.restart(self._obs)

        def step(self, action):
            if self._t >= self._length:
                return self.reset()
            self._t += 1
            if self._t >= self._length:
                return dm_env.truncation(0.0, self._obs)
            return dm_env.transition(0.0, self._obs)

    return SyntheticEnv


def synthetic_env(size: int = 84, episode_length: int = 1000, seed: Optional[int] = None):
    """Env factory of the ``synthetic`` workload (env id ``benchmark:synthetic_env``)."""
    return _synthetic_env_class()(size=size, episode_length=episode_length, seed=seed)


# --------------------------------------------------------------------------- pure functions


def ceiling_agent_steps_per_s(env_rate: float, inference_rate: float, learner_rate_per_core: float, cores: float) -> float:
    """``cores / (1/env_rate + 1/inference_rate + 1/learner_rate_per_core)`` (see module docstring).

    Rates are agent steps per second on one core; raises ``ValueError`` unless every rate is a
    positive finite number and ``cores`` is positive.
    """
    for name, value in (("env_rate", env_rate), ("inference_rate", inference_rate),
                        ("learner_rate_per_core", learner_rate_per_core), ("cores", cores)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive finite number, got {value!r}.")
    return cores / (1.0 / env_rate + 1.0 / inference_rate + 1.0 / learner_rate_per_core)


def cost_shares(env_rate: float, inference_rate: float, learner_rate_per_core: float) -> Dict[str, float]:
    """Each piece's share of the core-seconds one agent step costs (they sum to 1)."""
    costs = {"env": 1.0 / env_rate, "inference": 1.0 / inference_rate, "learner": 1.0 / learner_rate_per_core}
    total = sum(costs.values())
    return {k: v / total for k, v in costs.items()}


def envs_per_process(actors: int, actor_processes: int) -> int:
    """The largest number of envs one actor process hosts (the launcher splits evenly)."""
    return -(-actors // actor_processes)


def read_metrics(path: Path) -> List[Dict[str, Any]]:
    """The complete JSON records of a ``metrics.jsonl`` (a half-written last line is skipped)."""
    records = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return records
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue  # being written right now
        if isinstance(record, dict):
            records.append(record)
    return records


def select_window(records: Sequence[Mapping[str, Any]], warmup: float, seconds: float,
                  not_before: Optional[float] = None) -> Optional[Dict[str, Any]]:
    """The measurement window of a run's metrics records, or ``None`` while it is incomplete.

    ``t0`` is the time of the first record after a learner step; the window opens at the
    first record at least ``warmup`` seconds after ``t0`` (and, given ``not_before``, written
    at that wall-clock time or later) and closes at the first record at least ``seconds``
    after that. Returns the rates over the window (agent steps trained on per second, learner
    steps per second) and window means of a few diagnostics.
    """
    trained = [r for r in records if r.get("learner_step", 0) > 0 and "time" in r and "agent_steps" in r]
    if not trained:
        return None
    t0 = trained[0]["time"]
    opens = max(t0 + warmup, not_before if not_before is not None else -math.inf)
    start = next((r for r in trained if r["time"] >= opens), None)
    if start is None:
        return None
    end = next((r for r in trained if r["time"] >= start["time"] + seconds), None)
    if end is None:
        return None
    elapsed = end["time"] - start["time"]
    inside = [r for r in trained if start["time"] < r["time"] <= end["time"]]

    def mean(key):
        values = [r[key] for r in inside if isinstance(r.get(key), (int, float))]
        return sum(values) / len(values) if values else None

    agent = end["agent_steps"] - start["agent_steps"]
    window = {
        "agent_steps_per_s": agent / elapsed,
        "learner_steps_per_s": (end["learner_step"] - start["learner_step"]) / elapsed,
        "env_frames_per_s": (end.get("env_frames", end["agent_steps"]) - start.get("env_frames", start["agent_steps"])) / elapsed,
        "window_seconds": elapsed,
        "window_agent_steps": agent,
        "warmup_seconds": start["time"] - t0,
        "window_start_time": start["time"],
    }
    for key in WINDOW_DIAGNOSTICS:
        value = mean(key)
        if value is not None:
            window[key] = value
    sent = "transport/parameters_sent"
    steps = end["learner_step"] - start["learner_step"]
    if isinstance(end.get(sent), (int, float)) and isinstance(start.get(sent), (int, float)) and steps > 0:
        # Full parameter replies per learner step: one per actor process per version with
        # --param-refresh-lag 1 when every process fetches every version.
        window["parameters_sent_per_learner_step"] = (end[sent] - start[sent]) / steps
    return window


WINDOW_DIAGNOSTICS = ("queue_fill", "policy_lag_mean", "time_share/wait_batch", "time_share/train",
                      "time_share/publish", "transport/megabytes_per_second", "cores_learner", "cores_actors",
                      "cores_machine", "cores_learner_tensorflow", "cores_learner_intake", "cores_stolen",
                      "parameters_sent_per_learner_step")


def combine_windows(windows: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Slices of one run's measurement window as one window: the rates are the summed counts
    over the summed seconds (the time the run was paused between slices is in neither), the
    diagnostics are means weighted by each slice's seconds, and ``slices_agent_steps_per_s``
    and ``slices`` (wall-clock start and seconds of each) keep the slices, as does
    ``slices_cores_stolen`` when every slice has ``cores_stolen``."""
    if not windows:
        raise ValueError("combine_windows needs at least one window.")
    seconds = sum(w["window_seconds"] for w in windows)
    out: Dict[str, Any] = {
        "agent_steps_per_s": sum(w["window_agent_steps"] for w in windows) / seconds,
        "learner_steps_per_s": sum(w["learner_steps_per_s"] * w["window_seconds"] for w in windows) / seconds,
        "env_frames_per_s": sum(w["env_frames_per_s"] * w["window_seconds"] for w in windows) / seconds,
        "window_seconds": seconds,
        "window_agent_steps": sum(w["window_agent_steps"] for w in windows),
        "warmup_seconds": windows[0]["warmup_seconds"],
        "window_start_time": windows[0]["window_start_time"],
    }
    for key in WINDOW_DIAGNOSTICS:
        have = [w for w in windows if key in w]
        if have:
            out[key] = sum(w[key] * w["window_seconds"] for w in have) / sum(w["window_seconds"] for w in have)
    out["slices_agent_steps_per_s"] = [w["agent_steps_per_s"] for w in windows]
    out["slices"] = [[w["window_start_time"], w["window_seconds"]] for w in windows]
    if all("cores_stolen" in w for w in windows):
        out["slices_cores_stolen"] = [w["cores_stolen"] for w in windows]
    return out


# --------------------------------------------------------------------------- the pieces


def _env(threads_one: bool = True) -> Dict[str, str]:
    from impala_rep.plan import actor_process_env

    env = actor_process_env() if threads_one else dict(os.environ)
    env.setdefault("MUJOCO_GL", "egl")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # This checkout first: an editable install elsewhere (another worktree) must not answer
    # the children's imports, or the pieces would time other code than the end-to-end run.
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _child_env_rate(workload: Workload, seconds: float) -> Dict[str, Any]:
    import numpy as np

    import envs
    from impala_rep.costs import random_actions

    env = envs.make(workload.env_id, seed=0, **workload.env_kwargs)
    actions = random_actions(env.action_spec(), 256, np.random.default_rng(0))
    env.reset()
    for i in range(10):  # warm-up (first renders)
        env.step(actions[i])
    env.reset()
    steps, start = 0, time.perf_counter()
    deadline = start + seconds
    while True:
        if env.step(actions[steps & 255]).last():
            env.reset()
        steps += 1
        if (steps & 15) == 0 and time.perf_counter() >= deadline:
            break
    elapsed = time.perf_counter() - start
    out = {"agent_steps_per_s": steps / elapsed, "agent_steps": steps, "seconds": elapsed}
    if workload.env_id.startswith("dmc/"):
        from envs import dmc

        out["renderer"] = dmc.renderer_name()
        out["render"] = getattr(env, "render_preset", workload.env_kwargs.get("render"))
    close = getattr(env, "close", None)
    if close is not None:
        close()
    return out


def actor_network(env_spec):
    """What an actor of the workloads runs on ``env_spec``: ``(frame_stack, stacked obs specs,
    NumpyNetwork, policy)`` for the benchmark's network and stack depth (the inference piece
    and ``scripts/bench_actor.py`` both time it)."""
    from impala_rep.config import frame_stack_keys
    from impala_rep.distributions import make_policy
    from impala_rep.networks import NetworkConfig
    from impala_rep.networks.numpy_backend import NumpyNetwork
    from impala_rep.specs import stacked_observation_specs

    config = NetworkConfig(torso=NETWORK)
    frame_stack = frame_stack_keys(env_spec.observations, FRAME_STACK)
    obs_specs = stacked_observation_specs(env_spec.observations, frame_stack)
    return frame_stack, obs_specs, NumpyNetwork(config, obs_specs, env_spec.action), make_policy(env_spec.action, config)


def _child_inference_rate(workload: Workload, seconds: float, batch: int) -> Dict[str, Any]:
    import numpy as np

    import envs
    from impala_rep.costs import random_observations
    from impala_rep.specs import env_spec_from_dm_env

    env = envs.make(workload.env_id, seed=0, **workload.env_kwargs)
    env_spec = env_spec_from_dm_env(env)
    close = getattr(env, "close", None)
    if close is not None:
        close()
    frame_stack, obs_specs, network, policy = actor_network(env_spec)
    rng = np.random.default_rng(0)
    # What an actor runs: single frames, which the network stacks itself (step_frames).
    obs = random_observations(env_spec.observations, batch, rng)
    stacks = network.frame_stacks(frame_stack, batch)
    state = network.initial_state(batch)
    first = np.zeros(batch, bool)
    for _ in range(5):  # warm-up
        params, _, state = network.step_frames(obs, state, first, stacks)
        policy.sample_np(params, rng)
    calls, start = 0, time.perf_counter()
    deadline = start + seconds
    while calls < 5 or time.perf_counter() < deadline:
        params, _, state = network.step_frames(obs, state, first, stacks)
        policy.sample_np(params, rng)
        calls += 1
    elapsed = time.perf_counter() - start
    return {"agent_steps_per_s": batch * calls / elapsed, "batch": batch, "calls": calls,
            "ms_per_call": 1e3 * elapsed / calls, "seconds": elapsed,
            # What the learner trains on: the same stacked observations and action (the
            # learner piece is measured on these shapes).
            "observation_shapes": {key: list(spec.shape) for key, spec in obs_specs.items()},
            "frame_stack": frame_stack,
            "action_shape": list(env_spec.action.shape)}


def child_command(args: Sequence[str]) -> List[str]:
    """The command that runs this script as a TF-free piece child (``--child env|inference``)."""
    return [sys.executable, str(Path(__file__).resolve()), *args]


def _run_child(args: List[str], timeout: float) -> Dict[str, Any]:
    """Runs this script as a one-thread TF-free child and returns its ``RESULT`` record."""
    cmd = child_command(args)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=str(REPO))
    except subprocess.TimeoutExpired:
        return {"error": f"{' '.join(args[:2])} did not finish within {timeout:.0f} s; raise --timeout or lower --piece-seconds."}
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:]) or "no output"
        return {"error": f"{' '.join(args[:2])} failed (exit code {proc.returncode}): {tail}"}
    return json.loads(lines[-1][len("RESULT "):])


def learner_input(inference: Mapping[str, Any]) -> Tuple[List[int], int, int]:
    """The learner's frame shape, stack depth and action size, from the inference piece's specs.

    The learner trains on the stacked observations the actors' policy sees (84x84x3 frames
    stacked 3 deep are 84x84x9, about twice the learner's work of 84x84x3); its batches carry
    the single frames and its network stacks them, as in the launcher.
    """
    shapes = inference["observation_shapes"]
    if list(shapes) != ["pixels"] or len(shapes["pixels"]) != 3:
        raise ValueError(f"the learner piece measures one [H, W, C] 'pixels' observation; this workload has {shapes}.")
    action = inference["action_shape"]
    if len(action) != 1:
        raise ValueError(f"the learner piece measures a vector action; this workload's action has shape {action}.")
    h, w, kc = shapes["pixels"]
    k = int(inference.get("frame_stack", {}).get("pixels", 1))
    if kc % k:
        raise ValueError(f"the inference piece stacks 'pixels' {k} deep, but its shape {shapes['pixels']} has {kc} channels.")
    return [h, w, kc // k], k, int(action[0])


def learner_command(seconds: float, timeout: float, obs_shape: Sequence[int], frame_stack: int,
                    action_dims: int, precision: str = "float32", batch_size: int = BATCH_SIZE) -> List[str]:
    """The learner piece's command: scripts/bench_learner.py on one CPU replica and one thread,
    at ``batch_size`` unrolls (the end-to-end learner's per-replica batch: :func:`replica_batch`)."""
    return [sys.executable, str(SCRIPTS / "bench_learner.py"), "--torso", NETWORK, "--replicas", "1", "--kind", "cpu",
            "--obs-shape", *[str(d) for d in obs_shape], "--frame-stack", str(frame_stack),
            "--action-dims", str(action_dims),
            "--threads", "1", "--unroll-length", str(UNROLL_LENGTH), "--batch-size", str(batch_size),
            "--seconds", str(seconds), "--max-steps", "100000", "--warmup-seconds", str(max(2.0, seconds / 3)),
            "--timeout", str(timeout), "--precision", precision, "--json"]


def measure_learner(seconds: float, timeout: float, obs_shape: Sequence[int], frame_stack: int,
                    action_dims: int, precision: str = "float32", batch_size: int = BATCH_SIZE) -> Dict[str, Any]:
    """Learner frames/s on one CPU replica and one TensorFlow thread (scripts/bench_learner.py)."""
    cmd = learner_command(seconds, timeout, obs_shape, frame_stack, action_dims, precision, batch_size)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30, env=_env(), cwd=str(REPO))
    except subprocess.TimeoutExpired:
        return {"error": f"scripts/bench_learner.py did not finish within {timeout + 30:.0f} s; raise --timeout."}
    try:
        results = json.loads(proc.stdout)
        result = results[0]
    except (ValueError, IndexError, KeyError):
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:]) or "no output"
        return {"error": f"scripts/bench_learner.py failed (exit code {proc.returncode}): {tail}"}
    if "error" in result:
        return {"error": f"scripts/bench_learner.py: {result['error']}"}
    return {"agent_steps_per_s": result["frames_per_s"], "step_ms": result["step_ms"], "steps": result["steps"],
            "threads": 1, "batch": batch_size, "obs_shape": list(obs_shape), "frame_stack": frame_stack,
            "action_dims": action_dims,
            "precision": precision, "cpu_memory": result.get("cpu_memory"),
            "note": "frames = T x B transitions per learner step = agent steps trained on"}


# --------------------------------------------------------------------------- end to end


def _read_stat(path: str) -> Optional[Tuple[str, List[str]]]:
    """``(name, fields after the name)`` of a ``/proc/.../stat`` file (a process's or a
    thread's), or ``None`` if it is gone or unreadable. Field 1 is the parent PID, fields 11
    and 12 the user and system CPU ticks."""
    try:
        with open(path) as f:
            stat = f.read()
        return stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
    except (OSError, ValueError):
        return None


def _stat_cpu_seconds(fields: Sequence[str]) -> Optional[float]:
    """User + system CPU seconds from the fields :func:`_read_stat` returns."""
    try:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (IndexError, ValueError):
        return None


def _descendants(pid: int) -> List[int]:
    """PIDs of the processes below ``pid`` (from /proc; empty where /proc is missing)."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        stat = _read_stat(f"/proc/{entry}/stat")
        try:
            ppid = int(stat[1][1])
        except (TypeError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds of one process (all its threads), or ``None`` if it is gone."""
    stat = _read_stat(f"/proc/{pid}/stat")
    return None if stat is None else _stat_cpu_seconds(stat[1])


# TensorFlow names the threads of its compute pools tf_* (tf_Compute: the inter-op pool the
# learner's replicas run on); the learner process's other threads are Python's (the training
# loop, the batcher, gRPC handlers) and gRPC's own (event_engine, timers).
TF_THREAD_PREFIX = "tf_"


def threads_cpu_seconds(pid: int, prefix: str) -> Optional[float]:
    """User + system CPU seconds of the threads of process ``pid`` whose name starts with
    ``prefix`` (threads that ended are not counted), or ``None`` if the process is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0.0
    for tid in tids:
        stat = _read_stat(f"/proc/{pid}/task/{tid}/stat")  # None: the thread ended
        if stat is not None and stat[0].startswith(prefix):
            total += _stat_cpu_seconds(stat[1]) or 0.0
    return total


def machine_cpu_seconds() -> Tuple[Optional[float], Optional[float]]:
    """``(busy, stolen)``: CPU seconds all cores spent busy since boot, and seconds the
    hypervisor ran something else while this machine's cores wanted to run (``/proc/stat``:
    busy is user, nice, system, irq and softirq; stolen is the steal column). Stolen time is
    not in busy: it is time the machine's cores did not get. ``(None, None)`` without /proc."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
        return (sum(ticks[:7]) - ticks[3] - ticks[4]) / tick, ticks[7] / tick
    except (OSError, IndexError, ValueError):
        return None, None


def with_stolen(measure: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """``measure()``'s result with ``cores_stolen``: the cores' worth of time the hypervisor
    took from this machine while it ran (stolen seconds over wall seconds, the piece's process
    start included), when /proc/stat tells."""
    t0, (_, stolen0) = time.monotonic(), machine_cpu_seconds()
    result = measure()
    elapsed, (_, stolen1) = time.monotonic() - t0, machine_cpu_seconds()
    if stolen0 is not None and stolen1 is not None and elapsed > 0 and "error" not in result:
        result = {**result, "cores_stolen": (stolen1 - stolen0) / elapsed}
    return result


def cpu_sample(launcher_pid: int) -> Dict[str, Any]:
    """CPU seconds so far of the launcher (= learner) process with its intake process if it has one
    (``learner_intake``, ``--intake process``), of its TensorFlow threads
    (``learner_tensorflow``, :data:`TF_THREAD_PREFIX`), of its descendants (the actor
    processes) and of the whole machine, and the resident memory of the whole process tree
    (``rss_mb``), stamped with the wall-clock time. Walks /proc once."""
    descendants = _descendants(launcher_pid)
    intake = [pid for pid in descendants if _is_intake(pid)]
    actors = [c for c in (_cpu_seconds(pid) for pid in descendants if pid not in intake) if c is not None]
    learner = _cpu_seconds(launcher_pid)
    intake_cpu = sum(c for c in (_cpu_seconds(pid) for pid in intake) if c is not None)
    machine, stolen = machine_cpu_seconds()
    return {"time": time.time(), "learner": None if learner is None else learner + intake_cpu,
            "learner_intake": intake_cpu,
            "learner_tensorflow": threads_cpu_seconds(launcher_pid, TF_THREAD_PREFIX), "actors": sum(actors),
            "actor_processes": len(actors), "machine": machine, "stolen": stolen,
            "rss_mb": tree_rss_mb(launcher_pid, descendants)}


def _is_intake(pid: int) -> bool:
    """Whether ``pid`` is a learner's intake process (``--intake process``), whose CPU is the learner's."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"learner.intake" in f.read().split(b"\0")
    except OSError:
        return False


def cpu_split(samples: Sequence[Mapping[str, Any]], start: float, end: float) -> Optional[Dict[str, float]]:
    """Cores used on average between wall-clock times ``start`` and ``end`` by the learner
    process, the actor processes and the whole machine, from the two samples closest to
    those times (``None`` with fewer than two usable samples), and by the learner's
    TensorFlow threads (``cores_learner_tensorflow``) when both samples have them. Actor
    processes that start or end inside the window make its actor figure approximate. With
    ``stolen`` in both samples, ``cores_stolen`` is the cores' worth of time the hypervisor
    took from the machine (not in ``cores_machine``)."""
    usable = [s for s in samples if s.get("learner") is not None and s.get("machine") is not None]
    if len(usable) < 2:
        return None
    a = min(usable, key=lambda s: abs(s["time"] - start))
    b = min(usable, key=lambda s: abs(s["time"] - end))
    if b["time"] <= a["time"]:
        return None
    elapsed = b["time"] - a["time"]
    keys = ["learner", "actors", "machine"]
    for extra in ("learner_tensorflow", "learner_intake", "stolen"):
        if a.get(extra) is not None and b.get(extra) is not None:
            keys.append(extra)
    return {f"cores_{k}": (b[k] - a[k]) / elapsed for k in keys}


def signal_tree(pid: int, sig: int) -> List[int]:
    """Sends ``sig`` to ``pid`` and every process below it; returns the PIDs it reached."""
    reached = []
    for target in [pid] + _descendants(pid):
        try:
            os.kill(target, sig)
            reached.append(target)
        except (ProcessLookupError, PermissionError):
            pass
    return reached


def stop_on_sigterm() -> None:
    """Entry points: SIGTERM raises KeyboardInterrupt, so the ``finally`` clauses stop the runs
    and pieces this process started (in their own sessions, they would outlive it)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def _stop_launch(proc: subprocess.Popen, timeout: float) -> Optional[int]:
    """SIGTERM (clean stop: final checkpoint, actors stopped); SIGKILL the tree after ``timeout``."""
    if proc.poll() is not None:
        return proc.returncode
    tree = signal_tree(proc.pid, signal.SIGCONT)  # a paused run takes no signal but SIGKILL
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid] + tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc.wait(timeout=10)
        return None


def _log_tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "no log"


def tree_rss_mb(root: int, descendants: Optional[Sequence[int]] = None) -> float:
    """Sum of VmRSS over ``root`` and its descendants (Linux /proc; found when not given), in MB."""
    total_kb = 0
    for pid in [root, *(_descendants(root) if descendants is None else descendants)]:
        try:
            with open(f"/proc/{pid}/status") as f:
                total_kb += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            pass
    return total_kb / 1024


def measure_end_to_end(workload: Workload, args, between: Optional[Callable[[int], None]] = None,
                       launch: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Agent steps/s trained on through ``python -m impala_rep.launch`` (see module docstring);
    ``between`` and ``launch`` as in :func:`run_launch_window`."""
    launch_args = ["--env", workload.env_id, "--actors", str(args.actors), "--learner", "cpu", "--network", NETWORK,
                   "--unroll-length", str(UNROLL_LENGTH), "--batch-size", str(BATCH_SIZE),
                   "--frame-stack", str(FRAME_STACK), "--no-anneal", "--learner-precision", args.learner_precision]
    for item in workload.env_args():
        launch_args += ["--env-arg", item]
    if args.actor_processes:
        launch_args += ["--actor-processes", str(args.actor_processes)]
    if args.learner_threads != "auto":
        launch_args += ["--learner-threads", str(args.learner_threads)]
    if args.replicas:
        launch_args += ["--replicas", str(args.replicas)]
    if args.actor_nice is not None:
        launch_args += ["--actor-nice", str(args.actor_nice)]
    if args.param_refresh_lag is not None:
        launch_args += ["--param-refresh-lag", str(args.param_refresh_lag)]
    if args.intake != "auto":
        launch_args += ["--intake", args.intake]
    result = run_launch_window(launch_args, args, between, launch)
    result.update(actors=args.actors, actor_processes=args.actor_processes or "launcher's choice")
    return result


# After a pause, the slice opens at the first metrics record written this long after the
# run was resumed (its first steps then run on caches the pieces have filled).
SETTLE_SECONDS = 1.0


def watch_run(proc: subprocess.Popen, metrics_path: Path, args, between: Optional[Callable[[int], None]] = None,
              samples: Optional[List[Dict[str, Any]]] = None, log_path: Optional[Path] = None,
              started: Optional[float] = None) -> Dict[str, Any]:
    """Watches a running launcher's ``metrics.jsonl`` until its measurement window has closed.

    Without ``between``: one window of ``args.seconds`` after ``args.warmup`` (see
    :func:`select_window`). With it, the window is cut into ``args.slices`` slices of
    ``args.seconds / args.slices``, and ``between(i)`` is called with the whole process tree
    paused (SIGSTOP; SIGCONT after) once after the warm-up (``i = 0``) and after each slice:
    what it measures then runs on an otherwise idle machine right beside the slices. Each
    slice opens at the first record written :data:`SETTLE_SECONDS` after the run resumed, so
    no slice spans a pause. Returns the slices combined (:func:`combine_windows`), with the
    cores each part used over them, or ``error``.
    """
    samples = [] if samples is None else samples
    started = time.monotonic() if started is None else started
    slices = args.slices if between is not None else 1
    deadline = started + args.startup_timeout + args.warmup + args.seconds + (slices + 9) * args.log_interval
    windows: List[Dict[str, Any]] = []
    not_before: Optional[float] = None
    paused_for = 0.0
    records: List[Dict[str, Any]] = []

    def pause_for(i: int) -> float:
        t = time.monotonic()
        signal_tree(proc.pid, signal.SIGSTOP)
        try:
            between(i)
        finally:
            signal_tree(proc.pid, signal.SIGCONT)
        return time.monotonic() - t

    def log_end() -> str:
        return f"; the launcher's log ends: {_log_tail(log_path)}" if log_path is not None else ""

    # Before the first slice (with between): wait for the end of the warm-up, then pause.
    warmed = between is None
    while len(windows) < slices:
        time.sleep(min(0.5, args.log_interval / 2))
        samples.append(cpu_sample(proc.pid))
        records = read_metrics(metrics_path)
        if not warmed:
            trained = [r for r in records if r.get("learner_step", 0) > 0 and "time" in r]
            if trained and trained[-1]["time"] >= trained[0]["time"] + args.warmup:
                paused_for += pause_for(0)
                not_before, warmed = time.time() + SETTLE_SECONDS, True
                continue
        else:
            window = select_window(records, args.warmup, args.seconds / slices, not_before)
            if window is not None:
                split = cpu_split(samples, window["window_start_time"], window["window_start_time"] + window["window_seconds"])
                windows.append({**window, **(split or {})})
                if between is not None:
                    paused_for += pause_for(len(windows))
                    not_before = time.time() + SETTLE_SECONDS
                continue
        if proc.poll() is not None:
            return {"error": f"the launcher exited with code {proc.returncode} before the window closed{log_end()}"}
        if time.monotonic() > deadline + paused_for:
            trained = any(r.get("learner_step", 0) > 0 for r in records)
            return {"error": (f"no complete window within {deadline + paused_for - started:.0f} s "
                              + ("(training started; raise --startup-timeout or shorten --warmup/--seconds)"
                                 if trained else "(no learner step yet; raise --startup-timeout)") + log_end())}
    out = combine_windows(windows)
    if between is not None:
        out["paused_seconds"] = paused_for
    return out


LAUNCH_LOG_FIELDS = (("plan", "plan:"), ("learner_threads", "learner threads:"), ("actor_nice", "actor nice:"))


def launch_log_fields(lines: Sequence[str]) -> Dict[str, str]:
    """What the launcher's log says it chose: ``{field: text after the marker}`` from the last
    line holding each marker of :data:`LAUNCH_LOG_FIELDS` (fields it never logged are absent)."""
    out = {}
    for key, marker in LAUNCH_LOG_FIELDS:
        found = [line for line in lines if marker in line]
        if found:
            out[key] = found[-1].split(marker, 1)[1].strip()
    return out


# A line of actors.run.StatsReporter: "<id>: N agent steps in S s (R/s); CPU ms per agent step: env X, ...".
ACTOR_STATS_LINE = re.compile(r": (\d+) agent steps in [\d.]+ s \([\d.]+/s\); CPU ms per agent step: (.+)$")


def actor_loop_costs(logs: Sequence[Sequence[str]]) -> Dict[str, Any]:
    """The actors' own accounting of their loop: ``{"actor_loop_ms_per_step": {part: ms of
    the actor thread's CPU per agent step}, "actor_loop_reports": n}`` from the periodic lines
    of each actor process's log (one list of lines per process), weighted by their agent
    steps; each process's first report is left out (it holds the warm-up). Empty when no
    report is left."""
    totals: Dict[str, float] = {}
    steps = reports = 0
    for lines in logs:
        found = [m for m in (ACTOR_STATS_LINE.search(line) for line in lines) if m]
        for m in found[1:]:
            n = int(m.group(1))
            steps += n
            reports += 1
            for part in m.group(2).split(", "):
                name, value = part.rsplit(" ", 1)
                totals[name] = totals.get(name, 0.0) + float(value) * n
    if not steps:
        return {}
    return {"actor_loop_ms_per_step": {k: v / steps for k, v in totals.items()}, "actor_loop_reports": reports}


def run_launch_window(launch_args: Sequence[str], args, between: Optional[Callable[[int], None]] = None,
                      launch: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Runs ``python -m impala_rep.launch LAUNCH_ARGS`` on a temporary logdir until the
    measurement window (``args.warmup``, ``args.seconds``, and with ``between``
    ``args.slices``; see :func:`watch_run`) has closed, then stops it with SIGTERM. Returns
    the window's rates, the cores the learner process, the actor processes and the machine
    used over it, the peak resident memory of the whole process tree, and ``error`` with a
    sentence if the run failed or stalled.

    ``args`` also gives ``log_interval``, ``startup_timeout``, ``stop_timeout`` and
    ``keep_logdir``. ``launch`` (a dict), if given, gets the launcher's log under ``log_path``
    while it runs (``between`` reads its plan there).
    """
    logdir = Path(tempfile.mkdtemp(prefix="impala_bench_"))
    cmd = [sys.executable, "-m", "impala_rep.launch", *launch_args,
           "--total-steps", str(10 ** 12), "--no-resume", "--logdir", str(logdir / "run"),
           "--log-interval", str(args.log_interval), "--checkpoint-interval", str(10 ** 7), "--bind", "127.0.0.1"]
    env = _env(threads_one=False)  # the launcher sets the actors' and the learner's thread budgets itself
    log_path = logdir / "launch.log"
    if launch is not None:
        launch["log_path"] = log_path
    started, started_wall = time.monotonic(), time.time()
    result: Dict[str, Any] = {"command": " ".join(cmd[1:]), "logdir": str(logdir / "run")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                                start_new_session=True)
        samples: List[Dict[str, Any]] = []
        try:
            window = watch_run(proc, logdir / "run" / "metrics.jsonl", args, between, samples, log_path, started)
            result.update(window)
            result["peak_rss_mb"] = round(max((sample["rss_mb"] for sample in samples), default=0.0))
            if "error" not in window:
                records = read_metrics(logdir / "run" / "metrics.jsonl")
                first = next(r for r in records if r.get("learner_step", 0) > 0)
                result["first_record_after_s"] = first["time"] - started_wall
                result.update(launch_log_fields(log_path.read_text(errors="replace").splitlines()))
        finally:
            code = _stop_launch(proc, args.stop_timeout)
            if code is None:
                result["stop"] = f"killed after not stopping within {args.stop_timeout:.0f} s of SIGTERM"
    if "error" not in result:
        result.update(actor_loop_costs([path.read_text(errors="replace").splitlines()
                                        for path in sorted((logdir / "run" / "actors").glob("*.log"))]))
    if args.keep_logdir:
        result["kept_logdir"] = str(logdir)
    else:
        shutil.rmtree(logdir, ignore_errors=True)
        result.pop("logdir", None)
    return result


# --------------------------------------------------------------------------- driver


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_info(cpuinfo: str = "/proc/cpuinfo", meminfo: str = "/proc/meminfo") -> Dict[str, Any]:
    info: Dict[str, Any] = {"cores": available_cores(), "python": platform.python_version(),
                            "platform": platform.platform()}
    try:
        with open(cpuinfo) as f:
            first = f.read().split("\n\n", 1)[0]  # the first processor's block
        fields = {key.strip(): value.strip() for key, _, value in
                  (line.partition(":") for line in first.splitlines())}
        if fields.get("model name"):
            info["cpu"] = fields["model name"]
        # Family and model name the host kind that docs/benchmarks/hosts.txt records per session.
        for key, name in (("cpu family", "cpu_family"), ("model", "cpu_model")):
            if fields.get(key, "").isdigit():
                info[name] = int(fields[key])
        with open(meminfo) as f:
            total = next((int(l.split()[1]) for l in f if l.startswith("MemTotal:")), None)
        if total:
            info["memory_gib"] = round(total / 2 ** 20, 1)
    except OSError:
        pass
    return info


def parse_args(argv=None) -> argparse.Namespace:
    from impala_rep.config import INTAKES, LEARNER_PRECISIONS, MAX_PARAM_REFRESH_LAG
    from impala_rep.flags import nonnegative_float, positive_float
    from impala_rep.launch import parse_learner_threads

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), metavar="WORKLOAD",
                        help=f"which workloads (default all): {', '.join(WORKLOADS)}")
    parser.add_argument("--parts", nargs="+", default=["ceiling", "e2e"], choices=["ceiling", "e2e"],
                        help="ceiling: the pieces in isolation; e2e: the launcher end to end (default both)")
    parser.add_argument("--actors", type=int, default=32, help="envs acting at once in the end-to-end run (default 32)")
    parser.add_argument("--actor-processes", type=int, default=None,
                        help="actor processes in the end-to-end run (default: the launcher's choice: by cost for its CPU learner)")
    parser.add_argument("--learner-threads", type=parse_learner_threads, default="auto", metavar="N|auto",
                        help="the launcher's --learner-threads in the end-to-end run (default auto: sized from the "
                             "probed env and policy costs)")
    parser.add_argument("--replicas", type=int, default=None,
                        help="the launcher's --replicas in the end-to-end run: CPU replicas the learner's threads "
                             f"share (default: one per learner thread); must divide the batch, {BATCH_SIZE}. The "
                             "learner piece stays one replica on one core, on the batch each replica gets")
    parser.add_argument("--actor-nice", type=int, default=None, metavar="N",
                        help="the launcher's --actor-nice in the end-to-end run, 0-19 (default: the launcher's choice)")
    parser.add_argument("--param-refresh-lag", type=int, default=None, metavar="K",
                        help="the launcher's --param-refresh-lag in the end-to-end run: learner versions an actor may "
                             "fall behind before it is sent new parameters (default: the launcher's)")
    parser.add_argument("--learner-precision", choices=LEARNER_PRECISIONS, default="float32",
                        help="what the learner network computes in, in the learner piece and the end-to-end run "
                             "(the launcher's --learner-precision; default float32)")
    parser.add_argument("--intake", choices=INTAKES, default="auto",
                        help="the launcher's --intake in the end-to-end run: the learner's gRPC service, queue and "
                             "batcher in its process (thread) or a child process (process); default auto (thread "
                             "on this CPU learner). The child's CPU counts as the learner's")
    parser.add_argument("--seconds", type=positive_float, default=60.0, help="end-to-end measurement window (default 60)")
    parser.add_argument("--warmup", type=nonnegative_float, default=30.0,
                        help="seconds after the first learner step before the window opens (default 30)")
    parser.add_argument("--piece-seconds", type=positive_float, default=6.0,
                        help="measurement time of each ceiling piece in each round (default 6)")
    parser.add_argument("--slices", type=int, default=3,
                        help="with both parts: the end-to-end window is cut into this many slices, and the run is "
                             "paused for a round of the ceiling pieces after its warm-up and after each slice "
                             "(default 3: 4 rounds)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="with --parts ceiling alone: rounds of the pieces (default 2); each piece's rate is the "
                             "harmonic mean of its rounds")
    parser.add_argument("--cores", type=positive_float, default=None,
                        help="cores the ceiling is computed for (default: the cores this process may use)")
    parser.add_argument("--log-interval", type=positive_float, default=1.0, help="the run's metrics interval in seconds (default 1)")
    parser.add_argument("--startup-timeout", type=positive_float, default=300.0,
                        help="seconds allowed until the first learner step (default 300)")
    parser.add_argument("--stop-timeout", type=positive_float, default=60.0, help="seconds allowed for a clean stop (default 60)")
    parser.add_argument("--timeout", type=positive_float, default=300.0, help="limit for each ceiling-piece subprocess (default 300)")
    parser.add_argument("--keep-logdir", action="store_true", help="keep the end-to-end run's temporary directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    parser.add_argument("--child", choices=["env", "inference"], help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}.")
    if args.actors < 1:
        parser.error(f"--actors must be at least 1, got {args.actors}.")
    if args.actor_processes is not None and not 1 <= args.actor_processes <= args.actors:
        parser.error(f"--actor-processes must be between 1 and --actors ({args.actors}), got {args.actor_processes}.")
    if args.replicas is not None and (args.replicas < 1 or BATCH_SIZE % args.replicas):
        parser.error(f"--replicas must be a positive divisor of the batch size {BATCH_SIZE}, got {args.replicas}.")
    if args.actor_nice is not None and not 0 <= args.actor_nice <= 19:
        parser.error(f"--actor-nice must be between 0 and 19, got {args.actor_nice}.")
    if args.param_refresh_lag is not None and not 1 <= args.param_refresh_lag <= MAX_PARAM_REFRESH_LAG:
        parser.error(f"--param-refresh-lag must be from 1 to {MAX_PARAM_REFRESH_LAG}, got {args.param_refresh_lag}.")
    if args.slices < 1:
        parser.error(f"--slices must be at least 1, got {args.slices}.")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}.")
    if args.rounds is not None and "e2e" in args.parts:
        parser.error("--rounds is for --parts ceiling alone; with the end-to-end run the pieces run in its "
                     "--slices + 1 pauses (set --slices).")
    if args.rounds is None:
        args.rounds = args.slices + 1 if "e2e" in args.parts and "ceiling" in args.parts else 2
    if args.seconds < 2 * args.log_interval:
        parser.error(f"--seconds ({args.seconds}) must span at least two metrics records "
                     f"(2 x --log-interval = {2 * args.log_interval}).")
    return args


def inference_batch(args, planned: Optional[int] = None) -> int:
    """Envs per actor process in the end-to-end run (what the inference piece batches over):
    ``--batch``, else ``planned`` (the launcher's plan, :func:`planned_batch`), else one
    process per core as ``--actor-processes`` or the cores give it."""
    if args.batch:
        return args.batch
    if planned:
        return planned
    processes = args.actor_processes or min(args.actors, available_cores())
    return envs_per_process(args.actors, processes)


def _last_log_match(log_path: Optional[Path], pattern: str) -> Optional["re.Match"]:
    """The match of ``pattern`` in the last line of a launcher's log that has one; None
    without a log or such a line."""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines() if log_path else []
    except OSError:
        return None
    for line in reversed(lines):
        found = re.search(pattern, line)
        if found:
            return found
    return None


def planned_batch(log_path: Optional[Path]) -> Optional[int]:
    """The most envs one actor process runs, from the last ``plan:`` line of a launcher's log
    (``... in 1 process(es) (32 envs each) ...``; ``16/17 envs each`` gives 17); None without one."""
    found = _last_log_match(log_path, r"plan: .* process\(es\) \(([\d/]+) envs each\)")
    return max(int(n) for n in found.group(1).split("/")) if found else None


def planned_replicas(log_path: Optional[Path]) -> Optional[int]:
    """The CPU learner's replicas, from the last ``learner replicas: N`` line of a launcher's
    log; None without one."""
    found = _last_log_match(log_path, r"learner replicas: (\d+)")
    return int(found.group(1)) if found else None


def replica_batch(args, planned: Optional[int] = None) -> int:
    """Unrolls per replica of the end-to-end learner (what the learner piece trains on): the
    batch over ``--replicas``, else over ``planned`` (the launcher's log, :func:`planned_replicas`),
    else the whole batch. A replica's share of a step costs less per frame on a smaller batch
    (caches), so a piece at the whole batch would understate what one core can learn from."""
    replicas = args.replicas or planned or 1
    return BATCH_SIZE // replicas if BATCH_SIZE % replicas == 0 else BATCH_SIZE


def combine_rounds(rounds: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """One piece's rounds as one result: the rate is the harmonic mean of the rounds' rates
    (the mean core-seconds per agent step, which is what the ceiling adds up), the other
    fields are the last round's, and ``rounds_agent_steps_per_s`` lists every round's rate
    (``rounds_cores_stolen`` every round's ``cores_stolen``, when each has it).
    A round that failed makes the result that round's error."""
    if not rounds:
        raise ValueError("combine_rounds needs at least one round.")
    for r in rounds:
        if "error" in r:
            return dict(r)
    rates = [float(r["agent_steps_per_s"]) for r in rounds]
    out = dict(rounds[-1])
    out["agent_steps_per_s"] = len(rates) / sum(1.0 / x for x in rates)
    out["rounds_agent_steps_per_s"] = rates
    if all("cores_stolen" in r for r in rounds):
        out["rounds_cores_stolen"] = [float(r["cores_stolen"]) for r in rounds]
    return out


def measure_pieces(workload: Workload, args, report, label: str = "", batch: Optional[int] = None,
                   learner_batch: Optional[int] = None) -> Dict[str, Dict[str, Any]]:
    """One round of the three ceiling pieces, each in its own one-thread process (the policy at
    ``batch``, by default :func:`inference_batch`; the learner at ``learner_batch`` unrolls, by
    default :func:`replica_batch`)."""
    common = ["--workloads", workload.name, "--piece-seconds", str(args.piece_seconds)]
    out: Dict[str, Dict[str, Any]] = {}
    report(f"{workload.name}{label}: env steps/s on one core ...")
    out["env"] = with_stolen(lambda: _run_child(["--child", "env"] + common, args.timeout))
    batch = batch or inference_batch(args)
    report(f"{workload.name}{label}: policy inference at batch {batch} on one core ...")
    out["inference"] = with_stolen(lambda: _run_child(["--child", "inference", "--batch", str(batch)] + common, args.timeout))
    if "error" in out["inference"]:
        out["learner"] = {"error": "not measured: the learner piece takes its input shapes from the inference piece, which failed."}
    else:
        obs_shape, k, action_dims = learner_input(out["inference"])
        learner_batch = learner_batch or replica_batch(args)
        report(f"{workload.name}{label}: learner frames/s on one core ({'x'.join(map(str, obs_shape))} frames, "
               f"stacked {k} deep, batches of {learner_batch}) ...")
        out["learner"] = with_stolen(lambda: measure_learner(args.piece_seconds, args.timeout, obs_shape, k, action_dims,
                                                             args.learner_precision, learner_batch))
    return out


PIECES = ("env", "inference", "learner")


def live_over_pieces(end_to_end: Mapping[str, Any], pieces: Mapping[str, Mapping[str, Any]],
                     cores: Optional[float] = None) -> Dict[str, float]:
    """Where the end-to-end run spent more CPU per agent step than the pieces imply, in ms:
    ``env`` and ``policy`` (the actors' own reports of those parts against the env and
    inference pieces), ``actor_pipeline`` (the rest of the actor processes' CPU: unroll
    assembly, encoding, gRPC threads, batching observations) and ``learner`` (the learner
    process against the learner piece). With the learner's TensorFlow threads measured,
    ``learner`` is also split: ``learner_tensorflow`` (those threads against the learner
    piece, which counts its own Python dispatch too) and ``learner_rest`` (the learner
    process's other threads: gRPC ingest, batching, publishing, the training loop's Python).
    With the machine's CPU measured, ``other_processes`` is what the rest of the machine used
    (the benchmark's own sampling, system daemons) and, given ``cores``, ``stolen`` (the
    hypervisor's, when measured) and ``idle`` (cores no process used): then ``env``, ``policy``,
    ``actor_pipeline``, ``learner``, ``other_processes``, ``stolen`` and ``idle`` sum to the
    whole gap, ``cores`` ms per agent step at the end-to-end rate less the ceiling's.
    Empty without the actors' reports or the CPU split."""
    loop = end_to_end.get("actor_loop_ms_per_step") or {}
    rate = end_to_end.get("agent_steps_per_s")
    if not {"env", "policy"} <= set(loop) or not rate or "cores_actors" not in end_to_end:
        return {}
    if any("agent_steps_per_s" not in pieces.get(p, {}) for p in PIECES):
        return {}
    alone = {p: 1e3 / pieces[p]["agent_steps_per_s"] for p in PIECES}
    actors_ms = 1e3 * end_to_end["cores_actors"] / rate
    learner_ms = 1e3 * end_to_end["cores_learner"] / rate
    gaps = {
        "env": loop["env"] - alone["env"],
        "policy": loop["policy"] - alone["inference"],
        "actor_pipeline": actors_ms - loop["env"] - loop["policy"],
        "learner": learner_ms - alone["learner"],
    }
    if "cores_learner_tensorflow" in end_to_end:
        tensorflow_ms = 1e3 * end_to_end["cores_learner_tensorflow"] / rate
        gaps["learner_tensorflow"] = tensorflow_ms - alone["learner"]
        gaps["learner_rest"] = learner_ms - tensorflow_ms
    if "cores_machine" in end_to_end:
        machine_ms = 1e3 * end_to_end["cores_machine"] / rate
        gaps["other_processes"] = machine_ms - actors_ms - learner_ms
        if cores:
            # Without a steal figure (no /proc/stat column) its time stays inside ``idle``.
            stolen_ms = 0.0
            if "cores_stolen" in end_to_end:
                stolen_ms = gaps["stolen"] = 1e3 * end_to_end["cores_stolen"] / rate
            gaps["idle"] = 1e3 * cores / rate - machine_ms - stolen_ms
    return gaps


def run_workload(workload: Workload, args, report) -> Dict[str, Any]:
    """The pieces in ``args.rounds`` rounds and the end-to-end run, for one workload.

    With both parts, the rounds run while the end-to-end run is paused: one after its
    warm-up and one after each of its ``args.slices`` slices (:func:`watch_run`), so that the
    ceiling is measured right beside the window it is compared with (this host's speed
    drifts by tens of percent over minutes)."""
    out: Dict[str, Any] = {"workload": workload.name, "env_id": workload.env_id, "env_kwargs": dict(workload.env_kwargs),
                           "network": NETWORK, "unroll_length": UNROLL_LENGTH, "batch_size": BATCH_SIZE,
                           "frame_stack": FRAME_STACK}
    cores = args.cores or available_cores()
    ceiling = "ceiling" in args.parts
    launch: Dict[str, Any] = {}
    rounds: List[Dict[str, Dict[str, Any]]] = []

    def pieces_round(_slice: int = 0) -> None:
        label = f", round {len(rounds) + 1} of {args.rounds}" if args.rounds > 1 else ""
        # The policy at the batch the launcher's actor processes run (it picks how many).
        batch = inference_batch(args, planned_batch(launch.get("log_path")))
        # The learner at the batch each of the launcher's CPU replicas trains on.
        learner_batch = replica_batch(args, planned_replicas(launch.get("log_path")))
        rounds.append(measure_pieces(workload, args, report, label, batch, learner_batch))

    if "e2e" in args.parts:
        report(f"{workload.name}: end to end, {args.actors} actors, {args.warmup:.0f} s warm-up + {args.seconds:.0f} s"
               + (f" in {args.slices} slices, paused for the pieces" if ceiling else "") + " ...")
        out["end_to_end"] = measure_end_to_end(workload, args, pieces_round if ceiling else None, launch)
    while ceiling and (not rounds or ("e2e" not in args.parts and len(rounds) < args.rounds)):
        pieces_round()  # the pieces alone, or after an end-to-end run that failed before its first pause
    if rounds:
        for piece in PIECES:
            out[piece] = combine_rounds([r[piece] for r in rounds])
        if all("error" not in out[p] for p in PIECES):
            rates = [out[p]["agent_steps_per_s"] for p in PIECES]
            out["cores"] = cores
            out["ceiling_agent_steps_per_s"] = ceiling_agent_steps_per_s(*rates, cores)
            out["cost_shares"] = cost_shares(*rates)
            out["ceiling_per_round"] = [
                ceiling_agent_steps_per_s(*(r[p]["agent_steps_per_s"] for p in PIECES), cores) for r in rounds
            ]
    e2e = out.get("end_to_end", {})
    if "agent_steps_per_s" in e2e and "ceiling_agent_steps_per_s" in out:
        out["ratio_to_ceiling"] = e2e["agent_steps_per_s"] / out["ceiling_agent_steps_per_s"]
        gaps = live_over_pieces(e2e, out, cores)
        if gaps:
            out["live_over_pieces_ms_per_step"] = gaps
        slice_rates = e2e.get("slices_agent_steps_per_s", [])
        if slice_rates and len(rounds) == len(slice_rates) + 1:
            # Slice i ran between rounds i and i+1: its ceiling is theirs.
            out["ratio_to_ceiling_per_slice"] = [
                rate / ceiling_agent_steps_per_s(
                    *(combine_rounds([rounds[i][p], rounds[i + 1][p]])["agent_steps_per_s"] for p in PIECES), cores)
                for i, rate in enumerate(slice_rates)
            ]
    return out


def _fmt(piece: Mapping[str, Any]) -> str:
    return f"ERROR {piece['error']}" if "error" in piece else f"{piece['agent_steps_per_s']:10.1f} agent steps/s"


def summary(results: Sequence[Mapping[str, Any]]) -> str:
    lines = []
    for r in results:
        lines.append(f"== {r['workload']} ({r['env_id']} {r['env_kwargs']}, {r['network']}, T={r['unroll_length']}, "
                     f"B={r['batch_size']})")
        for key, label in (("env", "env, one core"), ("inference", "inference, one core"), ("learner", "learner, one core")):
            if key in r:
                extra = f" (batch {r[key]['batch']})" if key == "inference" and "batch" in r[key] else ""
                rates = r[key].get("rounds_agent_steps_per_s", [])
                spread = f"  (rounds: {', '.join(f'{x:.1f}' for x in rates)})" if len(rates) > 1 else ""
                stolen = r[key].get("rounds_cores_stolen", [])
                if stolen:
                    spread += f"  (steal: {', '.join(f'{x:.3f}' for x in stolen)} cores)"
                lines.append(f"  {label + extra:32s} {_fmt(r[key])}{spread}")
        if "ceiling_agent_steps_per_s" in r:
            shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["cost_shares"].items())
            lines.append(f"  {'ceiling on %g cores' % r['cores']:32s} {r['ceiling_agent_steps_per_s']:10.1f} agent steps/s"
                         f"  (core-time per step: {shares})")
        if "end_to_end" in r:
            e = r["end_to_end"]
            slices = e.get("slices_agent_steps_per_s", [])
            spread = f"  (slices: {', '.join(f'{x:.1f}' for x in slices)})" if len(slices) > 1 else ""
            lines.append(f"  {'end to end, %d actors' % e['actors']:32s} {_fmt(e)}{spread}")
            if "error" not in e:
                lines.append(f"  {'':32s} over {e['window_seconds']:.1f} s; queue fill {e.get('queue_fill', float('nan')):.2f}, "
                             f"policy lag {e.get('policy_lag_mean', float('nan')):.1f}; plan: {e.get('plan', '?')}")
                if "cores_machine" in e:
                    tf = (f" (TensorFlow's threads {e['cores_learner_tensorflow']:.2f})"
                          if "cores_learner_tensorflow" in e else "")
                    lines.append(f"  {'':32s} cores used: learner process {e['cores_learner']:.2f}{tf}, actor processes "
                                 f"{e['cores_actors']:.2f}, whole machine {e['cores_machine']:.2f} of {r.get('cores', available_cores()):g}")
                if "slices_cores_stolen" in e:
                    lines.append(f"  {'':32s} cores taken by the hypervisor (steal) in each slice: "
                                 + ", ".join(f"{x:.3f}" for x in e["slices_cores_stolen"]))
                if "actor_loop_ms_per_step" in e:
                    parts = ", ".join(f"{k} {v:.3f}" for k, v in e["actor_loop_ms_per_step"].items())
                    lines.append(f"  {'':32s} the actors' loop, CPU ms per agent step (their own reports): {parts}")
        if "ratio_to_ceiling" in r:
            per_slice = r.get("ratio_to_ceiling_per_slice", [])
            spread = (f"  (each slice against the rounds beside it: {', '.join(f'{100 * x:.1f} %' for x in per_slice)})"
                      if len(per_slice) > 1 else "")
            lines.append(f"  {'ratio to ceiling':32s} {100 * r['ratio_to_ceiling']:10.1f} %{spread}")
        if "live_over_pieces_ms_per_step" in r:
            over = dict(r["live_over_pieces_ms_per_step"])
            split = ({k: over.pop(k) for k in ("learner_tensorflow", "learner_rest")}
                     if "learner_tensorflow" in over else None)
            parts = []
            for k, v in over.items():
                parts.append(f"{k} {v:+.3f}")
                if k == "learner" and split is not None:
                    parts[-1] += (f" (TensorFlow's threads {split['learner_tensorflow']:+.3f}, the rest of the "
                                  f"learner process {split['learner_rest']:+.3f})")
            gaps = ", ".join(parts)
            if "idle" in over:
                gaps += f"; in all {sum(over.values()):+.3f}, the whole gap to the ceiling"
            lines.append(f"  {'CPU ms per step over the pieces':32s} {gaps}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        workload = WORKLOADS[args.workloads[0]]
        if args.child == "env":
            result = _child_env_rate(workload, args.piece_seconds)
        else:
            result = _child_inference_rate(workload, args.piece_seconds, args.batch or 1)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    def report(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    results = [run_workload(WORKLOADS[name], args, report) for name in args.workloads]
    failed = any("error" in r.get(k, {}) for r in results for k in ("env", "inference", "learner", "end_to_end"))
    if args.json:
        print(json.dumps({"machine": machine_info(), "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                          "settings": {k: v for k, v in vars(args).items() if k not in ("child", "batch", "json")},
                          "results": results}, indent=2))
    else:
        print(summary(results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(1, str(REPO))  # this checkout's packages, before any editable install's
    stop_on_sigterm()
    sys.exit(main())
