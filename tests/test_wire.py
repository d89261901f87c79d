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
    encode_unroll_bytes,
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
