"""Several unrolls per gRPC message (UnrollBatch, StreamUnrollBatches): the wire format, the
server's all-or-nothing validation, the client's packing and its fallback, the actor's hook."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from actors.client import InvalidUnrollError, LearnerClient
from impala_rep.proto import transport_pb2
from impala_rep.wire import (
    WireError, encode_unroll_batch, encode_unroll_bytes, encode_unroll_parts, parse_unroll, split_unroll_batch,
)

from test_transport_helpers import Drain, make_unroll, raw_stream, small_spec, start_server, wait_for


def _unroll_args(spec, rng, tag):
    return ("actor-x", int(tag) + 1, make_unroll(spec, rng, tag=float(tag)), [float(tag)], [int(tag) + 3])


# ------------------------------------------------------------------ wire format


def test_batch_bytes_are_what_protobuf_writes_and_split_back_into_the_unrolls():
    spec, rng = small_spec(), np.random.default_rng(0)
    args = [_unroll_args(spec, rng, i) for i in range(3)]
    batch = encode_unroll_batch([encode_unroll_parts(*a) for a in args])
    singles = [encode_unroll_bytes(*a) for a in args]
    expected = transport_pb2.UnrollBatch(unrolls=[transport_pb2.Unroll.FromString(b) for b in singles])
    assert batch == expected.SerializeToString()
    ranges = split_unroll_batch(batch)
    assert [batch[a:b] for a, b in ranges] == singles
    for (a, b), single in zip(ranges, singles):
        in_place, alone = parse_unroll(batch, start=a, stop=b), parse_unroll(single)
        assert (in_place.actor_id, in_place.policy_version, in_place.episode_returns, in_place.episode_lengths) == (
            alone.actor_id, alone.policy_version, alone.episode_returns, alone.episode_lengths)
        assert [(t.name, bytes(t.data)) for t in in_place.tensors] == [(t.name, bytes(t.data)) for t in alone.tensors]
        assert all(t.data.obj is batch for t in in_place.tensors if t.data.nbytes)  # views, not copies


@pytest.mark.parametrize("raw, words", [
    (b"", "holds no unrolls"),
    (b"\x12\x00", "field 2"),                       # not a field of UnrollBatch
    (b"\x08\x01", "unrolls"),                       # field 1 with the wrong wire type
    (b"\x0a\x05\x0a\x01", "runs past the end"),      # a length beyond the message
])
def test_malformed_batches_are_refused_with_a_sentence(raw, words):
    with pytest.raises(WireError, match=words):
        split_unroll_batch(raw)


def test_parse_unroll_refuses_a_range_outside_the_buffer():
    raw = encode_unroll_bytes(*_unroll_args(small_spec(), np.random.default_rng(1), 0))
    with pytest.raises(ValueError, match="do not delimit"):
        parse_unroll(raw, start=4, stop=len(raw) + 1)
    with pytest.raises(WireError, match=r"runs past the end of its message \(0 bytes left\)"):
        parse_unroll(raw, start=0, stop=len(raw) - 1)  # a message cut short inside its last field


# ------------------------------------------------------------------ server


def _raw_batch_stream(address, payloads):
    return raw_stream(address, payloads, method="StreamUnrollBatches")


def test_a_batch_with_one_bad_unroll_queues_none_of_them():
    spec, rng = small_spec(), np.random.default_rng(2)
    server = start_server(spec, capacity=16)
    try:
        good = [encode_unroll_parts(*_unroll_args(spec, rng, i)) for i in range(2)]
        bad_unroll = make_unroll(spec, rng)
        bad_unroll["reward"] = bad_unroll["reward"][:-1]  # wrong shape
        bad = encode_unroll_parts("actor-x", 1, bad_unroll)
        summary = _raw_batch_stream(server.address, [encode_unroll_batch(good)])
        assert summary.unrolls_accepted == 2 and len(server.queue) == 2
        with pytest.raises(grpc.RpcError) as info:
            _raw_batch_stream(server.address, [encode_unroll_batch(good + [bad])])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unroll 2 of 3 in the batch" in info.value.details() and "reward" in info.value.details()
        assert len(server.queue) == 2  # the batch's two good unrolls were not queued
        assert server.metrics.snapshot()["rejected/shape"] == 1
        with pytest.raises(grpc.RpcError) as info:
            _raw_batch_stream(server.address, [b"\x12\x00"])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid UnrollBatch" in info.value.details()
    finally:
        server.stop()


def test_a_batch_above_the_announced_limit_is_refused():
    spec, rng = small_spec(), np.random.default_rng(3)
    one = encode_unroll_parts(*_unroll_args(spec, rng, 0))
    server = start_server(spec, capacity=16, max_message_bytes=one.nbytes + 100, max_batch_bytes=2 * one.nbytes + 16)
    try:
        assert _raw_batch_stream(server.address, [encode_unroll_batch([one, one])]).unrolls_accepted == 2
        with pytest.raises(grpc.RpcError) as info:
            _raw_batch_stream(server.address, [encode_unroll_batch([one, one, one])])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"more than the learner's limit of {2 * one.nbytes + 16} bytes" in info.value.details()
        assert server.metrics.snapshot()["rejected/oversized"] == 1
    finally:
        server.stop()


def test_server_refuses_a_batch_limit_that_cannot_hold_one_unroll():
    with pytest.raises(ValueError, match="cannot hold one unroll"):
        start_server(max_batch_bytes=100)


# ------------------------------------------------------------------ client


@pytest.mark.parametrize("per_message, max_batch_bytes, messages", [
    (3, None, 3),    # 3 + 3 + 1
    (1, None, 7),    # one per message, on StreamUnrolls
    (8, 0, 7),       # a learner that takes no batches: one per message
    (8, "two", 4),   # the learner's byte limit holds two per message
])
def test_send_many_packs_unrolls_into_messages_in_order(per_message, max_batch_bytes, messages):
    spec, rng = small_spec(), np.random.default_rng(4)
    unrolls = [make_unroll(spec, rng, tag=float(i)) for i in range(7)]
    if max_batch_bytes == "two":
        size = max(encode_unroll_parts("actor-x", i + 1, u, [float(i)], [i + 3]).nbytes for i, u in enumerate(unrolls))
        max_batch_bytes = 2 * (size + 11) + 5
    kwargs = {} if max_batch_bytes is None else {"max_batch_bytes": max_batch_bytes}
    if max_batch_bytes:
        kwargs["max_message_bytes"] = max_batch_bytes // 2
    server = start_server(spec, capacity=16, **kwargs)
    drain = Drain(server.queue)
    try:
        with LearnerClient(server.address, actor_id="actor-x", unrolls_per_message=per_message,
                           give_up_after_s=10) as client:
            assert client.connect().max_batch_bytes == server.max_batch_bytes
            client.send_many([(u, i + 1, [float(i)], [i + 3]) for i, u in enumerate(unrolls)], timeout=10)
            assert client.flush(10)
            assert client.unrolls_sent == 7 and client.messages_sent == messages
        wait_for(lambda: drain.count == 7, 10, "the 7 unrolls")
        assert [int(item.policy_version) for item in drain.items] == list(range(1, 8))
        for i, item in enumerate(drain.items):
            np.testing.assert_array_equal(item.tensors["reward"], unrolls[i]["reward"])
            assert list(item.episode_returns) == [float(i)] and list(item.episode_lengths) == [i + 3]
        assert server.metrics.unrolls_accepted == 7 and server.metrics.messages_accepted == messages
    finally:
        drain.stop()
        server.stop()


def test_send_many_checks_every_unroll_before_queuing_any():
    spec, rng = small_spec(), np.random.default_rng(5)
    server = start_server(spec, capacity=16)
    try:
        with LearnerClient(server.address, give_up_after_s=10) as client:
            client.connect()
            bad = make_unroll(spec, rng)
            bad["reward"] = bad["reward"].astype(np.float64)
            with pytest.raises(ValueError, match="reward"):
                client.send_many([(make_unroll(spec, rng), 1, [], []), (bad, 1, [], [])])
            assert client.flush(5) and client.unrolls_sent == 0
    finally:
        server.stop()


def test_an_invalid_batch_is_a_fatal_error_for_the_client():
    spec, rng = small_spec(), np.random.default_rng(6)
    server = start_server(spec, capacity=16)
    try:
        client = LearnerClient(server.address, validate=False, give_up_after_s=10)
        client.connect()
        bad = make_unroll(spec, rng)
        bad["reward"] = bad["reward"][:-1]
        client.send_many([(make_unroll(spec, rng), 1, [], []), (bad, 1, [], [])])
        with pytest.raises(InvalidUnrollError, match="unroll 1 of 2 in the batch"):
            for _ in range(200):
                client.flush(0.05)
        client.close(drain=False)
        assert server.metrics.unrolls_accepted == 0
    finally:
        server.stop()


def test_client_refuses_zero_unrolls_per_message():
    with pytest.raises(ValueError, match="unrolls_per_message"):
        LearnerClient("127.0.0.1:1", unrolls_per_message=0)
