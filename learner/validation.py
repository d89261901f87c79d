"""Validation of incoming unrolls against the spec the learner announced (TensorFlow-free).

:class:`UnrollValidator` is compiled once from the unroll spec (``impala_rep.specs.unroll_spec``)
and checks, before anything is queued:

* the message size against the announced ``max_message_bytes``;
* every expected tensor present, no extra or duplicate tensor;
* each tensor's dtype and shape (exact), and that its raw byte length equals
  ``prod(shape) * itemsize`` (undecodable bytes);
* finite floats; values inside the spec's bounds (``num_values`` for discrete arrays),
  which covers actions; step types in {FIRST, MID, LAST}, a FIRST only at step 0 or after a
  LAST, and a FIRST after every LAST;
* the unroll's metadata: ``policy_version >= 0``, as many episode lengths as returns (at most
  T+1), finite returns, positive lengths.

These are the checks of :func:`impala_rep.specs.validate_array`, precompiled and vectorised
(bounds that cover the whole dtype range, such as 0..255 on uint8 pixels, cost nothing;
float tensors are passed by a min and a max, and only on failure checked in full to name
the problem). The server hands the received bytes to :meth:`UnrollValidator.validate_bytes`,
which reads them with :func:`impala_rep.wire.parse_unroll` (no protobuf objects, no copies:
queued arrays are read-only views on the received bytes). A
rejection raises :class:`UnrollRejected`, a ``ValueError`` carrying a short ``reason`` for
metrics and a sentence naming the tensor and what was expected.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

from impala_rep.specs import STEP_FIRST, STEP_LAST, STEP_MID, ArraySpec
from impala_rep.wire import ParsedTensor, ParsedUnroll, WireError, canonical_layout, parse_unroll, wire_dtype

__all__ = ["REJECT_REASONS", "UnrollRejected", "ValidUnroll", "UnrollValidator"]

REJECT_REASONS = (
    "oversized",
    "undecodable",
    "missing_tensor",
    "extra_tensor",
    "dtype",
    "shape",
    "non_finite",
    "out_of_bounds",
    "step_type",
    "metadata",
)


class UnrollRejected(ValueError):
    """An unroll that failed validation; ``reason`` is one of :data:`REJECT_REASONS`."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class ValidUnroll:
    """A validated unroll as it sits in the learner queue.

    ``tensors`` maps every key of the unroll spec to an array of exactly its spec's dtype
    and shape (read-only views on the received bytes).
    """

    tensors: Mapping[str, np.ndarray]
    policy_version: int
    actor_id: str
    episode_returns: np.ndarray  # [E] float64
    episode_lengths: np.ndarray  # [E] int64
    nbytes: int


_STEP_BYTES = bytes((STEP_FIRST, STEP_MID, STEP_LAST))
# Neighbouring step types (a, b) where "b is FIRST" differs from "a is LAST".
_BAD_STEP_PAIRS = tuple(
    bytes((a, b)) for a in _STEP_BYTES for b in _STEP_BYTES
    if (b == STEP_FIRST) != (a == STEP_LAST)
)


# Shared by unrolls in which no episode finished (read-only, like the tensors).
_NO_RETURNS = np.zeros([0], np.float64)
_NO_RETURNS.flags.writeable = False
_NO_LENGTHS = np.zeros([0], np.int64)
_NO_LENGTHS.flags.writeable = False


def _dtype_range(dtype: np.dtype) -> Tuple[float, float]:
    if dtype.kind in "ui":
        info = np.iinfo(dtype)
        return float(info.min), float(info.max)
    if dtype.kind == "b":
        return 0.0, 1.0
    return -math.inf, math.inf


