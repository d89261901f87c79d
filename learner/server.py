"""The learner's gRPC service: handshake, validated unroll streams, parameters (TensorFlow-free).

Service ``impala_rep.transport.Learner`` (``impala_rep/proto/transport.proto``):

* ``Handshake``: the unroll spec, unroll length, frame stacking, ``max_message_bytes``, the
  current parameter version and the launcher's ``run_config`` JSON.
* ``StreamUnrolls`` (client stream): every unroll is validated (:mod:`learner.validation`)
  before it enters the bounded :class:`learner.queue.UnrollQueue`; an invalid one ends that
  call with ``INVALID_ARGUMENT`` and a sentence, is counted per reason, and touches nothing
  else. A full queue blocks the handler, which stops reading the stream: gRPC flow control
  then slows that actor.
* ``StreamUnrollBatches``: the same with several unrolls per message (``UnrollBatch``, at
  most ``max_batch_bytes``, announced in the handshake; 0 turns it off). A batch's unrolls
  are all validated before any is queued. gRPC costs less CPU per byte on fewer, larger
  messages (``docs/BENCHMARKS.md``, twenty-fifth session), so actors send these by default.
* ``GetParameters``: the newest parameters from :class:`learner.params.ParameterStore`
  (serialised once per version), or only the version when the caller has it or, with
  ``refresh_lag`` K above 1, is fewer than K versions behind it.

Security: binds ``127.0.0.1`` unless another host is asked for; an optional shared token
is required in the metadata ``x-impala-token`` of every call (missing or wrong:
``UNAUTHENTICATED``); optional TLS from PEM certificate and key files.

Usage (inside the learner process)::

    spec = unroll_spec(env_spec, T, frame_stack={"pixels": 3}, policy_action=policy.action_spec)
    q, store = UnrollQueue(capacity=64), ParameterStore()
    store.publish(net.get_params())
    server = LearnerServer(spec, T, q, store, frame_stack={"pixels": 3}, run_config=cfg_json)
    server.start()                                   # server.address -> "127.0.0.1:PORT"
    batcher = Batcher(q, spec, batch_size=32, frame_stack={"pixels": 3})
    while training:
        batch = batcher.next_batch(timeout=600)
        learner.train(batch.tensors); store.publish(net.get_params())
    server.stop()
"""

from __future__ import annotations

import collections
import concurrent.futures
import hmac
import json
import logging
import threading
import time
import uuid
from typing import Any, Dict, Mapping, Optional, Sequence, Set, Tuple, Union

import grpc

from impala_rep.config import MAX_PARAM_REFRESH_LAG
from impala_rep.proto import transport_pb2
from impala_rep.specs import ArraySpec
from impala_rep.wire import PROTOCOL_VERSION, STREAM_ACCEPTED, WireError, spec_to_proto, split_unroll_batch
from learner.params import ParameterStore
from learner.queue import QueueClosed, UnrollQueue
from learner.validation import REJECT_REASONS, UnrollRejected, UnrollValidator

__all__ = [
    "PROTOCOL_VERSION",
    "SERVICE_NAME",
    "TOKEN_METADATA_KEY",
    "LearnerServer",
    "TransportMetrics",
    "connect_address",
]

SERVICE_NAME = "impala_rep.transport.Learner"
TOKEN_METADATA_KEY = "x-impala-token"
# What every call gets once the run is over (finish()), with grpc.StatusCode.OUT_OF_RANGE: the
# actors' client (actors/client.py) stops on it instead of retrying.
RUN_OVER = "the learner's run is over; it takes no more unrolls."

# stop() cancels the unroll streams still open after its drain (an actor between two slow
# messages, or one that stopped sending): their actors' clients reconnect at once (the first
# backoff is 0.05-0.1 s) and hear RUN_OVER from the handshake, which they raise at their next
# send however long after. The most that stop() keeps serving for those reconnects.
RUN_OVER_RECONNECT_S = 2.0
_LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
_log = logging.getLogger(__name__)


