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
    elif not (_same_bound(a.minimum, e.minimum) and _same_bound(a.maximum, e.maximum)):
        # The policy clips its actions to (and maps its bins onto) the bounds it was trained with.
        problems.append(f"the action's bounds are [{_bound(a.minimum)}, {_bound(a.maximum)}], the policy's "
                        f"[{_bound(e.minimum)}, {_bound(e.maximum)}]")
    if problems:
        raise ValueError(
            f"the policy was trained on {loaded.env!r} with other specs than this env: " + "; ".join(problems) +
            ". Evaluate on the env and --env-arg values it was trained with."
        )


def _same_bound(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    try:
        x, y = np.broadcast_arrays(np.asarray(a), np.asarray(b))  # a scalar bound stands for every dimension
    except ValueError:
        return False
    return bool(np.array_equal(x, y))


def _bound(value) -> str:
    return "none" if value is None else np.array2string(np.asarray(value), precision=3, separator=", ")


def _video_key(observations) -> Optional[str]:
    """The observation a video shows: ``pixels``, else the one uint8 image ([H, W, C]) there is."""
    if "pixels" in observations:
        return "pixels"
    images = [k for k, s in observations.items() if len(s.shape) == 3 and s.dtype == "uint8"]
    return images[0] if len(images) == 1 else None


def _video_frame(image: np.ndarray, stacked: int) -> np.ndarray:
    """The newest frame of an ``[H, W, C]`` observation (``stacked`` frames deep along C, by the
    env's own frame_stack option) as RGB: grey frames repeated over the three channels."""
    channels = image.shape[-1]
    per_frame = channels // stacked if stacked > 1 and channels % stacked == 0 else channels
    frame = image[..., channels - per_frame:]
    if per_frame == 1:
        return np.repeat(frame, 3, axis=-1)
    return frame[..., :3]


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
    from envs.dmc import recorded_env_kwargs
    from impala_rep.export import load_policy
    from impala_rep.framestack import FrameStacker

    if episodes < 1:
        raise ValueError(f"--episodes must be at least 1, got {episodes}.")
    loaded = load_policy(path)
    # The training env's arguments carry over to the same env only: another env id need not
    # take them (a plug-in does not know dmc's size=...); --env-arg adds or overrides.
    kwargs = recorded_env_kwargs(loaded.env, loaded.env_kwargs) if env_id in (None, loaded.env) else {}
    env_id = env_id or loaded.env
    kwargs.update(env_kwargs or {})
    env = envs.make(env_id, seed=seed, **kwargs)
    _check_spec(loaded, env)
    rng = np.random.default_rng(seed)
    net, policy = loaded.network, loaded.policy
    frames: List[np.ndarray] = []
    video_key = _video_key(loaded.env_spec.observations) if video else None
    if video and video_key is None:
        raise ValueError(f"--video needs an image observation ('pixels', or one uint8 [H, W, C] array); {env_id!r} "
                         f"gives {sorted(loaded.env_spec.observations)}.")
    stacked = int(kwargs.get("frame_stack", 1) or 1)
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
                frames.append(_video_frame(np.asarray(ts.observation[video_key]), stacked))
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
        try:
            _write_video(video, frames)
            report["video"] = os.path.abspath(video)
        except Exception as exc:  # noqa: BLE001 - the episodes' report is kept; main() says what failed
            report["video_error"] = f"could not write the video {video} ({type(exc).__name__}: {exc})"
    return report


# What imageio (its ffmpeg and pillow plugins) writes frames to.
VIDEO_SUFFIXES = (".mp4", ".gif", ".mkv", ".avi", ".mov", ".webm", ".webp", ".apng")  # each written here
PILLOW_SUFFIXES = (".gif", ".webp", ".apng")  # the rest go through ffmpeg


def _write_video(path: str, frames: List[np.ndarray], fps: int = 30) -> None:
    import imageio.v2 as imageio

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if os.path.splitext(path)[1].lower() in PILLOW_SUFFIXES:
        options = {"duration": 1000.0 / fps}  # pillow's animations take ms per frame (its fps is deprecated)
    else:
        options = {"fps": fps, "macro_block_size": 1}  # libx264 needs even sizes; 1 keeps 84x84 frames as they are
    with imageio.get_writer(path, **options) as writer:
        for frame in frames:
            writer.append_data(np.ascontiguousarray(frame))


def export_for_evaluation(run_dir: str, step: int) -> str:
    """The policy of the run's checkpoint at learner step ``step``: ``RUN_DIR/exports/ckpt-STEP``,
    exported there first (``python -m learner.export`` in a child process: TensorFlow and
    MuJoCo's renderer cannot share this one) unless an export newer than the checkpoint is
    there. Raises ValueError with the exporter's sentence when it cannot."""
    import subprocess

    from learner.export import checkpoint_export_dir  # no TensorFlow at import

    out = checkpoint_export_dir(run_dir, step)
    index = os.path.join(run_dir, "checkpoints", f"ckpt-{step}.index")
    meta = os.path.join(out, "policy.json")
    if os.path.isfile(meta) and os.path.isfile(index) and os.path.getmtime(meta) >= os.path.getmtime(index):
        return out
    print(f"exporting the policy of {os.path.join(run_dir, 'checkpoints', f'ckpt-{step}')} to {out} ...", flush=True)
    done = subprocess.run([sys.executable, "-m", "learner.export", run_dir, "--step", str(step), "--out", out],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        said = [line for line in done.stderr.splitlines() if line.startswith("python -m learner.export: error: ")]
        raise ValueError(said[-1].split("error: ", 1)[1] if said else
                         f"exporting ckpt-{step} failed (exit status {done.returncode}): {done.stderr.strip()[-500:]}")
    return out


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
    parser.add_argument("--checkpoint", type=int, default=None, metavar="N",
                        help="evaluate the run's checkpoint at learner step N (ckpt-N) instead of its newest export: "
                             "exported first to RUN_DIR/exports/ckpt-N by python -m learner.export, in a process of "
                             "its own (TensorFlow)")
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
    from learner.export import EXPORTS  # no TensorFlow at import

    try:
        # The outputs are checked before the episodes run, so no evaluation is lost to a bad path.
        if args.report is not None:
            check_output_path(args.report, "--report")
        if args.video is not None:
            check_output_path(args.video, "--video")
            if os.path.splitext(args.video)[1].lower() not in VIDEO_SUFFIXES:
                raise ValueError(f"--video {args.video}: name a video file ending in one of {', '.join(VIDEO_SUFFIXES)}.")
        overrides = envs.parse_env_args(args.env_arg)
        path = args.path if args.checkpoint is None else export_for_evaluation(args.path, args.checkpoint)
        report = evaluate(path, args.episodes, args.greedy, args.seed, args.env, overrides, args.video)
    except (PolicyLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"mean return {report['mean_return']:.1f} ± {report['std_return']:.1f} over {report['episodes']} episodes")
    if report.get("video"):
        print(f"video written to {report['video']}")
    if report.get("video_error"):
        print(f"error: {report['video_error']}; the report is written all the same.", file=sys.stderr)
    out = args.report
    if out is None:
        policy_dir = os.path.dirname(report["policy"]) if os.path.isfile(report["policy"]) else report["policy"]
        base = policy_dir
        if os.path.basename(policy_dir) == "policy":
            base = os.path.dirname(policy_dir)
        elif os.path.basename(os.path.dirname(policy_dir)) == EXPORTS:  # RUN_DIR/exports/ckpt-N (learner.export)
            base = os.path.dirname(os.path.dirname(policy_dir))
        out = os.path.join(base, "eval", f"eval-{report['learner_step']}.json")
        n = 0
        while os.path.exists(out):  # keep earlier reports (the run's own evaluation included)
            n += 1
            out = os.path.join(base, "eval", f"eval-{report['learner_step']}-{n}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"report written to {out}")
    return 1 if report.get("video_error") else 0


if __name__ == "__main__":
    sys.exit(main())
