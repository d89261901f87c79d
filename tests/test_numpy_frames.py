"""NumpyNetwork.step_frames (TF-free): the actors' network stacks frames itself.

Its outputs must equal ``step`` on the stacks ``FrameStacker`` builds from the same frames
and episode starts, through new parameters, for every torso; and bad input gets a sentence.
"""

import numpy as np
import pytest

from impala_rep.framestack import FrameHistory, FrameStacker
from impala_rep.networks import NetworkConfig
from impala_rep.networks.numpy_backend import NumpyNetwork, init_params
from impala_rep.specs import ArraySpec

K = 3
ACTION = ArraySpec("action", (2,), "float32", minimum=-1, maximum=1)


def _network(torso, lstm=None, size=24, vector=True):
    obs = {"pixels": ArraySpec("pixels", (size, size, 3 * K), "uint8")}
    if vector:
        obs["v"] = ArraySpec("v", (4,), "float32")
    config = NetworkConfig(torso=torso, lstm_size=lstm, hidden_size=32, mlp_sizes=(16,))
    return NumpyNetwork(config, obs, ACTION)


def _leaves(outputs):
    params, value, state = outputs
    return [params[k] for k in sorted(params)] + [value] + [state[k] for k in sorted(state)]


@pytest.mark.parametrize("torso,lstm", [("shallow", None), ("shallow", 8), ("deep", None), ("mlp", 8)])
def test_step_frames_equals_step_on_the_stacks(torso, lstm):
    rng = np.random.default_rng(0)
    batch, size = 5, 24
    net = _network(torso, lstm, size)
    stacks = net.frame_stacks({"pixels": K, "v": 1}, batch)
    stacker = FrameStacker(K, batch_size=batch)
    state_a = state_b = net.initial_state(batch)
    first = np.ones(batch, bool)
    for t in range(14):
        if t == 6:  # new parameters mid-stream: the kept parts of older frames must follow
            net.set_params(init_params(net.plan, seed=7))
        frame = rng.integers(0, 256, (batch, size, size, 3), dtype=np.uint8)
        vec = rng.normal(size=(batch, 4)).astype(np.float32)
        expected = net.step({"pixels": stacker.push(frame, first), "v": vec}, state_a, first)
        got = net.step_frames({"pixels": frame, "v": vec}, state_b, first, stacks)
        for a, b in zip(_leaves(expected), _leaves(got)):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
        state_a, state_b = expected[2], got[2]
        first = rng.random(batch) < 0.3
    # The shallow torso keeps the frames' space-to-depth blocks, in a ring of K.
    assert ("pixels" in stacks.rings) == (torso == "shallow")


def test_step_frames_does_not_write_the_callers_frames():
    rng = np.random.default_rng(1)
    net = _network("shallow", vector=False)
    stacks = net.frame_stacks({"pixels": K}, 3)
    frames = [rng.integers(0, 256, (3, 24, 24, 3), dtype=np.uint8) for _ in range(5)]
    copies = [f.copy() for f in frames]
    for t, frame in enumerate(frames):
        net.step_frames({"pixels": frame}, {}, np.array([t == 0, t == 2, t % 2 == 1]), stacks)
    for f, c in zip(frames, copies):
        np.testing.assert_array_equal(f, c)


def test_prefix_is_the_frames_before_the_next_step():
    net = _network("shallow", vector=False)
    stacks = net.frame_stacks({"pixels": K}, 2)
    upcoming = np.full((2, 24, 24, 3), 9, np.uint8)
    np.testing.assert_array_equal(stacks.prefix("pixels", upcoming), np.stack([upcoming] * (K - 1)))
    frames = [np.full((2, 24, 24, 3), i, np.uint8) for i in range(4)]
    for i, frame in enumerate(frames):
        net.step_frames({"pixels": frame}, {}, np.array([i == 0, i in (0, 3)]), stacks)
    prefix = stacks.prefix("pixels", upcoming)
    assert prefix.shape == (K - 1, 2, 24, 24, 3)
    np.testing.assert_array_equal(prefix[:, 0, 0, 0, 0], [2, 3])  # env 0: frames 2, 3
    np.testing.assert_array_equal(prefix[:, 1, 0, 0, 0], [3, 3])  # env 1: new episode at 3


def test_frame_history_follows_the_stacking_rule():
    rng = np.random.default_rng(2)
    history, stacker = FrameHistory(K), FrameStacker(K, batch_size=4)
    first = np.ones(4, bool)
    for _ in range(12):
        frame = rng.integers(0, 256, (4, 6, 6, 2), dtype=np.uint8)
        history.push(frame, first)
        np.testing.assert_array_equal(np.concatenate(history.items(), axis=-1), stacker.push(frame, first))
        first = rng.random(4) < 0.4


def test_bad_frames_get_sentences_and_leave_the_stacks_unchanged():
    net = _network("shallow")
    stacks = net.frame_stacks({"pixels": K}, 2)
    good = {"pixels": np.zeros((2, 24, 24, 3), np.uint8), "v": np.zeros((2, 4), np.float32)}
    with pytest.raises(ValueError, match=r"one frame of a stack of 3"):
        net.step_frames({**good, "pixels": np.zeros((2, 24, 24, 9), np.uint8)}, {}, np.ones(2, bool), stacks)
    with pytest.raises(ValueError, match=r"obs\['v'\]"):
        net.step_frames({**good, "v": np.zeros((2, 5), np.float32)}, {}, np.ones(2, bool), stacks)
    assert stacks.frames["pixels"].empty  # the pixels passed their check but were not pushed
    with pytest.raises(ValueError, match=r"first must have shape \[B\] = \[2\]"):
        net.step_frames(good, {}, np.ones(3, bool), stacks)
    with pytest.raises(ValueError, match=r"not one of the network's keys"):
        net.frame_stacks({"rgb": K}, 2)
    with pytest.raises(ValueError, match=r"not a stack of 2 frames"):
        net.frame_stacks({"pixels": 2}, 2)
    with pytest.raises(ValueError, match=r"batch must be at least 1, got 0"):
        net.frame_stacks({"pixels": K}, 0)
    history = FrameHistory(2)
    with pytest.raises(ValueError, match=r"called before any frame was pushed"):
        history.items()
    with pytest.raises(ValueError, match=r"first must have shape \[2\], got \[3\]"):
        history.push(np.zeros((2, 3)), np.ones(3, bool))
    history.push(np.zeros((2, 3)), np.ones(2, bool))
    with pytest.raises(ValueError, match=r"FrameHistory got a batch of shape"):
        history.push(np.zeros((2, 4)), np.ones(2, bool))
    with pytest.raises(ValueError, match=r"frame stack depth must be at least 1"):
        FrameHistory(0)
