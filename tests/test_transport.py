"""Server + client over loopback: handshake, 8 concurrent clients, parameters, restart with
reconnect, queue bound under a flood, stream limit, TLS, default bind address."""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest

from actors.client import LearnerClient, LearnerFinishedError, LearnerUnavailableError, TransportError
from learner.params import ParameterStore
from learner.queue import UnrollQueue
from learner.server import LearnerServer

from impala_rep.specs import ArraySpec, EnvSpec, unroll_spec

from test_transport_helpers import (
    FRAME_STACK, T, Drain, make_unroll, small_env_spec, small_spec, start_server, wait_for,
)


def test_handshake_announces_spec_limits_version_and_run_config():
    spec = small_spec("continuous")
    params = ParameterStore()
    params.publish({"w": np.ones(2, np.float32)})
    run_config = {"env_id": "dmc/cartpole-swingup", "env_kwargs": {"size": 84}, "network": {"torso": "shallow"}}
    server = start_server(spec, params=params, run_config=run_config)
    try:
        assert server.host == "127.0.0.1" and server.address.startswith("127.0.0.1:")
        with LearnerClient(server.address, give_up_after_s=5) as client:
            hs = client.connect()
            assert hs.unroll_spec == spec
            assert list(hs.unroll_spec) == list(spec)
            assert hs.unroll_length == T and hs.frame_stack == FRAME_STACK
            assert hs.parameter_version == 1
            assert hs.max_message_bytes == server.validator.max_message_bytes
            assert hs.run_config_dict() == run_config
            assert hs.server_id == server.server_id
    finally:
        server.stop()


def test_a_learner_that_speaks_another_protocol_is_refused_with_a_sentence(monkeypatch):
    import learner.server as server_module
    from impala_rep.wire import PROTOCOL_VERSION

    monkeypatch.setattr(server_module, "PROTOCOL_VERSION", PROTOCOL_VERSION - 1)
    server = start_server()
    try:
        with LearnerClient(server.address, give_up_after_s=5) as client:
            with pytest.raises(TransportError) as info:
                client.connect()
        assert str(info.value) == (
            f"the learner at {server.address} speaks transport protocol {PROTOCOL_VERSION - 1} and this actor "
            f"speaks {PROTOCOL_VERSION}; run the same impala_rep version on the learner and the actors.")
    finally:
        server.stop()


def test_parameters_newest_or_nothing():
    server = start_server()
    try:
        with LearnerClient(server.address, give_up_after_s=5) as client:
            assert client.get_parameters() is None  # nothing published yet
            server.params.publish({"w": np.arange(4, dtype=np.float32), "b": np.zeros([2, 2], np.int64)})
            version, params = client.get_parameters()
            assert version == 1
            np.testing.assert_array_equal(params["w"], np.arange(4, dtype=np.float32))
            assert params["b"].shape == (2, 2) and params["b"].dtype == np.int64
            assert client.get_parameters() is None  # up to date: nothing sent
            server.params.publish({"w": np.full(4, 7, np.float32), "b": np.zeros([2, 2], np.int64)})
            version, params = client.get_parameters()
            assert version == 2 and params["w"][0] == 7
        m = server.snapshot_metrics()
        assert m["parameter_requests"] == 4 and m["parameters_sent"] == 2
    finally:
        server.stop()


def test_refresh_lag_sends_parameters_only_to_callers_that_many_versions_behind():
    server = start_server(refresh_lag=3)
    try:
        publish = lambda v: server.params.publish({"w": np.full(4, v, np.float32)})  # noqa: E731
        with LearnerClient(server.address, give_up_after_s=5) as client:
            publish(1)
            version, params = client.get_parameters()  # holding none: sent whatever the lag
            assert version == 1 and params["w"][0] == 1
            publish(2)
            publish(3)
            assert client.get_parameters() is None  # 2 behind, fewer than 3: keeps version 1
            publish(4)
            version, params = client.get_parameters()  # 3 behind: the newest, not the next
            assert version == 4 and params["w"][0] == 4
            assert client.get_parameters() is None
        m = server.snapshot_metrics()
        assert m["parameter_requests"] == 4 and m["parameters_sent"] == 2
    finally:
        server.stop()


