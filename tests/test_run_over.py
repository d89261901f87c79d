"""When the learner's run ends, its server tells the actors (OUT_OF_RANGE), and they stop
instead of retrying until they give up. Loopback only; each test bounded in time."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

from actors.client import LearnerClient, LearnerFinishedError
import learner.server
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


@contextlib.contextmanager
def _streaming(capacity: int, **client_options):
    """(server, send): a server whose queue holds ``capacity`` unrolls and nothing consumes, and
    ``send(timeout=None)`` queueing a fresh unroll on a connected client that streams one unroll
    a message (built with ``client_options`` besides)."""
    spec = small_spec()
    server = start_server(spec, capacity=capacity)
    client = LearnerClient(server.address, give_up_after_s=30, unrolls_per_message=1, **client_options)
    rng = np.random.default_rng(0)
    try:
        client.connect()
        yield server, lambda timeout=None: client.send(make_unroll(spec, rng), policy_version=1, timeout=timeout)
    finally:
        client.close(drain=False, timeout=2)
        server.stop(0)


def _wait_queued(server, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(server.queue) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(server.queue) == n


def _sends_until_run_over(send) -> None:
    """Sends until the client raises that the run is over (within 10 s), else fails."""
    with pytest.raises(LearnerFinishedError):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            send(timeout=2)
            time.sleep(0.05)


def test_stop_ends_an_open_unroll_stream_with_the_run_over():
    # The queue fills (nothing consumes it, as when the learner has stopped training), so the
    # stream handler is blocked putting an unroll when the learner stops: the client learns the
    # run is over from the stream and raises it on its next send.
    with _streaming(capacity=2) as (server, send):
        for _ in range(4):
            send()
        _wait_queued(server, 2)
        stopper = threading.Thread(target=server.stop, kwargs={"grace": 1.0, "drain": 5.0})
        t0 = time.monotonic()
        stopper.start()
        stopper.join(10)
        assert not stopper.is_alive() and time.monotonic() - t0 < 5  # the stream ended within the drain
        _sends_until_run_over(send)


@pytest.mark.parametrize("backoff_initial_s", [0.1, 6.0], ids=["default-backoff", "backoff-past-the-wait"])
def test_an_actor_between_two_slow_unrolls_hears_it_after_the_learner_is_gone(backoff_initial_s):
    # An actor whose next unroll is far off (a slow env, a long unroll) when the learner stops
    # with a short drain: its stream is cut, its client reconnects at once and hears that the
    # run is over, and the actor raises it at its next send, after the server has stopped,
    # instead of retrying a learner that is gone until it gives up. At once whatever its
    # backoff: a client whose first backoff is longer than the server's wait for cut peers
    # (RUN_OVER_RECONNECT_S, 2 s; a first backoff of 6 s sleeps 3-6 s with its jitter) hears it too.
    with _streaming(capacity=64, backoff_initial_s=backoff_initial_s,
                    backoff_max_s=max(10.0, backoff_initial_s)) as (server, send):
        send()
        send()
        _wait_queued(server, 2)
        t0 = time.monotonic()
        server.stop(grace=0.5, drain=0.1)
        assert time.monotonic() - t0 < learner.server.RUN_OVER_RECONNECT_S  # told well before the wait's end
        assert server._server is None  # stopped: nothing answers now
        t0 = time.monotonic()
        with pytest.raises(LearnerFinishedError):
            send(timeout=5)
        assert time.monotonic() - t0 < 2  # known already, not learnt by retrying


def test_a_stream_whose_actor_does_not_call_again_holds_the_stop_a_bounded_time(monkeypatch):
    # A raw stream left open by a peer that never reconnects (an actor process that hangs):
    # the stop waits the drain, cuts it, and waits for it no longer than RUN_OVER_RECONNECT_S.
    import grpc

    monkeypatch.setattr(learner.server, "RUN_OVER_RECONNECT_S", 0.5)
    server = start_server(small_spec())
    channel = grpc.insecure_channel(server.address)
    idle = threading.Event()

    def requests():
        idle.wait(10)  # sends nothing until the test ends
        return
        yield  # noqa: unreachable - makes this a generator

    call = channel.stream_unary(f"/{learner.server.SERVICE_NAME}/StreamUnrolls").future(requests())
    try:
        deadline = time.monotonic() + 5
        while not server._open_streams and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(server._open_streams) == 1
        t0 = time.monotonic()
        server.stop(grace=0.2, drain=0.1)
        assert 0.5 <= time.monotonic() - t0 < 2.5  # the drain, the cut and the 0.5 s wait, then stopped
        with pytest.raises(grpc.RpcError) as err:
            call.result(timeout=5)
        assert err.value.code() == grpc.StatusCode.CANCELLED
    finally:
        idle.set()
        channel.close()
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
