"""Encode and decode named NumPy arrays as protobuf ``Tensor`` messages (TensorFlow-free).

The wire format (``impala_rep/proto/transport.proto``): each tensor travels as its numpy
dtype name, its shape and its raw bytes (C order, little-endian) in one ``bytes`` field —
never pickle. Decoding is zero-copy: the array is an ``np.frombuffer`` view on the message's
bytes (read-only). Both actors and the learner import this module.

Usage::

    msg = encode_tensor("reward", np.zeros([21], np.float32))
    arr = decode_tensor(msg)                     # raises WireError on undecodable input
    raw = encode_unroll_bytes("actor-0", 3, {"reward": np.zeros([21], np.float32)})
    unroll = parse_unroll(raw)                   # the learner's zero-copy reader of Unroll bytes
    batch = encode_unroll_batch([encode_unroll_parts("actor-0", 3, tensors) for tensors in many])
    for start, stop in split_unroll_batch(batch):  # an UnrollBatch: several Unrolls, one message
        unroll = parse_unroll(batch, start=start, stop=stop)
    specs = spec_from_proto(spec_to_proto(array_spec))
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Dict, Iterable, List, Mapping, NamedTuple, Tuple, Union

import numpy as np

from impala_rep.proto import transport_pb2
from impala_rep.specs import ArraySpec

# The transport protocol both ends speak; the learner announces it in its handshake and an
# actor refuses a learner that speaks another one (2: the learner confirms each unroll stream
# it serves with STREAM_ACCEPTED before reading from it).
PROTOCOL_VERSION = 2
# The initial metadata the learner sends on an unroll stream it serves. An actor sends nothing
# beyond a stream's first message until it has it: a stream refused for the stream limit then
# carries at most one message, which the actor sends again on its next stream.
STREAM_ACCEPTED = ("x-impala-stream", "accepted")

__all__ = [
    "WireError",
    "WIRE_DTYPES",
    "encode_parameters_response",
    "wire_dtype",
    "encode_tensor",
    "encode_tensors",
    "encode_unroll_bytes",
    "encode_unroll_parts",
    "encode_unroll_batch",
    "split_unroll_batch",
    "decode_tensor",
    "decode_tensors",
    "ParsedTensor",
    "ParsedUnroll",
    "UnrollParts",
    "parse_unroll",
    "canonical_layout",
    "spec_to_proto",
    "spec_from_proto",
]

WIRE_DTYPES = frozenset(
    ("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool")
)
_LE_DTYPES = {name: np.dtype(name).newbyteorder("<") for name in WIRE_DTYPES}
_LE_DTYPES["bool"] = np.dtype(bool)
_LE_DTYPES["uint8"] = np.dtype(np.uint8)
_LE_DTYPES["int8"] = np.dtype(np.int8)


def wire_dtype(name: str) -> np.dtype:
    """The little-endian numpy dtype a tensor of dtype ``name`` travels as."""
    try:
        return _LE_DTYPES[name]
    except KeyError:
        raise WireError(f"unknown dtype {name!r}; expected one of {sorted(WIRE_DTYPES)}.") from None


class WireError(ValueError):
    """A tensor message that cannot be turned into an array (or an array that cannot be sent)."""


def encode_tensor(name: str, value, out: "transport_pb2.Tensor | None" = None) -> "transport_pb2.Tensor":
    """Encodes one array as a ``Tensor`` message (into ``out`` when given)."""
    arr = np.asarray(value)
    dtype = arr.dtype.name
    if dtype not in WIRE_DTYPES:
        raise WireError(
            f"tensor {name!r}: dtype {dtype} cannot travel; use one of {sorted(WIRE_DTYPES)}."
        )
    le = _LE_DTYPES[dtype]
    if arr.dtype != le:
        arr = arr.astype(le)
    msg = out if out is not None else transport_pb2.Tensor()
    msg.name = name
    msg.dtype = dtype
    msg.shape[:] = arr.shape
    # tobytes() of a C-contiguous array is one memcpy; non-contiguous arrays are packed here.
    msg.data = arr.tobytes(order="C")
    return msg


def encode_tensors(arrays: Mapping[str, object], container) -> None:
    """Appends one ``Tensor`` per entry of ``arrays`` to a repeated field ``container``."""
    for name, value in arrays.items():
        encode_tensor(name, value, out=container.add())


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 two's complement, as protobuf encodes negative int64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _len_field(tag: int, payload_len: int) -> bytes:
    return bytes((tag,)) + _varint(payload_len)


@functools.lru_cache(maxsize=1024)
def _tensor_prefix(name: str, dtype: str, shape: Tuple[int, ...]) -> bytes:
    """One ``Unroll.tensors`` field as protobuf writes it, up to its data bytes.

    The tag and length of the field, then the tensor's name, dtype, packed shape and the
    tag and length of ``data`` (absent, as protobuf omits it, when there are no bytes).
    """
    head = []
    kb, db = name.encode(), dtype.encode()
    if kb:
        head += [_len_field(0x0A, len(kb)), kb]
    head += [_len_field(0x12, len(db)), db]
    if shape:
        dims = b"".join(_varint(int(d)) for d in shape)
        head += [_len_field(0x1A, len(dims)), dims]
    head_bytes = b"".join(head)
    nbytes = math.prod(shape) * _LE_DTYPES[dtype].itemsize
    if not nbytes:
        return _len_field(0x1A, len(head_bytes)) + head_bytes
    data_head = _len_field(0x22, nbytes)
    return _len_field(0x1A, len(head_bytes) + len(data_head) + nbytes) + head_bytes + data_head


def canonical_layout(tensors: Iterable[Tuple[str, str, Tuple[int, ...]]]) -> Tuple[tuple, ...]:
    """Precomputed fast path of :func:`parse_unroll` for tensors of known (name, dtype, shape).

    A tensor field whose bytes start exactly as protobuf (and :func:`encode_unroll_bytes`)
    writes such a tensor is taken with one comparison; anything else is parsed field by field.
    """
    out = []
    for name, dtype, shape in tensors:
        shape = tuple(int(d) for d in shape)
        if dtype not in _LE_DTYPES or any(d < 0 for d in shape):
            continue
        nbytes = math.prod(shape) * _LE_DTYPES[dtype].itemsize
        out.append((_tensor_prefix(name, dtype, shape), name, dtype, shape, nbytes))
    return tuple(out)


def encode_unroll_bytes(
    actor_id: str,
    policy_version: int,
    tensors: Mapping[str, object],
    episode_returns: Iterable[float] = (),
    episode_lengths: Iterable[int] = (),
) -> bytes:
    """The serialized ``transport_pb2.Unroll``, written with one copy of each tensor's bytes.

    Byte for byte what ``Unroll(...).SerializeToString()`` gives (tests compare), but it
    joins the arrays' memory directly instead of copying each array into the message and
    the message into bytes (two fewer copies of about 0.5 MB per pixel unroll).
    """
    return b"".join(encode_unroll_parts(actor_id, policy_version, tensors, episode_returns, episode_lengths).parts)


class UnrollParts(NamedTuple):
    """One ``Unroll``'s serialized pieces, not yet joined: ``b"".join(parts)`` is the message."""

    parts: List[Union[bytes, memoryview]]
    nbytes: int