def test_a_prefetch_brings_the_version_newest_when_it_was_asked_and_get_takes_it():
    server = start_server()
    publish = lambda v: server.params.publish({"w": np.full(4, v, np.float32)})  # noqa: E731
    try:
        with LearnerClient(server.address, give_up_after_s=5) as client:
            publish(1)
            client.prefetch_parameters()
            wait_for(lambda: server.snapshot_metrics()["parameters_sent"] == 1, 10, "the prefetch's reply")
            client.prefetch_parameters()  # one in flight already: not asked again
            publish(2)
            version, params = client.get_parameters()  # the prefetched answer, not a new call
            assert version == 1 and params["w"][0] == 1
            client.prefetch_parameters()
            version, params = client.get_parameters()  # asked holding 1: the newest
            assert version == 2 and params["w"][0] == 2
            client.prefetch_parameters()
            assert client.get_parameters() is None  # up to date
        m = server.snapshot_metrics()
        assert m["parameter_requests"] == 3 and m["parameters_sent"] == 2
    finally:
        server.stop()


def test_a_prefetch_cancelled_by_a_closing_client_ends_the_fetch_with_a_sentence():
    # A socket that accepts connections and never answers: the prefetch stays in flight.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        client = LearnerClient(f"127.0.0.1:{silent.getsockname()[1]}", give_up_after_s=5)
        client.prefetch_parameters()
        assert client._prefetched.cancel()  # what close() does to a prefetch in flight
        with pytest.raises(TransportError, match="the parameter fetch was cancelled: this client is closing"):
            client.get_parameters()
        client.close(drain=False)
    finally:
        silent.close()


def test_a_prefetch_that_fails_is_asked_again_with_retries():
    server = start_server()
    port = server.port
    server.params.publish({"w": np.full(4, 5, np.float32)})
    client = LearnerClient(server.address, backoff_initial_s=0.05, backoff_max_s=0.2, give_up_after_s=30)
    try:
        client.connect()
        server.stop(0)
        client.prefetch_parameters()  # fails: nothing listens now
        call = client._prefetched
        wait_for(call.done, 10, "the prefetch to fail")
        assert call.exception() is not None and call.exception().code() == grpc.StatusCode.UNAVAILABLE
        server2 = start_server(port=port)
        try:
            server2.params.publish({"w": np.full(4, 9, np.float32)})
            version, params = client.get_parameters()
            assert version == 1 and params["w"][0] == 9
            assert server2.snapshot_metrics()["parameters_sent"] == 1
        finally:
            server2.stop()
    finally:
        client.close(drain=False)


def test_parameter_store_reply_and_its_checks():
    store = ParameterStore()
    assert store.reply(0, refresh_lag=5) == (store.response_bytes(0), False)  # nothing published
    for v in range(1, 5):
        store.publish({"w": np.full(2, v, np.float32)})
    payload, sent = store.reply(0, refresh_lag=1000)
    assert sent and payload == store.response_bytes(1)
    assert store.reply(2, refresh_lag=2) == (payload, True)
    assert store.reply(3, refresh_lag=2)[1] is False and store.reply(3)[1] is True
    assert store.reply(4)[1] is False and store.reply(9)[1] is False  # a caller ahead is not sent older ones
    for bad in (0, -1, 1001):
        with pytest.raises(ValueError, match="refresh_lag must be from 1 to 1000"):
            store.reply(1, refresh_lag=bad)


