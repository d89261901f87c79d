"""The learner's intake in a process of its own (``--intake process``; TensorFlow-free).

The intake is everything of the learner that is not the update: the gRPC service the actors
stream unrolls into and fetch parameters from (:class:`learner.server.LearnerServer`), the
bounded unroll queue, the batcher (replay included) and the parameter store. By default
(``--intake thread``) it runs in the learner's process, where its Python shares one
interpreter (one GIL) with the training loop. A GPU or TPU learner at batches of 32 takes in
hundreds of MB/s of unrolls and serves every actor process each step's parameters; its step
then waits for the interpreter, not for the device (``docs/BENCHMARKS.md``, thirty-eighth
session). ``--intake process`` moves the intake into a child process (``python -m
learner.intake``, which never imports TensorFlow):

* **Batches** are written by the child straight into one of ``slots`` batch-sized slots of
  shared memory (a file in ``/dev/shm``, unlinked once both processes have mapped it, so
  nothing outlives them). The learner trains on a slot's arrays in place (64-byte aligned, as
  TensorFlow needs to use them without a copy) and hands the slot back when it asks for the
  next batch. With 3 slots the child fills two while the learner trains on the third.
* **Parameters** go the other way through 2 parameter slots: the learner copies a step's
  parameters into a free slot; the child checks them finite, encodes the actors' reply and
  frees the slot. When both slots are busy the newest snapshot waits and replaces an older
  one that is still waiting (actors always get the newest; versions still grow), as
  :class:`learner.params.BackgroundPublisher` does in the learner's process.
* **Control** messages are JSON over a socket pair (no pickle): the child's port, a slot
  ready (with the batch's episode returns, lengths, actor ids and fresh count), a slot free,
  parameters published or not finite, the transport's metrics on request, errors.

If the child exits, the learner's next call says so in a sentence (with its exit status);
if the learner exits, the child sees its socket close and stops. The child's log lines go to
the learner's stderr.

Usage (what :class:`learner.run.Trainer` does)::

    intake = ProcessIntake(unroll_spec, T, frame_stack={"pixels": 3}, batch_size=32,
                           queue_capacity=64, initial_params=(1, params), server_options={...})
    address = intake.start()
    batch = intake.next_batch(timeout=1.0)        # Batch; its tensors are views on a slot
    metrics, (step, params) = learner.train_and_read(batch.tensors)
    intake.submit(step + 1, params)               # published by the child
    intake.close(); intake.stop()
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from impala_rep.flags import configure_logging
from impala_rep.specs import ArraySpec
from learner.batcher import Batch, batch_layout
from learner.queue import QueueClosed
from learner.server import RUN_OVER_RECONNECT_S, connect_address

__all__ = ["IntakeError", "ProcessIntake", "SlotLayout"]

ALIGN = 64
log = logging.getLogger("impala_rep.learner")


class IntakeError(RuntimeError):
    """The intake process failed or exited (the message says how)."""


class SlotLayout:
    """Named arrays at 64-byte-aligned offsets in ``count`` equal slots of one buffer.

    ``fields``: ``[(name, shape, dtype)]``. :meth:`views` returns a slot's arrays as NumPy
    views on the buffer (no copies).
    """

    def __init__(self, fields: Sequence[Tuple[str, Sequence[int], Any]], count: int):
        if int(count) < 1:
            raise ValueError(f"a slot layout needs at least 1 slot, got {count}.")
        self.count = int(count)
        self.fields: List[Tuple[str, Tuple[int, ...], np.dtype, int]] = []
        offset = 0
        for name, shape, dtype in fields:
            dtype = np.dtype(dtype)
            shape = tuple(int(d) for d in shape)
            self.fields.append((str(name), shape, dtype, offset))
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            offset += -(-nbytes // ALIGN) * ALIGN
        self.slot_bytes = max(offset, ALIGN)
        self.nbytes = self.slot_bytes * self.count

    def views(self, buffer, slot: int, base: int = 0) -> Dict[str, np.ndarray]:
        """Slot ``slot``'s arrays on ``buffer`` (which holds the layout from byte ``base`` on)."""
        if not 0 <= slot < self.count:
            raise ValueError(f"slot {slot} is not one of this layout's {self.count}.")
        start = base + slot * self.slot_bytes
        return {
            name: np.frombuffer(buffer, dtype, int(np.prod(shape, dtype=np.int64)), start + offset).reshape(shape)
            for name, shape, dtype, offset in self.fields
        }

    def to_json(self) -> Dict[str, Any]:
        return {"count": self.count, "fields": [[n, list(s), d.str] for n, s, d, _ in self.fields]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "SlotLayout":
        return cls([(n, s, np.dtype(d)) for n, s, d in data["fields"]], data["count"])


def _shared_file(nbytes: int) -> Tuple[str, int]:
    """``(directory, fd)`` of a new file of ``nbytes`` for both processes to map: in
    ``/dev/shm`` (memory) when it has room, else in the temporary directory (with a warning:
    disk-backed). The room is reserved up front (``posix_fallocate``): a tmpfs that runs out
    while mapped kills its writer with SIGBUS. The file is unlinked at once and lives as long
    as a descriptor or mapping of it does (the child gets the descriptor), so a learner killed
    at any moment leaves nothing in ``/dev/shm``."""
    name = f"impala_rep-intake-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tried = []
    for directory in ("/dev/shm", tempfile.gettempdir()):
        if not os.path.isdir(directory):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            tried.append(f"{directory}: {exc.strerror or exc}")
            continue
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.close(fd)
            tried.append(f"{directory}: {exc.strerror or exc}")
            continue
        finally:
            os.unlink(path)
        if directory != "/dev/shm":
            log.warning("no room in /dev/shm for the intake's %.0f MiB of batch and parameter slots (%s): they are "
                        "in a file in %s, which a disk may back; give /dev/shm room (docker run --shm-size) or use "
                        "--intake thread.", nbytes / 2**20, "; ".join(tried) or "no /dev/shm", directory)
        return directory, fd
    raise OSError(f"the learner's intake needs {nbytes / 2**20:.0f} MiB of shared memory for its batch slots and "
                  f"found no room ({'; '.join(tried) or 'no /dev/shm or temporary directory'}); free some, set "
                  "TMPDIR to a directory with room, or use --intake thread.")


class _Channel:
    """JSON messages over a ``multiprocessing.connection.Connection`` (length-framed bytes, no
    pickle), sent under a lock so that several threads may send."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, **msg: Any) -> None:
        data = json.dumps(msg).encode()
        with self._lock:
            self.conn.send_bytes(data)

    def recv(self) -> Dict[str, Any]:
        return json.loads(self.conn.recv_bytes().decode())


class ProcessIntake:
    """The learner's gRPC service, queue, batcher and parameter store in a child process (see
    module docstring). Offers the learner what the in-process parts do: :meth:`start` and
    :attr:`address`, :meth:`next_batch`, :meth:`submit`/:meth:`flush`/:attr:`failed` (as
    :class:`learner.params.BackgroundPublisher`), :attr:`version`, :meth:`snapshot_metrics`,
    :meth:`finish`, :meth:`close` and :meth:`stop`.

    Args:
      unroll_spec, unroll_length, frame_stack: as :class:`learner.server.LearnerServer`.
      batch_size, queue_capacity, replay_ratio, replay_capacity, seed: as
        :class:`learner.batcher.Batcher` and :class:`learner.queue.UnrollQueue`.
      initial_params: ``(version, {name: array})`` served before the first :meth:`submit`;
        every later snapshot must have the same names, shapes and dtypes.
      server_options: keyword arguments of :class:`learner.server.LearnerServer` (``run_config``,
        ``host``, ``port``, ``token``, ``tls_cert_file``, ``tls_key_file``, ``refresh_lag``, ...).
      slots: batch slots (at least 2: one the learner trains on, one being filled).
      start_timeout: seconds :meth:`start` waits for the child to serve.
    """

    PARAM_SLOTS = 2

    def __init__(
        self,
        unroll_spec: Mapping[str, ArraySpec],
        unroll_length: int,
        *,
        batch_size: int,
        queue_capacity: int,
        initial_params: Tuple[int, Mapping[str, np.ndarray]],
        frame_stack: Optional[Mapping[str, int]] = None,
        replay_ratio: float = 0.0,
        replay_capacity: Optional[int] = None,
        seed: int = 0,
        server_options: Optional[Mapping[str, Any]] = None,
        slots: int = 3,
        start_timeout: float = 120.0,
    ):
        if int(slots) < 2:
            raise ValueError(f"the process intake needs at least 2 batch slots, got {slots}.")
        if not 1 <= int(batch_size) <= int(queue_capacity):
            raise ValueError(f"batch_size must be in [1, queue capacity {queue_capacity}], got {batch_size}.")
        version, params = initial_params
        if not params:
            raise ValueError("the process intake needs the initial parameters (at least one named array).")
        self.frame_stack = {str(k): int(v) for k, v in (frame_stack or {}).items()}
        layout = batch_layout(unroll_spec, batch_size, self.frame_stack)
        self.batches = SlotLayout([(k, s, d) for k, (s, d) in layout.items()], int(slots))
        self.params_layout = SlotLayout(
            [(k, np.shape(v), np.asarray(v).dtype) for k, v in params.items()], self.PARAM_SLOTS)
        self._setup = {
            "unroll_spec": {k: v.to_json() for k, v in unroll_spec.items()},
            "unroll_length": int(unroll_length),
            "frame_stack": self.frame_stack,
            "batch_size": int(batch_size),
            "queue_capacity": int(queue_capacity),
            "replay_ratio": float(replay_ratio),
            "replay_capacity": None if replay_capacity is None else int(replay_capacity),
            "seed": int(seed),
            "server_options": dict(server_options or {}),
            "batches": self.batches.to_json(),
            "params": self.params_layout.to_json(),
            "initial_version": int(version),
        }
        json.dumps(self._setup)  # every option must travel as JSON: fail here, not in the child
        self._initial = (int(version), params)
        self._start_timeout = float(start_timeout)
        self._proc: Optional[subprocess.Popen] = None
        self._chan: Optional[_Channel] = None
        self._mem: Optional[mmap.mmap] = None
        self._slot_views: List[Dict[str, np.ndarray]] = []
        self._param_views: List[Dict[str, np.ndarray]] = []
        self._cond = threading.Condition()
        self._ready: "queue.Queue[Dict[str, Any]]" = queue.Queue()
        self._held: Optional[int] = None  # the batch slot the learner trains on
        self._free_param_slots = list(range(self.PARAM_SLOTS))
        self._pending: Optional[Tuple[int, Mapping[str, np.ndarray]]] = None
        self._in_flight: Dict[int, int] = {}  # param slot -> version
        self._metrics: Optional[Dict[str, float]] = None
        self._metrics_seq = 0
        self._error: Optional[str] = None
        self._refused: Optional[str] = None  # why the child refused a snapshot, raised once
        self._stopped = False
        self._reader: Optional[threading.Thread] = None
        self.version = 0  # newest parameter version the child serves
        self.failed: Optional[int] = None  # a version whose parameters were not finite
        self.published = 0
        self.dropped = 0
        self.port: Optional[int] = None
        self.host = str(self._setup["server_options"].get("host", "127.0.0.1"))

    # ------------------------------------------------------------------ lifecycle

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("the intake is not started; call start() first.")
        return connect_address(self.host, self.port)

    def start(self) -> int:
        """Starts the child, which binds and serves; returns the port. Raises ``OSError`` (a
        port that cannot be bound) or :class:`IntakeError` with the child's sentence."""
        if self._proc is not None:
            raise RuntimeError("the intake is already started.")
        total = self.batches.nbytes + self.params_layout.nbytes
        _, fd = _shared_file(total)
        parent_sock = child_sock = None
        try:
            self._mem = mmap.mmap(fd, total)
            self._slot_views = [self.batches.views(self._mem, i) for i in range(self.batches.count)]
            self._param_views = [self.params_layout.views(self._mem, i, self.batches.nbytes)
                                 for i in range(self.PARAM_SLOTS)]
            version, params = self._initial
            for name, view in self._param_views[0].items():
                np.copyto(view, np.asarray(params[name]))
            parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self._proc = subprocess.Popen(  # pylint: disable=consider-using-with
                [sys.executable, "-m", "learner.intake", "--fd", str(child_sock.fileno()), "--memory-fd", str(fd)],
                pass_fds=(child_sock.fileno(), fd),
                start_new_session=True,  # a Ctrl-C in the terminal reaches the learner, which stops it
            )
            child_sock.close()
            child_sock = None
            self._chan = _Channel(Connection(parent_sock.detach()))
            self._chan.send(type="setup", setup=self._setup)
            first = self._recv_start()
        finally:
            os.close(fd)  # the mapping (and the child's descriptor) keep the memory
            if child_sock is not None:
                child_sock.close()
            if parent_sock is not None and self._chan is None:
                parent_sock.close()
        if first.get("type") != "ready":
            message = first.get("message", "the intake process did not start")
            self.stop()
            raise (OSError if first.get("kind") == "bind" else IntakeError)(message)
        self.port = int(first["port"])
        self.version = int(self._initial[0])
        self._reader = threading.Thread(target=self._read, name="intake-reader", daemon=True)
        self._reader.start()
        return self.port

    def _recv_start(self) -> Dict[str, Any]:
        conn = self._chan.conn
        deadline = time.monotonic() + self._start_timeout
        closed = False
        while time.monotonic() < deadline:
            if conn.poll(0.2):
                try:
                    return self._chan.recv()
                except (EOFError, OSError):
                    closed = True
                    break
            if self._proc.poll() is not None:
                break
        # A child that closed its end is exiting: its status says why, not a timeout.
        code = self._exit_status() if closed else self._proc.poll()
        if code is None:
            self._proc.kill()
            return {"type": "error", "message": f"the learner's intake process did not start serving within "
                                                f"{self._start_timeout:.0f} s; see the log above for why."}
        return {"type": "error", "message": f"the learner's intake process exited with status {code} while "
                                            "starting; see the log above for why."}

    def finish(self) -> None:
        """Tells the actors that the run is over, without waiting (as
        :meth:`LearnerServer.finish` with no drain): the child answers their calls ``OUT_OF_RANGE``
        from now on, while it keeps running until :meth:`stop`. Raises nothing: a child that is
        gone tells no one."""
        if self._chan is not None and not self._stopped and self._error is None:
            try:
                self._chan.send(type="finish")
            except (OSError, ValueError):
                pass

    def stop(self, grace: Optional[float] = 1.0) -> None:
        """Stops the child (its server first, in-flight calls get ``grace`` seconds) and frees
        the shared memory. Idempotent."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._ready.put({"type": "error"})  # wakes a next_batch() waiting in another thread
        if self._chan is not None:
            try:
                self._chan.send(type="stop", grace=grace)
            except (OSError, ValueError):
                pass
        if self._proc is not None:
            try:
                self._proc.wait(timeout=(grace or 0) + 10 + RUN_OVER_RECONNECT_S)  # its server's drain and cut (LearnerServer.stop)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._chan is not None:
            self._chan.conn.close()
        if self._reader is not None:
            self._reader.join(5)
        self._slot_views, self._param_views = [], []
        if self._mem is not None:
            try:
                self._mem.close()
            except BufferError:
                pass  # a batch the caller still holds maps it; the mapping goes with the process
            self._mem = None

    # ------------------------------------------------------------------ messages from the child

    def _read(self) -> None:
        try:
            while True:
                msg = self._chan.recv()
                kind = msg.get("type")
                if kind == "batch":
                    self._ready.put(msg)
                elif kind in ("published", "not_finite", "refused"):
                    self._on_params_done(msg)
                elif kind == "metrics":
                    with self._cond:
                        self._metrics = msg["values"]
                        self._metrics_seq += 1
                        self._cond.notify_all()
                elif kind == "error":
                    self._fail(msg.get("message", "the learner's intake process failed."))
                    return
        except (EOFError, OSError, ValueError):
            if not self._stopped:
                self._child_gone(self._exit_status())

    def _fail(self, message: str) -> None:
        with self._cond:
            if self._error is None:
                self._error = message
            self._cond.notify_all()
        self._ready.put({"type": "error"})

    def _raise_error(self) -> None:
        if self._error is not None:
            raise IntakeError(self._error)

    def _child_gone(self, code: Optional[int]) -> None:
        """Records that the child is gone (exit status ``code``; None: it no longer answers)."""
        self._fail("the learner's intake process (gRPC service, queue and batcher) "
                   + (f"exited with status {code}" if code is not None else "stopped answering")
                   + "; the actors can no longer reach the learner. See the log above for why.")

    def _send(self, **msg: Any) -> None:
        """Sends ``msg`` to the child; :class:`IntakeError` (with its exit status) when it is gone."""
        try:
            self._chan.send(**msg)
        except (OSError, ValueError):
            self._child_gone(self._exit_status())
            self._raise_error()

    def _exit_status(self, timeout: float = 5.0) -> Optional[int]:
        """The exit status of a child whose end of the socket closed; None when it does not
        exit within ``timeout`` (it then "stopped answering")."""
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    # ------------------------------------------------------------------ batches

    def next_batch(self, timeout: Optional[float] = None) -> Batch:
        """The next batch; its tensors are views on a shared slot, valid until the next call
        (which hands the slot back). ``TimeoutError`` when none is ready within ``timeout``,
        :class:`QueueClosed` after :meth:`stop`, :class:`IntakeError` if the child failed."""
        if self._stopped:
            raise QueueClosed("the learner's intake is stopped.")
        self._raise_error()
        if self._held is not None:
            self._send(type="free", slot=self._held)
            self._held = None
        try:
            msg = self._ready.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no batch within {timeout} s.") from None
        if msg["type"] == "error":
            self._ready.put(msg)
            if self._stopped:
                raise QueueClosed("the learner's intake is stopped.")
            self._raise_error()
        slot = int(msg["slot"])
        self._held = slot
        return Batch(
            tensors=dict(self._slot_views[slot]),
            episode_returns=np.asarray(msg["returns"], np.float64),
            episode_lengths=np.asarray(msg["lengths"], np.int64),
            actor_ids=list(msg["actor_ids"]),
            fresh_unrolls=msg.get("fresh"),
        )

    # ------------------------------------------------------------------ parameters

    def submit(self, version: int, params: Mapping[str, np.ndarray]) -> None:
        """Hands a step's parameters to the child to check and serve (copied at once when a
        parameter slot is free, else kept as the one pending, replacing an older pending one).
        ``ValueError`` for a snapshot that does not match the initial parameters' names, shapes
        and dtypes (nothing is kept of it); an earlier snapshot the child refused (a version
        that did not grow) is raised here, as a ``RuntimeError``."""
        self._check_params(params)
        with self._cond:
            self._raise_error()
            self._raise_refused()
            if self._stopped:
                raise RuntimeError("the learner's intake is stopped.")
            if self.failed is not None:
                return  # after a snapshot failed its check nothing more is published
            if self._pending is not None:
                self.dropped += 1
            self._pending = (int(version), params)
            self._send_pending()

    def _check_params(self, params: Mapping[str, np.ndarray]) -> None:
        want = {name: (shape, dtype) for name, shape, dtype, _ in self.params_layout.fields}
        if set(params) != set(want):
            missing, unknown = sorted(set(want) - set(params)), sorted(set(params) - set(want))
            raise ValueError(f"the parameters do not match the intake's: missing {missing}, unknown {unknown}.")
        for name, (shape, dtype) in want.items():
            value = params[name]
            if np.shape(value) != shape or not np.can_cast(np.asarray(value).dtype, dtype, "same_kind"):
                raise ValueError(f"parameter {name!r} is {np.shape(value)} {np.asarray(value).dtype}; the intake "
                                 f"holds {shape} {dtype.name}.")

    def _send_pending(self) -> None:
        """With ``_cond`` held: copies the pending snapshot into a free slot and tells the child."""
        if self._pending is None or not self._free_param_slots or self.failed is not None:
            return
        slot = self._free_param_slots.pop()
        version, params = self._pending
        self._pending = None
        for name, view in self._param_views[slot].items():
            np.copyto(view, params[name], casting="same_kind")  # checked by submit()
        self._in_flight[slot] = version
        try:
            self._send(type="params", slot=slot, version=version)
        except IntakeError:
            self._in_flight.pop(slot, None)
            self._free_param_slots.append(slot)
            raise

    def _raise_refused(self) -> None:
        if self._refused is not None:
            message, self._refused = self._refused, None
            raise RuntimeError(f"publishing the learner's parameters failed: {message}")

    def _on_params_done(self, msg: Dict[str, Any]) -> None:
        with self._cond:
            slot, version = int(msg["slot"]), int(msg["version"])
            self._in_flight.pop(slot, None)
            self._free_param_slots.append(slot)
            if msg["type"] == "published":
                self.published += 1
                self.version = max(self.version, version)
            elif msg["type"] == "refused":
                self._refused = self._refused or msg.get("message", f"version {version} was refused")
            elif self.failed is None:
                self.failed = version
                self._pending = None
            try:
                self._send_pending()
            except IntakeError:
                pass  # recorded; the training loop's next call raises it
            self._cond.notify_all()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Waits until every submitted snapshot is published or failed; False on timeout."""
        with self._cond:
            done = self._cond.wait_for(
                lambda: self._error is not None or self._stopped
                or (self._pending is None and not self._in_flight), timeout)
            self._raise_error()
            self._raise_refused()
            return done

    def close(self, timeout: Optional[float] = 30.0) -> None:
        """Waits (up to ``timeout``) for what was submitted to be published; raises nothing."""
        try:
            if self._chan is not None and not self._stopped:
                self.flush(timeout)
        except RuntimeError as exc:  # an IntakeError, or a snapshot the child refused
            log.error("%s", exc)

    # ------------------------------------------------------------------ metrics

    def snapshot_metrics(self, timeout: float = 5.0) -> Dict[str, float]:
        """The child's transport metrics and queue fill (:meth:`LearnerServer.snapshot_metrics`);
        the last ones received when the child does not answer within ``timeout``."""
        with self._cond:
            seq = self._metrics_seq
            if self._error is None and not self._stopped:
                try:
                    self._chan.send(type="metrics")
                except (OSError, ValueError):
                    pass
                else:
                    self._cond.wait_for(lambda: self._metrics_seq > seq or self._error is not None, timeout)
            return dict(self._metrics or {})