def _compile_checks(spec: ArraySpec) -> List[Callable[[np.ndarray], Optional[Tuple[str, str]]]]:
    """Content checks for one tensor; each returns None or (reason, sentence)."""
    name = spec.name
    dtype = np.dtype(spec.dtype)
    checks: List[Callable[[np.ndarray], Optional[Tuple[str, str]]]] = []
    if dtype.kind == "f":
        def finite(arr):
            if not np.isfinite(arr).all():
                bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
                return "non_finite", f"tensor {name!r} holds {bad} NaN or infinite values; expected finite {spec.dtype}."
            return None
        checks.append(finite)
    if name == "step_type":
        def step_types(arr):
            if arr.dtype == np.uint8 and arr.ndim == 1:
                # Fast path on the raw bytes: all in {0, 1, 2} and no forbidden neighbours.
                raw = arr.tobytes()
                if not raw.translate(None, _STEP_BYTES) and not any(p in raw for p in _BAD_STEP_PAIRS):
                    return None
            if arr.size and (arr.min() < STEP_FIRST or arr.max() > STEP_LAST):
                return "step_type", (
                    f"tensor 'step_type' holds {int(arr.max()) if arr.max() > STEP_LAST else int(arr.min())}; "
                    f"expected step types 0 (FIRST), 1 (MID) or 2 (LAST)."
                )
            first = arr[1:] == STEP_FIRST
            after_last = arr[:-1] == STEP_LAST
            if np.any(first != after_last):
                t = int(np.argmax(first != after_last)) + 1
                return "step_type", (
                    f"tensor 'step_type' is not a valid sequence at step {t}: a FIRST step must "
                    f"follow a LAST step and a LAST step must be followed by FIRST, got "
                    f"{int(arr[t - 1])} -> {int(arr[t])}."
                )
            return None
        checks.append(step_types)
        return checks
    if spec.num_values is not None:
        n = int(spec.num_values)
        def discrete(arr):
            if arr.size and (arr.min() < 0 or arr.max() >= n):
                return "out_of_bounds", (
                    f"tensor {name!r} holds values in [{arr.min()}, {arr.max()}]; expected values in [0, {n})."
                )
            return None
        checks.append(discrete)
        return checks
    lo, hi = spec.bounds()
    dmin, dmax = _dtype_range(dtype)
    if lo is not None:
        scalar = np.all(lo == lo.flat[0]) if lo.size else True
        lo_v = float(lo.flat[0]) if (scalar and lo.size) else None
        if not (lo_v is not None and lo_v <= dmin):
            lo_c = lo_v if lo_v is not None else np.asarray(lo)
            lo_scalar = lo_v is not None
            def below(arr, lo_c=lo_c):
                if arr.size and (arr.min() < lo_c if lo_scalar else np.any(arr < lo_c)):
                    return "out_of_bounds", (
                        f"tensor {name!r} holds values below its minimum {spec.minimum}; "
                        f"expected values in [{spec.minimum}, {spec.maximum}]."
                    )
                return None
            checks.append(below)
    if hi is not None:
        scalar = np.all(hi == hi.flat[0]) if hi.size else True
        hi_v = float(hi.flat[0]) if (scalar and hi.size) else None
        if not (hi_v is not None and hi_v >= dmax):
            hi_c = hi_v if hi_v is not None else np.asarray(hi)
            hi_scalar = hi_v is not None
            def above(arr, hi_c=hi_c):
                if arr.size and (arr.max() > hi_c if hi_scalar else np.any(arr > hi_c)):
                    return "out_of_bounds", (
                        f"tensor {name!r} holds values above its maximum {spec.maximum}; "
                        f"expected values in [{spec.minimum}, {spec.maximum}]."
                    )
                return None
            checks.append(above)
    return checks


def _compile_fast_check(spec: ArraySpec) -> Optional[Callable[[np.ndarray], bool]]:
    """A cheaper check that passes only arrays every check of :func:`_compile_checks` passes.

    For float arrays without per-element bounds: a min and a max replace the finite and
    bound checks (NaN propagates through both; infinities lie outside the finite range),
    without floating-point warnings. When it fails, the full checks run and name the
    problem. None where there is no such shortcut.
    """
    dtype = np.dtype(spec.dtype)
    if dtype.kind != "f" or spec.num_values is not None or spec.name == "step_type":
        return None
    lo, hi = spec.bounds()
    if math.prod(spec.shape) == 0:
        return None
    finite_max = float(np.finfo(dtype).max)
    lo_v, hi_v = -finite_max, finite_max
    for bound, is_lo in ((lo, True), (hi, False)):
        if bound is None:
            continue
        if bound.size and not np.all(bound == bound.flat[0]):
            return None  # per-element bounds: the full check
        value = float(bound.flat[0]) if bound.size else None
        if value is None:
            continue
        if is_lo:
            lo_v = max(lo_v, value)
        else:
            hi_v = min(hi_v, value)

    def within(arr):
        return lo_v <= arr.min() and arr.max() <= hi_v
    return within


