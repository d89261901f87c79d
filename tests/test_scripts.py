"""Smoke tests of scripts/plot_curves.py and of scripts/benchmark.py's pure parts (TF-free, fast).

The end-to-end benchmark itself (TensorFlow learner, actor processes) is not run here:
``python scripts/benchmark.py --parts e2e --actors 2 --actor-processes 1 --warmup 0 --seconds 3``
is its manual smoke test (about 30 s).
"""

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from script_modules import load as _load  # tests/ is on sys.path (its conftest.py), as for plugin_envs

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

bench = _load("benchmark")
curves = _load("plot_curves")


# ----------------------------------------------------------------------------- benchmark.py


def test_ceiling_is_cores_over_summed_core_seconds_per_step():
    # 1/2000 + 1/1000 + 1/500 = 0.0035 core-seconds per agent step; 2 cores -> 571.43 steps/s.
    assert bench.ceiling_agent_steps_per_s(2000.0, 1000.0, 500.0, 2) == pytest.approx(2 / 0.0035)
    # Equal pieces of rate r on C cores: C * r / 3.
    assert bench.ceiling_agent_steps_per_s(900, 900, 900, 3) == pytest.approx(900.0)
    # Linear in cores; an almost free env leaves the other two pieces.
    one = bench.ceiling_agent_steps_per_s(1e12, 1000.0, 1000.0, 1)
    assert one == pytest.approx(500.0)
    assert bench.ceiling_agent_steps_per_s(1e12, 1000.0, 1000.0, 4) == pytest.approx(4 * one)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), None, True, "100"])
def test_ceiling_rejects_non_positive_or_non_finite_rates(bad):
    with pytest.raises(ValueError, match="positive finite"):
        bench.ceiling_agent_steps_per_s(bad, 1000.0, 1000.0, 2)
    with pytest.raises(ValueError, match="cores"):
        bench.ceiling_agent_steps_per_s(1000.0, 1000.0, 1000.0, bad)


def test_cost_shares_are_proportional_to_core_seconds():
    shares = bench.cost_shares(2000.0, 1000.0, 500.0)
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares == pytest.approx({"env": 1 / 7, "inference": 2 / 7, "learner": 4 / 7})


def test_envs_per_process_matches_the_launchers_even_split():
    assert bench.envs_per_process(64, 2) == 32
    assert bench.envs_per_process(5, 2) == 3
    assert bench.envs_per_process(1, 1) == 1


def _records(n_idle, n_trained, per_s=640, start=1000.0):
    out = [{"time": start + i, "learner_step": 0, "agent_steps": 0} for i in range(n_idle)]
    for i in range(n_trained):
        t = start + n_idle + i
        out.append({"time": t, "learner_step": i + 1, "agent_steps": per_s * (i + 1), "env_frames": 4 * per_s * (i + 1),
                    "queue_fill": 0.5 + 0.1 * (i % 2)})
    return out


def test_select_window_measures_after_warmup_over_the_window():
    records = _records(3, 12)
    window = bench.select_window(records, warmup=2.0, seconds=5.0)
    assert window["warmup_seconds"] == pytest.approx(2.0)
    assert window["window_seconds"] == pytest.approx(5.0)
    assert window["agent_steps_per_s"] == pytest.approx(640.0)
    assert window["learner_steps_per_s"] == pytest.approx(1.0)
    assert window["env_frames_per_s"] == pytest.approx(2560.0)
    assert window["window_agent_steps"] == 5 * 640
    assert 0.5 <= window["queue_fill"] <= 0.6


def test_select_window_counts_full_parameter_replies_per_learner_step():
    records = _records(0, 12)
    for r in records:
        r["transport/parameters_sent"] = 2 * r["learner_step"] if r["learner_step"] < 6 else 10 + (r["learner_step"] - 5)
    window = bench.select_window(records, warmup=2.0, seconds=5.0)  # learner steps 3 to 8
    assert window["parameters_sent_per_learner_step"] == pytest.approx((13 - 6) / 5)
    assert "parameters_sent_per_learner_step" not in bench.select_window(_records(0, 12), warmup=2.0, seconds=5.0)


def test_select_window_waits_for_a_complete_window():
    assert bench.select_window(_records(5, 0), warmup=0.0, seconds=1.0) is None  # no learner step yet
    assert bench.select_window(_records(0, 4), warmup=2.0, seconds=5.0) is None  # window not closed
    assert bench.select_window(_records(0, 8), warmup=2.0, seconds=5.0) is not None


def test_select_window_uses_record_times_not_counts():
    # A learner stall (no record for 4 s) must lower the rate.
    records = _records(0, 3)
    records.append({"time": records[-1]["time"] + 4.0, "learner_step": 4, "agent_steps": 4 * 640})
    window = bench.select_window(records, warmup=0.0, seconds=3.0)
    assert window["agent_steps_per_s"] == pytest.approx(3 * 640 / 6.0)


def test_cpu_split_is_cores_used_between_the_samples_nearest_the_window():
    samples = [{"time": 100.0 + i, "learner": 1.5 * i, "actors": 0.5 * i, "machine": 1.9 * i} for i in range(10)]
    split = bench.cpu_split(samples, start=102.2, end=107.9)  # nearest samples: t=102 and t=108
    assert split == pytest.approx({"cores_learner": 1.5, "cores_actors": 0.5, "cores_machine": 1.9})
    with_tf = [{**s, "learner_tensorflow": 1.2 * i} for i, s in enumerate(samples)]
    assert bench.cpu_split(with_tf, start=102.2, end=107.9) == pytest.approx(
        {"cores_learner": 1.5, "cores_actors": 0.5, "cores_machine": 1.9, "cores_learner_tensorflow": 1.2})
    assert bench.cpu_split(samples[:1], 100.0, 101.0) is None
    assert bench.cpu_split(samples, 105.0, 105.2) is None  # both ends pick the same sample
    with_steal = [{**s, "stolen": 0.1 * i} for i, s in enumerate(samples)]
    assert bench.cpu_split(with_steal, start=102.2, end=107.9)["cores_stolen"] == pytest.approx(0.1)


def test_machine_cpu_seconds_keeps_stolen_time_out_of_busy_time(tmp_path, monkeypatch):
    # /proc/stat's first line: user nice system idle iowait irq softirq steal guest guest_nice.
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 20 30 500 40 5 5 60 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    real_open = open
    monkeypatch.setattr(bench, "open", lambda path, *a, **k: real_open(stat if path == "/proc/stat" else path, *a, **k),
                        raising=False)
    monkeypatch.setattr(bench.os, "sysconf", lambda name: 10)
    busy, stolen = bench.machine_cpu_seconds()
    assert busy == pytest.approx((100 + 20 + 30 + 5 + 5) / 10) and stolen == pytest.approx(6.0)


def test_machine_info_records_the_first_processors_family_and_model(tmp_path):
    # The host kind docs/benchmarks/hosts.txt checks each stored run against.
    cpuinfo, meminfo = tmp_path / "cpuinfo", tmp_path / "meminfo"
    block = "processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: {m}\nmodel name\t: AMD EPYC\n"
    cpuinfo.write_text(block.format(n=0, m=17) + "\n" + block.format(n=1, m=99))
    meminfo.write_text("MemTotal:       24641536 kB\nMemFree:  1 kB\n")
    info = bench.machine_info(str(cpuinfo), str(meminfo))
    assert (info["cpu"], info["cpu_family"], info["cpu_model"], info["memory_gib"]) == ("AMD EPYC", 25, 17, 23.5)
    cpuinfo.write_text("processor\t: 0\nmodel name\t: some ARM core\n")  # no family or model line
    assert "cpu_family" not in bench.machine_info(str(cpuinfo), str(meminfo))


def test_with_stolen_adds_the_hypervisors_share_of_a_piece(monkeypatch):
    readings = iter([(0.0, 10.0), (0.0, 10.5)])
    clock = iter([100.0, 102.0])
    monkeypatch.setattr(bench, "machine_cpu_seconds", lambda: next(readings))
    monkeypatch.setattr(bench.time, "monotonic", lambda: next(clock))
    assert bench.with_stolen(lambda: {"agent_steps_per_s": 5.0}) == {"agent_steps_per_s": 5.0, "cores_stolen": 0.25}
    monkeypatch.setattr(bench, "machine_cpu_seconds", lambda: (None, None))  # no /proc: nothing added
    monkeypatch.setattr(bench.time, "monotonic", iter([0.0, 1.0]).__next__)
    assert bench.with_stolen(lambda: {"agent_steps_per_s": 5.0}) == {"agent_steps_per_s": 5.0}


