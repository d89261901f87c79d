"""Wire format: tensor encode/decode, spec round trips, committed generated code, no TF, no pickle."""

from __future__ import annotations

import filecmp
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from impala_rep.proto import transport_pb2
from impala_rep.specs import ArraySpec
from impala_rep.wire import (
    WIRE_DTYPES,
    WireError,
    decode_tensor,
    decode_tensors,
    encode_tensor,
    encode_parameters_response,
    canonical_layout,
    encode_unroll_bytes,
    parse_unroll,
    spec_from_proto,
    spec_to_proto,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3, 4)])
def test_round_trip_every_dtype_and_shape(dtype, shape):
    rng = np.random.default_rng(0)
    value = np.asarray(rng.uniform(0, 100, shape)).astype(dtype)
    msg = transport_pb2.Tensor.FromString(encode_tensor("x", value).SerializeToString())
    out = decode_tensor(msg)
    assert out.dtype == np.dtype(dtype) and out.shape == np.shape(value)
    np.testing.assert_array_equal(out, value)


def test_non_contiguous_and_big_endian_inputs_are_packed():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    view = base[:, ::2]
    np.testing.assert_array_equal(decode_tensor(encode_tensor("v", view)), view)
    big = np.arange(5, dtype=">i4")
    out = decode_tensor(encode_tensor("b", big))
    assert out.dtype == np.dtype("int32")
    np.testing.assert_array_equal(out, big)


def test_decode_is_a_read_only_view_on_the_message_bytes():
    msg = encode_tensor("x", np.arange(10, dtype=np.int64))
    out = decode_tensor(msg)
    assert not out.flags.writeable
    root = out
    while isinstance(root, np.ndarray):
        root = root.base
    assert isinstance(root, bytes)  # an np.frombuffer view: no copy beyond the bytes field


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda m: setattr(m, "data", m.data[:-1]), "bytes cannot be"),
        (lambda m: setattr(m, "dtype", "object"), "unknown dtype"),
        (lambda m: m.shape.__setitem__(0, -1), "negative"),
    ],
)
def test_undecodable_tensors_raise_wire_error(mutate, words):
    msg = encode_tensor("frames", np.zeros([4, 2], np.float32))
    mutate(msg)
    with pytest.raises(WireError, match=words):
        decode_tensor(msg)


def test_wire_error_is_a_value_error_and_unsupported_dtypes_are_refused():
    assert issubclass(WireError, ValueError)
    with pytest.raises(WireError, match="cannot travel"):
        encode_tensor("c", np.zeros([2], np.complex64))
    with pytest.raises(WireError, match="cannot travel"):
        encode_tensor("o", np.array([object()], dtype=object))


def test_duplicate_names_are_refused():
    msg = transport_pb2.Unroll()
    encode_tensor("a", np.zeros(2), out=msg.tensors.add())
    encode_tensor("a", np.zeros(2), out=msg.tensors.add())
    with pytest.raises(WireError, match="twice"):
        decode_tensors(msg.tensors)


@pytest.mark.parametrize(
    "spec",
    [
        ArraySpec("pixels", (84, 84, 3), "uint8"),
        ArraySpec("action", (), "int32", num_values=6),
        ArraySpec("action", (2,), "float32", minimum=-1.0, maximum=1.0),
        ArraySpec("action", (3,), "float64", minimum=(-1.0, -2.0, 0.0), maximum=(1.0, 2.0, 0.5)),
        ArraySpec("step_type", (21,), "uint8", minimum=0, maximum=2),
        ArraySpec("action", (1,), "float32", minimum=(-1.0,), maximum=1.0),
    ],
)
def test_spec_round_trip(spec):
    back = spec_from_proto(transport_pb2.TensorSpec.FromString(spec_to_proto(spec).SerializeToString()))
    assert back == spec


