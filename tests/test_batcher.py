"""Bounded queue, batcher, frame-stack reconstruction, parameter store, policy lag."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from impala_rep.framestack import FrameStacker, rebuild_stack
from impala_rep.proto import transport_pb2
from impala_rep.specs import STEP_FIRST, STEP_LAST, STEP_MID, ArraySpec, EnvSpec, unroll_spec
from learner.batcher import Batcher, PrefetchingBatcher, batch_unrolls, policy_lag
from learner.params import ParameterStore
from learner.queue import QueueClosed, UnrollQueue
from learner.validation import ValidUnroll

from test_transport_helpers import T, make_unroll, small_spec


def _valid(tensors, version=0, returns=(), lengths=()):
    return ValidUnroll(
        tensors=tensors,
        policy_version=version,
        actor_id="a",
        episode_returns=np.asarray(returns, np.float64),
        episode_lengths=np.asarray(lengths, np.int64),
        nbytes=0,
    )


# ---------------------------------------------------------------- queue


def test_queue_put_blocks_when_full_and_resumes_when_drained():
    q = UnrollQueue(2)
    assert q.put(1) and q.put(2)
    t0 = time.monotonic()
    assert q.put(3, timeout=0.2) is False  # full: times out, item not queued
    assert time.monotonic() - t0 >= 0.19
    assert len(q) == 2 and q.fill == 1.0
    done = []
    th = threading.Thread(target=lambda: done.append(q.put(3, timeout=5)))
    th.start()
    time.sleep(0.1)
    assert not done  # still blocked
    assert q.get() == 1
    th.join(5)
    assert done == [True] and q.get_many(2) == [2, 3]
    assert q.max_size_seen == 2 and q.producer_wait_s > 0


def test_queue_cancel_close_and_argument_checks():
    q = UnrollQueue(1)
    q.put("a")
    assert q.put("b", cancelled=lambda: True) is False
    with pytest.raises(TimeoutError):
        UnrollQueue(1).get(timeout=0.05)
    with pytest.raises(ValueError, match="capacity"):
        UnrollQueue(0)
    with pytest.raises(ValueError, match="n <= capacity"):
        q.get_many(2)
    waiter_error = []

    def wait_put():
        try:
            q.put("c")
        except QueueClosed as e:
            waiter_error.append(e)

    th = threading.Thread(target=wait_put)
    th.start()
    time.sleep(0.05)
    q.close()
    th.join(5)
    assert waiter_error, "close() must wake a blocked producer with QueueClosed"


def test_queue_bound_holds_under_a_thread_flood():
    q = UnrollQueue(5)
    stop = threading.Event()
    seen = []

    def producer(i):
        while not stop.is_set():
            q.put(i, timeout=0.05)

    threads = [threading.Thread(target=producer, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 1.0
    got = 0
    while time.monotonic() < deadline:
        seen.append(len(q))
        if got < 50:
            q.get(timeout=1)
            got += 1
        time.sleep(0.001)
    stop.set()
    for th in threads:
        th.join(5)
    assert max(seen) <= 5 and q.max_size_seen == 5


# ---------------------------------------------------------------- batcher


def test_batch_layout_is_time_major_with_single_frames_for_stacked_keys():
    spec = small_spec()
    rng = np.random.default_rng(0)
    unrolls = [make_unroll(spec, rng, tag=float(i)) for i in range(3)]
    batch = batch_unrolls(
        [_valid(u, version=i, returns=[float(i)] * i, lengths=[5] * i) for i, u in enumerate(unrolls)],
        spec,
        {"pixels": 3},
    )
    t = batch.tensors
    assert set(t) == {
        "frames/pixels", "observation/position", "step_type", "reward", "discount",
        "action", "behaviour_log_prob", "policy_version",
    }
    # The stacked key travels as single frames, [T+K, B, H, W, C]: the network stacks them.
    assert t["frames/pixels"].shape == (T + 3, 3, 8, 8, 3) and t["frames/pixels"].dtype == np.uint8
    assert t["observation/position"].shape == (T + 1, 3, 2)
    for key in ("step_type", "reward", "discount", "action", "behaviour_log_prob"):
        assert t[key].shape == (T + 1, 3) and t[key].dtype == np.dtype(spec[key].dtype)
    for i, u in enumerate(unrolls):
        np.testing.assert_array_equal(t["reward"][:, i], u["reward"])
        np.testing.assert_array_equal(t["action"][:, i], u["action"])
        np.testing.assert_array_equal(t["observation/position"][:, i], u["observation/position"])
        # the K-1 prefix frames, then the T+1 steps' frames
        np.testing.assert_array_equal(t["frames/pixels"][:2, i], u["frame_prefix/pixels"])
        np.testing.assert_array_equal(t["frames/pixels"][2:, i], u["observation/pixels"])
    np.testing.assert_array_equal(t["policy_version"], [0, 1, 2])
    assert t["policy_version"].dtype == np.int64
    # Per-step arrays start on 64-byte boundaries, so the learner hands them to TensorFlow
    # without a copy (learner.step.shared_tensor).
    for key in ("frames/pixels", "observation/position", "step_type", "reward", "action"):
        assert t[key].ctypes.data % 64 == 0 and t[key].flags.c_contiguous, key
    np.testing.assert_array_equal(batch.episode_returns, [1.0, 2.0, 2.0])
    np.testing.assert_array_equal(batch.episode_lengths, [5, 5, 5])
    assert batch.batch_size == 3


def test_core_state_is_batched_along_the_first_axis():
    env = EnvSpec({"obs": ArraySpec("obs", (3,), "float32")}, ArraySpec("action", (), "int32", num_values=2))
    spec = unroll_spec(env, 2, core_state={"h": ArraySpec("h", (4,), "float32")})
    rng = np.random.default_rng(1)
    us = [make_unroll(spec, rng) for _ in range(2)]
    batch = batch_unrolls([_valid(u) for u in us], spec)
    assert batch.tensors["core_state/h"].shape == (2, 4)
    np.testing.assert_array_equal(batch.tensors["core_state/h"][1], us[1]["core_state/h"])


def _stack_oracle(frames, prefix, step_type):
    """The frame-stacking rule written out step by step (see impala_rep.framestack)."""
    k = prefix.shape[0] + 1
    steps, b = step_type.shape
    out = np.empty(frames.shape[:-1] + (frames.shape[-1] * k,), frames.dtype)
    for col in range(b):
        start = None
        for t in range(steps):
            if step_type[t, col] == STEP_FIRST:
                start = t
            parts = []
            for j in range(k - 1, -1, -1):
                src = t - j
                if start is not None and src < start:
                    src = start
                parts.append(frames[src, col] if src >= 0 else prefix[k - 1 + src, col])
            out[t, col] = np.concatenate(parts, axis=-1)
    return out


def test_rebuild_stack_equals_the_rule_written_out():
    rng = np.random.default_rng(2)
    for _ in range(60):
        steps, b, k, c = rng.integers(1, 9), rng.integers(1, 5), rng.integers(1, 5), rng.integers(1, 4)
        dtype = rng.choice([np.uint8, np.float32])
        frames = rng.integers(0, 255, (steps, b, 3, 2, c)).astype(dtype)
        prefix = rng.integers(0, 255, (k - 1, b, 3, 2, c)).astype(dtype)
        step_type = rng.choice([STEP_FIRST, STEP_MID, STEP_LAST], (steps, b)).astype(np.uint8)
        got = rebuild_stack(frames, prefix, step_type)
        assert got.dtype == frames.dtype
        np.testing.assert_array_equal(got, _stack_oracle(frames, prefix, step_type))
        # Without a batch axis: the same as column 0.
        np.testing.assert_array_equal(rebuild_stack(frames[:, 0], prefix[:, 0], step_type[:, 0]), got[:, 0])


def test_frame_stacker_equals_the_rule_written_out_and_returns_fresh_arrays():
    """Batched and unbatched stackers against the oracle, for several K, C and dtypes; every
    returned stack must stay as it was (the stacker reuses its internal buffers)."""
    rng = np.random.default_rng(5)
    for k in (1, 2, 3, 4):
        for dtype in (np.uint8, np.float32):
            steps, b, c = 12, 3, int(rng.integers(1, 4))
            frames = rng.integers(0, 255, (steps, b, 4, 3, c)).astype(dtype)
            step_type = rng.choice([STEP_FIRST, STEP_MID, STEP_LAST], (steps, b)).astype(np.uint8)
            step_type[0] = STEP_FIRST
            want = _stack_oracle(frames, np.zeros((k - 1, b, 4, 3, c), dtype), step_type)
            batched = FrameStacker(k, batch_size=b)
            singles = [FrameStacker(k) for _ in range(b)]
            got, got_single, hist = [], [], []
            for t in range(steps):
                if t:
                    hist.append(batched.history())
                got.append(batched.push(frames[t], first=step_type[t] == STEP_FIRST))
                got_single.append([s.push(frames[t, e], first=step_type[t, e] == STEP_FIRST) for e, s in enumerate(singles)])
            for t in range(steps):
                assert got[t].dtype == dtype and got[t].shape == (b, 4, 3, c * k)
                np.testing.assert_array_equal(got[t], want[t], err_msg=f"k={k} {dtype} step {t}")
                for e in range(b):
                    np.testing.assert_array_equal(got_single[t][e], want[t, e])
            for t in range(1, steps):  # history before step t = the K-1 newest frames of step t-1's stack
                expect = want[t - 1].reshape(b, 4, 3, k, c)[:, :, :, 1:]
                np.testing.assert_array_equal(hist[t - 1], np.moveaxis(expect, 3, 1))
    with pytest.raises(ValueError, match="frame of shape"):
        s = FrameStacker(2)
        s.push(np.zeros((4, 4, 3), np.uint8), True)
        s.push(np.zeros((4, 5, 3), np.uint8), False)


def test_batched_frames_restack_to_the_actor_stacks_across_episode_boundaries():
    """Simulates an actor with FrameStacker over B envs with random episode ends, sends single
    frames plus prefixes, and checks that the batch's frames, stacked by the rule
    (rebuild_stack; the learner's network stacks them in its graph by the same rule, checked
    against rebuild_stack in tests/learner), equal the actor's stacks."""
    k, b, n_unrolls = 4, 3, 6
    env = EnvSpec({"pixels": ArraySpec("pixels", (5, 5, 2), "uint8")}, ArraySpec("action", (), "int32", num_values=2))
    spec = unroll_spec(env, T, frame_stack={"pixels": k})
    rng = np.random.default_rng(3)
    stacker = FrameStacker(k, batch_size=b)
    steps = n_unrolls * T + 1
    frames = rng.integers(0, 256, (steps, b, 5, 5, 2)).astype(np.uint8)
    step_type = np.full((steps, b), STEP_MID, np.uint8)
    step_type[0] = STEP_FIRST
    for t in range(1, steps):
        for e in range(b):
            if step_type[t - 1, e] == STEP_LAST:
                step_type[t, e] = STEP_FIRST
            elif rng.uniform() < 0.2:
                step_type[t, e] = STEP_LAST
    stacked, history = [], []
    for t in range(steps):
        history.append(stacker.history() if t else np.repeat(frames[0][:, None], k - 1, axis=1))
        stacked.append(stacker.push(frames[t], first=step_type[t] == STEP_FIRST))
    unrolls = []
    for i in range(n_unrolls):
        for e in range(b):
            lo = i * T
            u = make_unroll(spec, rng)
            u["observation/pixels"] = frames[lo:lo + T + 1, e]
            u["frame_prefix/pixels"] = history[lo][e]
            u["step_type"] = step_type[lo:lo + T + 1, e]
            unrolls.append((i, e, _valid(u)))
    batch = batch_unrolls([v for _, _, v in unrolls], spec, {"pixels": k})
    frames_batch = batch.tensors["frames/pixels"]
    assert frames_batch.shape == (T + k, len(unrolls), 5, 5, 2)
    obs = rebuild_stack(frames_batch[k - 1:], frames_batch[:k - 1], batch.tensors["step_type"])
    for j, (i, e, _) in enumerate(unrolls):
        for t in range(T + 1):
            np.testing.assert_array_equal(obs[t, j], stacked[i * T + t][e], err_msg=f"unroll {i} env {e} step {t}")