def test_cpu_sample_counts_a_busy_child_as_an_actor():
    # The child burns 0.3 s of CPU (however long that takes on a loaded machine), says so,
    # and sleeps until killed: its CPU time must show up under "actors".
    code = "import sys, time\nwhile time.process_time() < 0.3: pass\nprint('done', flush=True)\ntime.sleep(60)"
    a = bench.cpu_sample(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        b = bench.cpu_sample(os.getpid())
        with_child = bench.tree_rss_mb(os.getpid())
    finally:
        child.kill()
        child.wait(timeout=30)
    assert b["actor_processes"] >= 1 and b["actors"] - a["actors"] >= 0.25
    assert b["learner"] >= a["learner"] and b["machine"] > a["machine"] and b["stolen"] >= a["stolen"] >= 0
    assert b["rss_mb"] == pytest.approx(with_child, rel=0.2)  # the sample's tree memory, child included
    assert with_child > bench.tree_rss_mb(os.getpid()) > 10  # this process alone, then plus the child


def test_read_metrics_skips_a_half_written_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"time": 1.0, "agent_steps": 0}) + "\n" + '{"time": 2.0, "agen')
    assert bench.read_metrics(path) == [{"time": 1.0, "agent_steps": 0}]
    assert bench.read_metrics(tmp_path / "missing.jsonl") == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--actors", "2", "--actor-processes", "3"], "--actor-processes must be between 1 and --actors"),
        (["--actors", "0"], "--actors must be at least 1"),
        (["--workloads", "pong"], "unknown workload"),
        (["--warmup", "-1"], "--warmup: expected a number of 0 or more, got -1"),
        (["--seconds", "0"], "--seconds: expected a positive number, got 0"),
        (["--seconds", "1", "--log-interval", "1"], "at least two metrics records"),
        (["--cores", "0"], "--cores: expected a positive number, got 0"),
        (["--parts", "ceiling", "--rounds", "0"], "--rounds must be at least 1"),
        (["--rounds", "3"], "--rounds is for --parts ceiling alone"),
        (["--slices", "0"], "--slices must be at least 1"),
        (["--learner-threads", "none"], "expected a positive number of threads or 'auto'"),
        (["--replicas", "3"], "--replicas must be a positive divisor of the batch size 32, got 3"),
        (["--replicas", "0"], "--replicas must be a positive divisor of the batch size 32, got 0"),
        (["--actor-nice", "20"], "--actor-nice must be between 0 and 19, got 20"),
        (["--actor-nice", "-1"], "--actor-nice must be between 0 and 19, got -1"),
        (["--param-refresh-lag", "0"], "--param-refresh-lag must be from 1 to 1000, got 0"),
        (["--param-refresh-lag", "1001"], "--param-refresh-lag must be from 1 to 1000, got 1001"),
    ],
)
def test_benchmark_flag_errors_are_sentences(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_benchmark_defaults_cover_both_workloads():
    args = bench.parse_args([])
    assert args.workloads == ["synthetic", "dmc/cartpole-swingup"]
    assert args.parts == ["ceiling", "e2e"]
    assert args.learner_threads == "auto" and bench.parse_args(["--learner-threads", "2"]).learner_threads == 2
    assert bench.inference_batch(bench.parse_args(["--actors", "64", "--actor-processes", "2"])) == 32
    assert bench.inference_batch(bench.parse_args(["--actors", "64"]), planned=64) == 64
    assert bench.inference_batch(bench.parse_args(["--actors", "64", "--batch", "8"]), planned=64) == 8
    # The pieces run in the end-to-end run's pauses: after the warm-up and after each slice.
    assert args.slices == 3 and args.rounds == 4
    assert bench.parse_args(["--slices", "1"]).rounds == 2
    assert bench.parse_args(["--parts", "ceiling"]).rounds == 2
    assert bench.parse_args(["--parts", "ceiling", "--rounds", "3"]).rounds == 3


def test_benchmark_learner_precision_reaches_the_learner_piece_and_the_launcher(monkeypatch, capsys):
    assert bench.parse_args([]).learner_precision == "float32"
    args = bench.parse_args(["--learner-precision", "bfloat16", "--workloads", "synthetic"])
    piece = bench.learner_command(5, 60, [84, 84, 3], 3, 1, args.learner_precision)
    assert piece[piece.index("--precision") + 1] == "bfloat16"
    assert bench.learner_command(5, 60, [84, 84, 3], 3, 1)[-3:] == ["--precision", "float32", "--json"]
    seen = {}
    monkeypatch.setattr(bench, "run_launch_window", lambda launch_args, *rest: seen.setdefault("args", launch_args) and {})
    bench.measure_end_to_end(bench.WORKLOADS["synthetic"], args)
    assert seen["args"][seen["args"].index("--learner-precision") + 1] == "bfloat16"
    with pytest.raises(SystemExit):
        bench.parse_args(["--learner-precision", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--replicas", "4"), ("--actor-nice", "0"), ("--param-refresh-lag", "2")])
def test_benchmark_launcher_flags_reach_the_launcher_only_when_given(monkeypatch, flag, value):
    seen = []
    monkeypatch.setattr(bench, "run_launch_window", lambda launch_args, *rest: seen.append(launch_args) or {})
    bench.measure_end_to_end(bench.WORKLOADS["synthetic"], bench.parse_args([flag, value]))
    bench.measure_end_to_end(bench.WORKLOADS["synthetic"], bench.parse_args([]))
    assert seen[0][seen[0].index(flag) + 1] == value
    assert flag not in seen[1]  # the launcher's choice


def test_learner_piece_trains_on_the_end_to_end_learners_per_replica_batch(tmp_path):
    log = tmp_path / "launch.log"
    log.write_text("x learner replicas: 1 (one per learner thread)\nx learner replicas: 2 (one per learner thread)\n")
    assert bench.planned_replicas(log) == 2
    assert bench.planned_replicas(tmp_path / "missing.log") is None
    assert bench.replica_batch(bench.parse_args([]), bench.planned_replicas(log)) == 16
    assert bench.replica_batch(bench.parse_args([])) == 32  # no launcher log: the whole batch
    assert bench.replica_batch(bench.parse_args(["--replicas", "4"]), 2) == 8  # --replicas is what the launcher got
    piece = bench.learner_command(5, 60, [84, 84, 3], 3, 1, "float32", 16)
    assert piece[piece.index("--batch-size") + 1] == "16" and piece[piece.index("--replicas") + 1] == "1"
    assert piece[piece.index("--threads") + 1] == "1"
    piece = bench.learner_command(5, 60, [84, 84, 3], 3, 1)  # with --replicas too, the piece is one replica
    assert piece[piece.index("--batch-size") + 1] == "32" and piece[piece.index("--replicas") + 1] == "1"


def test_measure_learner_records_the_batch_it_trained_on(monkeypatch):
    import types

    seen = []

    def run(cmd, **kwargs):
        seen.append(cmd)
        return types.SimpleNamespace(returncode=0, stderr="",
                                     stdout=json.dumps([{"frames_per_s": 1200.0, "step_ms": 266.0, "steps": 9,
                                                         "cpu_memory": "pool"}]))

    monkeypatch.setattr(subprocess, "run", run)
    out = bench.measure_learner(5, 60, [84, 84, 3], 3, 1, "float32", 16)
    assert out["agent_steps_per_s"] == 1200.0 and out["batch"] == 16
    assert out["cpu_memory"] == "pool"  # where the piece's TensorFlow took its CPU tensors from
    assert seen[0][seen[0].index("--batch-size") + 1] == "16"
    assert bench.measure_learner(5, 60, [84, 84, 3], 3, 1)["batch"] == 32


def test_planned_batch_reads_the_launchers_last_plan_line(tmp_path):
    log = tmp_path / "launch.log"
    log.write_text("x plan: 33 actors in 2 process(es) (16/17 envs each); estimated memory 3.0 GiB (one per core)\n"
                   "noise\n")
    assert bench.planned_batch(log) == 17
    log.write_text(log.read_text() + "x plan: 32 actors in 1 process(es) (32 envs each); estimated memory 2.0 GiB\n")
    assert bench.planned_batch(log) == 32
    log.write_text("the launcher stopped before its plan\n")
    assert bench.planned_batch(log) is None
    assert bench.planned_batch(tmp_path / "missing.log") is None and bench.planned_batch(None) is None
    # The line as the launcher writes it (ActorPlan.describe), so a change of its wording fails here.
    from impala_rep.plan import plan_actors

    plan = plan_actors(10, "catch", {}, processes=3, cores=2, memory_mb=24 * 1024)
    log.write_text(f"10:00:00 impala_rep.launch INFO plan: {plan.describe()} (--actor-processes)\n")
    assert bench.planned_batch(log) == 4


def test_combine_rounds_takes_the_harmonic_mean_and_keeps_each_round():
    rounds = [{"agent_steps_per_s": 1000.0, "batch": 16}, {"agent_steps_per_s": 500.0, "batch": 16}]
    out = bench.combine_rounds(rounds)
    # 1 ms and 2 ms per step average to 1.5 ms: 666.7 steps/s (not the arithmetic 750).
    assert out["agent_steps_per_s"] == pytest.approx(2000.0 / 3)
    assert out["rounds_agent_steps_per_s"] == [1000.0, 500.0] and out["batch"] == 16
    assert bench.combine_rounds(rounds[:1])["agent_steps_per_s"] == 1000.0
    assert "rounds_cores_stolen" not in out
    stolen = bench.combine_rounds([{**r, "cores_stolen": 0.01 * (i + 1)} for i, r in enumerate(rounds)])
    assert stolen["rounds_cores_stolen"] == [0.01, 0.02]
    failed = bench.combine_rounds([rounds[0], {"error": "learner crashed"}])
    assert failed == {"error": "learner crashed"}
    with pytest.raises(ValueError, match="at least one round"):
        bench.combine_rounds([])


@pytest.mark.parametrize("argv, order", [
    ([], ["pieces", "slice", "pieces", "slice", "pieces", "slice", "pieces"]),
    (["--slices", "1"], ["pieces", "slice", "pieces"]),
    (["--parts", "ceiling"], ["pieces", "pieces"]),
    (["--parts", "ceiling", "--rounds", "3"], ["pieces", "pieces", "pieces"]),
    (["--parts", "e2e"], ["slice"]),
])
def test_pieces_rounds_run_in_the_pauses_beside_the_slices(monkeypatch, tmp_path, argv, order):
    calls, batches, learner_batches = [], [], []
    # (env, inference, learner) agent steps/s of each round.
    rates = iter([(1e6, 1000.0, 500.0), (1e6, 500.0, 1000.0), (1e6, 800.0, 800.0), (1e6, 1000.0, 1000.0)])
    slice_rates = [400.0, 300.0, 450.0]

    def pieces(workload, args, report, label="", batch=None, learner_batch=None):
        calls.append("pieces")
        batches.append(batch)
        learner_batches.append(learner_batch)
        env, inference, learner = next(rates)
        return {"env": {"agent_steps_per_s": env}, "inference": {"agent_steps_per_s": inference},
                "learner": {"agent_steps_per_s": learner}}

    def e2e(workload, args, between=None, launch=None):
        # What run_launch_window does: the launcher's log, whose plan says 1 process of 32 envs.
        log_path = tmp_path / "launch.log"
        log_path.write_text("INFO impala_rep.launch: plan: 32 actors in 1 process(es) (32 envs each); estimated ...\n"
                            "INFO impala_rep.launch: learner replicas: 2 (one per learner thread)\n")
        launch["log_path"] = log_path
        # What watch_run does: between(0) after the warm-up, between(i) after slice i.
        n = args.slices if between is not None else 1
        if between is not None:
            between(0)
        for i in range(n):
            calls.append("slice")
            if between is not None:
                between(i + 1)
        windows = [{"agent_steps_per_s": r, "window_agent_steps": r * 20.0, "window_seconds": 20.0,
                    "learner_steps_per_s": r / 640, "env_frames_per_s": r, "warmup_seconds": 30.0,
                    "window_start_time": 100.0 + 40 * i} for i, r in enumerate(slice_rates[:n])]
        return {**bench.combine_windows(windows), "actors": 2}

    monkeypatch.setattr(bench, "measure_pieces", pieces)
    monkeypatch.setattr(bench, "measure_end_to_end", e2e)
    monkeypatch.setattr(bench, "available_cores", lambda: 2)
    args = bench.parse_args(["--workloads", "synthetic", "--cores", "2", *argv])
    out = bench.run_workload(bench.WORKLOADS["synthetic"], args, lambda message: None)
    assert calls == order
    # The policy piece batches as the launcher's actor processes do: by its plan once it has one,
    # else one process per core.
    assert args.actors == 32 and bench.inference_batch(args) < 32
    assert batches == [32 if "slice" in order else bench.inference_batch(args)] * order.count("pieces")
    # The learner piece trains on the batch each of the launcher's 2 replicas gets, once it has logged them.
    assert learner_batches == [16 if "slice" in order else 32] * order.count("pieces")
    rounds = order.count("pieces")
    if rounds == 0:
        assert "ceiling_agent_steps_per_s" not in out and "ratio_to_ceiling" not in out
        return
    assert len(out["ceiling_per_round"]) == rounds
    cost = 1 / 1e6 + 1 / out["inference"]["agent_steps_per_s"] + 1 / out["learner"]["agent_steps_per_s"]
    assert out["ceiling_agent_steps_per_s"] == pytest.approx(2 / cost)
    # Rounds 1 and 2 both cost 3 ms of core time per step (1 + 2, then 2 + 1).
    assert out["ceiling_per_round"][:2] == pytest.approx([2 / (3e-3 + 1e-6)] * 2)
    assert out["inference"]["rounds_agent_steps_per_s"] == [1000.0, 500.0, 800.0, 1000.0][:rounds]
    if "slice" not in order:
        assert "ratio_to_ceiling" not in out
        return
    n = order.count("slice")
    e2e_rate = sum(slice_rates[:n]) / n  # equal slice lengths
    assert out["end_to_end"]["agent_steps_per_s"] == pytest.approx(e2e_rate)
    assert out["ratio_to_ceiling"] == pytest.approx(e2e_rate / out["ceiling_agent_steps_per_s"])
    # Slice i against the harmonic mean of rounds i and i+1: per step, rounds cost 3, 3, 2.5
    # and 2 ms of core time (plus 1 us of env), so the slices' ceilings are 2/3, 2/2.75, 2/2.25 per ms.
    per_step = [3e-3, 2.75e-3, 2.25e-3][:n]
    assert out["ratio_to_ceiling_per_slice"] == pytest.approx(
        [r / (2 / (c + 1e-6)) for r, c in zip(slice_rates, per_step)])
    text = bench.summary([out])
    assert "ratio to ceiling" in text
    if n > 1:
        assert "each slice against the rounds beside it" in text and "slices: 400.0, 300.0, 450.0" in text


def test_combine_windows_sums_counts_and_weights_diagnostics_by_seconds():
    windows = [
        {"agent_steps_per_s": 100.0, "window_agent_steps": 1000, "window_seconds": 10.0, "learner_steps_per_s": 1.0,
         "env_frames_per_s": 400.0, "warmup_seconds": 30.0, "window_start_time": 50.0, "queue_fill": 0.2,
         "cores_actors": 1.0},
        {"agent_steps_per_s": 200.0, "window_agent_steps": 6000, "window_seconds": 30.0, "learner_steps_per_s": 2.0,
         "env_frames_per_s": 800.0, "warmup_seconds": 45.0, "window_start_time": 90.0, "queue_fill": 0.6},
    ]
    out = bench.combine_windows(windows)
    assert out["agent_steps_per_s"] == pytest.approx(7000 / 40.0)  # not the mean of the rates, 150
    assert out["window_seconds"] == 40.0 and out["window_agent_steps"] == 7000
    assert out["learner_steps_per_s"] == pytest.approx((10 + 60) / 40.0)
    assert out["env_frames_per_s"] == pytest.approx((4000 + 24000) / 40.0)
    assert out["queue_fill"] == pytest.approx((0.2 * 10 + 0.6 * 30) / 40.0)
    assert out["cores_actors"] == 1.0  # only the slice that has it
    assert out["warmup_seconds"] == 30.0 and out["window_start_time"] == 50.0
    assert out["slices_agent_steps_per_s"] == [100.0, 200.0] and out["slices"] == [[50.0, 10.0], [90.0, 30.0]]
    assert bench.combine_windows(windows[:1])["slices_agent_steps_per_s"] == [100.0]
    assert "slices_cores_stolen" not in out
    stolen = bench.combine_windows([{**w, "cores_stolen": s} for w, s in zip(windows, (0.05, 0.25))])
    assert stolen["slices_cores_stolen"] == [0.05, 0.25] and stolen["cores_stolen"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="at least one window"):
        bench.combine_windows([])


def test_select_window_not_before_opens_at_a_later_record():
    records = _records(0, 20)  # records at t = 1000 .. 1019
    window = bench.select_window(records, warmup=2.0, seconds=3.0, not_before=1010.5)
    assert window["window_start_time"] == 1011.0 and window["window_seconds"] == pytest.approx(3.0)
    assert bench.select_window(records, warmup=2.0, seconds=3.0, not_before=1017.5) is None  # not closed yet


def _cpu_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


_FAKE_LAUNCHER = r"""
import json, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # an 'actor process' that burns CPU
print(child.pid, flush=True)
steps = 0
with open(sys.argv[1], "a") as f:
    while True:
        time.sleep(0.02)
        steps += 20  # 20 agent steps per 20 ms of running: about 1000 per second while not paused
        f.write(json.dumps({"time": time.time(), "learner_step": steps, "agent_steps": steps}) + "\n")
        f.flush()
"""


def test_watch_run_pauses_the_whole_tree_between_slices_and_leaves_pauses_out(tmp_path):
    import argparse
    import signal

    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", _FAKE_LAUNCHER, str(metrics)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    child = int(proc.stdout.readline())
    args = argparse.Namespace(slices=3, seconds=1.5, warmup=0.2, log_interval=0.1, startup_timeout=30.0)
    seen = []

    def between(i):
        # Everything is stopped: no record is written and the busy child burns no CPU.
        size, cpu = metrics.stat().st_size, _cpu_of(child)
        time.sleep(1.0)  # twice a slice: a rate over a pause would fall below 1/3 of the real one
        seen.append((i, metrics.stat().st_size == size, _cpu_of(child) - cpu))

    try:
        out = bench.watch_run(proc, metrics, args, between)
        after = _cpu_of(child)
        time.sleep(0.3)
        resumed = _cpu_of(child) > after  # running again once the last pause is over
    finally:
        bench.signal_tree(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert [i for i, _, _ in seen] == [0, 1, 2, 3]
    assert all(unchanged and ticks <= 2 for _, unchanged, ticks in seen), seen
    assert resumed
    assert len(out["slices_agent_steps_per_s"]) == 3 and out["paused_seconds"] >= 4.0
    # About 1000/s in each slice (fewer when this machine is busy), never the rate over a pause.
    assert all(500 < r <= 1050 for r in out["slices_agent_steps_per_s"]), out
    assert out["window_seconds"] == pytest.approx(1.5, abs=0.5)
    # Without between: one window, no pause.
    metrics.unlink()
    proc = subprocess.Popen([sys.executable, "-c", _FAKE_LAUNCHER, str(metrics)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    proc.stdout.readline()
    try:
        out = bench.watch_run(proc, metrics, args)
    finally:
        bench.signal_tree(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert len(out["slices"]) == 1 and "paused_seconds" not in out and 500 < out["agent_steps_per_s"] <= 1050


def test_watch_run_reports_a_launcher_that_exits(tmp_path):
    import argparse

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    args = argparse.Namespace(slices=2, seconds=1.0, warmup=0.0, log_interval=0.1, startup_timeout=30.0)
    out = bench.watch_run(proc, tmp_path / "metrics.jsonl", args, lambda i: None)
    assert "exited with code 3 before the window closed" in out["error"]


def test_workload_env_args_round_trip_through_the_env_arg_parser():
    import envs

    for workload in bench.WORKLOADS.values():
        assert envs.parse_env_args(workload.env_args()) == dict(workload.env_kwargs)
    assert bench.WORKLOADS["dmc/cartpole-swingup"].env_kwargs == {"size": 84, "action_repeat": 4, "render": "fast"}


def test_synthetic_env_loads_by_module_id_as_actor_processes_load_it(monkeypatch):
    import dm_env

    import envs

    monkeypatch.syspath_prepend(str(SCRIPTS))  # what benchmark.py puts on PYTHONPATH
    try:
        env = envs.make("benchmark:synthetic_env", seed=3, episode_length=3)
        obs_spec, action_spec = env.observation_spec(), env.action_spec()
        assert set(obs_spec) == {"pixels"}
        assert obs_spec["pixels"].shape == (84, 84, 3) and obs_spec["pixels"].dtype == np.uint8
        assert action_spec.shape == (1,) and action_spec.dtype == np.float32
        assert float(action_spec.minimum) == -1.0 and float(action_spec.maximum) == 1.0
        first = env.reset()
        assert first.first()
        steps = [env.step(np.zeros(1, np.float32)) for _ in range(3)]
        assert [s.step_type for s in steps] == [dm_env.StepType.MID, dm_env.StepType.MID, dm_env.StepType.LAST]
        assert steps[-1].discount == 1.0  # truncation, like DM Control
        assert all(np.array_equal(s.observation["pixels"], first.observation["pixels"]) for s in steps)
        assert env.step(np.zeros(1, np.float32)).first()
    finally:
        sys.modules.pop("benchmark", None)
    with pytest.raises(ValueError, match="episode_length"):
        bench.synthetic_env(episode_length=0)
    assert "tensorflow" not in sys.modules


def test_learner_piece_measures_the_stacked_input_the_learner_trains_on():
    # The learner trains on K=3 stacked RGB frames (84x84x9), about twice the work of one
    # 84x84x3 frame; the first two sessions' ceilings were measured on 84x84x3 by mistake.
    # Its batches carry the single frames, which its network stacks; the piece does the same.
    result = bench._run_child(
        ["--child", "inference", "--batch", "2", "--workloads", "synthetic", "--piece-seconds", "0.2"], 120
    )
    assert "error" not in result, result
    assert result["observation_shapes"] == {"pixels": [84, 84, 3 * bench.FRAME_STACK]}
    assert result["frame_stack"] == {"pixels": bench.FRAME_STACK}
    assert bench.learner_input(result) == ([84, 84, 3], bench.FRAME_STACK, 1)
    with pytest.raises(ValueError, match="stacks 'pixels' 2 deep"):
        bench.learner_input({"observation_shapes": {"pixels": [84, 84, 9]}, "frame_stack": {"pixels": 2},
                             "action_shape": [1]})
    with pytest.raises(ValueError, match="one \\[H, W, C\\] 'pixels' observation"):
        bench.learner_input({"observation_shapes": {"pixels": [84, 84, 9], "position": [2]}, "action_shape": [1]})
    with pytest.raises(ValueError, match="vector action"):
        bench.learner_input({"observation_shapes": {"pixels": [84, 84, 9]}, "action_shape": []})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--obs-shape", "84", "0", "9"], "--obs-shape takes three positive sizes: H W C."),
        (["--action-dims", "0"], "--action-dims must be at least 1."),
    ],
)
def test_bench_learner_input_flag_errors_are_sentences(argv, message, capsys):
    bench_learner = _load("bench_learner")  # parses before anything imports TensorFlow
    with pytest.raises(SystemExit) as exc:
        bench_learner.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert "tensorflow" not in sys.modules


def test_bench_learner_times_the_step_on_the_learners_memory_pool():
    # The learner piece runs the step as the launcher's learner does: TensorFlow's CPU tensors
    # from its pool (learner.run.LEARNER_TF_ENV), unless the caller's environment says otherwise
    # (malloc takes oneDNN's operations off as well: where TensorFlow turns them on, as on an
    # Intel host with AMX, their allocator pools CPU tensors whatever TF_CPU_ALLOCATOR_USE_BFC says).
    cmd = [sys.executable, str(SCRIPTS / "bench_learner.py"), "--torso", "shallow", "--replicas", "1",
           "--batch-size", "2", "--unroll-length", "4", "--obs-shape", "32", "32", "3", "--min-steps", "1",
           "--max-steps", "2", "--warmup-steps", "0", "--seconds", "1", "--json"]
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPU_ALLOCATOR_USE_BFC", "TF_ENABLE_ONEDNN_OPTS")}
    for setting, expected in ((None, "pool"), ("false", "malloc")):
        run_env = env if setting is None else dict(env, TF_CPU_ALLOCATOR_USE_BFC=setting, TF_ENABLE_ONEDNN_OPTS="0")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=run_env, cwd=str(SCRIPTS.parent))
        assert proc.returncode == 0, proc.stderr[-2000:]
        (result,) = json.loads(proc.stdout)
        assert result["cpu_memory"] == expected and result["frames_per_s"] > 0, result


def test_descendants_finds_a_started_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in bench._descendants(os.getpid())
    finally:
        child.kill()
        child.wait()


def test_stop_launch_kills_a_process_that_ignores_sigterm():
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    start = time.monotonic()
    assert bench._stop_launch(child, timeout=0.5) is None
    assert child.poll() is not None and time.monotonic() - start < 10
    child.stdout.close()


def test_sigterm_to_bench_launch_stops_the_run_it_started(tmp_path):
    # The launcher runs in its own session; before, a SIGTERM to the script left it running
    # with its budget of 10**12 agent steps.
    import signal

    log = tmp_path / "bench.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(SCRIPTS / "bench_launch.py"), "--env", "catch", "--actors", "1",
                                 "--warmup", "300", "--seconds", "2", "--log-interval", "0.5"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=str(SCRIPTS.parent))
    launcher = None
    try:
        deadline = time.monotonic() + 120
        while launcher is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            found = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "impala_rep.launch"],
                                   capture_output=True, text=True).stdout.split()
            launcher = int(found[0]) if found else None
        assert launcher is not None, log.read_text()[-2000:]
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        gone = time.monotonic() + 30
        while time.monotonic() < gone and os.path.exists(f"/proc/{launcher}"):
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{launcher}"), "the launcher outlived the script"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if launcher is not None and os.path.exists(f"/proc/{launcher}"):
            os.killpg(launcher, signal.SIGKILL)


# ----------------------------------------------------------------------------- plot_curves.py


def _write_run(path, n=30, gap_at=None, evals=()):
    path.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        t = 1.0e9 + 10.0 * i + (5000.0 if gap_at is not None and i >= gap_at else 0.0)
        rec = {"time": t, "learner_step": i + 1, "agent_steps": 640 * (i + 1), "env_frames": 2560 * (i + 1)}
        if i >= 2:
            rec["episode_return"] = 10.0 * i
        lines.append(json.dumps(rec))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if evals:
        (path / "eval").mkdir()
        for k, (steps, mean) in enumerate(evals):
            (path / "eval" / f"eval-{k}.json").write_text(
                json.dumps({"agent_steps": steps, "mean_return": mean, "std_return": 5.0, "episodes": 10}))
    return path


def test_training_hours_collapse_stops_longer_than_max_gap():
    times = [0.0, 10.0, 20.0, 5020.0, 5030.0]
    hours = curves.training_hours(times, max_gap_s=300.0)
    assert hours == pytest.approx([0, 10 / 3600, 20 / 3600, 30 / 3600, 40 / 3600])
    assert curves.training_hours(times, max_gap_s=1e6)[-1] == pytest.approx(5030 / 3600)
    assert curves.training_hours([]) == []


def test_load_run_curve_hours_and_evals(tmp_path):
    run = curves.load_run(str(_write_run(tmp_path / "r", n=30, gap_at=20, evals=[(6400, 50.0), (1280, 20.0)])))
    frames, hours, returns = run.curve()
    assert len(frames) == 28 and frames[0] == 3 * 2560 and returns[-1] == 290.0
    assert hours[-1] == pytest.approx(290 / 3600)  # the 5000 s stop counts as one 10 s interval
    assert run.action_repeat == pytest.approx(4.0)
    assert [e["agent_steps"] for e in run.evals] == [1280, 6400]  # sorted by agent steps
    assert run.hours_at(640 * 5.5) == pytest.approx(45 / 3600)  # interpolated between records


def test_markdown_table_rows_and_values(tmp_path):
    run = curves.load_run(str(_write_run(tmp_path / "r", n=30, evals=[(9600, 50.0)])), label="mine")
    text = curves.markdown_tables([run], rows=3)
    lines = text.splitlines()
    assert lines[0].startswith("| run | env frames | agent steps | hours | return")
    body = [l for l in lines[2:] if l.startswith("| mine") and "±" not in l]
    assert len(body) == 3
    assert body[0] == "| mine | 7,680 | 1,920 | 0.01 | 20.0 |"
    assert body[-1] == "| mine | 76,800 | 19,200 | 0.08 | 290.0 |"
    assert "| mine | 38,400 | 9,600 | 0.04 | 50.0 ± 5.0 | 10 |" in lines


def test_plot_writes_a_png_and_prints_the_table(tmp_path, capsys):
    a = _write_run(tmp_path / "a", evals=[(6400, 50.0)])
    b = _write_run(tmp_path / "b", n=10)
    (a / "eval" / "broken.json").write_text("{")
    out = tmp_path / "figs" / "curves.png"
    assert curves.main([str(a), str(b), "--out", str(out), "--labels", "A", "B", "--title", "t"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    captured = capsys.readouterr()
    assert "| A | 76,800 |" in captured.out and "| B |" in captured.out
    assert "skipping" in captured.err and "broken.json" in captured.err
    assert "tensorflow" not in sys.modules


def test_comparison_table_compares_runs_at_the_same_agent_steps_and_minutes(tmp_path):
    a = _write_run(tmp_path / "a", n=30, evals=[(19200, 70.0), (19200, 70.0), (19200, 64.0), (6400, 50.0)])
    b = _write_run(tmp_path / "b", n=10)
    # b's learner had trained 30 s at its first record, and waited for batches a quarter of the time
    lines = [json.loads(l) for l in (b / "metrics.jsonl").read_text().splitlines()]
    for i, rec in enumerate(lines):
        rec["train_seconds"], rec["time_share/wait_batch"] = 30.0 + 10.0 * i, 0.25
    (b / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    ra, rb = curves.load_run(str(a), label="A"), curves.load_run(str(b), label="B", evals=False)
    assert curves.return_at_steps(ra, 1920) == 20.0 and curves.return_at_steps(ra, 1921) == 30.0
    assert curves.return_at_steps(rb, 640 * 10 + 1) is None  # b never trained on that many
    assert curves.return_at_minutes(ra, 2) == 120.0  # records 10 s apart from the first
    assert curves.return_at_minutes(rb, 1) == 30.0  # b's first record came 30 s into training
    assert curves.return_at_minutes(ra, 10) is None  # a trained for 290 s
    assert curves.return_at_minutes(rb, 2) == 90.0  # b trained for 120 s: its last record
    text = curves.comparison_table([ra, rb], at_steps=[1920, 6400], at_minutes=[1, 2])
    head, rule, row_a, row_b = text.splitlines()
    assert head == ("| run | agent steps | minutes | agent steps/s | learner waiting | return at 1,920 steps | "
                    "return at 6,400 steps | return at 1 min | return at 2 min | eval of the last evaluated policy |")
    assert rule.count("|") == head.count("|")
    assert row_a == "| A | 19,200 | 4.8 | 66 | — | 20 | 90 | 60 | 120 | 70.0 ± 5.0 (10), 64.0 ± 5.0 (10) |"
    assert row_b == "| B | 6,400 | 2.0 | 53 | 25% | 20 | 90 | 30 | 90 | — |"


def test_plot_curves_prints_the_comparison_without_drawing(tmp_path, capsys, monkeypatch):
    a = _write_run(tmp_path / "a")
    monkeypatch.chdir(tmp_path)
    assert curves.main([str(a), "--no-plot", "--at-steps", "5e3", "--at-minutes", "4", "--out", "x.svg"]) == 0
    out = capsys.readouterr().out
    assert "| a | 19,200 | 4.8 | 66 | — | 70 | 240 | — |" in out
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob("*.svg"))
    with pytest.raises(SystemExit):
        curves.parse_args([str(a), "--at-steps", "0"])
    assert "--at-steps: " in capsys.readouterr().err


def test_a_resume_from_an_earlier_checkpoint_drops_the_lost_records_but_counts_their_time(tmp_path):
    run = _write_run(tmp_path / "r", n=10)  # 640 agent steps a record, 10 s apart
    lines = (run / "metrics.jsonl").read_text().splitlines()
    # killed after 10 records, resumed from the checkpoint at 6 x 640 steps: records 7 to 10 are lost
    for i in range(6, 9):
        lines.append(json.dumps({"time": 1.0e9 + 100.0 + 10.0 * i, "learner_step": i + 1, "agent_steps": 640 * (i + 1),
                                 "env_frames": 2560 * (i + 1), "episode_return": 1000.0 + i}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    loaded = curves.load_run(str(run), evals=False)
    assert [r["agent_steps"] for r in loaded.records] == [640 * k for k in range(1, 7)] + [640 * k for k in (7, 8, 9)]
    assert [r["episode_return"] for r in loaded.records[-3:]] == [1006.0, 1007.0, 1008.0]  # the resumed run's
    assert loaded.hours[-1] == pytest.approx((100.0 + 80.0) / 3600)  # the lost 40 s of training count
    assert curves.superseded([{"agent_steps": s} for s in (1, 2, 3, 2, 3, 4)]) == [False, True, True, False, False,
                                                                                  False]


def test_metrics_half_written_last_line_is_skipped_but_a_corrupt_line_is_an_error(tmp_path):
    run = _write_run(tmp_path / "r", n=5)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"time": 1.0, "agent_st')
    assert len(curves.load_metrics(str(run))) == 5
    text = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([text[0], "garbage", text[1]]) + "\n")
    with pytest.raises(curves.CurveError, match="line 2 of .* is not JSON"):
        curves.load_metrics(str(run))


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "does not exist"),
        (lambda d: d.mkdir(), "has no metrics.jsonl"),
        (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text("\n")), "is empty"),
        (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text('{"time": 1.0, "learner_step": 0, "agent_steps": 0}\n')),
         "none with an episode_return"),
        (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text('{"time": 1.0}\n{"time": 2.0}\n')),
         "no numeric 'agent_steps'"),
    ],
)
def test_plot_curves_errors_are_sentences(tmp_path, capsys, setup, message):
    run = tmp_path / "run"
    setup(run)
    assert curves.main([str(run), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plot_curves: ") and message in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["a", "b", "--labels", "x"], "give one per run"),
        (["a", "--out", "x.svg"], "must name a .png"),
        (["a", "--rows", "0"], "--rows must be at least 1"),
        (["a", "--out", "/etc/hostname/x.png"], "--out /etc/hostname/x.png cannot be created: /etc/hostname is not a directory"),
    ],
)
def test_plot_curves_flag_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        curves.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_scripts_have_no_import_time_side_effects():
    # Importing either script must not import NumPy-heavy or TF code, or set env variables.
    code = (
        "import os, sys, importlib.util\n"
        "before = dict(os.environ)\n"
        f"sys.path.insert(0, {str(SCRIPTS)!r})\n"
        "import benchmark, plot_curves, bench_actor, benchmark_tally\n"
        "assert dict(os.environ) == before\n"
        "assert 'tensorflow' not in sys.modules and 'matplotlib' not in sys.modules and 'dm_env' not in sys.modules\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "ok", proc.stderr


# ----------------------------------------------------------------------------- bench_envs.py


@pytest.mark.parametrize("flag,key", [("--coarse-shapes", "coarse_shapes"), ("--fast-step", "fast_step")])
def test_bench_envs_measures_each_setting_of_an_env_option(flag, key):
    cmd = [sys.executable, str(SCRIPTS / "bench_envs.py"), "--tasks", "dmc/cartpole-swingup", "--presets", "fast",
           flag, "both", "--size", "32", "--steps", "8", "--seconds", "2", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(SCRIPTS.parent))
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)["results"]
    assert [r[key] for r in results] == [False, True]
    assert all(r["render"] == "fast" and r["agent_steps"] == 8 and r["agent_steps_per_cpu_s"] > 0 for r in results)


