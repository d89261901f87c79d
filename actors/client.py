"""The actor's gRPC client to the learner (TensorFlow-free).

:class:`LearnerClient` connects and handshakes (learning the unroll spec, unroll length,
frame stacking, limits, parameter version and the launcher's ``run_config``), streams
unrolls from a background sender thread, fetches newer parameters, and reconnects with
exponential backoff and jitter while the learner is away. The caller keeps its envs and
state: ``send`` only blocks (the outbox holds at most ``outbox_size`` encoded messages) until
the learner is back. ``send_many`` packs several unrolls into each message (``UnrollBatch``,
up to ``unrolls_per_message`` and the learner's ``max_batch_bytes``): gRPC spends less CPU
per byte on fewer, larger messages. The outbox holds one message by default, so that
unrolls do not go stale in it while the learner is the limit. On each new stream the client
hands gRPC one message until the learner confirms the stream (``STREAM_ACCEPTED``); a stream
refused for the learner's stream limit thus carries one message, which the next stream sends
again, and nothing is lost however often the refusal comes.

Errors the learner answers that retrying cannot fix are raised to the caller, on the next
``send``/``flush``/``get_parameters``: :class:`InvalidUnrollError` (``INVALID_ARGUMENT``, the
unroll was malformed: a bug in the actor, never retried), :class:`AuthenticationError`
(``UNAUTHENTICATED``: wrong or missing token) and :class:`LearnerUnavailableError` (the
learner stayed away longer than ``give_up_after_s``).

Usage::

    with LearnerClient("127.0.0.1:50051", token=secret, actor_id="actor-0") as client:
        hs = client.connect()                      # Handshake: hs.unroll_spec, hs.run_config, ...
        version, params = client.get_parameters() or (0, {})
        while True:
            ...step envs, cut an unroll {key: array} matching hs.unroll_spec...
            client.send(unroll, policy_version=version, episode_returns=[...], episode_lengths=[...])
            # or, for the unrolls of several envs cut at once:
            client.send_many([(unroll, version, returns, lengths), ...])
            fresh = client.get_parameters()          # None when the actor is up to date
            if fresh is not None:
                version, params = fresh
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import queue
import random
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, TypeVar, Union

import grpc
import numpy as np

from impala_rep.config import DEFAULT_UNROLLS_PER_MESSAGE
from impala_rep.proto import transport_pb2
from impala_rep.specs import ArraySpec
from impala_rep.wire import (
    PROTOCOL_VERSION, STREAM_ACCEPTED, UnrollParts, decode_tensors, encode_unroll_batch, encode_unroll_parts,
    spec_from_proto,
)

__all__ = [
    "TOKEN_METADATA_KEY",
    "Handshake",
    "LearnerClient",
    "TransportError",
    "InvalidUnrollError",
    "AuthenticationError",
    "LearnerUnavailableError",
]

TOKEN_METADATA_KEY = "x-impala-token"
_SERVICE = "/impala_rep.transport.Learner/"
_STREAM_LIMIT = "unroll streams at once"  # in the learner's refusal (learner/server.py)
_RETRYABLE = frozenset(
    (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
     grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED, grpc.StatusCode.UNKNOWN)
)
_log = logging.getLogger(__name__)
R = TypeVar("R")
# One unroll for send_many: (tensors, policy_version, episode_returns, episode_lengths).
UnrollItem = Tuple[Mapping[str, np.ndarray], int, Sequence[float], Sequence[int]]


class _Message(NamedTuple):
    """An encoded message in the outbox: an ``Unroll`` or (batch) an ``UnrollBatch``."""

    payload: bytes
    unrolls: int
    batch: bool


class _OpenedCall:
    """A stream's call, handed to its request generator once ``future()`` returns it."""

    def __init__(self) -> None:
        self.call: Optional[grpc.Future] = None
        self.ready = threading.Event()


class TransportError(RuntimeError):
    """The learner answered something the client cannot recover from."""


class LearnerFinishedError(TransportError):
    """The learner's run is over (it answers OUT_OF_RANGE): stop, there is nothing to retry."""


class InvalidUnrollError(TransportError, ValueError):
    """The learner rejected an unroll as malformed (INVALID_ARGUMENT); it is not resent."""


