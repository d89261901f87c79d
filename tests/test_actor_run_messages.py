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


def test_supervised_actor_processes_say_why_they_stopped():
    """actors.run --actor-processes P: each process's reason reaches the user (it went to
    /dev/null, and the user saw only 'exited with code 2; restarting it')."""
    server = start_server(small_spec(), token="SECRET")
    try:
        done = run_actor(server.address, "wrong", "--actors", "2", "--actor-processes", "2",
                         "--max-actor-restarts", "0")
    finally:
        server.stop(0)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.count("the learner refused this client: the call carries a wrong token; set "
                             "IMPALA_REP_TOKEN") == 2, done.stderr[-3000:]
    assert done.stderr.count("exited with code 2 and has been restarted 0 times") == 2


def test_supervised_actor_processes_log_to_files_with_log_dir(tmp_path):
    server = start_server(small_spec(), token="SECRET")
    try:
        done = run_actor(server.address, "wrong", "--actors", "2", "--actor-processes", "2",
                         "--max-actor-restarts", "0", "--log-dir", str(tmp_path / "logs"))
    finally:
        server.stop(0)
    assert done.returncode == 1, done.stderr[-2000:]
    for i in range(2):
        with open(tmp_path / "logs" / f"actor-{i}.log") as f:
            assert "carries a wrong token" in f.read()
    # each crash quotes the process's last lines, once, from its file
    assert done.stderr.count("last output:") == 2 and done.stderr.count("carries a wrong token") == 2


def test_actor_seeds_are_drawn_at_random_unless_given_and_must_leave_room_for_the_processes():
    server = start_server(small_spec(), token="SECRET")
    try:
        drawn = [run_actor(server.address, "wrong").stderr for _ in range(2)]
        given = run_actor(server.address, "wrong", "--seed", "7").stderr
    finally:
        server.stop(0)
    seeds = [line.split("seed ", 1)[1].split()[0] for text in drawn for line in text.splitlines()
             if "(drawn at random; --seed" in line]
    assert len(seeds) == 2 and seeds[0] != seeds[1], drawn
    assert "drawn at random" not in given
    from impala_rep.flags import MAX_ACTOR_SEED

    done = run_actor("127.0.0.1:1", None, "--actors", "4", "--actor-processes", "4", "--seed", str(MAX_ACTOR_SEED))
    assert done.returncode == 2
    assert "leaves no room for the 4 actor processes' seeds" in done.stderr
    assert f"give a seed of at most {MAX_ACTOR_SEED - 4000}." in done.stderr
    done = run_actor("127.0.0.1:1", None, "--log-dir", "/tmp")
    assert done.returncode == 2 and "--log-dir names where --actor-processes' processes log" in done.stderr