# ----------------------------------------------------------------------------- one thread before NumPy

# Records the BLAS/OpenMP thread settings at the moment NumPy is first imported (OpenBLAS reads its
# thread count then), runs one entry point's start, and prints what it saw.
_THREADS_AT_NUMPY = r"""
import importlib, importlib.abc, json, os, sys
seen = {}
class _Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "numpy" and not seen:
            seen.update({k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
        return None
sys.meta_path.insert(0, _Watch())
sys.path[:0] = [sys.argv[1], sys.argv[2]]
entry = sys.argv[3]
class _Stop(BaseException):
    pass
def _stop(*args, **kwargs):
    raise _Stop()
if entry == "actors.run":
    import actors.run
else:  # a bench's main, stopped where its timing would start
    stub, argv = {"bench_actor": ("measure", ["--seconds", "1"]),
                  "bench_envs": ("bench", ["--tasks", "dmc/cartpole-swingup"])}[entry]
    module = importlib.import_module(entry)
    setattr(module, stub, _stop)
    try:
        module.main(argv)
    except _Stop:
        pass
import numpy
print(json.dumps(seen))
"""


@pytest.mark.parametrize("entry", ["actors.run", "bench_actor", "bench_envs"])
def test_entry_points_with_one_thread_set_it_before_numpy_is_imported(entry):
    # The actor processes and the benches that time their pieces promise one BLAS thread; set after
    # NumPy's import it does nothing, and OpenBLAS spins a thread per core (bench_actor's loop CPU
    # counted it: 0.53 against 0.26 ms per agent step for its parts).
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-c", _THREADS_AT_NUMPY, str(SCRIPTS), str(SCRIPTS.parent), entry],
                          capture_output=True, text=True, timeout=120, cwd=str(SCRIPTS.parent), env=env)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, seen


