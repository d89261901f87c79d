"""scripts/bench_contention.py's pure parts and its neighbour handling (TF-free, fast).

The pieces themselves (TensorFlow learner, NumPy policy) are not run here:
``python scripts/bench_contention.py --seconds 2 --settle 5`` does that in about two minutes.
"""

import importlib.util
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def bc():
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location("bench_contention", SCRIPTS / "bench_contention.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPTS))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_summarise_slowdowns_and_both_ceilings(bc):
    alone = {"env": 600_000.0, "inference": 7_000.0, "learner": 4_800.0}
    beside = {"env|learner": 540_000.0, "inference|learner": 6_650.0, "learner|env": 4_700.0,
              "learner|inference": 4_464.0}
    out = bc.summarise(alone, beside, cores=2)
    assert out["slowdown"]["inference|learner"] == pytest.approx(0.05)
    assert out["slowdown"]["learner|inference"] == pytest.approx(0.07)
    assert out["slowdown"]["env|learner"] == pytest.approx(0.10)
    # Synthetic: the policy costs more per step than the env, so the learner's neighbour is it.
    assert out["learner_neighbour"] == "inference"
    assert out["ceiling_alone"] == pytest.approx(2 / (1 / 600_000 + 1 / 7_000 + 1 / 4_800))
    assert out["ceiling_beside"] == pytest.approx(2 / (1 / 540_000 + 1 / 6_650 + 1 / 4_464))
    assert out["ceiling_beside_over_alone"] == pytest.approx(out["ceiling_beside"] / out["ceiling_alone"])
    assert out["ceiling_beside_over_alone"] < 1


def test_summarise_takes_the_learner_beside_the_env_when_the_env_costs_more(bc):
    alone = {"env": 1_000.0, "inference": 6_000.0, "learner": 4_500.0}
    beside = {"env|learner": 950.0, "inference|learner": 5_800.0, "learner|env": 4_000.0, "learner|inference": 4_400.0}
    out = bc.summarise(alone, beside, cores=2)
    assert out["learner_neighbour"] == "env"
    assert out["ceiling_beside"] == pytest.approx(2 / (1 / 950 + 1 / 5_800 + 1 / 4_000))


def test_piece_commands(bc):
    inference = bc.piece_command("inference", "synthetic", 32, 5.0, 60.0)
    assert inference[1].endswith("benchmark.py")
    assert inference[2:] == ["--child", "inference", "--workloads", "synthetic", "--piece-seconds", "5.0", "--batch", "32"]
    assert "--batch" not in bc.piece_command("env", "synthetic", 32, 5.0, 60.0)
    learner = bc.piece_command("learner", "synthetic", 32, 5.0, 60.0, learner_input=([84, 84, 3], 3, 1))
    assert learner[1].endswith("bench_learner.py")
    assert learner[learner.index("--frame-stack") + 1] == "3" and learner[learner.index("--seconds") + 1] == "5.0"
    with pytest.raises(ValueError, match="time inference first"):
        bc.piece_command("learner", "synthetic", 32, 5.0, 60.0)
    with pytest.raises(ValueError, match="the pieces are env, inference and learner"):
        bc.piece_command("gpu", "synthetic", 32, 5.0, 60.0)


def test_time_piece_times_each_piece_as_benchmark_does(bc, monkeypatch):
    calls = []
    monkeypatch.setattr(bc.benchmark, "_run_child", lambda args, timeout: calls.append((args, timeout)) or {"agent_steps_per_s": 1.0})
    monkeypatch.setattr(bc.benchmark, "measure_learner",
                        lambda *a: calls.append(a) or {"agent_steps_per_s": 2.0})
    assert bc.time_piece("inference", "synthetic", 32, 5.0, 60.0) == {"agent_steps_per_s": 1.0}
    assert bc.time_piece("learner", "synthetic", 32, 5.0, 60.0, ([84, 84, 3], 3, 1)) == {"agent_steps_per_s": 2.0}
    assert calls == [(["--child", "inference", "--workloads", "synthetic", "--piece-seconds", "5.0", "--batch", "32"], 60.0),
                     (5.0, 60.0, [84, 84, 3], 3, 1)]
    with pytest.raises(ValueError, match="time inference first"):
        bc.time_piece("learner", "synthetic", 32, 5.0, 60.0)


def test_time_piece_turns_a_failing_piece_into_a_sentence(bc):
    result = bc.time_piece("env", "no-such-workload", 32, 1.0, 60.0)
    assert result["error"].startswith("--child env failed (exit code 2): "), result
    assert "no-such-workload" in result["error"]


def test_beside_runs_the_piece_while_the_neighbour_runs_and_then_kills_its_whole_group(bc, tmp_path):
    # The neighbour starts a child of its own (as bench_learner.py does) and sleeps.
    pids = tmp_path / "pids"
    neighbour = [sys.executable, "-c",
                 "import subprocess, sys, time\n"
                 f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                 f"open({str(pids)!r}, 'w').write(f'{{child.pid}}')\n"
                 "time.sleep(120)\n"]
    seen = {}

    def fake_run():
        grandchild = int(pids.read_text())
        seen["neighbour_alive"] = _alive(grandchild)
        seen["grandchild"] = grandchild
        return {"agent_steps_per_s": 123.0}

    started = time.monotonic()
    result = bc.beside("inference", "learner", neighbour, settle=1.0, run=fake_run)
    assert result == {"agent_steps_per_s": 123.0, "beside": "learner"}
    assert seen["neighbour_alive"]
    deadline = time.monotonic() + 10
    while _alive(seen["grandchild"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(seen["grandchild"]), "the neighbour's own child outlived the measurement"
    assert time.monotonic() - started < 30


def test_beside_reports_a_neighbour_that_exits_early(bc):
    calls = []
    result = bc.beside("learner", "env", [sys.executable, "-c", "raise SystemExit(3)"], settle=1.0,
                       run=lambda: calls.append(1) or {"agent_steps_per_s": 1.0})
    assert result["error"].startswith("the env piece beside it exited early (exit code 3)")
    assert not calls, "the piece was timed without its neighbour"


def test_beside_reports_a_neighbour_that_ends_during_the_piece(bc):
    neighbour = [sys.executable, "-c", "import time; time.sleep(1.5)"]

    def slow_run():
        time.sleep(3)
        return {"agent_steps_per_s": 5.0}

    result = bc.beside("learner", "inference", neighbour, settle=0.5, run=slow_run)
    assert "ended before the learner piece did" in result["error"]


@pytest.mark.parametrize("argv, message", [
    (["--seconds", "0"], "--seconds: expected a positive number, got 0"),
    (["--batch", "-1"], "--batch must be positive, got -1."),
    (["--cores", "0"], "--cores: expected a positive number, got 0"),
    (["--workload", "dmc/nope"], "invalid choice: 'dmc/nope'"),
])
def test_flag_errors_are_sentences(bc, argv, message, capsys):
    with pytest.raises(SystemExit):
        bc.parse_args(argv)
    assert message in capsys.readouterr().err


def test_summary_names_failures_and_prints_the_ceilings(bc):
    out = {"settings": {"workload": "synthetic", "batch": 32}, "cores": 2,
           "pieces": {"inference": {"agent_steps_per_s": 7000.0}, "env": {"agent_steps_per_s": 600000.0},
                      "learner": {"agent_steps_per_s": 4800.0},
                      "inference|learner": {"agent_steps_per_s": 6650.0, "beside": "learner"},
                      "learner|inference": {"error": "the inference piece beside it exited early (exit code 1); "
                                                     "run it alone to see why.", "beside": "inference"}},
           "errors": {"learner|inference": "the inference piece beside it exited early (exit code 1); "
                                           "run it alone to see why."}}
    text = bc.summary(out)
    assert "inference  alone     7,000.0   beside learner     6,650.0" in text
    assert "learner|inference: the inference piece beside it exited early" in text
    assert "ceiling" not in text


def test_summary_says_faster_for_a_negative_slowdown(bc):
    out = {"settings": {"workload": "synthetic", "batch": 32}, "cores": 2,
           "pieces": {"inference": {"agent_steps_per_s": 7000.0}, "env": {"agent_steps_per_s": 600000.0},
                      "learner": {"agent_steps_per_s": 4000.0},
                      "learner|env": {"agent_steps_per_s": 4080.0, "beside": "env"}},
           "slowdown": {"learner|env": -0.02}}
    assert "beside env     4,080.0 (2.0% faster)" in bc.summary(out)
