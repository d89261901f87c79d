"""--intake process: the learner's gRPC service, unroll queue, batcher and parameter store in a
child process (learner/intake.py), handing batches to the learner through shared-memory slots
and taking parameters back through parameter slots; the --intake flag; batch_unrolls(out=...)."""

from __future__ import annotations

import glob
import json
import mmap
import logging
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import grpc
import numpy as np
import pytest

from actors.client import LearnerClient
from impala_rep.config import INTAKES, ConfigError, RunConfig
from impala_rep.flags import add_learner_flags, config_from_args
from impala_rep.launch import build_parser
from impala_rep.proto import transport_pb2
from impala_rep.specs import ArraySpec, EnvSpec, unroll_spec
from impala_rep.wire import encode_tensor
from learner.batcher import Batcher, batch_layout, batch_unrolls
from learner.intake import ALIGN, IntakeError, ProcessIntake, SlotLayout
from learner.queue import QueueClosed, UnrollQueue
from learner.validation import ValidUnroll

T = 4
FRAME_STACK = {"pixels": 3}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Every test here is bounded (a hang in the intake fails it instead of the session).
pytestmark = pytest.mark.timeout(180)

W0 = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1, 2], np.int64)}


# ---------------------------------------------------------------------------------- helpers


def _spec():
    """A frame-stacked pixel key (frames/ in the batch), a plain vector and a discrete action."""
    env = EnvSpec(
        observations={"pixels": ArraySpec("pixels", (8, 8, 3), "uint8"),
                      "position": ArraySpec("position", (2,), "float32")},
        action=ArraySpec("action", (), "int32", num_values=3),
    )
    return unroll_spec(env, T, frame_stack=FRAME_STACK)


def _unroll(spec, rng, tag=0.0):
    """A valid unroll of ``spec`` (values inside every bound); ``reward`` is ``tag`` everywhere."""
    out = {}
    for key, s in spec.items():
        dtype = np.dtype(s.dtype)
        if s.num_values is not None:
            out[key] = rng.integers(0, s.num_values, s.shape).astype(dtype)
        elif dtype.kind in "ui":
            out[key] = rng.integers(0, 256 if dtype == np.uint8 else 2, s.shape).astype(dtype)
        else:
            lo = -1.0 if s.minimum is None else float(np.max(s.minimum))
            hi = 0.0 if s.maximum is None else float(np.min(s.maximum))
            out[key] = rng.uniform(lo, hi, s.shape).astype(dtype)
    out["step_type"] = np.ones(spec["step_type"].shape, np.uint8)
    out["discount"] = np.ones(spec["discount"].shape, np.float32)
    out["reward"] = np.full(spec["reward"].shape, tag, np.float32)
    return out


def _valid(tensors, version, actor_id, returns=(), lengths=()):
    return ValidUnroll(tensors=tensors, policy_version=int(version), actor_id=actor_id,
                       episode_returns=np.asarray(returns, np.float64),
                       episode_lengths=np.asarray(lengths, np.int64), nbytes=0)


def _intake(spec=None, **kwargs):
    spec = spec or _spec()
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("queue_capacity", 8)
    kwargs.setdefault("frame_stack", FRAME_STACK)
    kwargs.setdefault("initial_params", (1, W0))
    kwargs.setdefault("start_timeout", 60)
    return ProcessIntake(spec, T, **kwargs)


def _our_shared_files():
    """Shared-memory files of intakes this process made (their names carry its pid)."""
    pattern = f"impala_rep-intake-{os.getpid()}-*"
    return sorted(glob.glob(os.path.join("/dev/shm", pattern)) + glob.glob(os.path.join(tempfile.gettempdir(), pattern)))


def _wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def _raw_stream(address, payloads):
    """Sends serialized messages on one StreamUnrolls call; the call's result (or RpcError)."""
    channel = grpc.insecure_channel(address)
    try:
        call = channel.stream_unary("/impala_rep.transport.Learner/StreamUnrolls", request_serializer=lambda b: b,
                                    response_deserializer=transport_pb2.StreamSummary.FromString)
        return call(iter(payloads), timeout=20)
    finally:
        channel.close()


def _payload(tensors, version=0, actor_id="raw"):
    msg = transport_pb2.Unroll(actor_id=actor_id, policy_version=version)
    for name, value in tensors.items():
        encode_tensor(name, value, out=msg.tensors.add())
    return msg.SerializeToString()


def _stopped_in(intake):
    """Seconds that stop() took."""
    t0 = time.monotonic()
    intake.stop()
    return time.monotonic() - t0


# ---------------------------------------------------------------------------------- SlotLayout


