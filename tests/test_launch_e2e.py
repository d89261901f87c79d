"""The product end to end, through the real entry points (subprocesses: learner with TensorFlow,
actor processes without it, gRPC on 127.0.0.1)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

ENV = dict(os.environ, MUJOCO_GL="egl", TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
CATCH = ["--env", "catch", "--batch-size", "16", "--unroll-length", "10", "--log-interval", "1"]


def launch(*args, timeout=600, env=ENV):
    return subprocess.run(
        [sys.executable, "-m", "impala_rep.launch", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def evaluate(*args, timeout=300, env=ENV):
    return subprocess.run(
        [sys.executable, "-m", "impala_rep.evaluate", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def run_config(logdir):
    """The run's config.json."""
    with open(os.path.join(logdir, "config.json")) as f:
        return json.load(f)


def metrics(logdir):
    with open(os.path.join(logdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_catch_is_learned_then_evaluated_then_resumed(tmp_path):
    logdir = str(tmp_path / "run")
    proc = launch(*CATCH, "--actors", "4", "--total-steps", "128000", "--logdir", logdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The learner's threads were sized from the costs the probes measured (the learner step's too).
    assert re.search(r"learner threads: \d+ \(per agent step the env costs \d+\.\d+ ms, the policy \d+\.\d+ ms "
                     r"and the learner step \d+\.\d+ ms of CPU", proc.stderr), proc.stderr[-3000:]
    # So were the actor processes, and the launcher started as many as its plan says.
    plan = re.search(r"plan: 4 actors in (\d+) process\(es\) .*\(the cores the learner's share of the work "
                     r"leaves, times [\d.]+ for what live actors cost over their pieces, rounded up, are (\d+)\)",
                     proc.stderr)
    assert plan and plan.group(1) == plan.group(2), proc.stderr[-3000:]
    assert "TensorFlow's CPU tensors come from its pool" in proc.stderr, proc.stderr[-3000:]
    started = [n for n in os.listdir(os.path.join(logdir, "actors")) if re.fullmatch(r"actor-\d+\.log", n)]
    assert len(started) == int(plan.group(1)), started
    records = metrics(logdir)
    assert records, "no progress was recorded"
    # A uniformly random catch policy averages about -0.6; learned is close to +1.
    assert records[-1]["episode_return"] > 0.3, records[-1]
    assert records[-1]["agent_steps"] <= 128000 and records[-1]["transport/unrolls_rejected"] == 0
    assert run_config(logdir)["env"] == "catch"
    assert os.listdir(os.path.join(logdir, "summaries")), "no TensorBoard summaries written"

    ev = evaluate(logdir, "--episodes", "20", "--greedy", "--seed", "1")
    assert ev.returncode == 0, ev.stderr
    report = json.loads(open(os.path.join(logdir, "eval", "eval-800.json")).read())
    assert report["episodes"] == 20 and report["mean_return"] >= 0.6, report
    assert "mean return" in ev.stdout and "episode 20/20" in ev.stdout
    # Evaluating again keeps the earlier report (e.g. the run's own evaluation at that step).
    again = evaluate(logdir, "--episodes", "2", "--greedy", "--seed", "2")
    assert again.returncode == 0, again.stderr
    assert json.loads(open(os.path.join(logdir, "eval", "eval-800.json")).read())["episodes"] == 20
    assert json.loads(open(os.path.join(logdir, "eval", "eval-800-1.json")).read())["episodes"] == 2
    mismatch = evaluate(logdir, "--env-arg", "rows=12")
    assert mismatch.returncode == 2 and "other specs than this env" in mismatch.stderr, mismatch.stderr
    ev2 = evaluate(os.path.join(logdir, "policy"), "--episodes", "3", "--report", str(tmp_path / "r.json"))
    assert ev2.returncode == 0, ev2.stderr
    assert json.loads((tmp_path / "r.json").read_text())["episodes"] == 3

    # Same logdir, larger budget: resumes from the checkpoint (step counter continues).
    proc = launch(*CATCH, "--actors", "2", "--total-steps", "144000", "--logdir", logdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr
    resumed = metrics(logdir)[len(records):]
    assert resumed and resumed[0]["learner_step"] > 800 and resumed[-1]["agent_steps"] <= 144000
    policy = json.load(open(os.path.join(logdir, "policy", "policy.json")))
    assert policy["learner_step"] == 900 and policy["agent_steps"] == 144000


def _wait_for(proc, text, lines, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        if text in line:
            return True
    return False


def test_each_exported_policy_is_evaluated_during_training(tmp_path):
    logdir = str(tmp_path / "run")
    proc = launch(*CATCH, "--actors", "2", "--total-steps", "16000", "--checkpoint-interval", "2",
                  "--eval-episodes", "5", "--eval-greedy", "--logdir", logdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"evaluation at learner step (\d+) \((\d+) agent steps\): return (-?[\d.]+) ± [\d.]+ "
                       r"over 5 greedy episodes", proc.stderr)
    assert lines, proc.stderr[-3000:]
    # The last export (the end of the run: 16,000 agent steps = 100 learner steps) is always evaluated.
    assert lines[-1][:2] == ("100", "16000"), lines
    for step, _, mean in lines:
        report = json.loads(open(os.path.join(logdir, "eval", f"eval-{step}.json")).read())
        assert report["greedy"] and report["episodes"] == 5 and abs(report["mean_return"] - float(mean)) < 0.05
    assert run_config(logdir)["eval_episodes"] == 5


def test_killed_actor_is_restarted_and_sigterm_leaves_a_loadable_checkpoint(tmp_path):
    logdir = str(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, "-m", "impala_rep.launch", *CATCH, "--actors", "2", "--actor-processes", "2",
         "--total-steps", "100000000", "--logdir", logdir, "--checkpoint-interval", "3600"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=ENV,
    )
    lines = []
    try:
        assert _wait_for(proc, "learner steps/s", lines, 240), "".join(lines)
        children = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "actors.run"], capture_output=True, text=True)
        mine = [int(p) for p in children.stdout.split()]  # this launcher's actor processes only
        assert len(mine) == 2, children
        # The actors give the learner the CPU first, at the nice value the launcher logged: 10
        # by default, 19 where the learner's threads fill every core (a 1-core machine).
        chosen = re.search(r"actor nice: (\d+) ", "".join(lines))
        assert chosen and int(chosen.group(1)) in (10, 19), "".join(lines)
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert all(os.getpriority(os.PRIO_PROCESS, pid) == min(19, ours + int(chosen.group(1))) for pid in mine)
        os.kill(mine[0], signal.SIGKILL)
        assert _wait_for(proc, "restarting it (1/10)", lines, 60), "".join(lines)
        assert _wait_for(proc, "learner steps/s", lines, 60), "".join(lines)
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines.append(rest or "")
    log = "".join(lines)
    assert proc.returncode == 0, log[-3000:]
    assert "received SIGTERM" in log and "checkpoint" in log
    assert "killed by SIGKILL" in log
    assert os.path.exists(os.path.join(logdir, "checkpoints", "checkpoint"))
    ev = evaluate(logdir, "--episodes", "2")
    assert ev.returncode == 0, ev.stderr


def test_pixel_dm_control_trains_a_few_updates_end_to_end(tmp_path):
    logdir = str(tmp_path / "run")
    proc = launch("--env", "dmc/cartpole-swingup", "--actors", "2", "--batch-size", "4", "--unroll-length", "5",
                  "--total-steps", "200", "--log-interval", "1", "--logdir", logdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    policy = json.load(open(os.path.join(logdir, "policy", "policy.json")))
    assert policy["learner_step"] == 10 and policy["env_spec"]["observations"]["pixels"]["shape"] == [84, 84, 3]
    assert policy["frame_stack"] == {"pixels": 3}
    video = tmp_path / "episode.mp4"
    ev = evaluate(logdir, "--episodes", "1", "--video", str(video), "--env-arg", "time_limit=20")
    assert ev.returncode == 0, ev.stderr
    assert f"video written to {video}" in ev.stdout, ev.stdout
    import imageio.v2 as imageio

    frames = imageio.mimread(str(video), memtest=False)
    report = json.load(open(os.path.join(logdir, "eval", "eval-10.json")))
    assert len(frames) == report["lengths"][0] + 1 and frames[0].shape == (84, 84, 3)


def test_actors_act_with_the_learners_policy_on_pixels(tmp_path):
    # At a learning rate of ~0 the parameters never change, so the learner's log-probabilities
    # of the actions taken must equal the actors' (NumPy backend, frames stacked from single
    # frames and the unroll's frame prefix, across episode starts): |log rho| near 0. A
    # mismatch between the backends or in the stacking would make every update off-policy.
    logdir = str(tmp_path / "run")
    proc = launch("--env", "dmc/cartpole-swingup", "--actors", "4", "--batch-size", "4", "--unroll-length", "20",
                  "--total-steps", "4000", "--learning-rate", "1e-12", "--log-interval", "1", "--logdir", logdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = metrics(logdir)
    # At least 2400 agent steps of 4 envs in the last record: 600 per env, past an episode end
    # (250 agent steps each, the first one partly spent by the desync) in every env.
    assert records[-1]["agent_steps"] >= 2400 and records[-1]["episodes_in_return"] >= 4, records[-1]
    worst = max(r["loss/abs_log_rho_mean"] for r in records)
    assert worst < 1e-4, [r["loss/abs_log_rho_mean"] for r in records]


def test_replay_trains_on_more_unrolls_than_the_actors_send(tmp_path):
    logdir = str(tmp_path / "run")
    proc = launch(*CATCH, "--actors", "2", "--total-steps", "8000", "--replay-ratio", "0.5", "--logdir", logdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = metrics(logdir)[-1]
    # Half of each 16-unroll batch is replayed once the buffer holds 8 unrolls (after the first,
    # all-fresh batch), so the agent steps are 10 x 16 and then 10 x 8 fresh ones per learner step.
    assert 0.4 <= last["replayed_share"] <= 0.5, last
    assert last["agent_steps"] == 160 + 80 * (last["learner_step"] - 1) <= 8000 + 80, last
    config = run_config(logdir)
    assert config["replay_ratio"] == 0.5 and config["replay_unrolls"] is None


def test_param_refresh_lag_sends_actors_a_share_of_the_versions(tmp_path):
    logdir = str(tmp_path / "run")
    proc = launch(*CATCH, "--actors", "2", "--actor-processes", "2", "--total-steps", "8000",
                  "--param-refresh-lag", "5", "--logdir", logdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = metrics(logdir)[-1]
    # 50 learner steps of 160 agent steps; each process has an unroll boundary every 10 of its
    # steps, so with a lag of 1 it would fetch nearly every version (about 100 replies in all).
    # With 5: its first parameters, then at most one reply per 5 versions.
    versions = last["learner_step"] + 1
    assert 2 <= last["transport/parameters_sent"] <= 2 * (versions // 5 + 1), last
    assert last["transport/parameter_requests"] > 2 * versions // 2, last  # it still asked at every boundary
    assert run_config(logdir)["param_refresh_lag"] == 5


def test_a_plugin_env_with_integer_actions_trains_and_evaluates(tmp_path):
    # An int BoundedArray action (values 1..4, as a Gym adapter gives Discrete) had no policy.
    logdir = str(tmp_path / "run")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(ENV, PYTHONPATH=os.pathsep.join(p for p in (tests_dir, ENV.get("PYTHONPATH")) if p))
    proc = launch("--env", "plugin_envs:make_integer_action", "--actors", "2", "--batch-size", "4", "--unroll-length",
                  "5", "--total-steps", "400", "--log-interval", "1", "--logdir", logdir, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert metrics(logdir)[-1]["agent_steps"] >= 400
    ev = evaluate(logdir, "--episodes", "2", env=env)
    assert ev.returncode == 0 and "mean return 5.0" in ev.stdout, ev.stdout + ev.stderr[-2000:]


def test_max_actor_streams_refuses_the_actor_processes_beyond_it(tmp_path):
    logdir = str(tmp_path / "run")
    proc = launch(*CATCH, "--actors", "2", "--actor-processes", "2", "--total-steps", "4000",
                  "--max-actor-streams", "1", "--logdir", logdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = metrics(logdir)[-1]
    assert last["transport/streams_refused"] >= 1, last  # the second process waited for a stream
    assert run_config(logdir)["max_actor_streams"] == 1


def test_a_time_budget_ends_the_run_and_the_learning_rate_anneals_over_it(tmp_path):
    logdir = str(tmp_path / "run")
    budget, lr = 12.0, 6e-4
    proc = launch(*CATCH, "--actors", "2", "--total-steps", "100000000", "--time-budget", f"{budget:g}s",
                  "--lr-warmup", "0", "--logdir", logdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "time budget of 12 s spent" in proc.stderr, proc.stderr[-3000:]
    records = [r for r in metrics(logdir) if "loss/learning_rate" in r]
    assert len(records) >= 4, records
    for r in records:
        # The rate follows the seconds trained (the step budget is 10^5 times longer); the
        # variable it reads is advanced about once a second, before the record is taken.
        left = r["loss/learning_rate"] / lr
        assert 1 - r["train_seconds"] / budget - 0.02 <= left <= 1 - (r["train_seconds"] - 2.5) / budget + 0.02, r
        assert r["train_seconds"] <= budget + 1.0 and r["agent_steps"] < 100000000
    assert records[-1]["loss/learning_rate"] < 0.5 * lr, records[-1]
    policy = json.load(open(os.path.join(logdir, "policy", "policy.json")))
    assert budget <= policy["train_seconds"] <= budget + 2.0, policy
    assert run_config(logdir)["time_budget_s"] == budget


def test_bfloat16_learner_trains_and_exports_a_float32_policy(tmp_path):
    import numpy as np

    from impala_rep.export import load_policy

    logdir = str(tmp_path / "run")
    proc = launch(*CATCH, "--actors", "2", "--total-steps", "8000", "--learner-precision", "bfloat16",
                  "--logdir", logdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the learner's network computes in bfloat16" in proc.stderr, proc.stderr[-3000:]
    assert run_config(logdir)["learner_precision"] == "bfloat16"
    records = metrics(logdir)
    assert records and all(np.isfinite(r["loss/loss"]) for r in records), records[-1:]
    assert json.load(open(os.path.join(logdir, "policy", "policy.json")))["agent_steps"] == 8000
    params = load_policy(os.path.join(logdir, "policy")).network.params
    assert params and all(p.dtype == np.float32 and np.all(np.isfinite(p)) for p in params.values())


def test_a_diverged_run_stops_with_a_sentence_and_keeps_the_last_good_checkpoint(tmp_path):
    import numpy as np

    from impala_rep.export import load_policy

    logdir = str(tmp_path / "run")
    first = launch(*CATCH, "--actors", "2", "--total-steps", "4000", "--logdir", logdir)
    assert first.returncode == 0, first.stderr[-3000:]
    before = sorted(os.listdir(os.path.join(logdir, "checkpoints")))
    policy_before = json.load(open(os.path.join(logdir, "policy", "policy.json")))
    # Resumed with a learning rate of 1e12, clipping at 1e30 (none) and no warm-up, the
    # parameters turn NaN or infinite within a few updates.
    proc = launch(*CATCH, "--actors", "2", "--total-steps", "80000", "--learning-rate", "1e12", "--clip-norm", "1e30",
                  "--lr-warmup", "0", "--logdir", logdir)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # The learner's check finds NaN parameters; or, first, an actor finds parameters so large
    # that its policy's outputs overflow (seen on one core, where the actors ran ahead of it).
    assert ("made the network's parameters NaN or infinite" in proc.stderr
            or "policy gave NaN or infinite log-probabilities with parameters version" in proc.stderr), proc.stderr[-3000:]
    assert "the run diverged and stopped without saving" in proc.stderr
    assert f"the last checkpoint ({policy_before['checkpoint']}) and exported policy are from before it" in proc.stderr
    assert "Start again with a lower --learning-rate or --clip-norm" in proc.stderr and "Traceback" not in proc.stderr
    # Nothing after the divergence was saved: the checkpoints and the exported policy are the first run's.
    assert sorted(os.listdir(os.path.join(logdir, "checkpoints"))) == before
    assert json.load(open(os.path.join(logdir, "policy", "policy.json"))) == policy_before
    params = load_policy(logdir).network.params
    assert params and all(np.all(np.isfinite(p)) for p in params.values())

    # A resume that fails its last start-up check (the port is taken) leaves the run's record
    # of its settings as it was.
    config_before = open(os.path.join(logdir, "config.json")).read()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = launch(*CATCH, "--actors", "1", "--total-steps", "8000", "--port", str(busy.getsockname()[1]),
                       "--logdir", logdir)
    assert taken.returncode == 2 and "is the port in use" in taken.stderr, taken.stderr[-3000:]
    assert "resumed from" in taken.stderr  # it got as far as the restore
    assert open(os.path.join(logdir, "config.json")).read() == config_before

    # Resuming with settings whose checkpoint differs (a constant learning rate with no warm-up
    # is a variable, an annealed one a schedule), or with a corrupt checkpoint index, is a sentence too.
    other = launch(*CATCH, "--actors", "1", "--total-steps", "8000", "--no-anneal", "--lr-warmup", "0",
                   "--logdir", logdir)
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert f"cannot resume from {os.path.join(logdir, 'checkpoints', policy_before['checkpoint'])}" in other.stderr
    assert "expect_partial" not in other.stderr, other.stderr[-3000:]  # TensorFlow's warnings about the failed restore
    with open(os.path.join(logdir, "checkpoints", "checkpoint"), "w") as f:
        f.write("garbage")
    corrupt = launch(*CATCH, "--actors", "1", "--total-steps", "8000", "--logdir", logdir)
    assert corrupt.returncode == 2 and "Traceback" not in corrupt.stderr, corrupt.stderr[-3000:]
    assert "names none of them (missing or corrupt)" in corrupt.stderr, corrupt.stderr[-3000:]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--actors", "0"], "--actors: expected a positive integer"),
        (["--learner", "quantum"], "invalid choice: 'quantum'"),
        (["--env", "no-such-env"], "no-such-env"),
        (["--env", "catch", "--env-arg", "rows"], "rows"),
        (["--env", "catch", "--batch-size", "6", "--replicas", "4"], "not divisible by replicas 4"),
        (["--env", "catch", "--actors", "100000"], "or fewer"),
        (["--env", "catch", "--learner", "tpu"], "no TPU is attached to this host: run on a TPU VM, pass "
         "--tpu-address grpc://HOST:PORT for a remote TPU, or use --learner cpu or --learner gpu."),
        (["--env", "catch", "--learner", "gpu"], "or use --learner cpu."),
        (["--env", "catch", "--replay-ratio", "1"], "replay-ratio must be at least 0 and below 1"),
        (["--env", "catch", "--learner-precision", "float16"], "invalid choice: 'float16'"),
        (["--env", "catch", "--batch-size", "16", "--queue-unrolls", "8"],
         "--queue-unrolls 8 is smaller than --batch-size 16; the queue must hold at least one batch"),
    ],
)
def test_bad_flags_give_a_sentence_not_a_traceback(tmp_path, args, message):
    proc = launch(*args, "--logdir", str(tmp_path / "run"), timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "kind=" not in proc.stderr and "num_replicas" not in proc.stderr, proc.stderr[-2000:]  # flags, not arguments
    assert "usage:" not in proc.stderr, proc.stderr[-2000:]  # the sentence, not argparse's list of every flag


def test_evaluate_errors_are_sentences(tmp_path):
    missing = evaluate(str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "policy.json").write_text("{not json")
    corrupt = evaluate(str(tmp_path))
    assert corrupt.returncode == 2 and "not JSON" in corrupt.stderr and "Traceback" not in corrupt.stderr


def test_remote_actors_stop_when_the_learners_run_is_over(tmp_path):
    # The multi-host shape on one machine: learner.run alone, actors.run (two processes under
    # its supervisor) pointed at it. When the learner's budget is spent its server tells them the
    # run is over: they stop with exit status 0 at once, instead of retrying for --give-up-after
    # seconds and exiting 3 ("unreachable ... is it running?").
    learner = subprocess.Popen(
        [sys.executable, "-m", "learner.run", "--env", "catch", "--batch-size", "4", "--unroll-length", "5",
         "--total-steps", "600", "--checkpoint-interval", "never", "--logdir", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    actors = None
    try:
        line = learner.stdout.readline()
        assert line.startswith("learner listening on 127.0.0.1:"), (line, learner.stderr.read()[-3000:])
        address = line.split()[-1]
        actors = subprocess.Popen(
            [sys.executable, "-m", "actors.run", "--learner-address", address, "--actors", "2",
             "--actor-processes", "2", "--give-up-after", "120"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        assert learner.wait(timeout=300) == 0, learner.stderr.read()[-3000:]
        learner_log = learner.stderr.read()
        # alone on its host, a CPU learner lays its replicas out as the launcher does
        cores = len(os.sched_getaffinity(0))
        replicas = max(r for r in range(1, cores + 1) if 4 % r == 0)
        assert f"learner threads: {cores} (this host's cores); replicas: {replicas}" in learner_log, learner_log[-3000:]
        t0 = time.monotonic()
        _, err = actors.communicate(timeout=60)
        assert actors.returncode == 0, err[-3000:]
        assert time.monotonic() - t0 < 30, err[-3000:]
        assert "the learner's run is over" in err and "unreachable" not in err, err[-3000:]
    finally:
        for proc in (learner, actors):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
