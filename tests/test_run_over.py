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
def _streaming(capacity: int):
    """(server, send): a server whose queue holds ``capacity`` unrolls and nothing consumes, and
    ``send(timeout=None)`` queueing a fresh unroll on a connected client that streams one unroll
    a message."""
    spec = small_spec()
    server = start_server(spec, capacity=capacity)
    client = LearnerClient(server.address, give_up_after_s=30, unrolls_per_message=1)
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


def test_stop_waits_for_a_slow_stream_to_send_its_next_unroll():
    # An actor whose unrolls come 1.2 s apart, and a stop with a 0.1 s drain between two of them
    # (a learner whose final save was quick): the server waits for the stream's next message,
    # due by its last gap between messages, so the actor hears that the run is over instead of
    # finding the learner gone and retrying until it gives up.
    gap = 1.2
    with _streaming(capacity=64) as (server, send):
        for i in range(3):
            if i:
                time.sleep(gap)
            last = time.monotonic()
            send()
        _wait_queued(server, 3)
        stopper = threading.Thread(target=server.stop, kwargs={"grace": 1.0, "drain": 0.1})
        stopper.start()
        time.sleep(max(0.0, last + gap - time.monotonic()))
        assert stopper.is_alive()  # still waiting for the stream, past its 0.1 s drain
        _sends_until_run_over(send)
        stopper.join(10)
        assert not stopper.is_alive()


def test_a_silent_stream_is_cut_after_its_next_message_was_due():
    # A stream that stops sending (an actor stopped or stuck) holds the stop only until its
    # next message was due (its last message + 1.5 gaps + 0.5 s), not for the whole cap.
    with _streaming(capacity=64) as (server, send):
        send()
        time.sleep(0.3)
        send()
        _wait_queued(server, 2)
        t0 = time.monotonic()
        server.stop(grace=0.5, drain=0.1)
        assert time.monotonic() - t0 < 3  # 0.3 s gaps: due within about a second, not 15 s


def test_the_cap_on_waiting_for_next_messages_leaves_the_drain_as_given(monkeypatch):
    # The cap bounds only the wait for a stream's next message: a stop's own drain, here longer
    # than the (shrunk) cap, still holds for a stream whose next message is due later still.
    monkeypatch.setattr(learner.server, "RUN_OVER_DRAIN_MAX_S", 0.2)
    with _streaming(capacity=64) as (server, send):
        send()
        time.sleep(1.0)
        send()  # next due about 2 s after this
        _wait_queued(server, 2)
        t0 = time.monotonic()
        server.finish(drain=0.6, next_messages=True)
        assert 0.55 <= time.monotonic() - t0 < 1.5  # the drain's 0.6 s, not the cap's 0.2 or the due 2 s


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