# ---------------------------------------------------------------------- the child process


def _serve(chan: _Channel, memory_fd: int) -> int:
    from learner.batcher import Batcher
    from learner.params import ParameterStore
    from learner.queue import UnrollQueue
    from learner.server import LearnerServer

    first = chan.recv()
    setup = first["setup"]
    batches = SlotLayout.from_json(setup["batches"])
    params_layout = SlotLayout.from_json(setup["params"])
    try:
        mem = mmap.mmap(memory_fd, batches.nbytes + params_layout.nbytes)
    finally:
        os.close(memory_fd)
    slot_views = [batches.views(mem, i) for i in range(batches.count)]
    param_views = [params_layout.views(mem, i, batches.nbytes) for i in range(params_layout.count)]
    spec = {k: ArraySpec.from_json(v) for k, v in setup["unroll_spec"].items()}
    unroll_queue = UnrollQueue(capacity=setup["queue_capacity"])
    store = ParameterStore()
    store.publish({k: v.copy() for k, v in param_views[0].items()}, version=setup["initial_version"])
    try:
        server = LearnerServer(spec, setup["unroll_length"], unroll_queue, store,
                               frame_stack=setup["frame_stack"], **setup["server_options"])
        batcher = Batcher(unroll_queue, spec, setup["batch_size"], setup["frame_stack"],
                          replay_ratio=setup["replay_ratio"], replay_capacity=setup["replay_capacity"],
                          seed=setup["seed"])
    except (ValueError, TypeError) as exc:
        chan.send(type="error", message=str(exc))
        return 2
    try:
        port = server.start()
    except OSError as exc:
        chan.send(type="error", kind="bind", message=str(exc))
        return 2
    chan.send(type="ready", port=port)

    free: "queue.Queue[int]" = queue.Queue()
    for i in range(batches.count):
        free.put(i)
    stopping = threading.Event()

    def fill() -> None:
        try:
            while not stopping.is_set():
                try:
                    slot = free.get(timeout=0.5)
                except queue.Empty:
                    continue
                while not stopping.is_set():
                    try:
                        batch = batcher.next_batch(timeout=0.5, out=slot_views[slot])
                        break
                    except TimeoutError:
                        continue
                else:
                    return
                chan.send(type="batch", slot=slot, returns=batch.episode_returns.tolist(),
                          lengths=batch.episode_lengths.tolist(), actor_ids=batch.actor_ids,
                          fresh=batch.fresh_unrolls)
        except QueueClosed:
            return
        except BaseException as exc:  # a batching fault: the learner says it, and stops
            log.exception("the intake's batcher failed")
            try:
                chan.send(type="error", message=f"the learner's intake process failed to build a batch: {exc}")
            except OSError:
                pass
            stopping.set()

    filler = threading.Thread(target=fill, name="intake-batcher", daemon=True)
    filler.start()
    grace, told_to_stop = 1.0, False
    try:
        while not stopping.is_set():
            try:
                msg = chan.recv()
            except (EOFError, OSError):
                break  # the learner is gone
            kind = msg.get("type")
            if kind == "free":
                free.put(int(msg["slot"]))
            elif kind == "params":
                slot, version = int(msg["slot"]), int(msg["version"])
                views = param_views[slot]
                if all(np.isfinite(v).all() for v in views.values()):
                    try:
                        store.publish(views, version=version)  # copies them
                    except ValueError as exc:  # a version that does not grow: the learner says it
                        chan.send(type="refused", slot=slot, version=version, message=str(exc))
                    else:
                        chan.send(type="published", slot=slot, version=version)
                else:
                    chan.send(type="not_finite", slot=slot, version=version)
            elif kind == "metrics":
                chan.send(type="metrics", values={k: float(v) for k, v in server.snapshot_metrics().items()})
            elif kind == "finish":
                server.finish(drain=0.0)
            elif kind == "stop":
                grace, told_to_stop = msg.get("grace", 1.0), True
                break
    finally:
        stopping.set()
        # The server first: it tells the actors that the run is over (LearnerServer.stop), which
        # they would not hear from streams the closed queue had already ended. Only when the
        # learner said stop: a learner that is gone (killed, out of memory) may be restarted to
        # resume the run, and its actors should retry meanwhile, as with the thread intake.
        server.stop(grace, finish=told_to_stop)
        unroll_queue.close()
        filler.join(5)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="The learner's intake process (started by the learner).")
    parser.add_argument("--fd", type=int, required=True, help="the socket to the learner")
    parser.add_argument("--memory-fd", type=int, required=True,
                        help="the descriptor of the (unlinked) shared-memory file of batch and parameter slots")
    args = parser.parse_args(argv)
    configure_logging("%(asctime)s intake %(levelname)s %(message)s")
    chan = _Channel(Connection(args.fd))
    try:
        return _serve(chan, args.memory_fd)
    except (EOFError, OSError) as exc:
        log.error("the learner's intake process lost its learner: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