def test_committed_generated_code_matches_the_proto(tmp_path):
    """Regenerates with grpcio-tools (scripts/gen_proto.sh) and compares byte for byte."""
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    for name in ("transport_pb2.py", "transport_pb2_grpc.py"):
        fresh = tmp_path / "impala_rep" / "proto" / name
        committed = ROOT / "impala_rep" / "proto" / name
        assert fresh.exists(), f"protoc did not write {name}"
        assert filecmp.cmp(fresh, committed, shallow=False), (
            f"impala_rep/proto/{name} differs from what the .proto generates; run "
            "`bash scripts/gen_proto.sh` and commit the result."
        )


TRANSPORT_MODULES = [
    "impala_rep.wire",
    "impala_rep.proto.transport_pb2",
    "impala_rep.proto.transport_pb2_grpc",
    "actors.client",
    "learner.server",
    "learner.validation",
    "learner.queue",
    "learner.batcher",
    "learner.params",
]


def test_transport_modules_do_not_import_tensorflow():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in TRANSPORT_MODULES)
        + "bad = [m for m in sys.modules if m == 'tensorflow' or m.startswith('tensorflow.')]\n"
        + "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_no_pickle_in_the_transport():
    files = [ROOT / (m.replace(".", "/") + ".py") for m in TRANSPORT_MODULES]
    files += [ROOT / "impala_rep" / "proto" / "transport.proto"]
    pattern = re.compile(r"import (c?pickle|dill|marshal)|from (c?pickle|dill|marshal) import|pickle\.(loads?|dumps?|Pickler|Unpickler)\b|allow_pickle\s*=\s*True")
    for path in files:
        match = pattern.search(path.read_text())
        assert match is None, f"{path} uses {match.group(0)!r}"


@pytest.mark.parametrize("version", [0, 7, 2**40])
@pytest.mark.parametrize("episodes", [((), ()), ((1.5, -2.0), (10, 300))])
def test_fast_unroll_encoding_equals_protobuf_serialization(version, episodes):
    rng = np.random.default_rng(1)
    tensors = {
        "observation/pixels": rng.integers(0, 256, (3, 84, 84, 3)).astype(np.uint8),
        "reward": rng.normal(size=3).astype(np.float32),
        "action": np.arange(6, dtype=">i4").reshape(3, 2)[:, ::-1],  # big-endian, non-contiguous
        "scalar": np.float64(2.5),
        "empty": np.zeros((0, 4), np.int64),
        "flag": np.array([True, False]),
        "core_state/h": np.zeros((300,), np.float16),
    }
    returns, lengths = episodes
    msg = transport_pb2.Unroll(actor_id="actor-\u00e9", policy_version=version)
    msg.episode_returns[:] = returns
    msg.episode_lengths[:] = lengths
    for name, value in tensors.items():
        encode_tensor(name, value, out=msg.tensors.add())
    fast = encode_unroll_bytes("actor-\u00e9", version, tensors, returns, lengths)
    assert fast == msg.SerializeToString()
    back = transport_pb2.Unroll.FromString(fast)
    np.testing.assert_array_equal(decode_tensors(back.tensors)["action"], tensors["action"])


# ---------------------------------------------------------------- parse_unroll (the learner's reader)


def _unroll_fields(msg):
    """Comparable fields of a protobuf Unroll or a ParsedUnroll (NaN-safe returns)."""
    return (
        msg.actor_id,
        int(msg.policy_version),
        [(t.name, t.dtype, tuple(t.shape), bytes(t.data)) for t in msg.tensors],
        np.asarray(list(msg.episode_returns), np.float64).tobytes(),
        [int(n) for n in msg.episode_lengths],
    )


def _sample_tensors(rng):
    return {
        "observation/pixels": rng.integers(0, 256, (3, 84, 84, 3)).astype(np.uint8),
        "reward": rng.normal(size=3).astype(np.float32),
        "action": np.arange(6, dtype=np.int32).reshape(3, 2),
        "scalar": np.float64(2.5),
        "empty": np.zeros((0, 4), np.int64),
        "": np.ones(2, np.int8),
    }


def _sample_layout(tensors):
    return canonical_layout((k, np.asarray(v).dtype.name, np.shape(v)) for k, v in tensors.items())


