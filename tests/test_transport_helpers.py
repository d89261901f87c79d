"""Shared helpers for the transport tests (no tests here). TensorFlow-free."""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List

import grpc
import numpy as np

from impala_rep.proto import transport_pb2
from impala_rep.specs import ArraySpec, EnvSpec, unroll_spec
from learner.params import ParameterStore
from learner.queue import QueueClosed, UnrollQueue
from learner.server import LearnerServer

T = 4
FRAME_STACK = {"pixels": 3}


def small_env_spec(action: str = "discrete") -> EnvSpec:
    if action == "discrete":
        act = ArraySpec("action", (), "int32", num_values=3)
    else:
        act = ArraySpec("action", (2,), "float32", minimum=(-1.0, -2.0), maximum=(1.0, 2.0))
    return EnvSpec(
        observations={
            "pixels": ArraySpec("pixels", (8, 8, 3), "uint8"),
            "position": ArraySpec("position", (2,), "float32"),
        },
        action=act,
    )


def small_spec(action: str = "discrete") -> Dict[str, ArraySpec]:
    return unroll_spec(small_env_spec(action), T, frame_stack=FRAME_STACK)


def make_unroll(spec: Dict[str, ArraySpec], rng: np.random.Generator, tag: float = 0.0) -> Dict[str, np.ndarray]:
    """A valid unroll; ``reward[1:]`` all equal ``tag`` so tests can tell unrolls apart."""
    out = {}
    for key, s in spec.items():
        if s.dtype == "uint8":
            out[key] = rng.integers(0, 256, s.shape).astype(np.uint8)
        elif s.num_values is not None:
            out[key] = rng.integers(0, s.num_values, s.shape).astype(s.dtype)
        else:
            out[key] = rng.uniform(-0.5, 0.5, s.shape).astype(s.dtype)
    out["step_type"] = np.full(spec["step_type"].shape, 1, np.uint8)
    out["discount"] = np.ones(spec["discount"].shape, np.float32)
    out["reward"] = np.full(spec["reward"].shape, tag, np.float32)
    return out


def start_server(spec=None, capacity: int = 64, **kwargs) -> LearnerServer:
    spec = spec or small_spec()
    kwargs.setdefault("frame_stack", FRAME_STACK)
    server = LearnerServer(spec, T, UnrollQueue(capacity), kwargs.pop("params", ParameterStore()), **kwargs)
    server.start()
    return server


class Drain:
    """Background consumer that empties a queue and keeps what it took (bounded run)."""

    def __init__(self, q: UnrollQueue, keep: bool = True):
        self.q, self.keep = q, keep
        self.items: List = []
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                item = self.q.get(timeout=0.05)
            except (TimeoutError, QueueClosed):
                continue
            self.count += 1
            if self.keep:
                self.items.append(item)

    def stop(self):
        self._stop.set()
        self._thread.join(5)


def raw_stream(address: str, payloads, method: str = "StreamUnrolls", token=None):
    """Sends already-serialized messages on one client stream of ``method``; the StreamSummary."""
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)])
    call = channel.stream_unary(f"/impala_rep.transport.Learner/{method}", request_serializer=lambda b: b,
                                response_deserializer=transport_pb2.StreamSummary.FromString)
    try:
        metadata = (("x-impala-token", token),) if token is not None else ()
        return call(iter(payloads), metadata=metadata, timeout=20)
    finally:
        channel.close()


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)
