"""Malformed input over the wire: each is answered INVALID_ARGUMENT (or UNAUTHENTICATED) with a
sentence, counted per reason, and never disturbs a good client streaming beside it."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from actors.client import AuthenticationError, InvalidUnrollError, LearnerClient
from impala_rep.proto import transport_pb2
from impala_rep.specs import validate_array
from impala_rep.wire import encode_tensor
from learner.validation import UnrollRejected, UnrollValidator

from test_transport_helpers import T, Drain, make_unroll, raw_stream, small_spec, start_server, wait_for

TOKEN = "s3cret-token"


def _payload(unroll, version=1, returns=(), lengths=(), actor_id="bad"):
    msg = transport_pb2.Unroll(actor_id=actor_id, policy_version=version)
    msg.episode_returns[:] = returns
    msg.episode_lengths[:] = lengths
    for name, value in unroll.items():
        encode_tensor(name, value, out=msg.tensors.add())
    return msg.SerializeToString()


def _corrupt_bytes(spec, rng):
    msg = transport_pb2.Unroll.FromString(_payload(make_unroll(spec, rng)))
    for t in msg.tensors:
        if t.name == "reward":
            t.data = t.data[:-2]
    return msg.SerializeToString()


def _cases(spec, rng, max_bytes):
    def with_(key, value):
        u = make_unroll(spec, rng)
        if value is None:
            del u[key]
        else:
            u[key] = value
        return _payload(u)

    u = make_unroll(spec, rng)
    nan_reward = u["reward"].copy()
    nan_reward[2] = np.nan
    bad_steps = np.array([1, 2, 1, 1, 1], np.uint8)  # LAST not followed by FIRST
    return {
        "wrong dtype": (with_("reward", u["reward"].astype(np.float64)), "dtype", "'reward'"),
        "wrong shape": (with_("observation/pixels", np.zeros((T + 1, 8, 8, 4), np.uint8)), "shape", "observation/pixels"),
        "NaN reward": (with_("reward", nan_reward), "non_finite", "'reward'"),
        "action out of bounds": (with_("action", np.full(T + 1, 3, np.int32)), "out_of_bounds", "'action'"),
        "negative action": (with_("action", np.full(T + 1, -1, np.int32)), "out_of_bounds", "[0, 3)"),
        "discount above 1": (with_("discount", np.full(T + 1, 1.5, np.float32)), "out_of_bounds", "'discount'"),
        "step type 7": (with_("step_type", np.full(T + 1, 7, np.uint8)), "step_type", "step_type"),
        "LAST then MID": (with_("step_type", bad_steps), "step_type", "FIRST"),
        "missing tensor": (with_("behaviour_log_prob", None), "missing_tensor", "behaviour_log_prob"),
        "extra tensor": (with_("observation/extra", np.zeros(3, np.float32)), "extra_tensor", "observation/extra"),
        "undecodable bytes": (_corrupt_bytes(spec, rng), "undecodable", "'reward'"),
        "not a protobuf": (b"\xff\xff\xff\xff garbage", "undecodable", "not a valid Unroll"),
        "truncated message": (_payload(make_unroll(spec, rng))[:-7], "undecodable", "not a valid Unroll"),
        "unknown field": (_payload(make_unroll(spec, rng)) + b"\x30\x01", "undecodable", "not a field of Unroll"),
        "wrong wire type": (b"\x12\x01x" + _payload(make_unroll(spec, rng)), "undecodable", "has wire type"),
        "unknown tensor field": (b"\x1a\x02\x38\x01" + _payload(make_unroll(spec, rng)), "undecodable", "not a field of Tensor"),
        "oversized": (_payload(make_unroll(spec, rng), actor_id="x" * max_bytes), "oversized", "limit"),
        "negative policy version": (_payload(make_unroll(spec, rng), version=-3), "metadata", "policy_version"),
        "returns without lengths": (_payload(make_unroll(spec, rng), returns=[1.0]), "metadata", "lengths"),
    }


@pytest.fixture(scope="module")
def served():
    spec = small_spec()
    server = start_server(spec, capacity=16, token=TOKEN)
    drain = Drain(server.queue, keep=False)
    good = LearnerClient(server.address, token=TOKEN, actor_id="good", give_up_after_s=20)
    good.connect()
    yield spec, server, drain, good
    good.close(drain=False)
    drain.stop()
    server.stop()


def _raw_stream(address, payloads, token=TOKEN):
    return raw_stream(address, payloads, token=token)


def test_each_malformed_unroll_is_rejected_while_a_good_client_keeps_streaming(served):
    spec, server, drain, good = served
    rng = np.random.default_rng(0)
    cases = _cases(spec, rng, server.validator.max_message_bytes)
    for name, (payload, reason, words) in cases.items():
        before_reason = server.metrics.snapshot()[f"rejected/{reason}"]
        before_good = server.metrics.unrolls_accepted
        for _ in range(3):
            good.send(make_unroll(spec, rng), policy_version=1, timeout=10)
        # a valid unroll first, then the bad one: the stream dies at the bad one only
        with pytest.raises(grpc.RpcError) as info:
            _raw_stream(server.address, [_payload(make_unroll(spec, rng)), payload])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert words in info.value.details(), (name, info.value.details())
        assert info.value.details().endswith("."), info.value.details()
        assert server.metrics.snapshot()[f"rejected/{reason}"] == before_reason + 1, name
        good.flush(10)
        wait_for(lambda: server.metrics.unrolls_accepted >= before_good + 4, 10, f"good unrolls after {name!r}")
    # the good client never saw an error and the server still serves
    good.send(make_unroll(spec, rng), policy_version=1)
    assert good.flush(10)
    assert good.get_parameters() is None


def test_message_above_the_grpc_limit_is_refused_without_harm(served):
    spec, server, drain, good = served
    assert server.max_receive_bytes == 2 * max(server.validator.max_message_bytes, server.max_batch_bytes)
    huge = b"\x0a" + b"\x00" * (server.max_receive_bytes + 10)
    with pytest.raises(grpc.RpcError) as info:
        _raw_stream(server.address, [huge])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    before = server.metrics.unrolls_accepted
    good.send(make_unroll(spec, np.random.default_rng(1)), policy_version=1)
    wait_for(lambda: server.metrics.unrolls_accepted > before, 10, "a good unroll after a huge message")


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_missing_or_wrong_token_is_unauthenticated(served, token):
    spec, server, drain, good = served
    before = server.metrics.snapshot()["rejected/unauthenticated"]
    with pytest.raises(grpc.RpcError) as info:
        _raw_stream(server.address, [_payload(make_unroll(spec, np.random.default_rng(2)))], token=token)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "token" in info.value.details()
    client = LearnerClient(server.address, token=token, give_up_after_s=5)
    try:
        with pytest.raises(AuthenticationError, match="token"):
            client.connect()
        with pytest.raises(AuthenticationError):
            client.get_parameters()
    finally:
        client.close(drain=False)
    assert server.metrics.snapshot()["rejected/unauthenticated"] == before + 3


def test_client_surfaces_invalid_argument_and_does_not_retry(served):
    spec, server, drain, good = served
    before = server.metrics.snapshot()["rejected/non_finite"]
    client = LearnerClient(server.address, token=TOKEN, actor_id="buggy", validate=False, give_up_after_s=10)
    try:
        client.connect()
        bad = make_unroll(spec, np.random.default_rng(3))
        bad["reward"][1] = np.inf
        client.send(bad, policy_version=1)
        with pytest.raises(InvalidUnrollError, match="'reward'"):
            for _ in range(200):  # bounded: the error arrives within a few sends
                client.send(make_unroll(spec, np.random.default_rng(4)), policy_version=1, timeout=5)
                client.flush(0.05)
    finally:
        client.close(drain=False)
    assert server.metrics.snapshot()["rejected/non_finite"] == before + 1  # sent once, never retried


def test_client_side_checks_fail_early_with_value_error(served):
    spec, server, drain, good = served
    u = make_unroll(spec, np.random.default_rng(5))
    u["reward"] = u["reward"].astype(np.float64)
    with pytest.raises(ValueError, match="'reward' has dtype float64; expected float32"):
        good.send(u, policy_version=1)
    u = make_unroll(spec, np.random.default_rng(5))
    del u["action"]
    with pytest.raises(ValueError, match="missing \\['action'\\]"):
        good.send(u, policy_version=1)


def test_validator_agrees_with_specs_validate_array():
    """The precompiled checks accept and reject what impala_rep.specs.validate_array does."""
    spec = small_spec("continuous")
    validator = UnrollValidator(spec, T)
    rng = np.random.default_rng(6)
    for trial in range(40):
        u = make_unroll(spec, rng)
        key = rng.choice(sorted(k for k in spec if k != "step_type"))
        arr = u[key]
        if arr.dtype.kind == "f":
            arr.flat[rng.integers(arr.size)] = rng.choice([np.nan, np.inf, 3.0, -3.0, 0.25, 1.5])
        else:
            arr.flat[rng.integers(arr.size)] = rng.integers(0, 256)
        try:
            for k, s in spec.items():
                validate_array(s, u[k])
            expected_ok = True
        except ValueError:
            expected_ok = False
        raw = _payload(u)
        try:
            validator.validate(transport_pb2.Unroll.FromString(raw), len(raw))
            ok = True
        except UnrollRejected:
            ok = False
        assert ok == expected_ok, (trial, key, u[key])


def test_the_servers_byte_reader_agrees_with_protobuf_and_the_full_checks():
    """validate_bytes (zero-copy reader, quick checks) accepts and rejects exactly what
    validate() of protobuf's parse does, with the same reason, including sums that overflow."""
    spec = small_spec("continuous")
    validator = UnrollValidator(spec, T)
    rng = np.random.default_rng(7)
    big = np.finfo(np.float32).max
    for trial in range(80):
        u = make_unroll(spec, rng)
        key = rng.choice(sorted(k for k in spec if k != "step_type"))
        arr = u[key]
        if arr.dtype.kind == "f":
            value = rng.choice([np.nan, np.inf, -np.inf, 3.0, -3.0, 0.25, 1.5, big, -big])
            arr.flat[rng.integers(arr.size)] = value
            if value in (big, -big):
                arr[...] = value  # finite, but its float32 sum overflows: must still pass
        else:
            arr.flat[rng.integers(arr.size)] = rng.integers(0, 256)
        raw = _payload(u)
        outcomes = []
        for check in (lambda: validator.validate(transport_pb2.Unroll.FromString(raw), len(raw)),
                      lambda: validator.validate_bytes(raw)):
            try:
                item = check()
                outcomes.append(("ok", {k: v.tobytes() for k, v in item.tensors.items()}))
            except UnrollRejected as e:
                outcomes.append((e.reason, str(e)))
        assert outcomes[0] == outcomes[1], (trial, key, outcomes)
        if key in ("reward", "observation/position") and rng.random() < 0.5:
            u[key][...] = big
            item = validator.validate_bytes(_payload(u))
            assert np.all(item.tensors[key] == big)


def test_queued_tensors_are_read_only_views_on_the_received_bytes():
    spec = small_spec()
    validator = UnrollValidator(spec, T)
    raw = _payload(make_unroll(spec, np.random.default_rng(8)))
    item = validator.validate_bytes(raw)
    for name, arr in item.tensors.items():
        assert not arr.flags.writeable, name
        root = arr
        while isinstance(root, np.ndarray):
            root = root.base
        assert root.obj is raw, name  # a memoryview of the received bytes: no copy