# ----------------------------------------------------------------------------- bench_actor.py


def test_bench_actor_times_the_loop_and_its_parts():
    cmd = [sys.executable, str(SCRIPTS / "bench_actor.py"), "--envs", "2", "--unroll-length", "4",
           "--seconds", "0.5", "--refresh", "--evict-mb", "1", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(SCRIPTS.parent))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("loop", "env", "inference", "inference_evicted"):
        assert result[f"{key}_ms_per_step"] > 0
    # The loop's own accounting of its parts adds up to about the loop's CPU.
    parts = result["loop_parts_ms_per_step"]
    assert list(parts) == ["env", "policy", "emit", "other"] and parts["policy"] > 0 and parts["emit"] > 0
    assert sum(parts.values()) == pytest.approx(result["loop_ms_per_step"], rel=0.25)
    assert result["overhead_ms_per_step"] == pytest.approx(
        result["loop_ms_per_step"] - result["env_ms_per_step"] - result["inference_ms_per_step"])
    # Every unroll was serialized (5 frames of 84x84x3 and 2 prefix frames) and followed by
    # new parameters.
    assert result["unrolls"] >= 2 and result["param_updates"] == result["unrolls"] // 2
    assert result["unroll_bytes"] > 7 * 84 * 84 * 3
    assert set(result["page_faults_per_step"]) == {"loop", "env", "inference", "inference_evicted"}
    assert result["malloc"] == "reuse"