class AuthenticationError(TransportError, PermissionError):
    """The learner refused the token (UNAUTHENTICATED), or TLS with it failed (a certificate
    that does not verify or does not name the learner's address): retrying cannot help."""


# What gRPC's UNAVAILABLE carries when the TLS handshake itself failed (measured with grpcio
# 1.85: a self-signed certificate that is not the one trusted, one without the address in its
# subjectAltName), as opposed to a learner that is away.
# Only certificate checks: a handshake cut short by a reset connection stays retryable.
_TLS_FAILURES = ("Hostname Verification Check failed", "CERTIFICATE_VERIFY_FAILED")


# What a TLS client sees from a learner that serves plaintext (grpcio 1.85).
_PLAINTEXT_PEER = "WRONG_VERSION_NUMBER"

# How to fix a refused token, in the words of `python -m actors.run` (which reads the token
# from --token, else $IMPALA_REP_TOKEN) and of this API.
_TOKEN_ADVICE = (
    "set IMPALA_REP_TOKEN (or pass --token) to the learner's shared token, the --token or IMPALA_REP_TOKEN "
    "it was started with (LearnerClient(token=...) in code)."
)


def _token_problem(details: str) -> str:
    """The learner's UNAUTHENTICATED details without its own advice (which names only the API):
    "the call carries a wrong token"."""
    head = details.split(";", 1)[0] if details.startswith("the call carries") else details
    return head.strip().rstrip(".") or "the call carries no valid token"


class LearnerUnavailableError(TransportError, ConnectionError):
    """The learner could not be reached within ``give_up_after_s`` seconds."""


@dataclasses.dataclass(frozen=True)
class Handshake:
    """What the learner announced."""

    server_id: str
    protocol_version: int
    unroll_spec: Dict[str, ArraySpec]
    unroll_length: int
    frame_stack: Dict[str, int]
    parameter_version: int
    max_message_bytes: int
    run_config: str
    max_batch_bytes: int = 0  # 0: the learner takes one unroll per message only

    def run_config_dict(self) -> Dict[str, Any]:
        """``run_config`` parsed from JSON."""
        return json.loads(self.run_config) if self.run_config else {}


def _read_pem(value: Union[None, bytes, str]) -> Optional[bytes]:
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


