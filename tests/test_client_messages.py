"""The sentences LearnerClient raises name what a user sets: IMPALA_REP_TOKEN / --token for a
refused token, --tls-ca for a plaintext client that cannot reach a TLS learner. Loopback only."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from actors.client import AuthenticationError, LearnerClient, LearnerUnavailableError, _token_problem

from test_transport_helpers import small_spec, start_server

pytestmark = pytest.mark.timeout(60)


def make_certificate(tmp_path):
    """A self-signed certificate for 127.0.0.1 and localhost: (cert, key) paths."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


@pytest.mark.parametrize("token, what", [("wrong", "a wrong token"), (None, "no token")])
def test_a_refused_token_names_the_environment_variable_and_the_flag(token, what):
    server = start_server(small_spec(), token="SECRET")
    try:
        assert server.address.startswith("127.0.0.1:")
        client = LearnerClient(server.address, token=token, give_up_after_s=5)
        try:
            with pytest.raises(AuthenticationError) as info:
                client.connect()
        finally:
            client.close(drain=False)
    finally:
        server.stop(0)
    assert str(info.value) == (
        f"the learner refused this client: the call carries {what}; set IMPALA_REP_TOKEN (or pass --token) to the "
        "learner's shared token, the --token or IMPALA_REP_TOKEN it was started with "
        "(LearnerClient(token=...) in code)."
    )
    assert "SECRET" not in str(info.value)


def test_token_problem_keeps_a_learners_own_wording():
    assert _token_problem("the call carries a wrong token; pass it (metadata x).") == "the call carries a wrong token"
    assert _token_problem("some other learner says no.") == "some other learner says no"
    assert _token_problem("") == "the call carries no valid token"


def test_a_plaintext_client_against_a_tls_learner_is_told_to_pass_tls_ca(tmp_path):
    cert, key = make_certificate(tmp_path)
    server = start_server(small_spec(), tls_cert_file=str(cert), tls_key_file=str(key))
    try:
        client = LearnerClient(server.address, backoff_initial_s=0.05, backoff_max_s=0.2, give_up_after_s=1.0)
        t0 = time.monotonic()
        try:
            with pytest.raises(LearnerUnavailableError) as info:
                client.connect()
        finally:
            client.close(drain=False)
        assert time.monotonic() - t0 < 10
    finally:
        server.stop(0)
    message = str(info.value)
    assert message.startswith(f"the learner at {server.address} has been unreachable for 1 s (handshake: UNAVAILABLE")
    assert message.endswith("; is it running? If it serves TLS, pass its certificate with --tls-ca "
                            "(LearnerClient(root_certificates=...) in code).")


def test_a_tls_client_against_a_plaintext_learner_is_told_it_serves_no_tls(tmp_path):
    cert, _ = make_certificate(tmp_path)
    server = start_server(small_spec())
    try:
        client = LearnerClient(server.address, root_certificates=str(cert), backoff_initial_s=0.05,
                               backoff_max_s=0.2, give_up_after_s=1.0)
        try:
            with pytest.raises(LearnerUnavailableError) as info:
                client.connect()
        finally:
            client.close(drain=False)
    finally:
        server.stop(0)
    message = str(info.value)
    assert "--tls-ca (" not in message  # not the plaintext client's hint
    # Unconditional: a grpcio that words the failed handshake otherwise (1.85 says
    # WRONG_VERSION_NUMBER, actors/client.py's _PLAINTEXT_PEER) would lose the user this hint.
    assert message.endswith(" The learner answers without TLS: start it with --tls-cert and --tls-key, "
                            "or run the actors without --tls-ca."), message


def test_an_unreachable_learner_with_tls_gets_no_tls_hint(tmp_path):
    import socket

    cert, _ = make_certificate(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = LearnerClient(f"127.0.0.1:{port}", root_certificates=str(cert), backoff_initial_s=0.05,
                           backoff_max_s=0.2, give_up_after_s=0.5)
    try:
        with pytest.raises(LearnerUnavailableError) as info:
            client.connect()
    finally:
        client.close(drain=False)
    assert str(info.value).endswith("; is it running?")
