"""A rendered DM Control env and the actor client in one process, streaming to a learner
server: what crashes if TensorFlow sneaks into the actor side (see DESIGN.md). The learner's
rebuilt frame stacks must equal the stacks the actor computed."""

from __future__ import annotations

import os
import sys

import numpy as np

os.environ.setdefault("MUJOCO_GL", "egl")  # test-process setting, as the entry points do

import envs  # noqa: E402
from actors.client import LearnerClient  # noqa: E402
from impala_rep.framestack import FrameStacker, rebuild_stack  # noqa: E402
from impala_rep.specs import STEP_FIRST, STEP_LAST, STEP_MID, env_spec_from_dm_env, unroll_spec  # noqa: E402
from learner.batcher import Batcher  # noqa: E402
from learner.params import ParameterStore  # noqa: E402
from learner.queue import UnrollQueue  # noqa: E402
from learner.server import LearnerServer  # noqa: E402


def test_rendered_dmc_env_streams_through_the_client_in_one_process():
    k, t_len, n_unrolls = 3, 20, 12  # 240 env steps
    env = envs.make("dmc/cartpole-swingup", seed=0, action_repeat=1)
    env_spec = env_spec_from_dm_env(env)
    spec = unroll_spec(env_spec, t_len, frame_stack={"pixels": k})
    server = LearnerServer(spec, t_len, UnrollQueue(n_unrolls), ParameterStore(), frame_stack={"pixels": k},
                           run_config={"env_id": "dmc/cartpole-swingup"})
    server.start()
    try:
        client = LearnerClient(server.address, actor_id="dmc-actor", give_up_after_s=30)
        hs = client.connect()
        assert hs.run_config_dict() == {"env_id": "dmc/cartpole-swingup"}
        rng = np.random.default_rng(0)
        stacker = FrameStacker(k)
        action_spec = env_spec.action
        lo, hi = action_spec.bounds()
        steps = []  # per step: frame, step_type, reward, discount, action, stacked, history_before
        ts = env.reset()
        for t in range(n_unrolls * t_len + 1):
            frame = np.ascontiguousarray(ts.observation["pixels"])
            history = stacker.history() if t else np.repeat(frame[None], k - 1, axis=0)
            stacked = stacker.push(frame, first=ts.first())
            action = rng.uniform(lo, hi).astype(action_spec.dtype)
            steps.append(dict(
                frame=frame, stacked=stacked, history=history, action=action,
                step_type=STEP_FIRST if ts.first() else (STEP_LAST if ts.last() else STEP_MID),
                reward=0.0 if ts.reward is None else float(ts.reward),
                discount=1.0 if ts.discount is None else float(ts.discount),
            ))
            ts = env.reset() if ts.last() else env.step(action)
        for i in range(n_unrolls):
            window = steps[i * t_len:i * t_len + t_len + 1]
            unroll = {
                "observation/pixels": np.stack([s["frame"] for s in window]),
                "frame_prefix/pixels": window[0]["history"],
                "step_type": np.array([s["step_type"] for s in window], np.uint8),
                "reward": np.array([s["reward"] for s in window], np.float32),
                "discount": np.array([s["discount"] for s in window], np.float32),
                "action": np.stack([s["action"] for s in window]),
                "behaviour_log_prob": np.full(t_len + 1, -0.7, np.float32),
            }
            client.send(unroll, policy_version=0, timeout=30)
        assert client.flush(30)
        batch = Batcher(server.queue, spec, batch_size=n_unrolls, frame_stack={"pixels": k}).next_batch(timeout=30)
        client.close()
    finally:
        server.stop(0)
    # The batch carries single frames; stacked by the rule (as the learner's network stacks
    # them in its graph), they are what the actor's policy saw.
    frames = batch.tensors["frames/pixels"]
    assert frames.shape == (t_len + k, n_unrolls, 84, 84, 3)
    obs = rebuild_stack(frames[k - 1:], frames[:k - 1], batch.tensors["step_type"])
    assert obs.std() > 0  # real rendered frames, not blanks
    for i in range(n_unrolls):
        for t in range(t_len + 1):
            np.testing.assert_array_equal(obs[t, i], steps[i * t_len + t]["stacked"])
    assert server.snapshot_metrics()["unrolls_rejected"] == 0
    assert "tensorflow" not in sys.modules
