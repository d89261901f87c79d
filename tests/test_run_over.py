"""When the learner's run ends, its server tells the actors (OUT_OF_RANGE), and they stop
instead of retrying until they give up. Loopback only; each test bounded in time."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from actors.client import LearnerClient, LearnerFinishedError
from learner.server import RUN_OVER
from test_transport_helpers import make_unroll, small_spec, start_server

pytestmark = pytest.mark.timeout(60)


def test_calls_after_finish_say_the_run_is_over():
    server = start_server(small_spec())
    client = LearnerClient(server.address, give_up_after_s=30)
    try:
        client.connect()
        server.finish(drain=0)
        t0 = time.monotonic()
        with pytest.raises(LearnerFinishedError) as err:
            client.get_parameters()
        assert time.monotonic() - t0 < 5  # not retried until the give-up time
        assert str(err.value) == f"the learner at {server.address} says: {RUN_OVER}"
        fresh = LearnerClient(server.address, give_up_after_s=30)
        with pytest.raises(LearnerFinishedError):
            fresh.connect()  # the handshake too
        fresh.close(drain=False, timeout=2)
    finally:
        client.close(drain=False, timeout=2)
        server.stop(0)


def test_stop_ends_an_open_unroll_stream_with_the_run_over():
    # The queue fills (nothing consumes it, as when the learner has stopped training), so the
    # stream handler is blocked putting an unroll when the learner stops: the client learns the
    # run is over from the stream and raises it on its next send.
    spec = small_spec()
    server = start_server(spec, capacity=2)
    client = LearnerClient(server.address, give_up_after_s=30, unrolls_per_message=1)
    rng = np.random.default_rng(0)
    try:
        client.connect()
        for _ in range(4):
            client.send(make_unroll(spec, rng), policy_version=1)
        deadline = time.monotonic() + 10
        while len(server.queue) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(server.queue) == 2
        stopper = threading.Thread(target=server.stop, kwargs={"grace": 1.0, "drain": 5.0})
        t0 = time.monotonic()
        stopper.start()
        stopper.join(10)
        assert not stopper.is_alive() and time.monotonic() - t0 < 5  # the stream ended within the drain
        with pytest.raises(LearnerFinishedError):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                client.send(make_unroll(spec, rng), policy_version=1, timeout=1)
                time.sleep(0.05)
    finally:
        client.close(drain=False, timeout=2)
        server.stop(0)


def test_a_stopped_server_started_again_serves():
    server = start_server(small_spec())
    server.stop(0)
    server.start()
    client = LearnerClient(server.address, give_up_after_s=10)
    try:
        assert client.connect().unroll_length > 0
    finally:
        client.close(drain=False, timeout=2)
        server.stop(0)