def encode_unroll_parts(
    actor_id: str,
    policy_version: int,
    tensors: Mapping[str, object],
    episode_returns: Iterable[float] = (),
    episode_lengths: Iterable[int] = (),
) -> UnrollParts:
    """:func:`encode_unroll_bytes` before the join: the pieces (views on the arrays) and their size.

    :func:`encode_unroll_batch` joins several into one ``UnrollBatch`` with one copy.
    """
    parts = []
    name = actor_id.encode()
    if name:
        parts += [_len_field(0x0A, len(name)), name]
    if int(policy_version):
        parts += [b"\x10", _varint(int(policy_version))]
    for key, value in tensors.items():
        parts += _tensor_field_parts(key, value)[0]
    returns = np.asarray(list(episode_returns), dtype="<f8")
    if returns.size:
        parts += [_len_field(0x22, returns.nbytes), returns.tobytes()]
    lengths = b"".join(_varint(int(n)) for n in episode_lengths)
    if lengths:
        parts += [_len_field(0x2A, len(lengths)), lengths]
    return UnrollParts(parts, sum(len(p) for p in parts))  # the views are flat bytes ("B")


def _tensor_field_parts(key: str, value) -> Tuple[list, np.ndarray]:
    """One ``tensors`` field (field 3 of ``Unroll`` and ``GetParametersResponse``) as pieces to
    join (its head, then a flat view on the array's bytes), and the little-endian C-contiguous
    array those bytes are."""
    arr = np.asarray(value)
    dtype = arr.dtype.name
    if dtype not in WIRE_DTYPES:
        raise WireError(f"tensor {key!r}: dtype {dtype} cannot travel; use one of {sorted(WIRE_DTYPES)}.")
    le = _LE_DTYPES[dtype]
    if arr.dtype != le or not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr, dtype=le)
    head = _tensor_prefix(key, dtype, arr.shape)
    if not arr.nbytes:
        return [head], arr
    return [head, memoryview(arr.reshape(-1)).cast("B") if arr.ndim else arr.tobytes()], arr