class TransportMetrics:
    """Thread-safe counters of the service; :meth:`snapshot` returns a flat dict."""

    def __init__(self, unroll_length: int, rate_window_s: float = 10.0):
        self._lock = threading.Lock()
        self._unroll_length = int(unroll_length)
        self._window = float(rate_window_s)
        self._recent: collections.deque = collections.deque()  # (time, frames, bytes)
        self.unrolls_accepted = 0
        self.messages_accepted = 0  # Unroll or UnrollBatch messages whose unrolls were all queued
        self.frames_accepted = 0
        self.bytes_accepted = 0
        self.rejected: Dict[str, int] = {r: 0 for r in REJECT_REASONS + ("unauthenticated",)}
        self.streams_opened = 0
        self.streams_refused = 0
        self.parameter_requests = 0
        self.parameters_sent = 0

    def accept(self, nbytes: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.unrolls_accepted += 1
            self.frames_accepted += self._unroll_length
            self.bytes_accepted += nbytes
            self._recent.append((now, self._unroll_length, nbytes))
            while self._recent and self._recent[0][0] < now - self._window:
                self._recent.popleft()

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> Dict[str, float]:
        """Counters plus frames/s and MB/s over the last ``rate_window_s`` seconds.

        A frame is one env step: each accepted unroll adds T frames (its T+1 steps overlap
        the next unroll by one).
        """
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self._window:
                self._recent.popleft()
            span = (now - self._recent[0][0]) if len(self._recent) > 1 else 0.0
            frames = sum(f for _, f, _ in self._recent)
            nbytes = sum(b for _, _, b in self._recent)
            out: Dict[str, float] = {
                "unrolls_accepted": self.unrolls_accepted,
                "messages_accepted": self.messages_accepted,
                "frames_accepted": self.frames_accepted,
                "bytes_accepted": self.bytes_accepted,
                "unrolls_rejected": sum(self.rejected.values()),
                "streams_opened": self.streams_opened,
                "streams_refused": self.streams_refused,
                "parameter_requests": self.parameter_requests,
                "parameters_sent": self.parameters_sent,
                "frames_per_second": frames / span if span > 0 else 0.0,
                "megabytes_per_second": nbytes / span / 1e6 if span > 0 else 0.0,
            }
            for reason, n in self.rejected.items():
                out[f"rejected/{reason}"] = n
        return out


def connect_address(host: str, port: int) -> str:
    """``HOST:PORT`` for a client of a server bound to ``host`` (a wildcard: this machine's loopback)."""
    host = host if host not in ("0.0.0.0", "::", "[::]") else "127.0.0.1"
    return f"{host}:{port}"


def _identity(x):
    return x


class LearnerServer:
    """gRPC server for actors (see module docstring).

    Args:
      unroll_spec: key -> ArraySpec from ``impala_rep.specs.unroll_spec``.
      unroll_length: T.
      unroll_queue: where validated unrolls go (its capacity is the queue bound).
      params: the parameter store served by ``GetParameters``.
      frame_stack: observation key -> K, announced to actors (must match the spec).
      run_config: a JSON string (or a JSON-serialisable mapping) handed to actors verbatim.
      host: interface to bind; ``127.0.0.1`` by default. Anything else is only used when
        asked for explicitly (e.g. ``0.0.0.0`` for remote actors; use a token and TLS then).
      port: 0 picks a free port (read :attr:`port` after :meth:`start`).
      token: shared secret every call must carry in metadata ``x-impala-token``.
      tls_cert_file, tls_key_file: PEM files; both or neither. With them the port speaks TLS.
      max_message_bytes: largest accepted ``Unroll`` (default: 2x the spec's bytes + 64 KiB).
        gRPC itself refuses messages above ``max_receive_bytes`` (twice the larger of this and
        ``max_batch_bytes``: RESOURCE_EXHAUSTED) before they are read into memory; between the
        limits the validator answers INVALID_ARGUMENT.
      max_batch_bytes: largest accepted ``UnrollBatch`` (default 8x ``max_message_bytes``; each
        of its unrolls is also held to ``max_message_bytes``); 0 serves no
        ``StreamUnrollBatches``, and actors then send one unroll per message.
      max_streams: concurrent unroll streams served; more are refused with RESOURCE_EXHAUSTED
        (clients back off and retry). The thread pool has ``max_streams + 8`` threads so
        handshakes and parameter fetches are never starved by streams.
      grpc_options: extra gRPC server options (appended, so they override the defaults).
      refresh_lag: versions a caller of ``GetParameters`` may fall behind before it is sent
        new parameters (1: every new version; a caller holding none always gets them).
    """

    def __init__(
        self,
        unroll_spec: Mapping[str, ArraySpec],
        unroll_length: int,
        unroll_queue: UnrollQueue,
        params: ParameterStore,
        *,
        frame_stack: Optional[Mapping[str, int]] = None,
        run_config: Union[str, Mapping[str, Any]] = "{}",
        host: str = "127.0.0.1",
        port: int = 0,
        token: Optional[str] = None,
        tls_cert_file: Optional[str] = None,
        tls_key_file: Optional[str] = None,
        max_message_bytes: Optional[int] = None,
        max_batch_bytes: Optional[int] = None,
        max_streams: int = 64,
        grpc_options: Sequence[Tuple[str, Any]] = (),
        refresh_lag: int = 1,
    ):
        self.validator = UnrollValidator(unroll_spec, unroll_length, max_message_bytes)
        one = self.validator.max_message_bytes
        self.max_batch_bytes = 8 * one if max_batch_bytes is None else int(max_batch_bytes)
        if self.max_batch_bytes and self.max_batch_bytes < one + 16:
            raise ValueError(
                f"max_batch_bytes {self.max_batch_bytes} cannot hold one unroll of up to {one} bytes; "
                f"use at least {one + 16}, or 0 to serve no unroll batches."
            )
        # gRPC refuses larger messages (RESOURCE_EXHAUSTED) before reading them; up to this
        # size the validator answers with a sentence (INVALID_ARGUMENT).
        self.max_receive_bytes = 2 * max(one, self.max_batch_bytes)
        self.unroll_spec = self.validator.unroll_spec
        self.unroll_length = self.validator.unroll_length
        self.frame_stack = {str(k): int(v) for k, v in (frame_stack or {}).items()}
        for key, k in self.frame_stack.items():
            if k > 1 and f"frame_prefix/{key}" not in self.unroll_spec:
                raise ValueError(
                    f"frame_stack stacks {key!r} with K={k} but the unroll spec has no "
                    f"'frame_prefix/{key}'; build the spec with the same frame_stack."
                )
        if not isinstance(run_config, str):
            run_config = json.dumps(run_config, sort_keys=True)
        try:
            json.loads(run_config)
        except ValueError as e:
            raise ValueError(f"run_config must be a JSON string; parsing it failed: {e}.") from None
        self.run_config = run_config
        self.queue = unroll_queue
        self.params = params
        self.host = host
        self._requested_port = int(port)
        if token is not None and not token:
            raise ValueError("token is empty; pass None for no token or a non-empty secret.")
        self._token = token.encode() if token is not None else None
        if (tls_cert_file is None) != (tls_key_file is None):
            raise ValueError("TLS needs both tls_cert_file and tls_key_file (PEM), or neither.")
        self._tls = (tls_cert_file, tls_key_file) if tls_cert_file else None
        if int(max_streams) < 1:
            raise ValueError(f"max_streams must be at least 1, got {max_streams}.")
        self.max_streams = int(max_streams)
        if isinstance(refresh_lag, bool) or not isinstance(refresh_lag, int) or not 1 <= refresh_lag <= MAX_PARAM_REFRESH_LAG:
            raise ValueError(f"refresh_lag must be a whole number of versions from 1 to {MAX_PARAM_REFRESH_LAG}, got {refresh_lag!r}.")
        self.refresh_lag = refresh_lag
        self._grpc_options = list(grpc_options)
        self.server_id = uuid.uuid4().hex
        self.metrics = TransportMetrics(self.unroll_length)
        # The open unroll streams' contexts: how many there are, and what stop() cancels.
        self._open_streams: Set[grpc.ServicerContext] = set()
        # The peers of the streams stop() cancelled that have not yet been told RUN_OVER.
        self._untold_peers: set = set()
        self._streams_lock = threading.Lock()
        self._stopping = threading.Event()
        self._finished = threading.Event()  # finish(): the run is over
        self._server: Optional[grpc.Server] = None
        self.port: Optional[int] = None
        self._handshake = self._build_handshake_template()

    # ------------------------------------------------------------------ lifecycle

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("the server is not started; call start() first.")
        return connect_address(self.host, self.port)

    def start(self) -> int:
        """Binds and starts serving; returns the port."""
        if self._server is not None:
            raise RuntimeError("the server is already started.")
        if self.host not in _LOOPBACK and self._token is None:
            _log.warning("serving on %s without a token: anyone who reaches the port can send unrolls.", self.host)
        workers = self.max_streams + 8
        options = [
            ("grpc.max_receive_message_length", self.max_receive_bytes),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0),
            # No BDP probing: otherwise HTTP/2 receive windows grow to many MiB per stream on
            # loopback, and that much unread data waits in gRPC while the queue is full.
            ("grpc.http2.bdp_probe", 0),
        ] + self._grpc_options
        server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="learner-grpc"),
            options=options,
            maximum_concurrent_rpcs=workers,
        )
        handlers = {
            "Handshake": grpc.unary_unary_rpc_method_handler(
                self._handle_handshake,
                request_deserializer=transport_pb2.HandshakeRequest.FromString,
                response_serializer=transport_pb2.HandshakeResponse.SerializeToString,
            ),
            # Raw bytes in: the handler parses them itself (impala_rep.wire.parse_unroll, no
            # copies of the tensor bytes), so that undecodable messages and their size are
            # answered with INVALID_ARGUMENT and counted.
            "StreamUnrolls": grpc.stream_unary_rpc_method_handler(
                self._handle_stream,
                request_deserializer=_identity,
                response_serializer=transport_pb2.StreamSummary.SerializeToString,
            ),
            # Pre-serialized bytes out: each parameter version is serialized once.
            "GetParameters": grpc.unary_unary_rpc_method_handler(
                self._handle_get_parameters,
                request_deserializer=transport_pb2.GetParametersRequest.FromString,
                response_serializer=_identity,
            ),
        }
        if self.max_batch_bytes:
            handlers["StreamUnrollBatches"] = grpc.stream_unary_rpc_method_handler(
                self._handle_batch_stream,
                request_deserializer=_identity,
                response_serializer=transport_pb2.StreamSummary.SerializeToString,
            )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        target = f"{self.host}:{self._requested_port}"
        why = "is the port in use, or the host not an interface of this machine?"
        try:
            if self._tls is not None:
                why = "is the port in use, the host not an interface here, or the certificate and key not a PEM pair?"
                with open(self._tls[0], "rb") as f:
                    cert = f.read()
                with open(self._tls[1], "rb") as f:
                    key = f.read()
                port = server.add_secure_port(target, grpc.ssl_server_credentials([(key, cert)]))
            else:
                port = server.add_insecure_port(target)
        except OSError as exc:  # an unreadable certificate or key
            raise OSError(f"cannot read the TLS certificate or key: {exc}.") from None
        except RuntimeError:  # grpcio's "Failed to bind"
            port = 0
        if port == 0:
            raise OSError(f"could not listen on {target}: {why}")
        self._stopping.clear()
        self._finished.clear()
        server.start()
        self._server, self.port = server, port
        return port

    def finish(self, drain: float = 2.0, cut: bool = False) -> None:
        """Tells the actors that the run is over: from now on every call is answered
        ``OUT_OF_RANGE`` with :data:`RUN_OVER` (actors then stop instead of retrying until they
        give up), and open unroll streams end at their next message. Waits up to ``drain``
        seconds for those streams to end. With ``cut`` (:meth:`stop`), the streams still open
        then are cancelled, and it waits up to :data:`RUN_OVER_RECONNECT_S` for their actors
        to reconnect and hear it (an actor whose next message is minutes away, or that stopped
        sending, is told now rather than finding the learner gone and retrying)."""
        self._finished.set()
        deadline = time.monotonic() + max(0.0, float(drain))
        while time.monotonic() < deadline:
            with self._streams_lock:
                if not self._open_streams:
                    return
            time.sleep(0.02)
        if cut:
            self._cut_open_streams()

    def _cut_open_streams(self) -> None:
        with self._streams_lock:
            contexts = list(self._open_streams)
            self._untold_peers = {context.peer() for context in contexts}
        for context in contexts:
            context.cancel()
        deadline = time.monotonic() + RUN_OVER_RECONNECT_S
        while time.monotonic() < deadline:
            with self._streams_lock:
                if not self._untold_peers:
                    return
            time.sleep(0.02)
        with self._streams_lock:
            untold, self._untold_peers = len(self._untold_peers), set()
        _log.info("%d actor connection(s) whose unroll streams were cut did not call again within %.0f s to hear "
                  "that the run is over; those actors retry until they give up.", untold, RUN_OVER_RECONNECT_S)

    def _check_running(self, context: grpc.ServicerContext) -> None:
        if self._finished.is_set():
            with self._streams_lock:
                self._untold_peers.discard(context.peer())
            context.abort(grpc.StatusCode.OUT_OF_RANGE, RUN_OVER)

    def _abort_stopping(self, context: grpc.ServicerContext) -> None:
        """Ends a stream whose unroll could not be queued (the learner is stopping or its queue
        closed): the run is over once finish() was called, else the actor should reconnect."""
        self._check_running(context)
        context.abort(grpc.StatusCode.UNAVAILABLE, "the learner is shutting down; reconnect later.")

    def stop(self, grace: Optional[float] = 1.0, drain: float = 1.0, finish: bool = True) -> None:
        """Stops serving: first :meth:`finish` (the actors are told the run is over; open
        streams get up to ``drain`` seconds to end, then those left are cut and their actors
        hear it when they reconnect, within :data:`RUN_OVER_RECONNECT_S`), then blocked stream
        handlers return and in-flight calls get ``grace`` seconds.
        ``finish=False`` stops without saying the run is over (the learner is gone, not done: a
        restarted one may resume it), so the actors retry."""
        if self._server is not None and finish:
            self.finish(drain, cut=True)
        self._stopping.set()
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None

    def __enter__(self) -> "LearnerServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ handlers

    def _build_handshake_template(self) -> transport_pb2.HandshakeResponse:
        msg = transport_pb2.HandshakeResponse(
            protocol_version=PROTOCOL_VERSION,
            server_id=self.server_id,
            unroll_length=self.unroll_length,
            max_message_bytes=self.validator.max_message_bytes,
            run_config=self.run_config,
            max_batch_bytes=self.max_batch_bytes,
        )
        for spec in self.unroll_spec.values():
            spec_to_proto(spec, out=msg.unroll_spec.add())
        for key, k in self.frame_stack.items():
            msg.frame_stack[key] = k
        return msg

    def _check_token(self, context: grpc.ServicerContext) -> None:
        if self._token is None:
            return
        got = None
        for key, value in context.invocation_metadata():
            if key == TOKEN_METADATA_KEY:
                got = value.encode() if isinstance(value, str) else value
        if got is None or not hmac.compare_digest(got, self._token):
            self.metrics.reject("unauthenticated")
            what = "no token" if got is None else "a wrong token"
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"the call carries {what}; pass the learner's shared token "
                f"(metadata {TOKEN_METADATA_KEY}, LearnerClient(token=...)).",
            )

    def _handle_handshake(self, request, context):
        self._check_token(context)
        self._check_running(context)
        msg = transport_pb2.HandshakeResponse()
        msg.CopyFrom(self._handshake)
        msg.parameter_version = self.params.version
        return msg

    def _handle_get_parameters(self, request, context):
        self._check_token(context)
        self._check_running(context)
        self.metrics.count("parameter_requests")
        payload, sent = self.params.reply(request.have_version, self.refresh_lag)
        if sent:
            self.metrics.count("parameters_sent")
        return payload

    def _handle_stream(self, request_iterator, context):
        return self._serve_stream(request_iterator, context, batches=False)

    def _handle_batch_stream(self, request_iterator, context):
        return self._serve_stream(request_iterator, context, batches=True)

    def _validate_batch(self, raw: bytes) -> list:
        """The validated unrolls of serialized ``UnrollBatch`` bytes; UnrollRejected for any fault."""
        if len(raw) > self.max_batch_bytes:
            raise UnrollRejected(
                "oversized",
                f"the batch is {len(raw)} bytes, more than the learner's limit of {self.max_batch_bytes} bytes.",
            )
        try:
            ranges = split_unroll_batch(raw)
        except WireError as e:
            raise UnrollRejected(
                "undecodable",
                f"the message is not a valid UnrollBatch protobuf ({str(e).rstrip('.')}); "
                "send transport_pb2.UnrollBatch bytes.",
            ) from None
        items = []
        for i, (start, stop) in enumerate(ranges):
            try:
                items.append(self.validator.validate_bytes(raw, start, stop))
            except UnrollRejected as e:
                raise UnrollRejected(e.reason, f"unroll {i} of {len(ranges)} in the batch: {e}") from None
        return items

    def _serve_stream(self, request_iterator, context, batches: bool):
        self._check_token(context)
        self._check_running(context)
        with self._streams_lock:
            if len(self._open_streams) >= self.max_streams:
                refused = True
            else:
                refused = False
                self._open_streams.add(context)
        if refused:
            self.metrics.count("streams_refused")
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the learner serves at most {self.max_streams} unroll streams at once, one per actor process; "
                "this one retries until a stream ends. Start the learner with a larger --max-actor-streams "
                "(LearnerServer(max_streams=...) in code) to serve every actor process.",
            )
        self.metrics.count("streams_opened")
        accepted = 0
        cancelled = lambda: (  # noqa: E731
            self._stopping.is_set() or self._finished.is_set() or not context.is_active())
        try:
            # Before reading: the client holds back all but the first message until it has this.
            context.send_initial_metadata((STREAM_ACCEPTED,))
            for raw in request_iterator:
                self._check_running(context)
                try:
                    # Parsed in place: the queued arrays are views on these bytes (no copies).
                    if batches:
                        items = self._validate_batch(raw)
                    else:
                        items = [self.validator.validate_bytes(raw)]
                except UnrollRejected as e:
                    self.metrics.reject(e.reason)
                    what = "batch" if batches else "unroll"
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what} rejected: {e}")
                del raw
                for item in items:
                    try:
                        if not self.queue.put(item, cancelled=cancelled):
                            self._abort_stopping(context)
                    except QueueClosed:
                        self._abort_stopping(context)
                    self.metrics.accept(item.nbytes)
                    accepted += 1
                self.metrics.count("messages_accepted")
        finally:
            with self._streams_lock:
                self._open_streams.discard(context)
        return transport_pb2.StreamSummary(unrolls_accepted=accepted)

    def snapshot_metrics(self) -> Dict[str, float]:
        """Transport metrics plus queue fill (``queue_size``, ``queue_fill``, ``queue_capacity``)."""
        out = self.metrics.snapshot()
        out["queue_size"] = len(self.queue)
        out["queue_capacity"] = self.queue.capacity
        out["queue_fill"] = self.queue.fill
        out["queue_producer_wait_s"] = self.queue.producer_wait_s
        out["parameter_version"] = self.params.version
        return out