def test_eight_concurrent_clients_stream_intact_unrolls():
    spec = small_spec()
    server = start_server(spec, capacity=16)
    drain = Drain(server.queue)
    n_clients, per_client = 8, 25
    errors = []

    def actor(i):
        try:
            rng = np.random.default_rng(i)
            with LearnerClient(server.address, actor_id=f"actor-{i}", give_up_after_s=20) as client:
                client.connect()
                for j in range(per_client):
                    client.send(make_unroll(spec, rng, tag=i * 1000 + j), policy_version=j, timeout=20,
                                episode_returns=[float(i)], episode_lengths=[j + 1])
                assert client.flush(20)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    try:
        threads = [threading.Thread(target=actor, args=(i,)) for i in range(n_clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors
        wait_for(lambda: drain.count == n_clients * per_client, 30, "every unroll")
    finally:
        drain.stop()
        server.stop()
    by_actor = {}
    for item in drain.items:
        by_actor.setdefault(item.actor_id, []).append(item)
    assert sorted(by_actor) == [f"actor-{i}" for i in range(n_clients)]
    for i in range(n_clients):
        items = by_actor[f"actor-{i}"]
        tags = [float(it.tensors["reward"][1]) for it in items]
        assert tags == [i * 1000 + j for j in range(per_client)]  # in order, none lost or mixed
        assert [it.policy_version for it in items] == list(range(per_client))
        assert [int(it.episode_lengths[0]) for it in items] == [j + 1 for j in range(per_client)]
        assert all(it.tensors[k].shape == s.shape for it in items for k, s in spec.items())
    m = server.snapshot_metrics()
    assert m["unrolls_accepted"] == n_clients * per_client and m["unrolls_rejected"] == 0
    assert m["frames_accepted"] == n_clients * per_client * T and m["frames_per_second"] > 0


def test_queue_bound_holds_under_a_flood_and_backpressure_blocks_clients():
    env = small_env_spec()
    env = EnvSpec({"pixels": ArraySpec("pixels", (64, 64, 3), "uint8")}, env.action)
    spec = unroll_spec(env, T, frame_stack=FRAME_STACK)  # about 90 KB per unroll
    unroll_bytes = sum(s.nbytes for s in spec.values())
    capacity = 4
    server = start_server(spec, capacity=capacity)
    clients = [LearnerClient(server.address, actor_id=f"flood-{i}", outbox_size=2, give_up_after_s=20) for i in range(8)]
    stop = threading.Event()
    timeouts = []

    def flood(client, seed):
        rng = np.random.default_rng(seed)
        u = make_unroll(spec, rng)
        while not stop.is_set():
            try:
                client.send(u, policy_version=0, timeout=0.2)
            except TimeoutError:
                timeouts.append(1)
            except TransportError:  # closed by the test's clean-up
                return

    threads = [threading.Thread(target=flood, args=(c, i)) for i, c in enumerate(clients)]
    try:
        for th in threads:
            th.start()
        deadline = time.monotonic() + 2.0
        sizes = []
        while time.monotonic() < deadline:
            sizes.append(len(server.queue))
            time.sleep(0.01)
        assert max(sizes) <= capacity and server.queue.max_size_seen == capacity
        assert server.metrics.unrolls_accepted == capacity  # nothing consumed: nothing more got in
        assert timeouts, "full queue must block the clients' send()"
        sent = sum(c.unrolls_sent for c in clients)
        # Handed to gRPC but held back by flow control and blocked handlers: bounded by the
        # HTTP/2 windows (a few MiB per stream), not growing with time.
        time.sleep(0.5)
        assert sum(c.unrolls_sent for c in clients) - sent <= 8 * 2, "sends must stay blocked"
        print(f"flood: {sent} unrolls ({sent * unroll_bytes / 2**20:.1f} MiB) handed to gRPC by 8 clients")
        assert sent * unroll_bytes < 8 * 4 * 2**20, sent
        # draining lets the traffic flow again
        drain = Drain(server.queue, keep=False)
        wait_for(lambda: server.metrics.unrolls_accepted > capacity + 20, 20, "traffic after draining")
        stop.set()
        for th in threads:
            th.join(10)
        drain.stop()
    finally:
        stop.set()
        for c in clients:
            c.close(drain=False, timeout=2)
        server.stop(0)


def test_clients_reconnect_on_their_own_after_a_server_restart():
    spec = small_spec()
    server = start_server(spec, capacity=64)
    port = server.port
    drain = Drain(server.queue, keep=False)
    client = LearnerClient(server.address, actor_id="persistent", backoff_initial_s=0.05, backoff_max_s=0.5,
                           give_up_after_s=30)
    hs1 = client.connect()
    rng = np.random.default_rng(0)
    for _ in range(5):
        client.send(make_unroll(spec, rng), policy_version=0, timeout=10)
    wait_for(lambda: server.metrics.unrolls_accepted == 5, 10, "the first unrolls")
    drain.stop()
    server.stop(0, finish=False)  # the learner is gone, not done (a restart resumes the run)
    # Unrolls the sender hands to the open stream before gRPC reports it broken are in flight
    # and lost with the learner; how many depends on the machine's load. Count from the
    # moment the client has noticed (its first reconnect attempt).
    wait_for(lambda: client.reconnects >= 1, 10, "the client to notice that the learner is gone")
    # the learner is away: the caller keeps producing; send() blocks at most while the outbox is full
    sent_while_down = 0
    t_end = time.monotonic() + 1.0
    while time.monotonic() < t_end:
        try:
            client.send(make_unroll(spec, rng), policy_version=0, timeout=0.2)
            sent_while_down += 1
        except TimeoutError:
            pass
    # The bounded outbox (one message by default) and at most one held back per stream. With the
    # former default of 4 this counted 5: an actor that outruns its learner holds few unrolls back.
    assert sent_while_down <= 1 + 2
    server2 = LearnerServer(spec, T, UnrollQueue(64), ParameterStore(), frame_stack=FRAME_STACK, port=port)
    server2.start()
    drain2 = Drain(server2.queue, keep=False)
    try:
        for _ in range(5):
            client.send(make_unroll(spec, rng), policy_version=0, timeout=20)
        assert client.flush(20)
        wait_for(lambda: server2.metrics.unrolls_accepted >= 5, 20, "unrolls after the restart")
        assert client.reconnects >= 1
        assert client.handshake_info.server_id == server2.server_id != hs1.server_id
    finally:
        client.close(drain=False)
        drain2.stop()
        server2.stop(0)


def test_gives_up_with_a_clear_error_when_no_learner_answers():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = LearnerClient(f"127.0.0.1:{port}", backoff_initial_s=0.05, backoff_max_s=0.2, give_up_after_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(LearnerUnavailableError, match="unreachable"):
        client.connect()
    assert time.monotonic() - t0 < 10
    client.close(drain=False)


def test_interrupt_ends_a_wait_for_an_absent_learner_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = LearnerClient(f"127.0.0.1:{port}", backoff_initial_s=0.05, backoff_max_s=0.2, give_up_after_s=60)
    threading.Timer(0.5, client.interrupt).start()
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="closed while waiting for the learner"):
        client.connect()
    assert time.monotonic() - t0 < 5  # not the 60 s it would give the learner
    client.close(drain=False)


@contextlib.contextmanager
def _one_stream_taken(spec, b_give_up_s: float, b_backoff=(0.05, 0.2), keep: bool = False):
    """A learner serving one stream at most, client a's stream open on it (one unroll of tag -1
    accepted) and client b waiting to be refused: yields (server, drain, a, b, rng)."""
    server = start_server(spec, capacity=256, max_streams=1)
    drain = Drain(server.queue, keep=keep)
    a = LearnerClient(server.address, actor_id="a", give_up_after_s=20)
    b = LearnerClient(server.address, actor_id="b", backoff_initial_s=b_backoff[0], backoff_max_s=b_backoff[1],
                      give_up_after_s=b_give_up_s)
    try:
        rng = np.random.default_rng(0)
        a.send(make_unroll(spec, rng, tag=-1.0), policy_version=0)
        wait_for(lambda: server.metrics.unrolls_accepted == 1, 10, "client a's stream")
        yield server, drain, a, b, rng
    finally:
        b.close(drain=False)
        a.close(drain=False)
        drain.stop()
        server.stop(0)


def test_streams_beyond_the_limit_are_refused_and_retried():
    spec = small_spec()
    with _one_stream_taken(spec, b_give_up_s=20) as (server, _, a, b, rng):
        b.send(make_unroll(spec, rng), policy_version=0)
        wait_for(lambda: server.metrics.streams_refused >= 1, 10, "a refused stream")
        a.close()  # frees the slot; b's retry gets in
        wait_for(lambda: server.metrics.unrolls_accepted == 2, 20, "client b after a left")
        b.close()


def test_a_client_refused_again_and_again_for_the_stream_limit_loses_and_repeats_nothing():
    """Client b is refused (one stream at most) while it keeps sending: every unroll it sent
    reaches the learner exactly once, in order, after a leaves."""
    spec = small_spec()
    with _one_stream_taken(spec, b_give_up_s=30, b_backoff=(0.02, 0.05), keep=True) as (server, drain, a, b, rng):
        n = 30
        sender = threading.Thread(
            target=lambda: [b.send(make_unroll(spec, rng, tag=float(i)), policy_version=0, timeout=30) for i in range(n)],
            daemon=True)
        sender.start()
        wait_for(lambda: server.metrics.streams_refused >= 10, 20, "ten refused streams")
        a.close()
        sender.join(30)
        assert not sender.is_alive()
        b.close()
        wait_for(lambda: drain.count == n + 1, 20, "every unroll")
        tags = [float(it.tensors["reward"][1]) for it in drain.items if it.actor_id == "b"]
        assert tags == [float(i) for i in range(n)], tags
        assert b.unrolls_sent == n


class _StreamLimitRefusal(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return "the learner serves at most 1 unroll streams at once, one per actor process"


class _PullsThenRefuses:
    """A stream call that, like gRPC before a refusal arrives, pulls up to ``pull`` messages
    from the client's requests, then fails with the learner's stream-limit refusal."""

    def __init__(self, requests, pull: int):
        self.pulled: list = []
        self._done = threading.Event()
        self._callbacks: list = []

        def consume():
            for payload in requests:
                self.pulled.append(payload)
                if len(self.pulled) >= pull:
                    break
            self._done.set()
            for fn in self._callbacks:
                fn(self)

        threading.Thread(target=consume, daemon=True).start()

    def initial_metadata(self):
        return ()  # a refusal's: no STREAM_ACCEPTED

    def add_done_callback(self, fn):
        self._callbacks.append(fn)

    def result(self, timeout=None):
        assert self._done.wait(10)
        raise _StreamLimitRefusal()

    def cancel(self):
        return False


def test_what_grpc_pulled_before_a_stream_limit_refusal_is_sent_again_not_lost():
    """gRPC may pull several messages from a stream's requests before the learner's refusal
    comes back; the client hands over only the first until the learner confirms the stream, and
    sends that one again."""
    spec = small_spec()
    server = start_server(spec, capacity=64)
    drain = Drain(server.queue, keep=True)
    client = LearnerClient(server.address, actor_id="b", backoff_initial_s=0.02, backoff_max_s=0.05,
                           give_up_after_s=20, unrolls_per_message=1)
    refused = []
    real = dict(client._stream_calls)

    class FirstRefused:
        def __init__(self, batch):
            self.batch = batch

        def future(self, requests, metadata=None):
            if not refused:
                refused.append(_PullsThenRefuses(requests, pull=3))
                return refused[0]
            return real[self.batch].future(requests, metadata=metadata)

    client._stream_calls = {batch: FirstRefused(batch) for batch in (False, True)}
    try:
        rng = np.random.default_rng(0)
        for i in range(4):
            client.send(make_unroll(spec, rng, tag=float(i)), policy_version=0, timeout=20)
        client.flush(timeout=20)
        wait_for(lambda: drain.count == 4, 20, "four unrolls")
        assert [float(it.tensors["reward"][1]) for it in drain.items] == [0.0, 1.0, 2.0, 3.0]
        assert len(refused[0].pulled) == 1  # the rest waited for a confirmed stream
        assert client.unrolls_sent == 4 and client.reconnects == 1
    finally:
        client.close(drain=False)
        drain.stop()
        server.stop(0)


def test_a_client_refused_for_the_stream_limit_is_told_so_not_asked_whether_the_learner_runs():
    spec = small_spec()
    with _one_stream_taken(spec, b_give_up_s=1.0) as (server, _, a, b, rng):
        b.send(make_unroll(spec, rng), policy_version=0)
        wait_for(lambda: b._fatal is not None, 20, "client b giving up")  # its sender thread gave up
        with pytest.raises(LearnerUnavailableError) as info:
            b.send(make_unroll(spec, rng), policy_version=0)
        message = str(info.value)
        assert message.startswith(f"the learner at {server.address} has refused this client for 1 s (unroll stream: "
                                  "RESOURCE_EXHAUSTED: the learner serves at most 1 unroll streams at once"), message
        assert "--max-actor-streams" in message and "is it running?" not in message, message


def test_a_call_retrying_for_an_absent_learner_stops_at_what_the_sender_thread_learnt():
    """The sender thread learns the run is over (OUT_OF_RANGE) while the actor thread is
    already retrying a parameter fetch against the stopped server: the fetch stops at its next
    backoff with that error instead of retrying for give_up_after_s (then 'unreachable')."""
    server = start_server(small_spec())
    client = LearnerClient(server.address, backoff_initial_s=0.05, backoff_max_s=0.2, give_up_after_s=60)
    try:
        client.connect()
        server.stop(0)
        outcome = []
        fetch = threading.Thread(target=lambda: outcome.append(_raised(client.get_parameters)), daemon=True)
        fetch.start()
        time.sleep(0.5)  # retrying UNAVAILABLE by now
        assert fetch.is_alive()
        t0 = time.monotonic()
        client._fatal = LearnerFinishedError("the learner says: the run is over.")  # what the sender thread sets
        fetch.join(10)
        assert not fetch.is_alive() and time.monotonic() - t0 < 2
        assert isinstance(outcome[0], LearnerFinishedError), outcome
    finally:
        client.close(drain=False)


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a self-signed certificate")
def test_tls_with_token(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    spec = small_spec()
    server = start_server(spec, token="tok", tls_cert_file=str(cert), tls_key_file=str(key))
    drain = Drain(server.queue, keep=False)
    try:
        with LearnerClient(server.address, token="tok", root_certificates=str(cert), give_up_after_s=10) as client:
            assert client.connect().unroll_length == T
            client.send(make_unroll(spec, np.random.default_rng(0)), policy_version=0)
            assert client.flush(10)
        wait_for(lambda: server.metrics.unrolls_accepted == 1, 10, "an unroll over TLS")
        plain = LearnerClient(server.address, token="tok", backoff_initial_s=0.05, backoff_max_s=0.1, give_up_after_s=1.0)
        with pytest.raises(LearnerUnavailableError):  # a plaintext client cannot talk to a TLS port
            plain.connect()
        plain.close(drain=False)
    finally:
        drain.stop()
        server.stop(0)
    with pytest.raises(ValueError, match="both"):
        LearnerServer(spec, T, UnrollQueue(1), ParameterStore(), tls_cert_file=str(cert))


def test_server_argument_checks():
    spec = small_spec()
    with pytest.raises(ValueError, match="JSON"):
        LearnerServer(spec, T, UnrollQueue(1), ParameterStore(), run_config="{not json")
    with pytest.raises(ValueError, match="frame_prefix"):
        LearnerServer(spec, T, UnrollQueue(1), ParameterStore(), frame_stack={"position": 2})
    with pytest.raises(ValueError, match="token"):
        LearnerServer(spec, T, UnrollQueue(1), ParameterStore(), token="")
    with pytest.raises(ValueError, match="max_message_bytes"):
        LearnerServer(spec, T, UnrollQueue(1), ParameterStore(), max_message_bytes=10)
    for bad in (0, 1001, 2.0, True):
        with pytest.raises(ValueError, match="refresh_lag must be a whole number of versions from 1 to 1000"):
            LearnerServer(spec, T, UnrollQueue(1), ParameterStore(), refresh_lag=bad)


def test_a_server_that_cannot_listen_says_why_in_a_sentence(tmp_path):
    from test_transport_helpers import T, FRAME_STACK

    busy = start_server(small_spec())
    try:
        port = int(busy.address.rsplit(":", 1)[1])
        cases = [
            (dict(host="127.0.0.1", port=port), "is the port in use, or the host not an interface of this machine?"),
            (dict(host="10.254.254.254", port=0), "could not listen on 10.254.254.254:0"),
        ]
        not_pem = tmp_path / "not.pem"
        not_pem.write_text("not a certificate")
        cases.append((dict(host="127.0.0.1", port=0, tls_cert_file=str(not_pem), tls_key_file=str(not_pem)),
                      "the certificate and key not a PEM pair?"))
        cases.append((dict(host="127.0.0.1", port=0, tls_cert_file=str(tmp_path / "missing.pem"),
                           tls_key_file=str(not_pem)), "cannot read the TLS certificate or key"))
        for kwargs, sentence in cases:
            server = LearnerServer(small_spec(), T, UnrollQueue(4), ParameterStore(), frame_stack=FRAME_STACK, **kwargs)
            with pytest.raises(OSError, match=re.escape(sentence)):
                server.start()
    finally:
        busy.stop(0)


def test_a_certificate_that_does_not_name_the_address_fails_at_once_with_a_sentence(tmp_path):
    # Retried as "learner away" before, an actor waited --give-up-after (300 s) per restart.
    from actors.client import AuthenticationError

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=otherhost"], check=True, capture_output=True)
    server = start_server(small_spec(), tls_cert_file=str(cert), tls_key_file=str(key))
    try:
        client = LearnerClient(server.address, root_certificates=str(cert), give_up_after_s=60)
        t0 = time.monotonic()
        with pytest.raises(AuthenticationError, match="TLS with the learner at .* failed: .*Hostname Verification"
                                                      ".*name the address the actors use .*in its subjectAltName"):
            client.connect()
        assert time.monotonic() - t0 < 10
        client.close(drain=False)
    finally:
        server.stop(0)