def test_bench_actor_times_what_the_env_and_the_inference_cost_each_other_in_turn():
    cmd = [sys.executable, str(SCRIPTS / "bench_actor.py"), "--envs", "2", "--unroll-length", "4",
           "--seconds", "1", "--alternation", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(SCRIPTS.parent))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    after = result["alternated_ms_per_step"]
    assert set(after) == {"env_after_env", "env_after_inference", "inference_after_inference", "inference_after_env"}
    assert all(v > 0 for v in after.values()), after
    # The four conditions take turns, one timed call each, in whole turns: as many calls each.
    calls = result["alternation_calls"]
    assert set(calls) == set(after) and len(set(calls.values())) == 1 and min(calls.values()) >= 3, calls
    assert result["alternation_ms_per_step"] == pytest.approx(
        after["env_after_inference"] - after["env_after_env"]
        + after["inference_after_env"] - after["inference_after_inference"])
    # The loop and the parts back to back are still timed beside it.
    assert result["loop_ms_per_step"] > 0 and result["env_ms_per_step"] > 0 and result["inference_ms_per_step"] > 0
    text = subprocess.run(cmd[:-1], capture_output=True, text=True, timeout=120, cwd=str(SCRIPTS.parent))
    assert text.returncode == 0, text.stderr
    assert "what running them in turn adds:" in text.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the settings are glibc's")