class UnrollValidator:
    """Checks ``Unroll`` messages against the announced unroll spec.

    Args:
      unroll_spec: key -> :class:`ArraySpec` (``impala_rep.specs.unroll_spec``), whose
        leading dimension of per-step keys is T+1.
      unroll_length: T.
      max_message_bytes: the largest serialized ``Unroll`` accepted (announced in the
        handshake). Defaults to twice the spec's tensor bytes plus 64 KiB.
    """

    def __init__(
        self,
        unroll_spec: Mapping[str, ArraySpec],
        unroll_length: int,
        max_message_bytes: Optional[int] = None,
    ):
        if not unroll_spec:
            raise ValueError("the unroll spec is empty; build it with impala_rep.specs.unroll_spec.")
        self.unroll_spec: Dict[str, ArraySpec] = dict(unroll_spec)
        for key, spec in self.unroll_spec.items():
            if key != spec.name:
                raise ValueError(f"unroll spec key {key!r} holds a spec named {spec.name!r}; they must match.")
        self.unroll_length = int(unroll_length)
        if self.unroll_length < 1:
            raise ValueError(f"unroll_length must be at least 1, got {unroll_length}.")
        self.tensor_bytes = sum(s.nbytes for s in self.unroll_spec.values())
        if max_message_bytes is None:
            max_message_bytes = 2 * self.tensor_bytes + 64 * 1024
        self.max_message_bytes = int(max_message_bytes)
        if self.max_message_bytes < self.tensor_bytes:
            raise ValueError(
                f"max_message_bytes {self.max_message_bytes} is smaller than one unroll's tensors "
                f"({self.tensor_bytes} bytes); raise it."
            )
        self._shapes = {k: tuple(s.shape) for k, s in self.unroll_spec.items()}
        self._dtypes = {k: wire_dtype(s.dtype) for k, s in self.unroll_spec.items()}
        self._counts = {k: math.prod(s.shape) for k, s in self.unroll_spec.items()}
        self._checks = {k: _compile_checks(s) for k, s in self.unroll_spec.items()}
        # name -> (dtype name, shape, wire dtype, element count, byte size, quick check, checks)
        self._entries = {
            k: (s.dtype, self._shapes[k], self._dtypes[k], self._counts[k],
                self._counts[k] * self._dtypes[k].itemsize,
                _compile_fast_check(s) if self._checks[k] else None, tuple(self._checks[k]))
            for k, s in self.unroll_spec.items()
        }
        self._layout = canonical_layout((k, s.dtype, s.shape) for k, s in self.unroll_spec.items())

    def check_size(self, nbytes: int) -> None:
        """Raises :class:`UnrollRejected` ("oversized") above ``max_message_bytes``."""
        if nbytes > self.max_message_bytes:
            raise UnrollRejected(
                "oversized",
                f"the unroll message has {nbytes} bytes, more than the announced limit of "
                f"{self.max_message_bytes} bytes.",
            )

    def validate_bytes(self, raw: bytes, start: int = 0, stop: Optional[int] = None) -> ValidUnroll:
        """Validates serialized ``Unroll`` bytes (the server's path); raises :class:`UnrollRejected`.

        Reads the message with :func:`impala_rep.wire.parse_unroll`: no protobuf objects and
        no copies, the tensors of the result are read-only views on ``raw``. ``start`` and
        ``stop`` validate the ``Unroll`` in ``raw[start:stop]`` (one of an ``UnrollBatch``).
        """
        stop = len(raw) if stop is None else stop
        nbytes = stop - start
        self.check_size(nbytes)
        try:
            parsed = parse_unroll(raw, self._layout, start, stop)
        except WireError as e:
            raise UnrollRejected(
                "undecodable",
                f"the message is not a valid Unroll protobuf ({str(e).rstrip('.')}); "
                "send transport_pb2.Unroll bytes.",
            ) from None
        return self._validate(parsed, nbytes)

    def validate(self, msg, nbytes: int) -> ValidUnroll:
        """Returns the validated unroll or raises :class:`UnrollRejected`.

        ``msg`` is a parsed ``transport_pb2.Unroll`` (or a :class:`impala_rep.wire.ParsedUnroll`);
        ``nbytes`` its serialized size.
        """
        self.check_size(nbytes)
        if not isinstance(msg, ParsedUnroll):
            msg = ParsedUnroll(
                msg.actor_id,
                int(msg.policy_version),
                [ParsedTensor(t.name, t.dtype, tuple(t.shape), t.data) for t in msg.tensors],
                list(msg.episode_returns),
                list(msg.episode_lengths),
            )
        return self._validate(msg, nbytes)

    def _validate(self, msg: ParsedUnroll, nbytes: int) -> ValidUnroll:
        tensors: Dict[str, np.ndarray] = {}
        entries = self._entries
        for name, dtype_name, shape, data in msg.tensors:
            entry = entries.get(name)
            if entry is None:
                raise UnrollRejected(
                    "extra_tensor",
                    f"tensor {name!r} is not part of the announced unroll spec; expected only "
                    f"{sorted(self.unroll_spec)}.",
                )
            spec_dtype, spec_shape, dtype, count, size, quick, checks = entry
            if name in tensors:
                raise UnrollRejected("extra_tensor", f"tensor {name!r} appears twice; send each tensor once.")
            if dtype_name != spec_dtype:
                raise UnrollRejected(
                    "dtype", f"tensor {name!r} has dtype {dtype_name!r}; expected {spec_dtype}."
                )
            if shape != spec_shape:
                raise UnrollRejected(
                    "shape", f"tensor {name!r} has shape {list(shape)}; expected {list(spec_shape)}."
                )
            if len(data) != size:
                raise UnrollRejected(
                    "undecodable",
                    f"tensor {name!r} carries {len(data)} bytes, which cannot be a {spec_dtype} "
                    f"array of shape {list(spec_shape)}; expected {size} bytes.",
                )
            arr = np.frombuffer(data, dtype=dtype, count=count)
            if len(spec_shape) != 1:
                arr = arr.reshape(spec_shape)
            if not dtype.isnative:  # big-endian host
                arr = arr.astype(dtype.newbyteorder("="))
            if checks and (quick is None or not quick(arr)):
                for check in checks:
                    problem = check(arr)
                    if problem is not None:
                        raise UnrollRejected(*problem)
            tensors[name] = arr
        if len(tensors) != len(entries):
            missing = sorted(set(self.unroll_spec) - set(tensors))
            raise UnrollRejected(
                "missing_tensor", f"the unroll lacks tensor(s) {missing}; every key of the announced spec is required."
            )
        policy_version = int(msg.policy_version)
        if policy_version < 0:
            raise UnrollRejected("metadata", f"policy_version is {policy_version}; expected a version >= 0.")
        if msg.episode_returns or msg.episode_lengths:
            returns = np.array(msg.episode_returns, dtype=np.float64)
            lengths = np.array(msg.episode_lengths, dtype=np.int64)
        else:
            returns, lengths = _NO_RETURNS, _NO_LENGTHS
        if returns.shape != lengths.shape:
            raise UnrollRejected(
                "metadata",
                f"the unroll reports {returns.size} episode returns and {lengths.size} episode "
                "lengths; expected one length per return.",
            )
        if returns.size > self.unroll_length + 1:
            raise UnrollRejected(
                "metadata",
                f"the unroll reports {returns.size} finished episodes; at most "
                f"{self.unroll_length + 1} can finish in {self.unroll_length + 1} steps.",
            )
        if returns.size and (not np.isfinite(returns).all() or lengths.min() < 1):
            raise UnrollRejected(
                "metadata", "episode returns must be finite and episode lengths at least 1."
            )
        return ValidUnroll(
            tensors=tensors,
            policy_version=policy_version,
            actor_id=str(msg.actor_id)[:128],
            episode_returns=returns,
            episode_lengths=lengths,
            nbytes=int(nbytes),
        )