@pytest.mark.parametrize("use_layout", [False, True])
@pytest.mark.parametrize("version", [0, 5, -3, 2**62])
def test_parse_unroll_reads_what_protobuf_reads(use_layout, version):
    tensors = _sample_tensors(np.random.default_rng(2))
    raw = encode_unroll_bytes("actor-\u00e9", version, tensors, [1.5, float("nan")], [10, 2**40])
    got = parse_unroll(raw, _sample_layout(tensors) if use_layout else ())
    assert _unroll_fields(got) == _unroll_fields(transport_pb2.Unroll.FromString(raw))


def test_parse_unroll_data_is_a_zero_copy_view_on_the_input():
    tensors = _sample_tensors(np.random.default_rng(3))
    raw = encode_unroll_bytes("a", 1, tensors)
    for layout in ((), _sample_layout(tensors)):
        got = parse_unroll(raw, layout)
        data = got.tensors[0].data
        assert isinstance(data, memoryview) and data.obj is raw and data.readonly
        arr = np.frombuffer(data, np.uint8)
        assert not arr.flags.writeable
        np.testing.assert_array_equal(arr.reshape(3, 84, 84, 3), tensors["observation/pixels"])


def _field(tag_byte, payload=b""):
    return bytes((tag_byte,)) + payload


def _ld(tag_byte, payload):
    return bytes((tag_byte,)) + _varint_bytes(len(payload)) + payload


def _varint_bytes(value):
    out = bytearray()
    value &= (1 << 64) - 1
    while True:
        b = value & 0x7F
        value >>= 7
        out.append(b | (0x80 if value else 0))
        if not value:
            return bytes(out)


def test_parse_unroll_accepts_what_protobuf_accepts_in_other_encodings():
    """Unpacked repeated scalars, any field order, repeated singular fields (last wins)."""
    data = np.arange(6, dtype="<f4").tobytes()
    tensor = (
        _ld(0x22, b"junk-overwritten")  # data first, then replaced by a later data field
        + _field(0x18, _varint_bytes(2)) + _ld(0x1A, _varint_bytes(3))  # shape: unpacked then packed
        + _ld(0x12, b"float32") + _ld(0x0A, b"first") + _ld(0x0A, b"x")
        + _ld(0x22, data)
    )
    raw = (
        _field(0x10, _varint_bytes(7)) + _ld(0x1A, tensor) + _ld(0x0A, b"me")
        + _field(0x21, np.float64(1.25).tobytes()) + _ld(0x22, np.array([2.5, -1.0]).tobytes())
        + _field(0x28, _varint_bytes(4)) + _ld(0x2A, _varint_bytes(5) + _varint_bytes(2**35))
        + _field(0x10, _varint_bytes(-2))  # last policy_version wins
        + _field(0x8A, b"\x00" + _varint_bytes(0))  # an overlong (2-byte) tag for actor_id
    )
    reference = transport_pb2.Unroll.FromString(raw)
    assert reference.policy_version == -2 and reference.actor_id == ""
    assert _unroll_fields(parse_unroll(raw)) == _unroll_fields(reference)
    layout = canonical_layout([("x", "float32", (2, 3))])
    assert _unroll_fields(parse_unroll(raw, layout)) == _unroll_fields(reference)


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"\x1a\x05\x0a\x01", "runs past the end"),  # truncated tensor
        (b"\x10", "ends inside"),  # truncated varint
        (b"\x10" + b"\xff" * 10 + b"\x01", "longer than 10 bytes"),
        (b"\x30\x01", "field 6 (varint) is not a field of Unroll"),  # unknown field
        (b"\x1a\x02\x28\x01", "field 5 (varint) is not a field of Tensor"),
        (b"\x12\x01a", "Unroll.policy_version) has wire type length-delimited; expected varint"),
        (b"\x08\x01", "Unroll.actor_id) has wire type varint"),
        (b"\x1a\x02\x20\x01", "Tensor.data) has wire type varint"),
        (b"\x1a\x02\x0d\x00", "Tensor.name) has wire type 32-bit"),
        (b"\x0b", "start-group"),  # groups are not Unroll fields
        (b"\x02\x00", "field 0"),
        (b"\x22\x03abc", "not a whole number of doubles"),
        (b"\x21\x00\x00", "ends inside a double"),
        (b"\x0a\x02\xc3\x28", "actor_id is not valid UTF-8"),
        (b"\x1a\x03\x12\x01\xff", "dtype is not valid UTF-8"),
        (b"\x2a\x01\x80", "ends inside a varint"),  # packed varints cut inside their field
    ],
)
def test_parse_unroll_rejects_malformed_bytes_with_a_sentence(raw, words):
    with pytest.raises(WireError, match=re.escape(words)) as info:
        parse_unroll(raw)
    assert str(info.value).endswith(".")