def test_bench_actors_loop_does_not_fault_its_unroll_buffers_in_at_every_boundary():
    """The actor assembles each boundary's unrolls with one copy of the frames (env-major),
    so even with glibc's defaults (--malloc system) the loop keeps its heap: before that,
    the per-env copies made glibc hand the top of the heap back after every boundary and
    fault it in again (about 9.5 faults per agent step at 16 envs); with --malloc reuse (the
    default) it keeps freed memory mapped either way."""
    faults = {}
    for mode in ("reuse", "system"):
        cmd = [sys.executable, str(SCRIPTS / "bench_actor.py"), "--envs", "16", "--seconds", "1", "--malloc", mode,
               "--json"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(SCRIPTS.parent), env=env)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        if result["malloc"] != mode:
            pytest.skip(f"this C library is not glibc: {result['malloc']}")
        faults[mode] = result["page_faults_per_step"]["loop"]
    # Measured in 1-s runs (the first boundaries fault their pages in once): 0.2-0.6 per agent
    # step in either mode, up to 1.2 on one busy core; 9.2 with glibc's defaults before 33b0e33.
    assert faults["system"] < 3 and faults["reuse"] < 3, faults


@pytest.mark.parametrize("argv,message", [
    (["--workload", "atari"], "unknown workload 'atari'"),
    (["--envs", "0"], "--envs and --unroll-length must be at least 1 and --seconds positive"),
    (["--seconds", "0"], "--seconds: expected a positive number, got 0"),
    (["--evict-mb", "-1"], "--evict-mb must be between 0 and 4096, got -1"),
])
def test_bench_actor_bad_arguments_get_sentences(argv, message):
    cmd = [sys.executable, str(SCRIPTS / "bench_actor.py"), "--seconds", "0.1"] + argv
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=str(SCRIPTS.parent))
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.parametrize(
    "script, argv, message",
    [
        ("benchmark", ["--warmup", "nan"], "--warmup: expected a number of 0 or more (a finite number), got 'nan'"),
        ("benchmark", ["--seconds", "inf"], "--seconds: expected a positive number (a finite number), got 'inf'"),
        ("bench_launch", ["--warmup", "nan"], "--warmup: expected a number of 0 or more (a finite number)"),
        ("bench_ingest", ["--clients", "0"], "--clients: expected a positive number of clients, got 0"),
        ("bench_ingest", ["--per-message", "0"], "--per-message: expected a positive number of unrolls per message, got 0"),
        ("bench_contention", ["--settle", "-1"], "--settle: expected a positive number, got -1"),
    ],
)
def test_script_numbers_must_be_finite_and_in_range(script, argv, message):
    # A NaN window never closed (bench_launch waited until its own limit); zero clients measured nothing.
    proc = subprocess.run([sys.executable, str(SCRIPTS / f"{script}.py"), *argv], capture_output=True, text=True,
                          timeout=60, cwd=str(SCRIPTS.parent))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_launch_log_fields_read_the_launchers_last_choice_of_each():
    lines = [
        "10:00:00 impala_rep.launch INFO plan: 32 actors in 2 process(es) (16 envs each); estimated memory 2.1 GiB",
        "10:00:00 impala_rep.launch INFO learner threads: 1 (per agent step the env costs 0.70 ms)",
        "10:00:00 impala_rep.launch INFO actor nice: 10 (the learner runs first on the cores it shares with the actors)",
        "10:00:05 impala_rep.launch INFO actor nice: 0 (--actor-nice)",
        "10:00:06 impala_rep.learner INFO step 1 | agent steps 640",
    ]
    fields = bench.launch_log_fields(lines)
    assert fields == {
        "plan": "32 actors in 2 process(es) (16 envs each); estimated memory 2.1 GiB",
        "learner_threads": "1 (per agent step the env costs 0.70 ms)",
        "actor_nice": "0 (--actor-nice)",
    }
    # A launcher that never logged a choice leaves its field out rather than inventing one.
    assert bench.launch_log_fields(lines[:2]) == {"plan": fields["plan"], "learner_threads": fields["learner_threads"]}


def test_actor_loop_costs_read_the_actors_reports_after_the_first_weighted_by_steps():
    from actors.run import stats_line

    def report(actor, steps, env, policy):
        line = stats_line(actor, (0, dict.fromkeys(("env", "policy", "emit", "other"), 0.0)),
                          (steps, {"env": env * steps / 1e3, "policy": policy * steps / 1e3, "emit": 0.0,
                                   "other": 0.0}), 20.0)
        return f"10:00:00 impala_rep.actor INFO {line}"

    logs = [
        ["10:00:00 impala_rep.actor INFO actor-0: 16 env(s), policy version 0", report("actor-0", 100, 9.0, 9.0),
         report("actor-0", 3000, 0.8, 0.2), "something else", report("actor-0", 1000, 0.4, 0.1)],
        [report("actor-1", 100, 9.0, 9.0), report("actor-1", 4000, 0.7, 0.2)],
        [report("actor-2", 500, 5.0, 5.0)],  # only a first report: left out
    ]
    costs = bench.actor_loop_costs(logs)
    assert costs["actor_loop_reports"] == 3
    parts = costs["actor_loop_ms_per_step"]
    assert list(parts) == ["env", "policy", "emit", "other"]
    assert parts["env"] == pytest.approx((3000 * 0.8 + 1000 * 0.4 + 4000 * 0.7) / 8000)
    assert parts["policy"] == pytest.approx((3000 * 0.2 + 1000 * 0.1 + 4000 * 0.2) / 8000)
    assert parts["emit"] == 0.0
    assert bench.actor_loop_costs([logs[2], []]) == {}