def test_batcher_takes_batches_from_the_queue():
    spec = small_spec()
    q = UnrollQueue(8)
    rng = np.random.default_rng(4)
    for i in range(6):
        q.put(_valid(make_unroll(spec, rng, tag=float(i)), version=i))
    batcher = Batcher(q, spec, batch_size=4, frame_stack={"pixels": 3})
    batch = batcher.next_batch(timeout=1)
    np.testing.assert_array_equal(batch.tensors["policy_version"], [0, 1, 2, 3])
    with pytest.raises(TimeoutError):
        batcher.next_batch(timeout=0.1)
    assert len(q) == 2  # a timed-out batch takes nothing
    with pytest.raises(ValueError, match="batch_size"):
        Batcher(q, spec, batch_size=9)
    with pytest.raises(ValueError, match="frame_prefix"):
        Batcher(q, small_spec(), batch_size=2, frame_stack={"position": 2})


def test_replay_mixes_earlier_unrolls_into_each_batch_and_counts_only_fresh_ones():
    spec = small_spec()
    q = UnrollQueue(16)
    rng = np.random.default_rng(6)
    for i in range(12):
        q.put(_valid(make_unroll(spec, rng, tag=float(i)), version=i, returns=[float(i)], lengths=[3]))
    batcher = Batcher(q, spec, batch_size=4, frame_stack={"pixels": 3}, replay_ratio=0.5, replay_capacity=5)
    first = batcher.next_batch(timeout=1)  # nothing to replay yet: all fresh
    assert first.fresh == 4 and list(first.tensors["policy_version"]) == [0, 1, 2, 3]
    second = batcher.next_batch(timeout=1)
    versions = list(second.tensors["policy_version"])
    assert second.fresh == 2 and second.batch_size == 4
    assert versions[:2] == [4, 5] and set(versions[2:]) <= {0, 1, 2, 3} and len(set(versions[2:])) == 2
    # Episodes are counted once, when their unroll is fresh.
    np.testing.assert_array_equal(second.episode_returns, [4.0, 5.0])
    # A replayed unroll is trained on as it was: same tensors, same behaviour log-probs.
    j = versions[2]
    np.testing.assert_array_equal(second.tensors["behaviour_log_prob"][:, 2], first.tensors["behaviour_log_prob"][:, j])
    np.testing.assert_array_equal(second.tensors["frames/pixels"][:, 2], first.tensors["frames/pixels"][:, j])
    third = batcher.next_batch(timeout=1)
    assert len(batcher.replay) == 5  # bounded: the oldest (version 0) was dropped
    assert 0 not in [u.policy_version for u in batcher.replay._items]
    assert third.fresh == 2 and list(third.tensors["policy_version"][:2]) == [6, 7]
    with pytest.raises(ValueError, match="replay_ratio must be at least 0 and below 1"):
        Batcher(q, spec, batch_size=4, replay_ratio=1.0)
    # Every batch keeps a fresh unroll, however high the ratio.
    assert Batcher(q, spec, batch_size=4, replay_ratio=0.99).replay_per_batch == 3
    assert Batcher(q, spec, batch_size=4).replay is None


