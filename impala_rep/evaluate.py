"""Evaluate a saved policy: ``python -m impala_rep.evaluate RUN_DIR_OR_POLICY --episodes N``.

Runs the exported policy (network spec + NumPy weights; no TensorFlow, so DM Control can
render in this process), prints each episode's return and the mean ± std, writes a JSON
report, and with ``--video FILE.mp4`` records the pixel observations of the episodes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

__all__ = ["evaluate", "main"]

log = logging.getLogger("impala_rep.evaluate")


def _check_spec(loaded, env) -> None:
    from impala_rep.specs import env_spec_from_dm_env

    actual = env_spec_from_dm_env(env)
    expected = loaded.env_spec
    problems = []
    for key, spec in expected.observations.items():
        got = actual.observations.get(key)
        if got is None:
            problems.append(f"observation {key!r} is missing (env has {sorted(actual.observations)})")
        elif (got.shape, got.dtype) != (spec.shape, spec.dtype):
            problems.append(f"observation {key!r} is {got.dtype}{list(got.shape)}, the policy expects {spec.dtype}{list(spec.shape)}")
    a, e = actual.action, expected.action
    if (a.shape, a.dtype, a.num_values) != (e.shape, e.dtype, e.num_values):
        problems.append(f"the action is {a.dtype}{list(a.shape)} (num_values={a.num_values}), the policy emits "
                        f"{e.dtype}{list(e.shape)} (num_values={e.num_values})")
    if problems:
        raise ValueError(
            f"the policy was trained on {loaded.env!r} with other specs than this env: " + "; ".join(problems) +
            ". Evaluate on the env and --env-arg values it was trained with."
        )


def evaluate(
    path: str,
    episodes: int = 10,
    greedy: bool = False,
    seed: int = 0,
    env_id: Optional[str] = None,
    env_kwargs: Optional[Dict[str, Any]] = None,
    video: Optional[str] = None,
    max_video_frames: int = 10_000,
    progress=print,
) -> Dict[str, Any]:
    """Runs ``episodes`` episodes of the policy at ``path``; returns the report dict."""
    import envs
    from impala_rep.export import load_policy
    from impala_rep.framestack import FrameStacker

    if episodes < 1:
        raise ValueError(f"--episodes must be at least 1, got {episodes}.")
    loaded = load_policy(path)
    env_id = env_id or loaded.env
    kwargs = dict(loaded.env_kwargs)
    kwargs.update(env_kwargs or {})
    env = envs.make(env_id, seed=seed, **kwargs)
    _check_spec(loaded, env)
    rng = np.random.default_rng(seed)
    net, policy = loaded.network, loaded.policy
    frames: List[np.ndarray] = []
    if video and "pixels" not in loaded.env_spec.observations:
        raise ValueError(f"--video needs pixel observations; {env_id!r} gives {sorted(loaded.env_spec.observations)}.")
    returns, lengths = [], []
    t0 = time.monotonic()
    for episode in range(episodes):
        stackers = {k: FrameStacker(v, batch_size=1) for k, v in loaded.frame_stack.items() if v > 1}
        state = net.initial_state(1)
        ts = env.reset()
        total, length = 0.0, 0
        while True:
            obs = {k: np.asarray(v)[None] for k, v in ts.observation.items()}
            if video and len(frames) < max_video_frames:
                frames.append(np.asarray(ts.observation["pixels"])[..., -3:])
            first = np.array([ts.first()])
            for key, stacker in stackers.items():
                obs[key] = stacker.push(obs[key], first)
            params, _, state = net.step(obs, state, first)
            if greedy:
                action = policy.mode_np(params)
            else:
                action, _ = policy.sample_np(params, rng)
            if ts.last():
                break
            ts = env.step(policy.to_env_action(np.asarray(action))[0])
            total += float(ts.reward or 0.0)
            length += 1
        returns.append(total)
        lengths.append(length)
        progress(f"episode {episode + 1}/{episodes}: return {total:.1f} ({length} steps)")
    report = {
        "policy": os.path.abspath(path),
        "env": env_id,
        "env_kwargs": kwargs,
        "episodes": episodes,
        "greedy": greedy,
        "seed": seed,
        "returns": returns,
        "lengths": lengths,
        "mean_return": float(np.mean(returns)),
        "std_return": float(np.std(returns)),
        "learner_step": loaded.metadata.get("learner_step"),
        "agent_steps": loaded.metadata.get("agent_steps"),
        "train_seconds": loaded.metadata.get("train_seconds"),
        "seconds": time.monotonic() - t0,
    }
    if video:
        _write_video(video, frames)
        report["video"] = os.path.abspath(video)
    return report


# What imageio (its ffmpeg and pillow plugins) writes frames to.
VIDEO_SUFFIXES = (".mp4", ".gif", ".mkv", ".avi", ".mov", ".webm", ".webp", ".apng")  # each written here


def _write_video(path: str, frames: List[np.ndarray], fps: int = 30) -> None:
    import imageio.v2 as imageio

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # libx264 needs even sizes; macro_block_size=1 keeps 84x84 frames as they are.
    with imageio.get_writer(path, fps=fps, macro_block_size=1) as writer:
        for frame in frames:
            writer.append_data(np.ascontiguousarray(frame))


def main(argv=None) -> int:
    os.environ.setdefault("MUJOCO_GL", "egl")
    from impala_rep.flags import CommandLineParser, check_output_path, configure_logging, seed_flag

    configure_logging("%(message)s")

    parser = CommandLineParser(prog="python -m impala_rep.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="run directory (uses RUN_DIR/policy) or exported policy directory")
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--greedy", action="store_true", help="act with the policy's mode instead of sampling")
    parser.add_argument("--seed", type=seed_flag, default=0)
    parser.add_argument("--env", default=None, help="evaluate on another env id (its specs must match)")
    parser.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE", help="override an env argument")
    parser.add_argument("--video", default=None, metavar="FILE.mp4", help="record the episodes' pixel observations")
    parser.add_argument("--report", default=None, help="JSON report path (default RUN_DIR/eval/eval-STEP.json, or eval-STEP-N.json where that exists)")
    parser.add_argument("--nice", type=int, default=0, metavar="N",
                        help="lower this process's CPU priority by N (0-19) first; a training run's own "
                             "evaluations use its --actor-nice")
    args = parser.parse_args(argv)
    if not 0 <= args.nice <= 19:
        parser.error(f"--nice must be between 0 and 19, got {args.nice}.")
    if args.nice:
        os.nice(args.nice)  # before anything starts a thread; threads inherit it
    import envs
    from impala_rep.export import PolicyLoadError

    try:
        # The outputs are checked before the episodes run, so no evaluation is lost to a bad path.
        if args.report is not None:
            check_output_path(args.report, "--report")
        if args.video is not None:
            check_output_path(args.video, "--video")
            if os.path.splitext(args.video)[1].lower() not in VIDEO_SUFFIXES:
                raise ValueError(f"--video {args.video}: name a video file ending in one of {', '.join(VIDEO_SUFFIXES)}.")
        overrides = envs.parse_env_args(args.env_arg)
        report = evaluate(args.path, args.episodes, args.greedy, args.seed, args.env, overrides, args.video)
    except (PolicyLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"mean return {report['mean_return']:.1f} ± {report['std_return']:.1f} over {report['episodes']} episodes")
    if report.get("video"):
        print(f"video written to {report['video']}")
    out = args.report
    if out is None:
        policy_dir = os.path.dirname(report["policy"]) if os.path.isfile(report["policy"]) else report["policy"]
        base = os.path.dirname(policy_dir) if os.path.basename(policy_dir) == "policy" else policy_dir
        out = os.path.join(base, "eval", f"eval-{report['learner_step']}.json")
        n = 0
        while os.path.exists(out):  # keep earlier reports (the run's own evaluation included)
            n += 1
            out = os.path.join(base, "eval", f"eval-{report['learner_step']}-{n}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"report written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