def test_parse_unroll_never_accepts_more_than_protobuf_and_never_crashes():
    """Every truncation and many random corruptions of a valid message: WireError, or the same
    fields protobuf reads (never another exception, never something protobuf refuses)."""
    from google.protobuf.message import DecodeError

    rng = np.random.default_rng(4)
    tensors = {
        "observation/pixels": rng.integers(0, 256, (2, 4, 4, 3)).astype(np.uint8),
        "reward": rng.normal(size=2).astype(np.float32),
        "action": np.arange(2, dtype=np.int32),
    }
    raw = encode_unroll_bytes("actor", 3, tensors, [1.0], [7])
    layout = _sample_layout(tensors)
    candidates = [raw[:n] for n in range(len(raw))]
    for _ in range(1500):
        b = bytearray(raw)
        for _ in range(rng.integers(1, 4)):
            i = int(rng.integers(len(b)))
            b[i] = int(rng.choice([rng.integers(256), 0x00, 0x80, 0xFF, b[i] ^ 0x08]))
        if rng.random() < 0.3:
            cut = int(rng.integers(len(b)))
            b = b[:cut] + b[cut + int(rng.integers(1, 5)):]
        candidates.append(bytes(b))
    accepted = 0
    for cand in candidates:
        for lay in ((), layout):
            try:
                got = parse_unroll(cand, lay)
            except WireError:
                continue
            accepted += 1
            try:
                reference = transport_pb2.Unroll.FromString(cand)
            except DecodeError:
                pytest.fail(f"parse_unroll accepted bytes protobuf refuses: {cand!r}")
            assert _unroll_fields(got) == _unroll_fields(reference), cand
    assert accepted > 10  # the comparison was exercised


def test_parameters_response_is_what_protobuf_writes_and_its_views_are_the_arrays():
    rng = np.random.default_rng(3)
    params = {
        "torso/conv_0/kernel": rng.standard_normal([8, 8, 9, 16]).astype(np.float32),
        "transposed": rng.standard_normal([5, 7]).astype(np.float32).T,  # not C-contiguous
        "big_endian": np.arange(6, dtype=">i4").reshape(2, 3),
        "scalar": np.float64(2.5),
        "empty": np.zeros([0, 3], np.int32),
        "flags": np.array([True, False, True]),
        "counts": np.arange(4, dtype=np.uint8),
    }
    for version in (0, 1, 300):
        payload, views = encode_parameters_response(version, params)
        expected = transport_pb2.GetParametersResponse(version=version)
        for name, value in params.items():
            encode_tensor(name, value, out=expected.tensors.add())
        assert payload == expected.SerializeToString()
        decoded = decode_tensors(transport_pb2.GetParametersResponse.FromString(payload).tensors)
        assert list(views) == list(params) == list(decoded)
        for name, value in params.items():
            np.testing.assert_array_equal(views[name], value)
            np.testing.assert_array_equal(decoded[name], value)
            assert views[name].shape == np.shape(value) and not views[name].flags.writeable
    # The views are of the reply's bytes, not of the arrays given: changing those changes neither.
    params["counts"][0] = 9
    assert views["counts"][0] == 0 and decode_tensors(
        transport_pb2.GetParametersResponse.FromString(payload).tensors)["counts"][0] == 0


def test_parameters_response_refuses_what_cannot_travel():
    with pytest.raises(WireError, match="complex64 cannot travel"):
        encode_parameters_response(1, {"c": np.zeros([2], np.complex64)})
    with pytest.raises(WireError, match="at least 0"):
        encode_parameters_response(-1, {"w": np.zeros([2], np.float32)})