class LearnerClient:
    """Client of ``impala_rep.transport.Learner`` (see module docstring).

    Args:
      address: ``host:port`` of the learner.
      token: the learner's shared token, sent as metadata ``x-impala-token``.
      root_certificates: PEM bytes, or a path to a PEM file, of the certificate(s) to trust;
        given, the channel uses TLS.
      actor_id: a name for this actor in the learner's metrics.
      outbox_size: encoded messages waiting for the sender thread (bound; ``send`` blocks when full).
        Default 1: an unroll waiting here is acted on by an older policy the longer it waits,
        and when the learner is the limit every message an actor process holds back adds
        to the policy lag (a lent H200 learner, 16 actor processes: 62-228 versions with
        4); one is enough to keep the sender busy while the caller acts.
      unrolls_per_message: the most unrolls ``send_many`` packs into one message (1: one
        unroll per message, as ``send``; learners that take no batches get one per message).
      validate: check keys, dtypes, shapes and size against the handshake before sending
        (the learner validates everything anyway; this fails early, with a ``ValueError``).
      backoff_initial_s, backoff_max_s: exponential backoff with jitter between reconnects.
      give_up_after_s: raise :class:`LearnerUnavailableError` after this long without the
        learner (``None``: retry forever).
      ssl_target_name: the name the server certificate is checked against, when it differs
        from the host in ``address``.
    """

    def __init__(
        self,
        address: str,
        token: Optional[str] = None,
        root_certificates: Union[None, bytes, str] = None,
        *,
        actor_id: str = "actor",
        outbox_size: int = 1,
        unrolls_per_message: int = DEFAULT_UNROLLS_PER_MESSAGE,
        validate: bool = True,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 10.0,
        give_up_after_s: Optional[float] = 300.0,
        ssl_target_name: Optional[str] = None,
        call_timeout_s: float = 30.0,
    ):
        if int(outbox_size) < 1:
            raise ValueError(f"outbox_size must be at least 1, got {outbox_size}.")
        if int(unrolls_per_message) < 1:
            raise ValueError(f"unrolls_per_message must be at least 1, got {unrolls_per_message}.")
        self.unrolls_per_message = int(unrolls_per_message)
        if backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise ValueError("backoff needs 0 < backoff_initial_s <= backoff_max_s.")
        self.address = address
        self.actor_id = str(actor_id)
        self._metadata = ((TOKEN_METADATA_KEY, token),) if token is not None else ()
        self._validate = bool(validate)
        self._backoff = (float(backoff_initial_s), float(backoff_max_s))
        self._give_up = give_up_after_s
        self._call_timeout = float(call_timeout_s)
        options = [
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", -1),
            ("grpc.initial_reconnect_backoff_ms", int(backoff_initial_s * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(backoff_initial_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(backoff_max_s * 1000)),
        ]
        certs = _read_pem(root_certificates)
        self._tls = certs is not None
        if certs is not None:
            if ssl_target_name:
                options.append(("grpc.ssl_target_name_override", ssl_target_name))
            self._channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=certs), options)
        else:
            self._channel = grpc.insecure_channel(address, options)
        self._handshake_call = self._channel.unary_unary(
            _SERVICE + "Handshake",
            request_serializer=transport_pb2.HandshakeRequest.SerializeToString,
            response_deserializer=transport_pb2.HandshakeResponse.FromString,
        )
        self._params_call = self._channel.unary_unary(
            _SERVICE + "GetParameters",
            request_serializer=transport_pb2.GetParametersRequest.SerializeToString,
            response_deserializer=transport_pb2.GetParametersResponse.FromString,
        )
        self._stream_calls = {
            batch: self._channel.stream_unary(
                _SERVICE + ("StreamUnrollBatches" if batch else "StreamUnrolls"),
                request_serializer=lambda b: b,  # serialized by send() and send_many()
                response_deserializer=transport_pb2.StreamSummary.FromString,
            )
            for batch in (False, True)
        }
        self._outbox: "queue.Queue[_Message]" = queue.Queue(maxsize=int(outbox_size))
        # Taken from the outbox but not handed to gRPC, or handed to a stream the learner
        # refused before reading it (stream limit): sent first on the next stream.
        self._pending: collections.deque = collections.deque()
        # Handed to the current stream before the learner confirmed it (STREAM_ACCEPTED): at
        # most its first message, since _requests holds back the rest until then.
        self._yielded: collections.deque = collections.deque()
        self._handshake: Optional[Handshake] = None
        self._have_version = 0
        self._prefetched: Optional[grpc.Future] = None  # prefetch_parameters' call in flight
        self._fatal: Optional[BaseException] = None
        self._closing = threading.Event()
        self._sender: Optional[threading.Thread] = None
        self._call: Optional[grpc.Future] = None
        self._discard = False  # close(drain=False): drop what is queued
        self._lock = threading.Lock()
        self.unrolls_sent = 0  # handed to gRPC
        self.messages_sent = 0
        self.reconnects = 0

    # ------------------------------------------------------------------ public API

    @property
    def handshake_info(self) -> Optional[Handshake]:
        return self._handshake

    def connect(self) -> Handshake:
        """Handshakes (retrying while the learner is away) and starts the sender thread."""
        self._raise_fatal()
        hs = self._do_handshake()
        with self._lock:
            if self._sender is None:
                self._sender = threading.Thread(target=self._sender_main, name=f"{self.actor_id}-sender", daemon=True)
                self._sender.start()
        return hs

    def send(
        self,
        unroll: Mapping[str, np.ndarray],
        policy_version: int,
        episode_returns: Sequence[float] = (),
        episode_lengths: Sequence[int] = (),
        timeout: Optional[float] = None,
    ) -> None:
        """Encodes one unroll and queues it for the sender thread.

        Blocks while the outbox is full (the learner is slow or away); raises ``TimeoutError``
        after ``timeout`` seconds, ``ValueError`` for an unroll that does not match the
        handshake (with ``validate``), and the sender's fatal error if there was one.
        """
        self._raise_fatal()
        if self._sender is None:
            self.connect()
        payload = self.encode_unroll(unroll, policy_version, episode_returns, episode_lengths)
        self._put(_Message(payload, 1, False), None if timeout is None else time.monotonic() + timeout, timeout)

    def send_many(self, unrolls: Sequence[UnrollItem], timeout: Optional[float] = None) -> None:
        """Queues several unrolls, packed into as few messages as the limits allow, in order.

        Each item is ``(tensors, policy_version, episode_returns, episode_lengths)``. A message
        holds at most ``unrolls_per_message`` unrolls and the learner's ``max_batch_bytes``;
        against a learner that takes no batches, or with ``unrolls_per_message=1``, each
        unroll goes as ``send`` sends it. Errors and blocking as ``send``; an unroll that
        fails validation raises before any of them is queued.
        """
        self._raise_fatal()
        if self._sender is None:
            self.connect()
        hs = self._handshake
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.unrolls_per_message == 1 or not hs.max_batch_bytes:
            payloads = [self.encode_unroll(*item) for item in unrolls]
            for payload in payloads:
                self._put(_Message(payload, 1, False), deadline, timeout)
            return
        groups: List[list] = []
        size = 0
        for item in unrolls:
            parts = self._encode_parts(*item)
            need = parts.nbytes + 11  # the field's tag and length: at most 11 bytes
            if not groups or len(groups[-1]) >= self.unrolls_per_message or size + need > hs.max_batch_bytes:
                groups.append([])
                size = 0
            groups[-1].append(parts)
            size += need
        for group in groups:
            self._put(_Message(encode_unroll_batch(group), len(group), True), deadline, timeout)

    def _put(self, message: _Message, deadline: Optional[float], timeout: Optional[float]) -> None:
        while True:
            try:
                self._outbox.put(message, timeout=0.1)
                return
            except queue.Full:
                self._raise_fatal()
                if self._closing.is_set():
                    raise TransportError("the client is closed; create a new LearnerClient.") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the outbox stayed full for {timeout} s; the learner is not taking unrolls."
                    ) from None

    def encode_unroll(
        self,
        unroll: Mapping[str, np.ndarray],
        policy_version: int,
        episode_returns: Sequence[float] = (),
        episode_lengths: Sequence[int] = (),
    ) -> bytes:
        """The serialized ``Unroll`` message ``send`` would queue."""
        return b"".join(self._encode_parts(unroll, policy_version, episode_returns, episode_lengths).parts)

    def _encode_parts(
        self,
        unroll: Mapping[str, np.ndarray],
        policy_version: int,
        episode_returns: Sequence[float] = (),
        episode_lengths: Sequence[int] = (),
    ) -> UnrollParts:
        """The unroll's ``Unroll`` pieces, checked against the handshake when ``validate``."""
        if self._validate:
            hs = self._handshake or self._do_handshake()
            self._check_unroll(hs, unroll)
        parts = encode_unroll_parts(self.actor_id, policy_version, unroll, episode_returns, episode_lengths)
        if self._validate and parts.nbytes > self._handshake.max_message_bytes:
            raise ValueError(
                f"the unroll encodes to {parts.nbytes} bytes, more than the learner's limit of "
                f"{self._handshake.max_message_bytes} bytes."
            )
        return parts

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Waits until every queued unroll has been handed to gRPC; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._outbox.qsize() or self._pending:
            self._raise_fatal()
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        self._raise_fatal()
        return True

    def prefetch_parameters(self) -> None:
        """Asks the learner for newer parameters without waiting for the answer.

        The next :meth:`get_parameters` takes this answer (waiting only for what is left of
        it) instead of asking then: an actor that prefetches a few steps before its unroll
        boundary does not sit idle at the boundary while a reply of megabytes is produced and
        sent. The answer is the newest version when the request was made. A prefetch that
        fails is asked again, with the usual retries, by :meth:`get_parameters`. A second
        prefetch before that call does nothing.
        """
        self._raise_fatal()
        if self._prefetched is not None:
            return
        request = transport_pb2.GetParametersRequest(have_version=self._have_version)
        self._prefetched = self._params_call.future(request, metadata=self._metadata, timeout=self._call_timeout)

    def get_parameters(self) -> Optional[Tuple[int, Dict[str, np.ndarray]]]:
        """(version, {name: array}) when the learner has newer parameters, else None.

        Takes the answer of a :meth:`prefetch_parameters` made since the last call, if any;
        otherwise asks now. Retries with backoff while the learner is away.
        """
        self._raise_fatal()
        reply = self._take_prefetched()
        if reply is None:
            request = transport_pb2.GetParametersRequest(have_version=self._have_version)
            reply = self._retry(lambda: self._params_call(request, metadata=self._metadata, timeout=self._call_timeout))
        if reply.up_to_date or not reply.tensors:
            return None
        params = decode_tensors(reply.tensors)
        self._have_version = int(reply.version)
        return self._have_version, params

    def _take_prefetched(self) -> Optional[Any]:
        """The prefetched reply, or None when there was no prefetch or it failed retryably."""
        pending, self._prefetched = self._prefetched, None
        if pending is None:
            return None
        try:
            return pending.result()
        except grpc.FutureCancelledError:
            raise TransportError("the parameter fetch was cancelled: this client is closing.") from None
        except grpc.RpcError as e:
            fatal = self._classify(e)
            if fatal is not None:
                raise fatal from None
            return None  # asked again, with retries, by the caller

    def interrupt(self) -> None:
        """Ends every wait for the learner now: a call retrying with backoff (the handshake,
        a parameter fetch) raises :class:`TransportError` instead of waiting up to
        ``give_up_after_s``. For a stop requested while the learner is away; close() still
        has to be called. Call it from a thread, not from inside a signal handler (it takes
        the lock of an Event the main thread may be waiting on)."""
        self._closing.set()

    def close(self, drain: bool = True, timeout: float = 10.0) -> None:
        """Ends the stream (after sending what is queued when ``drain``) and the channel."""
        if drain and self._sender is not None and self._fatal is None:
            self.flush(timeout)
        self._closing.set()
        if self._prefetched is not None:
            self._prefetched.cancel()
            self._prefetched = None
        if not drain:
            self._discard = True
        if self._sender is not None:
            self._sender.join(timeout if drain else 0.2)
            call = self._call
            if self._sender.is_alive() and call is not None:
                call.cancel()  # the learner is not reading (queue full or away): stop waiting
                self._sender.join(timeout)
        self._channel.close()

    def __enter__(self) -> "LearnerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close(drain=exc[0] is None)

    # ------------------------------------------------------------------ internals

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    def _check_unroll(self, hs: Handshake, unroll: Mapping[str, np.ndarray]) -> None:
        missing = sorted(set(hs.unroll_spec) - set(unroll))
        extra = sorted(set(unroll) - set(hs.unroll_spec))
        if missing or extra:
            raise ValueError(f"the unroll does not match the learner's spec: missing {missing}, unexpected {extra}.")
        for name, spec in hs.unroll_spec.items():
            arr = unroll[name]
            dtype = getattr(arr, "dtype", None)
            if dtype is None or np.dtype(dtype).name != spec.dtype:
                raise ValueError(f"tensor {name!r} has dtype {getattr(dtype, 'name', type(arr).__name__)}; expected {spec.dtype}.")
            if tuple(np.shape(arr)) != spec.shape:
                raise ValueError(f"tensor {name!r} has shape {list(np.shape(arr))}; expected {list(spec.shape)}.")

    def _sleep_backoff(self, attempt: int, since: float, what: str, error: grpc.RpcError) -> None:
        self._raise_fatal()  # the sender thread may have learnt the run is over (or worse) meanwhile
        if self._give_up is not None and time.monotonic() - since > self._give_up:
            details = error.details() or ""
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # it answers, but refuses this client
                raise LearnerUnavailableError(
                    f"the learner at {self.address} has refused this client for {self._give_up:.0f} s "
                    f"({what}: RESOURCE_EXHAUSTED: {details.rstrip('.')})."
                )
            raise LearnerUnavailableError(
                f"the learner at {self.address} has been unreachable for {self._give_up:.0f} s "
                f"({what}: {error.code().name}: {details}); is it running?{self._tls_hint(details)}"
            )
        initial, maximum = self._backoff
        delay = min(maximum, initial * (2 ** min(attempt, 30)))
        delay = delay / 2 + random.uniform(0, delay / 2)  # jitter
        if self._closing.wait(delay):
            raise TransportError("the client was closed while waiting for the learner.")
        self._raise_fatal()

    def _classify(self, e: grpc.RpcError) -> Optional[BaseException]:
        code = e.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidUnrollError(f"the learner rejected an unroll: {e.details()}")
        details = e.details() or ""
        if code == grpc.StatusCode.OUT_OF_RANGE:  # the learner's finish(): the run is over
            return LearnerFinishedError(f"the learner at {self.address} says: {details}")
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return AuthenticationError(f"the learner refused this client: {_token_problem(details)}; {_TOKEN_ADVICE}")
        if code == grpc.StatusCode.UNAVAILABLE and any(marker in details for marker in _TLS_FAILURES):
            return AuthenticationError(
                f"TLS with the learner at {self.address} failed: {details.rstrip('.')}. "
                "The certificate trusted with --tls-ca must be the learner's, and name the address the actors "
                "use (or the ssl_target_name given to the client) in its subjectAltName (README, Transport and "
                "security, gives an openssl command for 127.0.0.1 and localhost)."
            )
        if code in _RETRYABLE:
            return None
        return TransportError(f"the learner answered {code.name}: {e.details()}")

    def _tls_hint(self, details: str) -> str:
        """What to check about TLS when the learner stayed unreachable ("" when nothing points there).

        A plaintext client against a TLS learner only sees the connection closed ("Socket
        closed"), as from a learner that is away, so the hint is given whenever the client
        connects without TLS."""
        if not self._tls:
            return (" If it serves TLS, pass its certificate with --tls-ca "
                    "(LearnerClient(root_certificates=...) in code).")
        if _PLAINTEXT_PEER in details:
            return (" The learner answers without TLS: start it with --tls-cert and --tls-key, "
                    "or run the actors without --tls-ca.")
        return ""

    def _retry(self, fn: Callable[[], R], what: str = "call") -> R:
        attempt, since = 0, time.monotonic()
        while True:
            try:
                return fn()
            except grpc.RpcError as e:
                fatal = self._classify(e)
                if fatal is not None:
                    raise fatal from None
                self._sleep_backoff(attempt, since, what, e)
                attempt += 1

    def _do_handshake(self) -> Handshake:
        request = transport_pb2.HandshakeRequest(actor_id=self.actor_id)
        reply = self._retry(
            lambda: self._handshake_call(request, metadata=self._metadata, timeout=self._call_timeout), "handshake"
        )
        if int(reply.protocol_version) != PROTOCOL_VERSION:
            raise TransportError(
                f"the learner at {self.address} speaks transport protocol {int(reply.protocol_version)} and this "
                f"actor speaks {PROTOCOL_VERSION}; run the same impala_rep version on the learner and the actors."
            )
        hs = Handshake(
            server_id=reply.server_id,
            protocol_version=int(reply.protocol_version),
            unroll_spec={s.name: spec_from_proto(s) for s in reply.unroll_spec},
            unroll_length=int(reply.unroll_length),
            frame_stack={str(k): int(v) for k, v in reply.frame_stack.items()},
            parameter_version=int(reply.parameter_version),
            max_message_bytes=int(reply.max_message_bytes),
            run_config=reply.run_config,
            max_batch_bytes=int(reply.max_batch_bytes),
        )
        old = self._handshake
        if old is not None and (old.unroll_spec != hs.unroll_spec or old.unroll_length != hs.unroll_length
                                or old.frame_stack != hs.frame_stack):
            raise TransportError(
                "the learner came back with a different unroll spec; restart this actor so it "
                "builds its envs and network from the new handshake."
            )
        if old is not None and old.server_id != hs.server_id:
            _log.info("the learner at %s restarted (new server id); resuming.", self.address)
            if hs.parameter_version < self._have_version:
                self._have_version = 0  # a restarted learner may count versions from scratch
        self._handshake = hs
        return hs

    def _next_message(self, done: Optional[threading.Event] = None) -> bool:
        """Makes sure ``_pending`` holds the next message; False once there is none to wait for."""
        while not self._pending:
            if self._discard:
                return False
            try:
                self._pending.append(self._outbox.get(timeout=0.05))
            except queue.Empty:
                if self._closing.is_set() or (done is not None and done.is_set()):
                    return False
        return not self._discard

    def _requests(self, done: threading.Event, batch: bool, opened: "_OpenedCall"):
        """Yields queued messages of one kind into the current stream until it ends, the next
        message is of the other kind (the stream ends; the next one carries it), or the client
        closes. After the first message it waits for the learner to confirm the stream
        (STREAM_ACCEPTED in its initial metadata): gRPC may pull several messages before a
        refusal arrives, and the learner reads none of a refused stream's messages, so only what
        was yielded before the confirmation needs sending again."""
        accepted = False
        while self._next_message(done):
            if done.is_set() or self._pending[0].batch != batch:
                return  # keep _pending for the next stream
            item = self._pending.popleft()
            if not accepted:
                self._yielded.append(item)
            self.unrolls_sent += item.unrolls
            self.messages_sent += 1
            yield item.payload
            if not accepted:
                if not self._stream_accepted(opened, done):
                    return  # refused or ended: the call's status says which (_sender_loop)
                accepted = True
                self._yielded.clear()

    def _stream_accepted(self, opened: "_OpenedCall", done: threading.Event) -> bool:
        """Whether the learner confirmed the stream; waits for its initial metadata, which a
        refusal or a cancelled call also ends (without STREAM_ACCEPTED)."""
        while not opened.ready.wait(0.05):  # gRPC may pull the first message before future() returns
            if done.is_set() or self._closing.is_set():
                return False
        return STREAM_ACCEPTED in tuple(opened.call.initial_metadata() or ())  # gRPC's items are named tuples

    def _sender_main(self) -> None:
        """The sender thread: whatever ends it unexpectedly (even from inside its own error
        handling) is recorded, so that send() and flush() raise it instead of waiting forever
        on a thread that is gone."""
        try:
            self._sender_loop()
        except BaseException as err:  # noqa: BLE001 - surfaced to the caller
            if self._fatal is None:
                self._fatal = TransportError(f"the sender thread failed: {err!r}")

    def _sender_loop(self) -> None:
        attempt, since = 0, time.monotonic()
        need_handshake = False
        while not self._closing.is_set():
            done = threading.Event()
            sent_before = self.unrolls_sent
            self._yielded.clear()
            try:
                if need_handshake:
                    self._do_handshake()
                    need_handshake = False
                if not self._next_message():
                    return  # closing with nothing left to send
                batch = self._pending[0].batch
                opened = _OpenedCall()
                call = self._stream_calls[batch].future(self._requests(done, batch, opened), metadata=self._metadata)
                opened.call = call
                opened.ready.set()
                self._call = call
                call.add_done_callback(lambda _: done.set())
                call.result()
                attempt, since = 0, time.monotonic()
            except grpc.RpcError as e:
                done.set()
                fatal = self._classify(e)
                if fatal is not None:
                    self._fatal = fatal
                    return
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and _STREAM_LIMIT in (e.details() or ""):
                    # Refused before the learner read anything: resend what this stream took.
                    self._pending.extendleft(reversed(self._yielded))
                    self.unrolls_sent -= sum(item.unrolls for item in self._yielded)
                    self.messages_sent -= len(self._yielded)
                elif self.unrolls_sent > sent_before:
                    attempt, since = 0, time.monotonic()
                if self._closing.is_set():
                    return
                self.reconnects += 1
                need_handshake = True
                if e.code() == grpc.StatusCode.CANCELLED and attempt == 0:
                    # The learner cut this stream (its stop, after the drain): its server waits
                    # only briefly (RUN_OVER_RECONNECT_S) to tell cut peers that the run is over,
                    # so the first handshake goes at once, whatever the backoff. It retries with
                    # backoff itself if the learner is away, and a learner that keeps cancelling
                    # before reading anything meets the backoff from the second attempt on.
                    attempt += 1
                    continue
                try:
                    self._sleep_backoff(attempt, since, "unroll stream", e)
                except TransportError as err:
                    if not self._closing.is_set():
                        self._fatal = err
                    return
                attempt += 1
            except TransportError as err:  # handshake found a fatal problem
                self._fatal = err
                return
            except grpc.FutureCancelledError:
                if self._closing.is_set():  # close() cancelled a stream the learner did not read
                    return
                self._fatal = TransportError("the unroll stream was cancelled; reconnect with a new client.")
                return
            except Exception as err:  # noqa: BLE001 - surface anything unexpected to the caller
                self._fatal = TransportError(f"the sender thread failed: {err!r}")
                return