def encode_parameters_response(version: int, params: Mapping[str, object]) -> Tuple[bytes, Dict[str, np.ndarray]]:
    """``GetParametersResponse(version=version, tensors=params)`` serialized with one copy of
    each array's bytes, and read-only arrays of ``params`` that are views on those bytes.

    Byte for byte what protobuf's ``SerializeToString()`` gives (tests compare). A learner
    publishes a few megabytes of parameters every step; this replaces three copies of them
    (a snapshot, each array into its message, the message into bytes) with one.
    """
    version = int(version)
    if version < 0:
        raise WireError(f"a parameter version is at least 0, got {version}.")
    parts: list = [b"\x08", _varint(version)] if version else []
    pieces = []  # (name, offset of its data in the message, the array), in order
    offset = sum(len(p) for p in parts)
    for name, value in params.items():
        name = str(name)
        field, arr = _tensor_field_parts(name, value)
        offset += len(field[0])  # the field's head; its data, arr.nbytes of them, follow
        pieces.append((name, offset, arr))
        offset += arr.nbytes
        parts += field
    payload = b"".join(parts)
    views: Dict[str, np.ndarray] = {}
    for name, start, arr in pieces:
        view = np.frombuffer(payload, dtype=arr.dtype, count=arr.size, offset=start).reshape(arr.shape)
        views[name] = view if arr.dtype.isnative else view.astype(arr.dtype.newbyteorder("="))
    return payload, views


def encode_unroll_batch(unrolls: Iterable[UnrollParts]) -> bytes:
    """The serialized ``transport_pb2.UnrollBatch`` of these unrolls, in order (one copy).

    Byte for byte what ``UnrollBatch(unrolls=[...]).SerializeToString()`` gives.
    """
    parts: list = []
    for unroll in unrolls:
        parts.append(_len_field(0x0A, unroll.nbytes))
        parts += unroll.parts
    return b"".join(parts)


def split_unroll_batch(buf: bytes) -> List[Tuple[int, int]]:
    """The ``(start, stop)`` byte range of each ``Unroll`` in serialized ``UnrollBatch`` bytes.

    No copies: parse each with ``parse_unroll(buf, start=start, stop=stop)``. Stricter than
    protobuf: any field but ``unrolls`` (1, length-delimited) is refused, and so is a batch
    with no unrolls. Raises ``WireError`` with a sentence naming the byte offset.
    """
    ranges = []
    pos, end = 0, len(buf)
    while pos < end:
        at = pos
        tag, pos = _read_varint(buf, pos, end)
        if tag != 0x0A:
            raise _bad_field("UnrollBatch", _BATCH_FIELDS, tag >> 3, tag & 7, at)
        n, pos = _length(buf, pos, end)
        ranges.append((pos, pos + n))
        pos += n
    if not ranges:
        raise WireError("the UnrollBatch holds no unrolls; send at least one.")
    return ranges