def test_slot_layout_aligns_every_field_and_keeps_slots_apart():
    fields = [("a", (3,), np.uint8), ("b", (5, 7), np.float64), ("c", (), np.int64), ("d", (2, 9, 3), np.float32),
              ("e", (1,), np.bool_)]
    layout = SlotLayout(fields, 3)
    offsets = [offset for _, _, _, offset in layout.fields]
    assert all(offset % ALIGN == 0 for offset in offsets) and ALIGN == 64
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    for (name, shape, dtype, offset), (_, next_offset) in zip(layout.fields, zip(offsets, offsets[1:] + [layout.slot_bytes])):
        assert offset + int(np.prod(shape)) * np.dtype(dtype).itemsize <= next_offset, name  # no field overlaps the next
    assert layout.slot_bytes % ALIGN == 0 and layout.nbytes == 3 * layout.slot_bytes
    buffer = mmap.mmap(-1, layout.nbytes)  # page-aligned, as the intake's shared file
    views = [layout.views(buffer, i) for i in range(3)]
    for slot in views:
        assert list(slot) == ["a", "b", "c", "d", "e"]
        for name, shape, dtype, _ in layout.fields:
            assert slot[name].shape == shape and slot[name].dtype == np.dtype(dtype)
            assert slot[name].ctypes.data % ALIGN == 0, name
            assert not slot[name].flags.owndata  # a view on the buffer, not a copy
    for slot in views:
        for arr in slot.values():
            arr[...] = 0
    for arr in views[1].values():  # write all of slot 1 ...
        arr[...] = 1
    for i in (0, 2):  # ... and the others are untouched
        for name, arr in views[i].items():
            assert not np.any(arr), (i, name)
    assert bytes(buffer[:layout.slot_bytes]) == bytes(layout.slot_bytes)
    assert bytes(buffer[2 * layout.slot_bytes:]) == bytes(layout.slot_bytes)
    assert any(buffer[layout.slot_bytes:2 * layout.slot_bytes])
    # views from a base offset (the parameter slots follow the batch slots in one file)
    big = mmap.mmap(-1, 128 + layout.nbytes)
    layout.views(big, 2, 128)["c"][...] = 42
    assert np.frombuffer(big, np.int64, 1, 128 + 2 * layout.slot_bytes + offsets[2])[0] == 42
    assert sum(bytes(big)) == 42  # nothing else was written
    for bad in (-1, 3, 10):
        with pytest.raises(ValueError, match=f"slot {bad} is not one of this layout's 3"):
            layout.views(buffer, bad)
    with pytest.raises(ValueError, match="at least 1 slot"):
        SlotLayout(fields, 0)


def test_slot_layout_round_trips_through_json():
    layout = SlotLayout([("frames/pixels", (7, 4, 8, 8, 3), "uint8"), ("reward", (5, 4), np.float32),
                         ("big_endian", (3,), ">f8"), ("policy_version", (4,), np.int64)], 3)
    data = json.loads(json.dumps(layout.to_json()))  # it travels as JSON to the child
    again = SlotLayout.from_json(data)
    assert again.fields == layout.fields
    assert [d for _, _, d, _ in again.fields] == [np.dtype(np.uint8), np.dtype(np.float32), np.dtype(">f8"),
                                                  np.dtype(np.int64)]
    assert (again.count, again.slot_bytes, again.nbytes) == (layout.count, layout.slot_bytes, layout.nbytes)


# ---------------------------------------------------------------------------------- batch_unrolls(out=...)


def test_batch_unrolls_writes_into_given_arrays_with_the_same_values():
    spec = _spec()
    rng = np.random.default_rng(3)
    unrolls = [_valid(_unroll(spec, rng, tag=i), version=10 + i, actor_id=f"a{i}", returns=[float(i)] * (i % 2),
                      lengths=[i + 1] * (i % 2)) for i in range(3)]
    plain = batch_unrolls(unrolls, spec, FRAME_STACK)
    layout = batch_layout(spec, 3, FRAME_STACK)
    assert set(layout) == set(plain.tensors)
    assert "frames/pixels" in layout and "observation/pixels" not in layout
    for key, (shape, dtype) in layout.items():
        assert plain.tensors[key].shape == shape and plain.tensors[key].dtype == dtype, key
    out = {key: np.full(shape, 77, dtype) for key, (shape, dtype) in layout.items()}
    given = batch_unrolls(unrolls, spec, FRAME_STACK, out=out)
    for key, arr in plain.tensors.items():
        assert given.tensors[key] is out[key], key  # written in place, not copied
        np.testing.assert_array_equal(out[key], arr, err_msg=key)
    np.testing.assert_array_equal(out["policy_version"], [10, 11, 12])
    np.testing.assert_array_equal(out["frames/pixels"][FRAME_STACK["pixels"] - 1:, 1],
                                  unrolls[1].tensors["observation/pixels"])
    np.testing.assert_array_equal(given.episode_returns, plain.episode_returns)
    np.testing.assert_array_equal(given.episode_returns, [1.0])
    np.testing.assert_array_equal(given.episode_lengths, [2])
    assert given.actor_ids == ["a0", "a1", "a2"]
    # through the Batcher, as the intake's child does
    q = UnrollQueue(4)
    for u in unrolls:
        q.put(u)
    out2 = {key: np.zeros(shape, dtype) for key, (shape, dtype) in layout.items()}
    batch = Batcher(q, spec, 3, FRAME_STACK).next_batch(timeout=5, out=out2)
    for key, arr in plain.tensors.items():
        assert batch.tensors[key] is out2[key]
        np.testing.assert_array_equal(arr, out2[key], err_msg=key)