def test_prefetching_batcher_keeps_order_and_bound_and_forwards_closing():
    spec = small_spec()
    q = UnrollQueue(16)
    rng = np.random.default_rng(5)
    for i in range(12):
        q.put(_valid(make_unroll(spec, rng, tag=float(i)), version=i))
    batches = PrefetchingBatcher(Batcher(q, spec, batch_size=2, frame_stack={"pixels": 3}))
    try:
        first = batches.next_batch(timeout=5)
        np.testing.assert_array_equal(first.tensors["policy_version"], [0, 1])
        # Bound: one batch ready plus one being built, so at least 12 - 2 - 2 - 2 remain.
        time.sleep(0.3)
        assert len(q) >= 6
        versions = [batches.next_batch(timeout=5).tensors["policy_version"].tolist() for _ in range(5)]
        assert versions == [[2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
        with pytest.raises(TimeoutError):
            batches.next_batch(timeout=0.2)
        q.close()
        for _ in range(2):  # the closing is reported to every later call
            with pytest.raises(QueueClosed):
                batches.next_batch(timeout=5)
    finally:
        batches.close()
    assert not batches._thread.is_alive()


def test_policy_lag():
    lag = policy_lag(np.array([3, 5, 7]), 7)
    assert lag == {"policy_lag_mean": 2.0, "policy_lag_max": 4.0, "policy_lag_min": 0.0}
    with pytest.raises(ValueError):
        policy_lag([], 1)


# ---------------------------------------------------------------- parameter store


def test_parameter_store_versions_and_serialises_once():
    store = ParameterStore()
    empty = transport_pb2.GetParametersResponse.FromString(store.response_bytes(0))
    assert empty.version == 0 and empty.up_to_date and not empty.tensors
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
    assert store.publish(params) == 1
    params["w"][0, 0] = 100.0  # the store keeps its own copy
    first = store.response_bytes(0)
    assert store.response_bytes(0) is first  # the same bytes object: serialised once per version
    reply = transport_pb2.GetParametersResponse.FromString(first)
    assert reply.version == 1 and not reply.up_to_date
    assert {t.name for t in reply.tensors} == {"w", "b"}
    up = transport_pb2.GetParametersResponse.FromString(store.response_bytes(1))
    assert up.up_to_date and up.version == 1 and not up.tensors
    version, got = store.get()
    assert version == 1 and got["w"][0, 0] == 0.0 and not got["w"].flags.writeable
    assert store.publish(params) == 2 and store.wait_for_version(2, timeout=0)
    with pytest.raises(ValueError, match="grow"):
        store.publish(params, version=2)
    with pytest.raises(ValueError):
        store.publish({})
