"""Versioned parameter store served to actors (TensorFlow-free).

The learner publishes NumPy snapshots of its parameters; each publish gets the next version
(1, 2, ...; 0 means nothing published yet) and is serialised once into a
``GetParametersResponse``, whatever the number of actors that fetch it. An actor sends the
version it holds and receives either the newest parameters or, when it is up to date, only
the version number. With a refresh lag ``K`` above 1 (``--param-refresh-lag``), a caller that
holds some version receives new parameters only once it is ``K`` or more versions behind;
closer than that it is answered as up to date, and keeps acting with what it holds (V-trace
corrects for the older policy). A caller holding none (version 0) always receives them.

Usage::

    store = ParameterStore()
    version = store.publish(learner.get_params())   # {name: np.ndarray}
    payload = store.response_bytes(have_version=3)  # serialized reply for GetParameters
    payload, sent = store.reply(have_version=3, refresh_lag=2)
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from impala_rep.config import MAX_PARAM_REFRESH_LAG
from impala_rep.proto import transport_pb2
from impala_rep.wire import encode_parameters_response

__all__ = ["BackgroundPublisher", "ParameterStore"]

log = logging.getLogger("impala_rep.learner")


class ParameterStore:
    """Holds the newest parameter snapshot and its serialized reply (bound: one snapshot)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._version = 0
        self._params: Dict[str, np.ndarray] = {}
        self._payload: bytes = transport_pb2.GetParametersResponse(version=0, up_to_date=True).SerializeToString()
        self._up_to_date: bytes = self._payload
        self._changed = threading.Condition(self._lock)

    @property
    def version(self) -> int:
        return self._version

    def publish(self, params: Mapping[str, np.ndarray], version: Optional[int] = None) -> int:
        """Stores a copy of ``params`` as the next version (or ``version``, which must grow).

        The copy is the serialized reply itself (one copy of the arrays); :meth:`get` returns
        read-only views on it."""
        if not params:
            raise ValueError("publish() needs at least one named parameter array.")
        with self._lock:
            new_version = self._version + 1 if version is None else int(version)
            if new_version <= self._version:
                raise ValueError(
                    f"parameter version must grow: have {self._version}, got {new_version}."
                )
        # One copy of the arrays: the reply's bytes, of which the snapshot's arrays are views.
        payload, snapshot = encode_parameters_response(new_version, params)
        up_to_date = transport_pb2.GetParametersResponse(version=new_version, up_to_date=True).SerializeToString()
        with self._lock:
            if new_version <= self._version:  # a concurrent publish got there first
                raise ValueError(f"parameter version must grow: have {self._version}, got {new_version}.")
            self._version, self._params = new_version, snapshot
            self._payload, self._up_to_date = payload, up_to_date
            self._changed.notify_all()
        return new_version

    def get(self) -> Tuple[int, Dict[str, np.ndarray]]:
        """(version, {name: read-only array}) of the newest snapshot ((0, {}) before any).

        The arrays are views on the serialized reply, so they may be unaligned in memory:
        ``np.array(v)`` gives an aligned copy for heavy compute."""
        with self._lock:
            return self._version, dict(self._params)

    def response_bytes(self, have_version: int) -> bytes:
        """The serialized ``GetParametersResponse`` for a caller holding ``have_version``
        (every newer version sent; :meth:`reply` takes a refresh lag)."""
        return self.reply(have_version)[0]

    def reply(self, have_version: int, refresh_lag: int = 1) -> Tuple[bytes, bool]:
        """(serialized ``GetParametersResponse``, whether it carries the parameters) for a
        caller holding ``have_version``: the newest parameters when it holds none (0) or is
        ``refresh_lag`` or more versions behind, else only the newest version number."""
        refresh_lag = int(refresh_lag)
        if not 1 <= refresh_lag <= MAX_PARAM_REFRESH_LAG:
            raise ValueError(f"refresh_lag must be from 1 to {MAX_PARAM_REFRESH_LAG}, got {refresh_lag}.")
        have_version = int(have_version)
        with self._lock:
            behind = self._version - have_version
            if behind >= 1 and (have_version <= 0 or behind >= refresh_lag):
                return self._payload, True
            return self._up_to_date, False

    def wait_for_version(self, version: int, timeout: Optional[float] = None) -> bool:
        """Blocks until a version >= ``version`` is published; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._version >= version, timeout)


class BackgroundPublisher:
    """Publishes into a :class:`ParameterStore` on a thread of its own, so that checking and
    serialising one learner step's parameters overlaps the next step (``--overlap-publish``).

    A learner on a GPU or TPU sits idle while the host checks the parameters it read back,
    copies them and encodes the actors' reply: 13-15% of its time at batches of 32 on an H200
    (BENCHMARKS.md, thirty-sixth session). Here that work runs while the device computes the
    next step; TensorFlow releases the GIL while a step runs.

    :meth:`submit` hands over a step's snapshot; one that has not been taken yet when the
    next arrives is dropped for it (versions still grow, and actors always get the newest).
    Each snapshot is first passed to ``check`` (the learner's finite check): one that fails is
    not published, nothing is published after it, and :attr:`failed` holds its version. An
    error in the thread is raised again by the next :meth:`submit` or :meth:`flush`.
    :meth:`flush` waits until everything submitted is published (or failed); :meth:`close`
    publishes what is pending and ends the thread, raising nothing.
    """

    def __init__(self, store: ParameterStore, check=None, name: str = "param-publisher"):
        self._store = store
        self._check = check
        self._cond = threading.Condition()
        self._pending: Optional[Tuple[int, Mapping[str, np.ndarray]]] = None
        self._busy = False
        self._closed = False
        self._error: Optional[BaseException] = None
        self.failed: Optional[int] = None
        self.published = 0  # snapshots published
        self.dropped = 0  # snapshots replaced by a newer one before they were taken
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, version: int, params: Mapping[str, np.ndarray]) -> None:
        """Queues ``params`` as ``version`` (the arrays must not change afterwards)."""
        with self._cond:
            self._raise_error()
            if self._closed:
                raise RuntimeError("the parameter publisher is closed.")
            if self.failed is not None:
                return  # after a snapshot failed its check nothing more is published
            if self._pending is not None:
                self.dropped += 1
            self._pending = (int(version), params)
            self._cond.notify_all()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Waits until every submitted snapshot is published or failed; False on timeout."""
        with self._cond:
            done = self._cond.wait_for(
                lambda: self._error is not None or not self._thread.is_alive()
                or (self._pending is None and not self._busy), timeout)
            self._raise_error()
            return done

    def close(self, timeout: Optional[float] = 30.0) -> None:
        """Publishes what is pending, then ends the thread. Raises nothing (it runs while a
        learner shuts down): an error not yet raised to a caller is logged."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            if self._error is not None:
                log.error("publishing the learner's parameters failed: %s", self._error)
                self._error = None

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"publishing the learner's parameters failed: {error}") from error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return  # closed, nothing left
                (version, params), self._pending = self._pending, None
                self._busy = True
            try:
                if self._check is not None and not self._check(params):
                    with self._cond:
                        self.failed = version
                        self._pending = None
                else:
                    self._store.publish(params, version=version)
                    self.published += 1
            except BaseException as exc:  # handed to the training loop's thread
                with self._cond:
                    self._error = exc
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