def test_live_over_pieces_sets_the_actors_reports_and_process_cpu_beside_the_pieces():
    pieces = {"env": {"agent_steps_per_s": 1000.0}, "inference": {"agent_steps_per_s": 5000.0},
              "learner": {"agent_steps_per_s": 2500.0}}
    e2e = {"agent_steps_per_s": 1000.0, "cores_actors": 1.5, "cores_learner": 0.5,
           "actor_loop_ms_per_step": {"env": 1.1, "policy": 0.25, "emit": 0.03, "other": 0.01}}
    gaps = bench.live_over_pieces(e2e, pieces)
    assert gaps == pytest.approx({"env": 0.1, "policy": 0.05, "actor_pipeline": 0.15, "learner": 0.1})
    # Without the actors' reports, or a piece that failed, there is nothing to set beside.
    assert bench.live_over_pieces({k: v for k, v in e2e.items() if k != "actor_loop_ms_per_step"}, pieces) == {}
    assert bench.live_over_pieces(e2e, {**pieces, "learner": {"error": "failed"}}) == {}
    # With the learner's TensorFlow threads measured, its gap is split between them and the rest.
    split = bench.live_over_pieces({**e2e, "cores_learner_tensorflow": 0.42}, pieces)
    assert split == pytest.approx({"env": 0.1, "policy": 0.05, "actor_pipeline": 0.15, "learner": 0.1,
                                   "learner_tensorflow": 0.02, "learner_rest": 0.08})
    # With the machine's CPU and the cores, the rest of the machine, the hypervisor and the idle
    # cores are counted too, and the terms add up to the whole gap between the run and the ceiling.
    whole = bench.live_over_pieces({**e2e, "cores_machine": 2.3, "cores_stolen": 0.05}, pieces, cores=2.5)
    assert whole == pytest.approx({"env": 0.1, "policy": 0.05, "actor_pipeline": 0.15, "learner": 0.1,
                                   "other_processes": 0.3, "stolen": 0.05, "idle": 0.15})
    ceiling = bench.ceiling_agent_steps_per_s(1000.0, 5000.0, 2500.0, 2.5)
    assert sum(whole.values()) == pytest.approx(2.5e3 / e2e["agent_steps_per_s"] - 2.5e3 / ceiling)
    # Without a steal figure none is reported: its time stays in idle, and the terms still add up.
    unstolen = bench.live_over_pieces({**e2e, "cores_machine": 2.3}, pieces, cores=2.5)
    assert "stolen" not in unstolen and unstolen["idle"] == pytest.approx(0.2)
    assert sum(unstolen.values()) == pytest.approx(sum(whole.values()))
    # Without the cores only the rest of the machine is known.
    assert bench.live_over_pieces({**e2e, "cores_machine": 2.3}, pieces)["other_processes"] == pytest.approx(0.3)
    assert "idle" not in bench.live_over_pieces({**e2e, "cores_machine": 2.3}, pieces)


def test_summary_prints_the_learner_split_between_tensorflow_and_the_rest():
    e2e = {"actors": 32, "agent_steps_per_s": 3000.0, "window_seconds": 60.0, "queue_fill": 1.0,
           "policy_lag_mean": 5.0, "plan": "32 actors in 1 process(es)", "cores_learner": 1.2,
           "cores_learner_tensorflow": 1.05, "cores_actors": 0.7, "cores_machine": 1.9}
    result = {"workload": "synthetic", "env_id": "x", "env_kwargs": {}, "network": "shallow", "unroll_length": 20,
              "batch_size": 32, "cores": 2, "end_to_end": e2e,
              "live_over_pieces_ms_per_step": {"env": 0.001, "policy": 0.03, "actor_pipeline": 0.05, "learner": 0.06,
                                               "learner_tensorflow": 0.01, "learner_rest": 0.05}}
    text = bench.summary([result])
    assert "learner process 1.20 (TensorFlow's threads 1.05)" in text
    assert ("learner +0.060 (TensorFlow's threads +0.010, the rest of the learner process +0.050)" in text)
    # With the rest of the machine and the idle cores, the line ends with the whole gap they sum to.
    result["live_over_pieces_ms_per_step"].update({"other_processes": 0.004, "stolen": 0.001, "idle": 0.008})
    text = bench.summary([result])
    assert ("learner +0.060 (TensorFlow's threads +0.010, the rest of the learner process +0.050), "
            "other_processes +0.004, stolen +0.001, idle +0.008; in all +0.154, the whole gap to the ceiling") in text
    for key in ("other_processes", "stolen", "idle"):
        del result["live_over_pieces_ms_per_step"][key]
    # Without the thread split (an older JSON), the line is as before.
    del e2e["cores_learner_tensorflow"]
    for key in ("learner_tensorflow", "learner_rest"):
        del result["live_over_pieces_ms_per_step"][key]
    text = bench.summary([result])
    assert "learner process 1.20, actor processes 0.70" in text and "TensorFlow" not in text


def test_summary_prints_the_time_the_hypervisor_took_in_slices_and_pieces():
    e2e = {"actors": 32, "agent_steps_per_s": 3000.0, "window_seconds": 60.0, "plan": "32 actors in 1 process(es)",
           "cores_learner": 1.2, "cores_actors": 0.7, "cores_machine": 1.9, "slices_cores_stolen": [0.004, 0.25, 0.01]}
    piece = {"agent_steps_per_s": 1000.0, "rounds_agent_steps_per_s": [900.0, 1100.0], "rounds_cores_stolen": [0.0, 0.125]}
    result = {"workload": "synthetic", "env_id": "x", "env_kwargs": {}, "network": "shallow", "unroll_length": 20,
              "batch_size": 32, "cores": 2, "end_to_end": e2e, "env": piece}
    text = bench.summary([result])
    assert "cores taken by the hypervisor (steal) in each slice: 0.004, 0.250, 0.010" in text
    assert "(rounds: 900.0, 1100.0)  (steal: 0.000, 0.125 cores)" in text
    # An older JSON, without them: no such lines.
    del e2e["slices_cores_stolen"], piece["rounds_cores_stolen"]
    assert "steal" not in bench.summary([result])


def test_threads_cpu_seconds_counts_only_the_named_threads():
    # Two threads burn 0.3 s of CPU each (however long that takes); only the one whose
    # kernel name starts with the prefix may count, and all of it must.
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    ready, release = threading.Barrier(3), threading.Event()

    def burn(name):
        libc.prctl(15, name, 0, 0, 0)  # PR_SET_NAME: the thread's name in /proc
        start = time.thread_time()
        while time.thread_time() - start < 0.3:
            pass
        ready.wait()
        release.wait(30)

    pid = os.getpid()
    before = bench.threads_cpu_seconds(pid, "tf_benchtest")
    threads = [threading.Thread(target=burn, args=(n,), daemon=True) for n in (b"tf_benchtest", b"other_burn")]
    for t in threads:
        t.start()
    try:
        ready.wait(60)
        after = bench.threads_cpu_seconds(pid, "tf_benchtest")
    finally:
        release.set()
        for t in threads:
            t.join(30)
    assert before == 0.0
    assert 0.25 <= after <= 0.45
    assert bench.threads_cpu_seconds(2**22 + 12345, "tf_") is None  # no such process


def test_piece_children_import_this_checkout_first(monkeypatch):
    # The ceiling's children run as `python scripts/benchmark.py --child ...`, whose sys.path
    # starts with scripts/ and PYTHONPATH: this checkout must come before any editable install.
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    parts = bench._env()["PYTHONPATH"].split(os.pathsep)
    assert parts == [str(bench.SCRIPTS), str(bench.REPO), "/elsewhere"]


# ----------------------------------------------------------------------------- train.sh


def test_the_main_job_flags_parse_into_its_documented_budget():
    """scripts/train.sh's launcher flags (the README's main job) are accepted by the launcher
    and give the budget its comment states: 4M agent steps or 50 minutes, annealed over both."""
    import shlex

    from impala_rep.flags import config_from_args
    from impala_rep.launch import build_parser

    text = (SCRIPTS / "train.sh").read_text()
    start = text.index("exec .venv/bin/python -m impala_rep.launch") + len("exec .venv/bin/python -m impala_rep.launch")
    command = text[start:text.index('"$@"', start)]
    argv = shlex.split(command.replace("\\\n", " "))
    config = config_from_args(build_parser().parse_args(argv))
    assert config.env == "dmc/cartpole-swingup" and config.learner == "cpu"
    assert config.total_steps == 4_000_000 and config.time_budget_s == 3000.0
    assert config.optimizer["anneal_seconds"] == 3000.0 and config.optimizer["anneal_steps"] == 50_000
    assert config.eval_episodes == 10 and config.eval_greedy
    # PopArt with epsilon over sigma squared (seventy-first session), and the way back to the
    # recipe without it that the README gives: a repeated flag overrides.
    assert config.loss["popart"] == 3e-4 and config.optimizer["epsilon_scale"] == "sigma"
    plain = config_from_args(build_parser().parse_args(argv + ["--popart", "0", "--rmsprop-epsilon-scale", "fixed"]))
    assert "popart" not in plain.loss and "epsilon_scale" not in plain.optimizer
    assert dataclasses.replace(plain, loss=config.loss, optimizer=config.optimizer) == config


def test_bench_ingest_sends_batched_messages_as_the_actors_do():
    # Bounded: 2 streams in 1 process for 1 s after 0.5 s of warm-up, on loopback.
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_ingest.py"), "--clients", "2", "--procs", "1",
                           "--seconds", "1", "--warmup", "0.5", "--per-message", "4", "--batch", "4", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=str(SCRIPTS.parent))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (result,) = json.loads(proc.stdout)["results"]
    assert result["unrolls_per_message"] == 4 and result["rejected"] == 0
    # The learner got batches of 4 (the window's edges can cut a message between its unrolls).
    assert abs(result["unrolls_per_message_received"] - 4) < 1
    assert result["unrolls_per_s"] > 0 and result["batches_per_s"] > 0


# ----------------------------------------------------------------------------- benchmark_tally.py

tally = _load("benchmark_tally")