@pytest.mark.parametrize("key, change", [
    ("reward", "shape"), ("frames/pixels", "shape"), ("policy_version", "dtype"), ("step_type", "dtype"),
    ("action", "missing"),
])
def test_batch_unrolls_refuses_out_arrays_of_another_layout_naming_the_key(key, change):
    spec = _spec()
    rng = np.random.default_rng(0)
    unrolls = [_valid(_unroll(spec, rng), 0, "a") for _ in range(2)]
    layout = batch_layout(spec, 2, FRAME_STACK)
    out = {k: np.zeros(shape, dtype) for k, (shape, dtype) in layout.items()}
    shape, dtype = layout[key]
    if change == "shape":
        out[key] = np.zeros((shape[0] + 1,) + shape[1:], dtype)
    elif change == "dtype":
        out[key] = np.zeros(shape, np.float64 if dtype != np.float64 else np.float32)
    else:
        del out[key]
    with pytest.raises(ValueError, match=rf"batch_unrolls\(out=\.\.\.\) needs '{key}' of shape"):
        batch_unrolls(unrolls, spec, FRAME_STACK, out=out)


# ---------------------------------------------------------------------------------- ProcessIntake: batches


def test_the_childs_batches_equal_the_in_process_ones_and_its_slots_are_reused():
    spec = _spec()
    n_batches, b = 6, 4
    intake = _intake(spec, batch_size=b, queue_capacity=8, slots=2)
    port = intake.start()
    client = None
    stop = threading.Event()
    try:
        assert intake.address == f"127.0.0.1:{port}" and port > 0
        assert intake._proc.poll() is None
        assert not _our_shared_files()  # unlinked once both processes mapped it
        rng = np.random.default_rng(7)
        items = []
        for i in range(n_batches * b):
            finished = i % 3 == 0
            items.append((_unroll(spec, rng, tag=i), 100 + i, [float(i) + 0.5] if finished else [],
                          [i + 1] if finished else []))
        client = LearnerClient(intake.address, actor_id="actor-7", unrolls_per_message=1, give_up_after_s=20)
        hs = client.connect()
        assert hs.unroll_spec == spec and hs.unroll_length == T and hs.frame_stack == FRAME_STACK
        assert hs.parameter_version == 1
        errors = []

        def feed():  # one stream, in order; blocks while the queue is full
            try:
                for tensors, version, returns, lengths in items:
                    while not stop.is_set():
                        try:
                            client.send(tensors, policy_version=version, episode_returns=returns,
                                        episode_lengths=lengths, timeout=0.5)
                            break
                        except TimeoutError:
                            continue
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        expected = [batch_unrolls([_valid(t, v, "actor-7", r, l) for t, v, r, l in items[k * b:(k + 1) * b]],
                                  spec, FRAME_STACK) for k in range(n_batches)]
        first = intake.next_batch(timeout=30)
        # While the learner holds the first slot, the child fills the other one and then waits:
        # the held slot is not written although unrolls are waiting.
        _wait_for(lambda: intake.snapshot_metrics()["queue_size"] >= b and intake._ready.qsize() >= 1, 30,
                  "the second slot filled and a batch's unrolls queued behind it")
        time.sleep(0.3)
        batches = [first]
        addresses = []
        for k in range(n_batches):
            batch = batches[k]
            want = expected[k]
            assert set(batch.tensors) == set(want.tensors) == set(batch_layout(spec, b, FRAME_STACK))
            for key, arr in want.tensors.items():
                got = batch.tensors[key]
                assert got.shape == arr.shape and got.dtype == arr.dtype, key
                assert got.ctypes.data % ALIGN == 0, key
                np.testing.assert_array_equal(got, arr, err_msg=f"batch {k}, {key}")
            assert batch.episode_returns.dtype == np.float64 and batch.episode_lengths.dtype == np.int64
            np.testing.assert_array_equal(batch.episode_returns, want.episode_returns)
            np.testing.assert_array_equal(batch.episode_lengths, want.episode_lengths)
            assert batch.actor_ids == ["actor-7"] * b
            assert batch.fresh_unrolls is None and batch.fresh == b and batch.batch_size == b
            addresses.append(batch.tensors["reward"].ctypes.data)
            if k + 1 < n_batches:
                batches.append(intake.next_batch(timeout=30))  # hands slot k back
        assert len(set(addresses)) == 2  # 6 batches through 2 slots: each slot reused
        assert addresses[0::2] == [addresses[0]] * 3 and addresses[1::2] == [addresses[1]] * 3
        feeder.join(30)
        assert not errors, errors
        m = intake.snapshot_metrics()
        assert m["unrolls_accepted"] == n_batches * b and m["unrolls_rejected"] == 0 and m["streams_opened"] >= 1
        with pytest.raises(TimeoutError):
            intake.next_batch(timeout=0.3)  # everything sent was handed over
    finally:
        stop.set()
        if client is not None:
            client.close(drain=False, timeout=2)
        stop_s = _stopped_in(intake)
    assert stop_s < 15
    assert intake._proc.returncode == 0  # stopped, not killed
    assert not _our_shared_files()
    with pytest.raises(QueueClosed):
        intake.next_batch(timeout=1)
    with pytest.raises(RuntimeError, match="stopped"):
        intake.submit(5, W0)


def test_replay_in_the_child_reports_the_fresh_unrolls_of_each_batch():
    spec = _spec()
    intake = _intake(spec, batch_size=4, queue_capacity=8, replay_ratio=0.5, seed=3)
    intake.start()
    client = LearnerClient(intake.address, actor_id="r", unrolls_per_message=1, give_up_after_s=20)
    try:
        rng = np.random.default_rng(1)
        for i in range(8):  # 4 fresh for the first batch, then 2 fresh (and 2 replayed) per batch
            client.send(_unroll(spec, rng, tag=i), policy_version=i, episode_returns=[float(i)], episode_lengths=[1],
                        timeout=20)
        assert client.flush(20)
        fresh, returns = [], []
        for _ in range(3):
            batch = intake.next_batch(timeout=30)
            fresh.append(batch.fresh_unrolls)
            returns.append(batch.episode_returns.tolist())
            assert batch.batch_size == 4
            tags = sorted(float(t) for t in batch.tensors["reward"][0])
            assert len(set(tags)) == 4  # distinct unrolls within a batch
        assert fresh == [4, 2, 2]
        assert returns == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]  # replayed episodes are not counted again
    finally:
        client.close(drain=False, timeout=2)
        intake.stop()


