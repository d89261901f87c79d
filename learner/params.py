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

import threading
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from impala_rep.config import MAX_PARAM_REFRESH_LAG
from impala_rep.proto import transport_pb2
from impala_rep.wire import encode_tensor

__all__ = ["ParameterStore"]


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
        """Stores a copy of ``params`` as the next version (or ``version``, which must grow)."""
        if not params:
            raise ValueError("publish() needs at least one named parameter array.")
        snapshot = {str(k): np.array(v, copy=True) for k, v in params.items()}
        with self._lock:
            new_version = self._version + 1 if version is None else int(version)
            if new_version <= self._version:
                raise ValueError(
                    f"parameter version must grow: have {self._version}, got {new_version}."
                )
        msg = transport_pb2.GetParametersResponse(version=new_version, up_to_date=False)
        for name, arr in snapshot.items():
            encode_tensor(name, arr, out=msg.tensors.add())
        payload = msg.SerializeToString()
        up_to_date = transport_pb2.GetParametersResponse(version=new_version, up_to_date=True).SerializeToString()
        with self._lock:
            if new_version <= self._version:  # a concurrent publish got there first
                raise ValueError(f"parameter version must grow: have {self._version}, got {new_version}.")
            for arr in snapshot.values():
                arr.setflags(write=False)
            self._version, self._params = new_version, snapshot
            self._payload, self._up_to_date = payload, up_to_date
            self._changed.notify_all()
        return new_version

    def get(self) -> Tuple[int, Dict[str, np.ndarray]]:
        """(version, {name: read-only array}) of the newest snapshot ((0, {}) before any)."""
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