@pytest.mark.parametrize("folder, number", [
    ("first-session", 1), ("eleventh-session", 11), ("nineteenth-session", 19), ("twentieth-session", 20),
    ("forty-seventh-session", 47), ("ninetieth-session", 90), ("ninety-second-session", 92),
    ("ninety-ninth-session", 99), ("hundredth-session", 100), ("one-hundredth-session", 100),
    ("hundred-and-first-session", 101), ("one-hundred-twelfth-session", 112),
    ("hundred-and-ninety-ninth-session", 199),
    ("ninety-second", None), ("notes-session", None), ("ninety-tenth-session", None),
    ("hundred-session", None), ("hundred-and-hundredth-session", None), ("two-hundredth-session", None),
])
def test_tally_reads_the_session_from_the_folder_name(folder, number):
    assert tally.session_number(folder) == number


def _bench_json(path, **ratios):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"results": [{"workload": w.replace("_", "/"), "ratio_to_ceiling": r}
                                            for w, r in ratios.items()]}))


def test_tally_counts_runs_at_the_target_as_printed_and_leaves_out_the_listed_files(tmp_path):
    _bench_json(tmp_path / "forty-sixth-session" / "a.json", synthetic=0.99)  # before --since
    _bench_json(tmp_path / "forty-seventh-session" / "a.json", synthetic=0.8496, dmc_cartpole=0.70)
    _bench_json(tmp_path / "forty-seventh-session" / "b.json", synthetic=0.95)  # listed: not counted
    _bench_json(tmp_path / "ninetieth-session" / "c.json", synthetic=0.80, dmc_cartpole=0.90)
    (tmp_path / "ninetieth-session" / "launch.json").write_text(json.dumps([{"agent_steps_per_s": 1.0}]))
    (tmp_path / "not-counted.txt").write_text("# comment\nforty-seventh-session/b.json  slowed on purpose\n")
    result = tally.tally(tally.collect(tmp_path, since=47), target=0.85)
    # 0.8496 prints as 0.850, and the documents count what they print.
    assert result["synthetic"]["runs"] == 2 and result["synthetic"]["met"] == 1
    assert result["synthetic"]["lowest"]["ratio"] == 0.8 and result["synthetic"]["lowest"]["session"] == 90
    assert result["synthetic"]["mean"] == 0.825  # of the ratios as printed, 0.850 and 0.800
    assert result["dmc/cartpole"] == {
        "runs": 2, "met": 1, "mean": 0.8,
        "lowest": {"ratio": 0.7, "session": 47, "file": "forty-seventh-session/a.json"},
        "highest": {"ratio": 0.9, "session": 90, "file": "ninetieth-session/c.json"}}
    assert tally.tally(tally.collect(tmp_path, since=47, until=47), 0.85)["synthetic"]["runs"] == 1


def test_tally_prints_one_line_per_workload_and_json(tmp_path, capsys):
    _bench_json(tmp_path / "ninetieth-session" / "c.json", synthetic=0.80, dmc_cartpole=0.90)
    assert tally.main(["--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "synthetic: at or past 0.85 in 0 of 1 runs since session 47; 0.800 (session 90) to 0.800 (session 90), mean 0.800",
        "dmc/cartpole: at or past 0.85 in 1 of 1 runs since session 47; 0.900 (session 90) to 0.900 (session 90), mean 0.900"]
    assert tally.main(["--root", str(tmp_path), "--since", "91", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workloads"] == {}


@pytest.mark.parametrize("text, sessions", [
    ("47", [47]), ("47-51", [47, 48, 49, 50, 51]), ("47-47", [47]),
    ("47-46", None), ("47-", None), ("-47", None), ("4x", None), ("47-5x", None),
])
def test_tally_reads_a_session_or_a_range_of_sessions(text, sessions):
    found = tally.session_range(text)
    assert (None if found is None else list(found)) == sessions


def _hosts(root, text):
    (root / "hosts.txt").write_text("# sessions kind family model description\n" + text)


def test_tally_counts_one_host_kind_and_checks_recorded_cpus_against_the_hosts_list(tmp_path, capsys):
    _bench_json(tmp_path / "forty-seventh-session" / "a.json", synthetic=0.90)
    _bench_json(tmp_path / "forty-eighth-session" / "a.json", synthetic=0.80)
    # A run that records its CPU, as scripts/benchmark.py does now.
    recorded = tmp_path / "ninetieth-session" / "c.json"
    recorded.parent.mkdir()
    recorded.write_text(json.dumps({"machine": {"cpu_family": 25, "cpu_model": 17},
                                    "results": [{"workload": "synthetic", "ratio_to_ceiling": 0.70}]}))
    _hosts(tmp_path, "47  zen3  25  1  AMD EPYC, Zen 3\n48  model167  6  167  Intel\n"
                     "90  zen3  25  1  AMD EPYC, Zen 3\n")
    with pytest.raises(ValueError, match="ran on CPU family 25 model 17, but .* gives session 90 the zen3 host "
                                         r"\(family 25 model 1\); correct the line for session 90"):
        tally.collect(tmp_path, since=47)
    _hosts(tmp_path, "47  zen3  25  1  AMD EPYC, Zen 3\n48  model167  6  167  Intel\n")
    with pytest.raises(ValueError, match="session 90 has no line in .*hosts.txt; add one naming its host kind"):
        tally.collect(tmp_path, since=47)
    _hosts(tmp_path, "47  zen3  25  1  AMD EPYC, Zen 3\n48  model167  6  167  Intel\n"
                     "89-90  zen4  25  17  AMD EPYC, Zen 4\n")
    runs = tally.collect(tmp_path, since=47)
    assert [(run["session"], run["host"]) for run in runs] == [(47, "zen3"), (48, "model167"), (90, "zen4")]
    assert [run["ratio"] for run in tally.collect(tmp_path, since=47, host="zen4")] == [0.70]
    assert [run["session"] for run in tally.collect(tmp_path, since=48, host="zen3")] == []
    assert tally.main(["--root", str(tmp_path), "--host", "zen3"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "synthetic: at or past 0.85 in 1 of 1 runs since session 47 on the zen3 host; 0.900 (session 47) to "
        "0.900 (session 47), mean 0.900"]
    assert tally.main(["--root", str(tmp_path), "--host", "zen5"]) == 2
    assert ("no session in" in (err := capsys.readouterr().err)
            and "ran on a host kind named 'zen5'; the kinds there: model167, zen3, zen4." in err)


@pytest.mark.parametrize("listing, message", [
    ("47 zen3 25 1\n", "write 'SESSIONS KIND FAMILY MODEL description'"),
    ("47-46 zen3 25 1 AMD EPYC\n", "write 'SESSIONS KIND FAMILY MODEL description'"),
    ("47 zen3 family 1 AMD EPYC\n", "write 'SESSIONS KIND FAMILY MODEL description'"),
    ("47-49 zen3 25 1 AMD EPYC\n49 zen4 25 17 AMD EPYC\n", "session 49 already has a host (zen3)"),
])
def test_tally_hosts_list_errors_are_sentences(tmp_path, capsys, listing, message):
    _bench_json(tmp_path / "forty-seventh-session" / "a.json", synthetic=0.8)
    _hosts(tmp_path, listing)
    assert tally.main(["--root", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_the_stored_hosts_list_gives_every_counted_session_a_kind():
    # Every benchmark session since the forty-seventh has its host kind, so the per-kind tallies
    # add up to the whole.
    root = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
    runs = tally.collect(root, since=47)
    assert runs and [run["session"] for run in runs if run["host"] is None] == []


@pytest.mark.parametrize("listing, message", [
    ("forty-seventh-session/a.json\n", "give the reason the run is not counted after its path"),
    ("forty-seventh-session/gone.json  moved\n", "forty-seventh-session/gone.json is not a file under"),
])
def test_tally_not_counted_list_errors_are_sentences(tmp_path, capsys, listing, message):
    _bench_json(tmp_path / "forty-seventh-session" / "a.json", synthetic=0.8)
    (tmp_path / "not-counted.txt").write_text(listing)
    assert tally.main(["--root", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_tally_counts_sessions_past_the_ninety_ninth_and_refuses_a_folder_it_cannot_read(tmp_path, capsys):
    # The hundredth session's folder was once skipped without a word: a session folder the tally
    # cannot number must stop it, not drop its runs.
    _bench_json(tmp_path / "ninety-ninth-session" / "a.json", synthetic=0.80)
    _bench_json(tmp_path / "hundredth-session" / "a.json", synthetic=0.86)
    _bench_json(tmp_path / "hundred-and-first-session" / "a.json", synthetic=0.84)
    runs = tally.collect(tmp_path, since=99)
    assert [(run["session"], run["ratio"]) for run in runs] == [(99, 0.80), (100, 0.86), (101, 0.84)]
    assert tally.tally(tally.collect(tmp_path, since=100), 0.85)["synthetic"]["met"] == 1
    _bench_json(tmp_path / "hundred-first-sesion" / "a.json", synthetic=0.99)  # not a session folder
    _bench_json(tmp_path / "one-hundred-and-second-session" / "a.json", synthetic=0.99)
    assert len(tally.collect(tmp_path, since=99)) == 4
    _bench_json(tmp_path / "hundreth-session" / "a.json", synthetic=0.99)  # misspelt
    assert tally.main(["--root", str(tmp_path)]) == 2
    assert "hundreth-session is named like a session's folder, but its name is not a session number" \
        in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--target", "1.5"], "--target 1.5 is a ratio to the ceiling; give one in (0, 1]."),
    (["--since", "50", "--until", "49"], "--since 50 and --until 49 give no sessions"),
    (["--root", "/nonexistent/benchmarks"], "is not a folder; pass the folder that holds the session folders"),
])
def test_tally_flag_errors_are_sentences(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        tally.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err

