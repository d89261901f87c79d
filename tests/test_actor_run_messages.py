"""What `python -m actors.run` prints when the learner refuses its token or serves TLS it does
not use: sentences naming the actor's own settings (IMPALA_REP_TOKEN, --tls-ca). Loopback only."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_client_messages import make_certificate
from test_transport_helpers import small_spec, start_server

pytestmark = pytest.mark.timeout(90)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_actor(address: str, token=None, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "IMPALA_REP_TOKEN"}
    if token is not None:
        env["IMPALA_REP_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "actors.run", "--learner-address", address, "--give-up-after", "1", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )


def test_a_wrong_token_in_the_environment_is_named_on_the_command_line():
    server = start_server(small_spec(), token="SECRET")
    try:
        done = run_actor(server.address, "wrong")
    finally:
        server.stop(0)
    assert done.returncode == 2, done.stderr[-2000:]
    assert ("the learner refused this client: the call carries a wrong token; set IMPALA_REP_TOKEN (or pass "
            "--token) to the learner's shared token") in done.stderr
    assert "SECRET" not in done.stderr


def test_no_tls_ca_against_a_tls_learner_names_the_flag(tmp_path):
    cert, key = make_certificate(tmp_path)
    server = start_server(small_spec(), tls_cert_file=str(cert), tls_key_file=str(key))
    try:
        done = run_actor(server.address)
    finally:
        server.stop(0)
    assert done.returncode == 3, done.stderr[-2000:]
    assert f"the learner at {server.address} has been unreachable for 1 s" in done.stderr
    assert "is it running? If it serves TLS, pass its certificate with --tls-ca" in done.stderr