# ---------------------------------------------------------------------------------- ProcessIntake: parameters


def test_parameters_initial_then_submitted_and_a_nan_snapshot_is_never_served():
    intake = _intake(initial_params=(3, W0))
    intake.start()
    client = LearnerClient(intake.address, give_up_after_s=20)
    try:
        assert client.connect().parameter_version == 3 and intake.version == 3
        version, params = client.get_parameters()
        assert version == 3 and set(params) == {"w", "b"}
        np.testing.assert_array_equal(params["w"], W0["w"])
        np.testing.assert_array_equal(params["b"], W0["b"])
        assert params["b"].dtype == np.int64 and params["w"].shape == (2, 3)
        assert client.get_parameters() is None  # up to date

        new = {"w": np.full((2, 3), 7.5, np.float32), "b": np.array([5, 6], np.int64)}
        intake.submit(4, new)
        assert intake.flush(10) and intake.version == 4 and intake.failed is None
        version, params = client.get_parameters()
        assert version == 4 and np.all(params["w"] == 7.5) and params["b"].tolist() == [5, 6]

        nan = {"w": np.full((2, 3), np.nan, np.float32), "b": np.array([0, 0], np.int64)}
        intake.submit(5, nan)
        assert intake.flush(10)
        assert intake.failed == 5 and intake.version == 4
        assert client.get_parameters() is None  # still version 4: nothing newer is served
        fresh = LearnerClient(intake.address, give_up_after_s=20)
        try:
            version, params = fresh.get_parameters()
            assert version == 4 and np.all(params["w"] == 7.5)
        finally:
            fresh.close(drain=False)
        published = intake.published
        intake.submit(6, new)  # ignored after a failed snapshot
        assert intake.flush(10) and intake.version == 4 and intake.failed == 5 and intake.published == published
        assert client.get_parameters() is None
        assert intake.snapshot_metrics()["parameter_version"] == 4
    finally:
        client.close(drain=False)
        intake.stop()


def test_rapid_submits_publish_the_newest_and_account_for_every_snapshot():
    intake = _intake(initial_params=(1, W0))
    intake.start()
    client = LearnerClient(intake.address, give_up_after_s=20)
    try:
        with pytest.raises(ValueError, match=r"parameter 'w' is \(6,\) float32; the intake holds \(2, 3\) float32"):
            intake.submit(2, {"w": np.zeros(6, np.float32), "b": W0["b"]})
        for _ in range(3):  # a refused snapshot gives its slot back
            with pytest.raises(ValueError):
                intake.submit(2, {"w": np.zeros((3, 2), np.float32), "b": W0["b"]})
        for v in range(2, 42):
            intake.submit(v, {"w": np.full((2, 3), v, np.float32), "b": np.array([v, -v], np.int64)})
        assert intake.flush(20)
        assert intake.version == 41 and intake.failed is None
        assert intake.published + intake.dropped == 40 and intake.published >= 2
        version, params = client.get_parameters()
        assert version == 41 and np.all(params["w"] == 41) and params["b"].tolist() == [41, -41]
        # float64 values are cast into the float32 slots (same kind)
        intake.submit(42, {"w": np.full((2, 3), 0.25, np.float64), "b": W0["b"]})
        assert intake.flush(10) and intake.version == 42
        version, params = client.get_parameters()
        assert version == 42 and params["w"].dtype == np.float32 and np.all(params["w"] == 0.25)
    finally:
        client.close(drain=False)
        intake.stop()


# ---------------------------------------------------------------------------------- ProcessIntake: invalid input, metrics


def test_invalid_unrolls_are_rejected_through_the_child_and_counted():
    spec = _spec()
    intake = _intake(spec, batch_size=4, queue_capacity=8)
    intake.start()
    client = None
    try:
        m = intake.snapshot_metrics()
        assert m["queue_capacity"] == 8 and m["queue_fill"] == 0 and m["unrolls_rejected"] == 0
        with pytest.raises(grpc.RpcError) as info:
            _raw_stream(intake.address, [b"\xff\xfe not a protobuf"])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unroll rejected" in info.value.details()
        bad = _unroll(spec, np.random.default_rng(0))
        bad["reward"] = bad["reward"].copy()
        bad["reward"][2] = np.nan
        with pytest.raises(grpc.RpcError) as info:
            _raw_stream(intake.address, [_payload(bad)])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'reward'" in info.value.details()
        m = intake.snapshot_metrics()
        assert m["unrolls_rejected"] == 2 and m["rejected/undecodable"] == 1 and m["rejected/non_finite"] == 1
        assert m["unrolls_accepted"] == 0
        # the child goes on serving good unrolls
        client = LearnerClient(intake.address, actor_id="good", unrolls_per_message=1, give_up_after_s=20)
        rng = np.random.default_rng(1)
        for i in range(6):
            client.send(_unroll(spec, rng, tag=i), policy_version=0, timeout=20)
        assert client.flush(20)
        batch = intake.next_batch(timeout=30)
        assert [float(x) for x in batch.tensors["reward"][0]] == [0.0, 1.0, 2.0, 3.0]
        _wait_for(lambda: intake.snapshot_metrics()["unrolls_accepted"] == 6, 20, "six accepted unrolls")
        m = intake.snapshot_metrics()
        assert m["queue_size"] == 2 and m["queue_fill"] == 0.25 and m["queue_capacity"] == 8
        assert m["unrolls_rejected"] == 2 and m["frames_accepted"] == 6 * T
    finally:
        if client is not None:
            client.close(drain=False, timeout=2)
        intake.stop()