def decode_tensor(msg: "transport_pb2.Tensor", max_elements: int | None = None) -> np.ndarray:
    """Returns the array a ``Tensor`` message holds (a read-only view on its bytes).

    Raises ``WireError`` naming the tensor when the dtype is unknown, the shape is negative
    or too large, or the byte length does not equal ``prod(shape) * itemsize``.
    """
    name = msg.name
    dtype = msg.dtype
    le = _LE_DTYPES.get(dtype)
    if le is None:
        raise WireError(f"tensor {name!r}: unknown dtype {dtype!r}; expected one of {sorted(WIRE_DTYPES)}.")
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"tensor {name!r}: shape {list(shape)} has a negative dimension.")
    count = math.prod(shape)
    if max_elements is not None and count > max_elements:
        raise WireError(
            f"tensor {name!r}: shape {list(shape)} has {count} elements, more than the limit {max_elements}."
        )
    data = msg.data
    expected = count * le.itemsize
    if len(data) != expected:
        raise WireError(
            f"tensor {name!r}: {len(data)} bytes cannot be a {dtype} array of shape {list(shape)} "
            f"(expected {expected} bytes)."
        )
    arr = np.frombuffer(data, dtype=le, count=count).reshape(shape)
    if not le.isnative:
        arr = arr.astype(le.newbyteorder("="))
    return arr


def decode_tensors(messages: Iterable["transport_pb2.Tensor"]) -> Dict[str, np.ndarray]:
    """Decodes repeated ``Tensor`` messages into ``{name: array}``; duplicate names are an error."""
    out: Dict[str, np.ndarray] = {}
    for msg in messages:
        if msg.name in out:
            raise WireError(f"tensor {msg.name!r} appears twice; every name must be unique.")
        out[msg.name] = decode_tensor(msg)
    return out


_MASK64 = (1 << 64) - 1
_SIGN64 = 1 << 63
_WIRE_TYPES = {0: "varint", 1: "64-bit", 2: "length-delimited", 3: "start-group", 4: "end-group", 5: "32-bit"}
_UNROLL_FIELDS = {1: ("actor_id", 2), 2: ("policy_version", 0), 3: ("tensors", 2),
                  4: ("episode_returns", 1), 5: ("episode_lengths", 0)}
_BATCH_FIELDS = {1: ("unrolls", 2)}
_TENSOR_FIELDS = {1: ("name", 2), 2: ("dtype", 2), 3: ("shape", 0), 4: ("data", 2)}
_REPEATED_SCALARS = {("Unroll", 4), ("Unroll", 5), ("Tensor", 3)}  # packed or not