def _stream_into_a_full_queue(intake, client, spec, rng):
    for i in range(40):  # more than the slots and the queue hold: the rest waits in the stream
        client.send(_unroll(spec, rng, tag=i), policy_version=0, timeout=20)
    _wait_for(lambda: intake.snapshot_metrics()["queue_fill"] == 1.0, 20, "a full queue")


def _send_until_it_fails(client, spec, rng, seconds=20.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:  # the outbox may stay full while the stream ends
        try:
            client.send(_unroll(spec, rng), policy_version=0, timeout=1)
        except TimeoutError:
            pass
        time.sleep(0.05)


def test_stop_tells_a_streaming_actor_that_the_run_is_over():
    # As LearnerServer.stop() in the learner's process: the child's queue is full (nothing takes
    # batches any more) and an actor is streaming when the learner stops the intake; the actor
    # must learn that the run is over, not find the learner gone and retry until it gives up.
    from actors.client import LearnerFinishedError

    spec = _spec()
    intake = _intake(spec, batch_size=4, queue_capacity=4)
    intake.start()
    client = LearnerClient(intake.address, actor_id="a", unrolls_per_message=1, give_up_after_s=60)
    rng = np.random.default_rng(0)
    try:
        _stream_into_a_full_queue(intake, client, spec, rng)
        intake.stop()
        with pytest.raises(LearnerFinishedError):
            _send_until_it_fails(client, spec, rng)
    finally:
        client.close(drain=False, timeout=2)
        intake.stop()


def test_a_learner_that_is_gone_does_not_tell_the_actors_the_run_is_over():
    # The learner killed (or out of memory) while an actor streams into a full queue: its child
    # sees the socket close. A restarted learner may resume the run, so the actor must retry
    # (as with the thread intake) and give up as "unreachable", not stop on "the learner's run
    # is over", which only a learner that said stop sends (the test above).
    from actors.client import LearnerFinishedError, LearnerUnavailableError

    spec = _spec()
    intake = _intake(spec, batch_size=4, queue_capacity=4)
    intake.start()
    client = LearnerClient(intake.address, actor_id="a", unrolls_per_message=1, backoff_initial_s=0.05,
                           backoff_max_s=0.2, give_up_after_s=2.0)
    rng = np.random.default_rng(0)
    try:
        _stream_into_a_full_queue(intake, client, spec, rng)
        intake._stopped = True  # this test ends the learner's side on purpose: no failure to report
        # As the learner's death closes its end (a shutdown: a close() here would wait for the
        # reader thread's blocked recv to let go of the socket).
        with socket.socket(fileno=os.dup(intake._chan.conn.fileno())) as end:
            end.shutdown(socket.SHUT_RDWR)
        assert intake._proc.wait(20) == 0
        with pytest.raises(LearnerUnavailableError) as info:
            _send_until_it_fails(client, spec, rng)
        assert not isinstance(info.value, LearnerFinishedError), info.value
        assert "has been unreachable for 2 s" in str(info.value)
    finally:
        client.close(drain=False, timeout=2)
        intake.stop()


# ---------------------------------------------------------------------------------- ProcessIntake: failures


def test_a_killed_child_is_a_sentence_and_stop_does_not_hang():
    intake = _intake()
    intake.start()
    try:
        pid = intake._proc.pid
        intake._proc.kill()
        with pytest.raises(IntakeError, match=r"the learner's intake process .*exited with status -9"):
            intake.next_batch(timeout=20)
        with pytest.raises(IntakeError, match="exited with status -9"):
            intake.next_batch(timeout=1)  # every later call says it too
        with pytest.raises(IntakeError, match="exited"):
            intake.submit(2, W0)
        with pytest.raises(IntakeError, match="exited"):
            intake.flush(1)
        t0 = time.monotonic()
        assert isinstance(intake.snapshot_metrics(timeout=2), dict)
        assert time.monotonic() - t0 < 2.5
        intake.close(timeout=1)  # logs, raises nothing
    finally:
        stop_s = _stopped_in(intake)
    assert stop_s < 15  # the child is already gone: no wait for it
    assert intake._proc.returncode == -9 and intake._proc.pid == pid
    intake.stop()  # idempotent
    assert not _our_shared_files()


def test_a_child_that_dies_while_the_learner_holds_a_batch_is_a_sentence_too():
    spec = _spec()
    intake = _intake(spec)
    intake.start()
    client = LearnerClient(intake.address, unrolls_per_message=1, give_up_after_s=20)
    try:
        rng = np.random.default_rng(0)
        for _ in range(4):
            client.send(_unroll(spec, rng), policy_version=0, timeout=20)
        batch = intake.next_batch(timeout=30)  # held: the next call hands the slot back
        intake._proc.kill()
        intake._proc.wait(10)
        _wait_for(lambda: intake._error is not None, 10, "the intake to notice its child's exit")
        with pytest.raises(IntakeError, match="exited with status -9"):
            intake.next_batch(timeout=10)
        del batch
    finally:
        client.close(drain=False, timeout=2)
        stop_s = _stopped_in(intake)
    assert stop_s < 15


def test_a_child_death_not_yet_seen_by_the_reader_is_still_an_intake_error():
    spec = _spec()
    intake = _intake(spec)
    intake.start()
    client = LearnerClient(intake.address, unrolls_per_message=1, give_up_after_s=20)
    try:
        rng = np.random.default_rng(0)
        for _ in range(4):
            client.send(_unroll(spec, rng), policy_version=0, timeout=20)
        intake.next_batch(timeout=30)  # holds a slot
        # The reader thread takes the condition's lock to record the exit: holding it here
        # widens the window between the child's death and the reader noticing it, which in a
        # run is a scheduling accident.
        with intake._cond:
            intake._proc.kill()
            intake._proc.wait(10)
            time.sleep(0.2)
            with pytest.raises(IntakeError, match="exited"):
                intake.next_batch(timeout=5)
    finally:
        client.close(drain=False, timeout=2)
        intake.stop()


def test_a_port_in_use_is_an_oserror_and_leaves_nothing_behind():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        intake = _intake(server_options={"port": port})
        with pytest.raises(OSError, match=rf"could not listen on 127\.0\.0\.1:{port}"):
            intake.start()
        assert intake._proc.poll() is not None  # the child is gone
        assert not _our_shared_files()
        with pytest.raises(RuntimeError, match="not started"):
            intake.address
    finally:
        busy.close()


def test_a_child_that_cannot_build_the_server_says_why():
    intake = _intake(server_options={"refresh_lag": 0})
    with pytest.raises(IntakeError, match="refresh_lag must be a whole number of versions from 1 to"):
        intake.start()
    assert intake._proc.poll() is not None and not _our_shared_files()


def test_constructor_checks():
    spec = _spec()
    with pytest.raises(ValueError, match="at least 2 batch slots"):
        ProcessIntake(spec, T, batch_size=4, queue_capacity=8, frame_stack=FRAME_STACK, initial_params=(1, W0), slots=1)
    with pytest.raises(ValueError, match=r"batch_size must be in \[1, queue capacity 4\]"):
        ProcessIntake(spec, T, batch_size=5, queue_capacity=4, frame_stack=FRAME_STACK, initial_params=(1, W0))
    with pytest.raises(ValueError, match="initial parameters"):
        ProcessIntake(spec, T, batch_size=4, queue_capacity=8, frame_stack=FRAME_STACK, initial_params=(1, {}))
    with pytest.raises(TypeError):  # options travel as JSON: refused here, not in the child
        ProcessIntake(spec, T, batch_size=4, queue_capacity=8, frame_stack=FRAME_STACK, initial_params=(1, W0),
                      server_options={"run_config": object()})
    intake = _intake()
    with pytest.raises(RuntimeError, match="not started"):
        intake.address
    intake.stop()  # never started: nothing to do


def test_the_child_stops_when_the_learner_process_dies():
    script = textwrap.dedent(f"""
        import os, sys
        import numpy as np
        from impala_rep.specs import ArraySpec, EnvSpec, unroll_spec
        from learner.intake import ProcessIntake
        env = EnvSpec({{"x": ArraySpec("x", (2,), "float32")}}, ArraySpec("action", (), "int32", num_values=2))
        intake = ProcessIntake(unroll_spec(env, {T}), {T}, batch_size=2, queue_capacity=4,
                               initial_params=(1, {{"w": np.zeros(3, np.float32)}}))
        intake.start()
        print(intake._proc.pid, os.getpid(), flush=True)
        os._exit(0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    child, learner = (int(x) for x in proc.stdout.split()[:2])

    def gone():
        try:
            with open(f"/proc/{child}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True

    _wait_for(gone, 20, f"the orphaned intake process {child} to exit")
    pattern = f"impala_rep-intake-{learner}-*"
    assert not glob.glob(os.path.join("/dev/shm", pattern)) + glob.glob(os.path.join(tempfile.gettempdir(), pattern))


def test_the_child_never_imports_tensorflow():
    code = ("import sys; import learner.intake, learner.server, learner.batcher, learner.params, learner.queue; "
            "print('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_a_snapshot_missing_a_parameter_gives_its_slot_back():
    intake = _intake()
    intake.start()
    try:
        for v in (2, 3):
            with pytest.raises((KeyError, ValueError)):
                intake.submit(v, {"w": W0["w"]})  # no "b"
        intake.submit(4, {"w": np.full((2, 3), 4, np.float32), "b": W0["b"]})
        assert intake.flush(2) and intake.version == 4
    finally:
        intake.stop()


def test_a_version_that_does_not_grow_is_refused_without_killing_the_child():
    intake = _intake()
    intake.start()
    try:
        intake.submit(5, W0)
        assert intake.flush(10) and intake.version == 5
        intake.submit(3, W0)
        with pytest.raises(RuntimeError, match="version must grow"):  # refused with a sentence ...
            intake.flush(10)
        assert intake.version == 5
        assert intake._proc.poll() is None  # ... and the actors' service survives it
        intake.submit(6, W0)
        assert intake.flush(10) and intake.version == 6
    finally:
        intake.stop()


def test_stop_wakes_a_waiting_next_batch_with_queue_closed():
    intake = _intake()
    intake.start()
    result = []

    def wait():
        t0 = time.monotonic()
        try:
            intake.next_batch(timeout=3)
        except BaseException as exc:  # noqa: BLE001
            result.append((type(exc), time.monotonic() - t0))

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    time.sleep(0.3)
    intake.stop()
    waiter.join(10)
    assert result and result[0][0] is QueueClosed and result[0][1] < 2.5, result


# ---------------------------------------------------------------------------------- flags and config


def test_the_intake_flag_and_its_config():
    assert INTAKES == ("auto", "thread", "process")
    assert config_from_args(build_parser().parse_args(["--env", "catch"])).intake == "auto"
    for value in INTAKES:
        assert config_from_args(build_parser().parse_args(["--env", "catch", "--intake", value])).intake == value
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--env", "catch", "--intake", "fork"])
    import argparse

    learner_alone = argparse.ArgumentParser()
    add_learner_flags(learner_alone)  # python -m learner.run takes it too
    assert config_from_args(learner_alone.parse_args(["--env", "catch", "--intake", "process"])).intake == "process"
    assert RunConfig().intake == "auto" and RunConfig(intake="process").intake == "process"
    with pytest.raises(ConfigError, match=r"^intake must be one of auto, thread, process, got 'x'\.$"):
        RunConfig(intake="x")
    assert json.loads(RunConfig(intake="process").dumps())["intake"] == "process"


# ---------------------------------------------------------------------------------- the Trainer


@pytest.fixture(scope="module")
def catch_spec():
    from impala_rep.probe import probe_env_spec

    return probe_env_spec("catch", {})


def _trainer_config(logdir, intake, **kwargs):
    return RunConfig(env="catch", logdir=str(logdir), batch_size=4, unroll_length=5, total_steps=10**9,
                     log_interval_s=0.05, intake=intake, **kwargs)


class _Feeder:
    """Streams valid unrolls of ``spec`` to ``address`` until stopped (one client, one stream)."""

    def __init__(self, address, spec):
        self.client = LearnerClient(address, actor_id="feeder", unrolls_per_message=1, give_up_after_s=30)
        self.handshake = self.client.connect()
        self.spec = spec
        self.stop = threading.Event()
        self.errors = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        rng = np.random.default_rng(0)
        try:
            while not self.stop.is_set():
                try:
                    self.client.send(_unroll(self.spec, rng), policy_version=1, episode_returns=[1.0],
                                     episode_lengths=[5], timeout=0.2)
                except TimeoutError:
                    continue
        except Exception as exc:  # noqa: BLE001
            if not self.stop.is_set():
                self.errors.append(exc)

    def close(self):
        self.stop.set()
        self.thread.join(10)
        self.client.close(drain=False, timeout=2)


def test_the_trainer_trains_and_publishes_through_a_process_intake(tmp_path, catch_spec):
    from learner.run import Trainer

    trainer = Trainer(_trainer_config(tmp_path, "process"), catch_spec)
    feeder = None
    intake = None
    try:
        assert trainer.intake == "process" and trainer.queue is None
        intake = trainer.server
        assert isinstance(intake, ProcessIntake) and trainer.batcher is intake and trainer.params is intake
        address = trainer.start()
        assert address == intake.address and address.startswith("127.0.0.1:")
        assert json.load(open(tmp_path / "config.json"))["intake"] == "process"
        feeder = _Feeder(address, trainer.unroll_spec)
        assert feeder.handshake.parameter_version == 1 and feeder.handshake.unroll_spec == trainer.unroll_spec
        version, first = feeder.client.get_parameters()
        assert version == 1
        trainer.train(max_learner_steps=3)
        assert trainer.learner_step == 3 and trainer.diverged is None
        assert intake.version == 4 and intake.failed is None  # each step's parameters were published
        version, params = feeder.client.get_parameters()
        assert version == 4
        _, now = trainer.step.get_params()
        assert set(params) == set(now)
        for name, value in now.items():
            np.testing.assert_array_equal(params[name], value, err_msg=name)
        assert any(not np.array_equal(first[k], params[k]) for k in params)  # it trained
        trainer.train(max_learner_steps=2)
        assert trainer.learner_step == 5 and intake.version == 6
        assert feeder.client.get_parameters()[0] == 6
        assert not feeder.errors, feeder.errors
        records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
        assert records, "no progress record was written"
        last = records[-1]
        assert last["transport/queue_capacity"] == 8 and 0 <= last["queue_fill"] <= 1
        assert last["transport/unrolls_accepted"] >= 4 * last["learner_step"]
        assert last["agent_steps"] == 4 * 5 * last["learner_step"]
        feeder.close()
        feeder = None
        trainer.close()  # saves: a checkpoint, and the policy export records the served version
        trainer = None
    finally:
        if feeder is not None:
            feeder.close()
        if trainer is not None:
            trainer.close(save=False)
    assert intake._proc.poll() is not None and intake._proc.returncode == 0  # the child is gone
    assert os.path.exists(tmp_path / "checkpoints" / "ckpt-5.index")
    policy = json.load(open(tmp_path / "policy" / "policy.json"))
    assert policy["learner_step"] == 5 and policy["version"] == 6
    assert not _our_shared_files()


def test_a_diverged_update_is_not_served_by_the_process_intake(tmp_path, catch_spec, poison_update):
    from learner.run import Trainer

    trainer = Trainer(_trainer_config(tmp_path, "process"), catch_spec)
    feeder = None
    intake = trainer.server
    try:
        feeder = _Feeder(trainer.start(), trainer.unroll_spec)
        poison_update(trainer, 3)  # the third update makes the parameters NaN
        trainer.train(max_learner_steps=10)
        assert trainer.diverged is not None
        assert trainer.diverged.startswith("the update of learner step 3 made the network's parameters NaN or infinite")
        assert trainer.learner_step <= 4
        assert intake.failed == 4 and intake.version == 3
        version, params = feeder.client.get_parameters()
        assert version == 3 and all(np.all(np.isfinite(v)) for v in params.values())
    finally:
        if feeder is not None:
            feeder.close()
        trainer.close()  # diverged: saves nothing
    assert not os.path.exists(tmp_path / "checkpoints" / "checkpoint")
    assert intake._proc.poll() is not None


def test_auto_keeps_the_intake_in_the_process_on_a_cpu_learner(tmp_path, catch_spec):
    from learner.run import Trainer
    from learner.server import LearnerServer

    trainer = Trainer(_trainer_config(tmp_path, "auto"), catch_spec)
    try:
        assert trainer.replicator.kind == "cpu" and trainer.intake == "thread"
        assert isinstance(trainer.server, LearnerServer) and trainer.queue is not None
    finally:
        trainer.close(save=False)


def test_launch_with_a_process_intake_trains_catch_and_checkpoints(tmp_path):
    logdir = tmp_path / "run"
    before = set(glob.glob("/dev/shm/impala_rep-intake-*") + glob.glob(os.path.join(tempfile.gettempdir(),
                                                                                    "impala_rep-intake-*")))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "impala_rep.launch", "--env", "catch", "--intake", "process", "--learner", "cpu",
         "--actors", "1", "--batch-size", "4", "--unroll-length", "5", "--total-steps", "200", "--log-interval", "0.1",
         "--logdir", str(logdir)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 10 learner steps" in proc.stderr
    assert json.load(open(logdir / "config.json"))["intake"] == "process"
    assert os.path.exists(logdir / "checkpoints" / "ckpt-10.index")
    policy = json.load(open(logdir / "policy" / "policy.json"))
    assert policy["learner_step"] == 10 and policy["version"] == 11
    records = [json.loads(line) for line in open(logdir / "metrics.jsonl")]
    assert records and records[-1]["transport/queue_capacity"] == 8
    assert records[-1]["transport/unrolls_accepted"] >= 4 * records[-1]["learner_step"]
    after = set(glob.glob("/dev/shm/impala_rep-intake-*") + glob.glob(os.path.join(tempfile.gettempdir(),
                                                                                   "impala_rep-intake-*")))
    assert after <= before  # the run left no shared-memory file behind


def _intake_children(pid):
    """PIDs of ``learner.intake`` processes below ``pid`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"learner.intake" in cmd:
            found.append(int(entry))
    return found


def test_a_launch_whose_intake_dies_stops_with_a_sentence_and_saves(tmp_path):
    logdir = tmp_path / "run"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "impala_rep.launch", "--env", "catch", "--intake", "process", "--learner", "cpu",
         "--actors", "1", "--batch-size", "4", "--unroll-length", "5", "--total-steps", "100000000",
         "--log-interval", "0.1", "--logdir", str(logdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (logdir / "metrics.jsonl").exists() or not (logdir / "metrics.jsonl").stat().st_size:
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.2)
        children = _intake_children(proc.pid)
        assert len(children) == 1
        os.kill(children[0], 9)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, stderr[-3000:]
    assert "the learner's intake process (gRPC service, queue and batcher) exited with status -9" in stderr
    assert "Stopping; the learner's last parameters are saved." in stderr
    assert "Traceback" not in stderr
    assert glob.glob(str(logdir / "checkpoints" / "ckpt-*.index"))  # what was learned is kept


def test_the_shared_file_falls_back_to_the_temp_dir_and_says_when_nothing_has_room(monkeypatch, tmp_path, caplog):
    import errno

    from learner import intake as intake_module

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real = os.posix_fallocate
    full = {"/dev/shm"}

    def fallocate(fd, offset, length):
        if os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")) in full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with caplog.at_level(logging.WARNING, logger="impala_rep.learner"):
        directory, fd = intake_module._shared_file(4096)
    try:
        assert directory == str(tmp_path) and os.fstat(fd).st_size == 4096
        assert os.fstat(fd).st_nlink == 0 and not os.listdir(tmp_path)  # unlinked at once: nothing to leave behind
    finally:
        os.close(fd)
    assert "no room in /dev/shm for the intake's 0 MiB of batch and parameter slots" in caplog.text
    assert f"they are in a file in {tmp_path}, which a disk may back" in caplog.text
    full.add(str(tmp_path))
    with pytest.raises(OSError, match=r"needs 0 MiB of shared memory for its batch slots and found no room "
                                      r"\(/dev/shm: No space left on device; .*: No space left on device\); .*"
                                      r"or use --intake thread\."):
        intake_module._shared_file(4096)
    assert not _our_shared_files()  # nothing left where there was no room