class ParsedTensor(NamedTuple):
    """One ``Tensor`` as :func:`parse_unroll` read it; ``data`` is a view on the input."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    data: Union[memoryview, bytes]


class ParsedUnroll(NamedTuple):
    """The fields of one ``Unroll`` message, as :func:`parse_unroll` read them."""

    actor_id: str
    policy_version: int
    tensors: List[ParsedTensor]
    episode_returns: List[float]
    episode_lengths: List[int]


def _read_varint(buf: bytes, pos: int, end: int) -> Tuple[int, int]:
    """(unsigned value, next position) of the varint at ``pos``; at most 10 bytes, inside ``end``."""
    if pos >= end:
        raise WireError(f"byte {pos}: the message ends inside a field.")
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    value, shift, start = b & 0x7F, 7, pos
    pos += 1
    while True:
        if pos >= end:
            raise WireError(f"byte {start}: the message ends inside a varint.")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value & _MASK64, pos
        shift += 7
        if shift >= 70:
            raise WireError(f"byte {start}: a varint is longer than 10 bytes.")


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= _SIGN64 else value


def _utf8(buf: bytes, pos: int, end: int, what: str) -> str:
    try:
        return str(buf[pos:end], "utf-8")
    except UnicodeDecodeError:
        raise WireError(f"byte {pos}: {what} is not valid UTF-8.") from None


def _bad_field(message: str, fields, number: int, wire_type: int, pos: int) -> WireError:
    kind = _WIRE_TYPES.get(wire_type, f"invalid ({wire_type})")
    known = fields.get(number)
    if known is None:
        return WireError(f"byte {pos}: field {number} ({kind}) is not a field of {message}.")
    name, expected = known
    if (message, number) in _REPEATED_SCALARS:
        expected_text = f"{_WIRE_TYPES[expected]} or packed"
    else:
        expected_text = _WIRE_TYPES[expected]
    return WireError(f"byte {pos}: field {number} ({message}.{name}) has wire type {kind}; expected {expected_text}.")


def _length(buf: bytes, pos: int, end: int) -> Tuple[int, int]:
    n, pos = _read_varint(buf, pos, end)
    if n > end - pos:
        raise WireError(f"byte {pos}: a field of {n} bytes runs past the end of its message ({end - pos} bytes left).")
    return n, pos


def _read_string(buf: bytes, pos: int, end: int, what: str) -> Tuple[str, int]:
    n, pos = _length(buf, pos, end)
    return _utf8(buf, pos, pos + n, what), pos + n


def _read_packed_varints(buf: bytes, pos: int, end: int, out: List[int]) -> int:
    """Appends a packed run of (signed) varints to ``out``; returns the position after it."""
    n, pos = _length(buf, pos, end)
    stop = pos + n
    while pos < stop:
        d, pos = _read_varint(buf, pos, stop)
        out.append(_signed(d))
    return pos


def _parse_tensor(buf: bytes, view: memoryview, pos: int, end: int) -> ParsedTensor:
    name = dtype = ""
    shape: List[int] = []
    data: Union[memoryview, bytes] = b""
    while pos < end:
        at = pos
        tag, pos = _read_varint(buf, pos, end)
        if tag == 0x22:  # data
            n, pos = _length(buf, pos, end)
            data = view[pos:pos + n]
            pos += n
        elif tag == 0x1A:  # shape, packed
            pos = _read_packed_varints(buf, pos, end, shape)
        elif tag == 0x0A:
            name, pos = _read_string(buf, pos, end, "a tensor name")
        elif tag == 0x12:
            dtype, pos = _read_string(buf, pos, end, "a tensor dtype")
        elif tag == 0x18:  # shape, one unpacked element
            d, pos = _read_varint(buf, pos, end)
            shape.append(_signed(d))
        else:
            raise _bad_field("Tensor", _TENSOR_FIELDS, tag >> 3, tag & 7, at)
    return ParsedTensor(name, dtype, tuple(shape), data)


def _match_canonical(buf: bytes, pos: int, end: int, layout: Tuple[tuple, ...], first: int) -> int:
    """Index of the layout entry whose canonical field starts at ``pos`` and fits; -1 if none."""
    if first < len(layout):
        prefix, nbytes = layout[first][0], layout[first][4]
        if buf.startswith(prefix, pos) and pos + len(prefix) + nbytes <= end:
            return first
    for j, entry in enumerate(layout):
        prefix, nbytes = entry[0], entry[4]
        if buf.startswith(prefix, pos) and pos + len(prefix) + nbytes <= end:
            return j
    return -1


def parse_unroll(buf: bytes, layout: Tuple[tuple, ...] = (), start: int = 0, stop: "int | None" = None) -> ParsedUnroll:
    """Reads serialized ``transport_pb2.Unroll`` bytes without copying the tensors' data.

    Each tensor's ``data`` is a ``memoryview`` slice of ``buf`` (so ``np.frombuffer`` of it is
    a read-only view on the received bytes). Stricter than protobuf's parser, never looser:
    whatever it accepts, ``Unroll.FromString`` parses to the same fields (the tests compare);
    it also refuses fields that ``Unroll`` does not have and known fields sent with the
    wrong wire type (protobuf would skip both as unknown). Repeated scalars are read packed
    or unpacked and later singular fields win, as protobuf does.

    ``layout`` (from :func:`canonical_layout`) names the tensors the caller expects: those
    written canonically are recognised by one byte comparison each (same result, less time).

    ``start`` and ``stop`` read the message that fills ``buf[start:stop]`` (one ``Unroll`` of
    an ``UnrollBatch``, :func:`split_unroll_batch`) in place; byte offsets in errors count
    from the start of ``buf``.

    Raises ``WireError`` with a sentence naming the byte offset of the problem.
    """
    if not isinstance(buf, bytes):
        buf = bytes(buf)
    view = memoryview(buf)
    actor_id = ""
    policy_version = 0
    tensors: List[ParsedTensor] = []
    returns: List[float] = []
    lengths: List[int] = []
    pos, end = int(start), len(buf) if stop is None else int(stop)
    if not 0 <= pos <= end <= len(buf):
        raise ValueError(f"start {start} and stop {stop} do not delimit a part of the {len(buf)} bytes.")
    nexp, i = len(layout), 0
    while pos < end:
        if nexp and buf[pos] == 0x1A:
            # Fast path: the tensor after the last one matched, else any expected tensor.
            j = _match_canonical(buf, pos, end, layout, i)
            if j >= 0:
                prefix, name, dtype, shape, nbytes = layout[j]
                start = pos + len(prefix)
                tensors.append(ParsedTensor(name, dtype, shape, view[start:start + nbytes]))
                pos, i = start + nbytes, j + 1
                continue
        at = pos
        tag, pos = _read_varint(buf, pos, end)
        if tag == 0x1A:  # tensors
            n, pos = _length(buf, pos, end)
            tensors.append(_parse_tensor(buf, view, pos, pos + n))
            pos += n
        elif tag == 0x0A:
            actor_id, pos = _read_string(buf, pos, end, "actor_id")
        elif tag == 0x10:
            v, pos = _read_varint(buf, pos, end)
            policy_version = _signed(v)
        elif tag == 0x22:  # episode_returns, packed doubles
            n, pos = _length(buf, pos, end)
            if n % 8:
                raise WireError(f"byte {pos}: packed episode_returns hold {n} bytes, not a whole number of doubles.")
            returns.extend(struct.unpack_from(f"<{n // 8}d", buf, pos))
            pos += n
        elif tag == 0x21:  # episode_returns, one unpacked double
            if end - pos < 8:
                raise WireError(f"byte {pos}: the message ends inside a double.")
            returns.append(struct.unpack_from("<d", buf, pos)[0])
            pos += 8
        elif tag == 0x2A:  # episode_lengths, packed
            pos = _read_packed_varints(buf, pos, end, lengths)
        elif tag == 0x28:
            v, pos = _read_varint(buf, pos, end)
            lengths.append(_signed(v))
        else:
            raise _bad_field("Unroll", _UNROLL_FIELDS, tag >> 3, tag & 7, at)
    return ParsedUnroll(actor_id, policy_version, tensors, returns, lengths)


def _bound_to_proto(value, bound: "transport_pb2.Bound") -> None:
    if isinstance(value, tuple):
        bound.values[:] = [float(v) for v in value]
        bound.scalar = False
    else:
        bound.values[:] = [float(value)]
        bound.scalar = True


def _bound_from_proto(bound: "transport_pb2.Bound"):
    values = list(bound.values)
    if bound.scalar:
        if len(values) != 1:
            raise WireError(f"a scalar bound must hold one value, got {len(values)}.")
        return values[0]
    return tuple(values)


def spec_to_proto(spec: ArraySpec, out: "transport_pb2.TensorSpec | None" = None) -> "transport_pb2.TensorSpec":
    """``ArraySpec`` -> ``TensorSpec`` message (bounds and ``num_values`` included)."""
    msg = out if out is not None else transport_pb2.TensorSpec()
    msg.name = spec.name
    msg.dtype = spec.dtype
    msg.shape[:] = spec.shape
    if spec.minimum is not None:
        _bound_to_proto(spec.minimum, msg.minimum)
    if spec.maximum is not None:
        _bound_to_proto(spec.maximum, msg.maximum)
    if spec.num_values is not None:
        msg.num_values = int(spec.num_values)
    return msg


def spec_from_proto(msg: "transport_pb2.TensorSpec") -> ArraySpec:
    """``TensorSpec`` message -> ``ArraySpec``."""
    return ArraySpec(
        name=msg.name,
        shape=tuple(msg.shape),
        dtype=msg.dtype,
        minimum=_bound_from_proto(msg.minimum) if msg.HasField("minimum") else None,
        maximum=_bound_from_proto(msg.maximum) if msg.HasField("maximum") else None,
        num_values=int(msg.num_values) if msg.HasField("num_values") else None,
    )
