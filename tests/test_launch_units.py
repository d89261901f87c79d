"""Launcher pieces (TF-free): run config validation, actor planning, supervision."""

import json
import sys
import time

import pytest

from actors.supervisor import ActorSupervisor
from impala_rep.config import ConfigError, RunConfig, actor_view
from impala_rep.plan import PlanError, plan_actors, split_envs, unroll_memory
from impala_rep.specs import ArraySpec, EnvSpec


def test_run_config_round_trips_and_hides_the_token():
    cfg = RunConfig(env="catch", actors=4, token="s3cret", network={"torso": "mlp"})
    data = json.loads(cfg.dumps())
    assert data["token"] == "<set>" and "s3cret" not in cfg.dumps()
    data["token"] = "s3cret"
    assert RunConfig.from_json(data) == cfg


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"actors": 0}, "actors must be a positive integer"),
        ({"learner": "quantum"}, "learner must be one of cpu, gpu, tpu, auto"),
        ({"batch_size": 30, "replicas": 4}, "not divisible by replicas 4"),
        ({"actors": 2, "actor_processes": 3}, "cannot exceed actors"),
        ({"tls_cert": "cert.pem"}, "both --tls-cert and --tls-key"),
        ({"port": 70000}, "port must be in 0..65535"),
        ({"actor_nice": 20}, "actor-nice must be between 0 and 19"),
        ({"actor_nice": -1}, "actor-nice must be between 0 and 19"),
        ({"unrolls_per_message": 0}, "unrolls-per-message must be a whole number of at least 1, got 0"),
        ({"param_refresh_lag": 0}, "param-refresh-lag must be 'auto' or a whole number of learner versions from 1 .* to 1000, got 0"),
        ({"param_refresh_lag": "often"}, "param-refresh-lag must be 'auto' or .* got 'often'"),
        ({"param_refresh_lag": 1001}, "param-refresh-lag must be .* got 1001"),
        ({"max_actor_streams": 0}, "max-actor-streams must be a whole number of actor processes from 1 to 4096, got 0"),
        ({"replay_ratio": 0.1, "batch_size": 4}, r"replay-ratio 0.1 of a batch of 4 unrolls replays none of them .* "
         r"use a replay-ratio of at least 0.125, or 0"),
        ({"replay_ratio": 0.5, "batch_size": 32, "replay_unrolls": 8}, r"replay-unrolls 8 holds fewer than the 16 "
         r"unrolls each batch replays .* give at least 16"),
        ({"max_actor_streams": 5000}, "max-actor-streams must be .* got 5000"),
        ({"learner_precision": "float16"}, "learner-precision must be one of float32, bfloat16, got 'float16'"),
        ({"time_budget_s": 0}, "time-budget must be a positive, finite number of seconds"),
        ({"time_budget_s": float("inf")}, "time-budget must be a positive, finite number of seconds"),
        ({"time_budget_s": "50m"}, "time-budget must be a positive, finite number of seconds .* got '50m'"),
    ],
)
def test_run_config_rejects_bad_values_with_a_sentence(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**kwargs)


def test_unknown_config_keys_are_named():
    with pytest.raises(ConfigError, match="unknown config keys \\['colour'\\]"):
        RunConfig.from_json({"colour": "blue"})


def test_plan_spreads_envs_over_processes_and_fits_64_actors_here():
    plan = plan_actors(64, "dmc/cartpole-swingup", {}, cores=2, memory_mb=24 * 1024)
    assert plan.processes == 2 and plan.envs_per_process == [32, 32]
    plan = plan_actors(10, "catch", {}, processes=3, cores=2, memory_mb=24 * 1024)
    assert plan.envs_per_process == [4, 3, 3]
    # actors.run --actor-processes splits the same way
    assert split_envs(10, 3) == [4, 3, 3] and split_envs(7, 7) == [1] * 7


def test_plan_counts_less_memory_per_env_when_rendering_contexts_are_shared():
    shared = plan_actors(64, "dmc/walker-walk", {}, cores=2, memory_mb=24 * 1024)
    own = plan_actors(64, "dmc/walker-walk", {"share_context": False}, cores=2, memory_mb=24 * 1024)
    standard = plan_actors(64, "dmc/walker-walk", {"share_context": False, "render": "standard"}, cores=2,
                           memory_mb=24 * 1024)
    assert shared.estimated_mb < own.estimated_mb < standard.estimated_mb
    state = plan_actors(64, "dmc/walker-walk", {"observation": "state"}, cores=2, memory_mb=24 * 1024)
    assert state.estimated_mb < shared.estimated_mb


def _pixels_spec(size):
    return EnvSpec(observations={"pixels": ArraySpec("pixels", (size, size, 3), "uint8")},
                   action=ArraySpec("action", (1,), "float32", minimum=-1.0, maximum=1.0))


PIXELS_84 = _pixels_spec(84)


def test_plan_counts_the_unrolls_by_their_observations_and_the_buffers_lengths():
    config = RunConfig(env="dmc/cartpole-swingup", actors=32)
    small, large = unroll_memory(config, PIXELS_84), unroll_memory(config, _pixels_spec(168))
    # one unroll: 21 steps and 2 stacked frames before them, of 84x84x3 bytes, and the per-step scalars
    assert 23 * 84 * 84 * 3 < small.unroll_bytes < 23 * 84 * 84 * 3 + 21 * 32
    assert large.unroll_bytes > 3.9 * small.unroll_bytes
    assert small.learner_unrolls == 2 * 32 + 4 * 32 and small.per_stream == 8  # queue, batches; a message
    replay = unroll_memory(RunConfig(env="dmc/cartpole-swingup", actors=32, replay_ratio=0.5), PIXELS_84)
    assert replay.learner_unrolls == small.learner_unrolls + 8 * 32  # the replay buffer's default 8 batches
    plans = [plan_actors(32, config.env, {}, processes=2, cores=2, memory_mb=24 * 1024, unrolls=u)
             for u in (None, small, large)]
    assert plans[0].estimated_mb < plans[1].estimated_mb < plans[2].estimated_mb
    assert plans[2].estimated_mb - plans[0].estimated_mb > 3.9 * (plans[1].estimated_mb - plans[0].estimated_mb) > 0


def test_plan_counts_an_unroll_as_the_learner_builds_it_with_its_recurrent_state():
    from impala_rep.distributions import make_policy
    from impala_rep.networks import NetworkConfig
    from impala_rep.specs import core_state_spec, unroll_spec

    feed_forward = unroll_memory(RunConfig(env="dmc/cartpole-swingup", actors=32), PIXELS_84)
    config = RunConfig(env="dmc/cartpole-swingup", actors=32, network={"lstm_size": 256})
    recurrent = unroll_memory(config, PIXELS_84)
    assert recurrent.unroll_bytes - feed_forward.unroll_bytes == 2 * 256 * 4  # h and c, float32, once an unroll
    # the same bytes as the learner's spec of an unroll (learner/run.py builds it so)
    network = NetworkConfig(**config.network)
    spec = unroll_spec(PIXELS_84, config.unroll_length, {"pixels": 3}, core_state_spec(network),
                       make_policy(PIXELS_84.action, network).action_spec)
    assert recurrent.unroll_bytes == sum(s.nbytes for s in spec.values())


def test_plan_refuses_a_replay_buffer_larger_than_the_memory_and_names_the_flags():
    huge = unroll_memory(RunConfig(env="dmc/cartpole-swingup", actors=32, replay_ratio=0.5,
                                   replay_unrolls=100_000), PIXELS_84)
    with pytest.raises(PlanError, match=r"the learner's buffers alone hold about \d+\.\d GiB of 0\.46-MB unrolls: "
                                        r"use a smaller --replay-unrolls"):
        plan_actors(32, "dmc/cartpole-swingup", {}, processes=2, cores=2, memory_mb=24 * 1024, unrolls=huge)
    # a buffer that fits beside fewer envs says how many
    tight = unroll_memory(RunConfig(env="dmc/cartpole-swingup", actors=32, replay_ratio=0.5,
                                    replay_unrolls=2_000), PIXELS_84)
    with pytest.raises(PlanError, match=r"use --actors \d+ or fewer"):
        plan_actors(256, "dmc/cartpole-swingup", {}, processes=2, cores=2, memory_mb=4 * 1024, unrolls=tight)


def test_plan_with_unrolls_still_says_when_the_processes_are_what_does_not_fit():
    unrolls = unroll_memory(RunConfig(env="dmc/cartpole-swingup", actors=16), PIXELS_84)
    with pytest.raises(PlanError, match=r"use fewer actor processes: --actor-processes 1 fits --actors \d+ or fewer\."):
        plan_actors(16, "dmc/cartpole-swingup", {}, processes=16, cores=16, memory_mb=4 * 1024, unrolls=unrolls)


def test_plan_refuses_what_cannot_fit_and_says_what_would():
    with pytest.raises(PlanError, match=r"use --actors \d+ or fewer"):
        plan_actors(64, "dmc/cartpole-swingup", {"render": "standard", "share_context": False}, cores=2,
                    memory_mb=4 * 1024)
    with pytest.raises(PlanError, match=r"use --actors \d+ or fewer"):
        plan_actors(256, "dmc/cartpole-swingup", {"render": "standard"}, cores=2, memory_mb=4 * 1024)
    with pytest.raises(PlanError, match="exceeds --actors"):
        plan_actors(2, "catch", {}, processes=4, cores=2, memory_mb=1024)
    # Many cores and little memory: the processes, not the envs, are what does not fit, and a
    # first plan (before the launcher chooses the process count) is not refused for them.
    with pytest.raises(PlanError, match=r"use fewer actor processes: --actor-processes 1 fits --actors 138 or fewer\."):
        plan_actors(16, "dmc/cartpole-swingup", {}, cores=16, memory_mb=4 * 1024)
    assert plan_actors(16, "dmc/cartpole-swingup", {}, cores=16, memory_mb=4 * 1024, check_memory=False).processes == 16
    assert plan_actors(16, "dmc/cartpole-swingup", {}, processes=2, cores=16, memory_mb=4 * 1024).processes == 2


def _sleeper(code, delay=0.0):
    return [sys.executable, "-c", f"import time, sys; time.sleep({delay}); print('bye'); sys.exit({code})"]


def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_supervisor_restarts_crashed_actors_up_to_the_limit(tmp_path):
    sup = ActorSupervisor([_sleeper(3)], log_dir=str(tmp_path), max_restarts=2)
    sup.start()
    events = []
    try:
        assert _wait(lambda: events.extend(sup.poll()) or sup.all_given_up)
    finally:
        sup.stop()
    assert sup.actors[0].restarts == 2 and sup.total_restarts == 2
    assert "exited with code 3; restarting it (1/2)" in events[0]
    assert "bye" in events[0]  # the crash reason quotes the actor's last output
    assert "not restarting it again" in events[-1]


def test_supervisor_counts_restarts_again_after_an_actor_ran_a_good_while(tmp_path, monkeypatch):
    """--max-actor-restarts bounds a crash loop: a process that ran RESTART_WINDOW_S before it
    stopped starts its count again (a run of days is not ended by rare crashes)."""
    import actors.supervisor

    monkeypatch.setattr(actors.supervisor, "RESTART_WINDOW_S", 0.3)
    sup = ActorSupervisor([_sleeper(3, 0.5)], log_dir=str(tmp_path), max_restarts=1)
    sup.start()
    events = []
    try:
        assert _wait(lambda: events.extend(sup.poll()) or sup.actors[0].restarts_total >= 3)
    finally:
        sup.stop()
    assert not sup.actors[0].given_up and sup.actors[0].restarts == 1 and sup.total_restarts >= 3
    assert all("restarting it (1/1)" in e for e in events), events


def test_supervisor_does_not_restart_an_actor_that_found_the_run_diverged(tmp_path):
    from actors.supervisor import DIVERGED_EXIT_CODE

    said = "ERROR the policy's log-probabilities came out NaN or infinite with parameters version 26"
    diverged = [sys.executable, "-c", f"import sys; print({said!r}); sys.exit({DIVERGED_EXIT_CODE})"]
    sup = ActorSupervisor([diverged, _sleeper(0, 60)], log_dir=str(tmp_path), max_restarts=5)
    sup.start()
    events = []
    try:
        assert _wait(lambda: events.extend(sup.poll()) or sup.diverged is not None)
        assert sup.diverged == "actor process 0's policy gave NaN or infinite log-probabilities with parameters version 26"
        assert sup.diverged_version == 26  # the learner compares it with its newest checkpoint
        assert sup.actors[0].given_up and sup.actors[0].restarts == 0
        assert "the training run diverged; not restarting it" in events[0]
        assert sup.alive == 1 and not sup.all_given_up  # the other keeps running until the launcher stops
    finally:
        sup.stop()


def test_supervisor_stop_terminates_running_actors(tmp_path):
    sup = ActorSupervisor([_sleeper(0, 60), _sleeper(0, 60)], log_dir=str(tmp_path), max_restarts=1)
    sup.start()
    assert sup.alive == 2
    t0 = time.monotonic()
    sup.stop(timeout=5)
    assert sup.alive == 0 and time.monotonic() - t0 < 10
    assert sup.poll() == []  # no restarts while stopping


@pytest.mark.parametrize(
    "argv, scale",
    [
        (["--env", "dmc/cartpole-swingup"], 0.25),  # dmc sums 4 repeated rewards by default
        (["--env", "dmc/cartpole-swingup", "--env-arg", "action_repeat=8"], 0.125),
        (["--env", "catch"], 1.0),
        (["--env", "dmc/cartpole-swingup", "--reward-scale", "0.5"], 0.5),
    ],
)
def test_reward_scale_defaults_to_one_over_the_action_repeat(argv, scale):
    from impala_rep.flags import config_from_args
    from impala_rep.launch import build_parser

    config = config_from_args(build_parser().parse_args(argv))
    assert config.loss["reward_scale"] == scale


def test_exported_policy_round_trips_and_mismatched_weights_are_a_sentence(tmp_path):
    import numpy as np

    import envs
    from impala_rep.export import PolicyLoadError, load_policy, save_policy
    from impala_rep.networks import NetworkConfig
    from impala_rep.networks.numpy_backend import NumpyNetwork
    from impala_rep.specs import env_spec_from_dm_env

    spec = env_spec_from_dm_env(envs.make("catch", seed=0))
    net = NumpyNetwork(NetworkConfig(), spec.observations, spec.action, seed=3)
    meta = {"env": "catch", "env_spec": spec.to_json(), "network": {}, "frame_stack": {}}
    loaded = load_policy(save_policy(str(tmp_path / "ok"), net.params, meta))
    for name, value in net.params.items():
        np.testing.assert_array_equal(loaded.network.params[name], value)
    bad = dict(net.params)
    name = sorted(bad)[0]
    bad[name] = np.zeros(bad[name].shape + (2,), np.float32)
    save_policy(str(tmp_path / "bad"), bad, meta)
    with pytest.raises(PolicyLoadError, match=f"does not match the network: .*{name}.*must have shape"):
        load_policy(str(tmp_path / "bad"))
    del bad[name]
    save_policy(str(tmp_path / "missing"), bad, meta)
    with pytest.raises(PolicyLoadError, match="missing"):
        load_policy(str(tmp_path / "missing"))


def test_rmsprop_epsilon_flag_reaches_the_optimizer_config_and_the_default_leaves_it_unwritten():
    from impala_rep.flags import config_from_args
    from impala_rep.launch import build_parser

    parser = build_parser()
    # Runs at IMPALA's 0.01 keep their config.json as before the flag (the learner's default).
    assert "epsilon" not in config_from_args(parser.parse_args(["--env", "catch"])).optimizer
    given = config_from_args(parser.parse_args(["--env", "catch", "--rmsprop-epsilon", "1e-5"]))
    assert given.optimizer["epsilon"] == 1e-5


def test_rmsprop_epsilon_scale_flag_needs_popart_and_the_default_leaves_it_unwritten():
    from impala_rep.flags import UsageError, config_from_args
    from impala_rep.launch import build_parser

    parser = build_parser()
    assert "epsilon_scale" not in config_from_args(parser.parse_args(["--env", "catch", "--popart", "3e-4"])).optimizer
    given = config_from_args(parser.parse_args(["--env", "catch", "--popart", "3e-4", "--rmsprop-epsilon-scale",
                                                "sigma"]))
    assert given.optimizer["epsilon_scale"] == "sigma"
    with pytest.raises(UsageError, match=r"--rmsprop-epsilon-scale sigma needs --popart STEP_SIZE \(e.g. 3e-4\).*"
                                         r"give --rmsprop-epsilon-scale fixed as well"):
        config_from_args(parser.parse_args(["--env", "catch", "--rmsprop-epsilon-scale", "sigma"]))


def test_popart_terms_impala_reaches_the_loss_config_and_needs_popart():
    from impala_rep.flags import UsageError, config_from_args
    from impala_rep.launch import build_parser

    parser = build_parser()
    given = config_from_args(parser.parse_args(["--env", "catch", "--popart", "3e-4", "--popart-terms", "impala"]))
    assert given.loss["popart_terms"] == "impala"
    assert "popart_terms" not in config_from_args(parser.parse_args(["--env", "catch", "--popart", "3e-4"])).loss
    with pytest.raises(UsageError, match="--popart-terms impala needs --popart STEP_SIZE"):
        config_from_args(parser.parse_args(["--env", "catch", "--popart-terms", "impala"]))


def test_lr_warmup_flag_reaches_the_optimizer_config_and_rejects_negatives(capsys):
    from impala_rep.flags import config_from_args
    from impala_rep.launch import build_parser

    parser = build_parser()
    assert config_from_args(parser.parse_args(["--env", "catch"])).optimizer["warmup_steps"] == 100
    short = ["--env", "catch", "--total-steps", "64000", "--unroll-length", "20", "--batch-size", "32"]  # 100 updates
    assert config_from_args(parser.parse_args(short)).optimizer["warmup_steps"] == 5
    assert config_from_args(parser.parse_args(["--env", "catch", "--lr-warmup", "0"])).optimizer["warmup_steps"] == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--env", "catch", "--lr-warmup", "-5"])
    assert "expected a whole number (0 or more), got -5" in capsys.readouterr().err


def test_interval_flags_accept_never_and_config_json_stays_strict(capsys):
    import math

    from impala_rep.flags import config_from_args
    from impala_rep.launch import build_parser

    parser = build_parser()
    config = config_from_args(parser.parse_args(["--env", "catch", "--checkpoint-interval", "never",
                                                 "--log-interval", "inf"]))
    assert config.checkpoint_interval_s == math.inf and config.log_interval_s == math.inf
    text = config.dumps()

    def no_constants(name):
        raise AssertionError(f"config.json holds {name}, which strict JSON readers refuse")

    data = json.loads(text, parse_constant=no_constants)
    assert data["checkpoint_interval_s"] is None and data["log_interval_s"] is None
    assert RunConfig.from_json(data) == config
    finite = config_from_args(parser.parse_args(["--env", "catch", "--checkpoint-interval", "30"]))
    assert finite.checkpoint_interval_s == 30.0 and json.loads(finite.dumps())["checkpoint_interval_s"] == 30.0
    for bad in ("0", "-3", "nan", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--env", "catch", "--checkpoint-interval", bad])
        assert "expected a positive number of seconds or 'never'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="log-interval must be a positive number"):
        RunConfig(env="catch", log_interval_s=float("nan"))


def test_learner_precision_flag_reaches_the_run_config():
    from impala_rep.flags import config_from_args
    from impala_rep.launch import build_parser

    parser = build_parser()
    assert config_from_args(parser.parse_args(["--env", "catch"])).learner_precision == "float32"
    config = config_from_args(parser.parse_args(["--env", "catch", "--learner-precision", "bfloat16"]))
    assert config.learner_precision == "bfloat16"
    assert RunConfig.from_json(json.loads(config.dumps())).learner_precision == "bfloat16"
    assert "learner_precision" not in actor_view(config, {})  # the actors compute in float32 either way


def test_launcher_starts_actors_with_lowered_priority():
    from impala_rep.flags import config_from_args
    from actors.supervisor import actor_process_commands
    from impala_rep.launch import build_parser

    parser = build_parser()
    assert config_from_args(parser.parse_args(["--env", "catch"])).actor_nice == 10
    assert config_from_args(parser.parse_args(["--env", "catch", "--actor-nice", "0"])).actor_nice == 0
    commands = actor_process_commands("127.0.0.1:1", [3, 2], seed=0, nice=10)  # as the launcher calls it
    assert all(cmd[cmd.index("--nice") + 1] == "10" for cmd in commands)


def test_actors_fill_the_gaps_of_a_learner_whose_threads_fill_the_cores():
    from impala_rep.launch import FILL_NICE, choose_actor_nice

    assert choose_actor_nice(None, "cpu", 1, 2)[0] == 10  # the learner runs first on the core it shares
    nice, why = choose_actor_nice(None, "cpu", 2, 2)
    assert nice == FILL_NICE == 19 and "fill the 2 cores" in why and "on every core" in why
    nice, why = choose_actor_nice(None, "cpu", 1, 1)  # a 1-core machine, in the singular
    assert nice == 19 and why.startswith("the learner's thread fills the one core")
    assert choose_actor_nice(None, "cpu", 4, 4)[0] == 19
    with pytest.raises(ValueError, match="resolved learner"):  # auto may yet become a GPU learner
        choose_actor_nice(None, "auto", 4, 4)
    assert choose_actor_nice(None, "gpu", 2, 2)[0] == 10  # its threads only feed the GPU
    assert choose_actor_nice(7, "cpu", 2, 2) == (7, "--actor-nice")
    assert choose_actor_nice(0, "cpu", 1, 2) == (0, "--actor-nice")


_PRIORITY_PROBE = """
import os, sys
sys.path.insert(0, {repo!r})
from actors.run import lower_priority
def group_nice():
    # The file is empty when the process's CPU group is a cgroup rather than its session's
    # autogroup (e.g. a CI job run under a systemd or container cgroup): nothing to compare.
    try:
        words = open("/proc/self/autogroup").read().split()
    except OSError:
        return None
    return words[-1] if words else None
before = group_nice()
print(lower_priority({nice}))
print(os.getpriority(os.PRIO_PROCESS, 0))
print(before, group_nice())
"""


def _priority_probe(nice: int, new_session: bool):
    import os
    import subprocess
    from pathlib import Path

    code = _PRIORITY_PROBE.format(repo=str(Path(__file__).resolve().parents[1]), nice=nice)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          start_new_session=new_session)
    assert proc.returncode == 0, proc.stderr
    done, priority, groups = proc.stdout.strip().splitlines()
    before, after = groups.split()
    return done, int(priority), before, after, os.getpriority(os.PRIO_PROCESS, 0)


def test_actor_lowers_its_priority_and_its_own_session_groups():
    done, priority, before, after, ours = _priority_probe(5, new_session=True)
    assert priority == min(19, ours + 5)
    if before == "None":
        pytest.skip("this kernel has no autogroup (/proc/self/autogroup): no session group to lower")
    # the kernel schedules by autogroup: the actor's session gives way too
    if "session group too" in done:
        assert after == "5"
    else:  # a kernel or container that refuses the write: said, and nothing changed
        assert "session group unchanged" in done and after == before
    done, priority, before, after, ours = _priority_probe(0, new_session=True)
    assert done == "normal priority" and priority == ours and after == before


def test_actor_sharing_a_session_leaves_the_session_group_alone():
    # Another process of the session (say, the learner started from the same shell) must not
    # be slowed down with it.
    done, priority, before, after, ours = _priority_probe(7, new_session=False)
    assert priority == min(19, ours + 7)
    assert after == before and "session group" not in done


def test_actor_nice_flag_is_checked(capsys):
    from actors.run import main

    with pytest.raises(SystemExit):
        main(["--learner-address", "127.0.0.1:1", "--nice", "25"])
    assert "--nice must be between 0 and 19, got 25" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--learner-address", "127.0.0.1:1", "--unrolls-per-message", "0"])
    assert "--unrolls-per-message must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--learner-address", "127.0.0.1:1", "--param-prefetch-steps", "-1"])
    assert "--param-prefetch-steps must be 0 or more agent steps, got -1" in capsys.readouterr().err


def test_param_prefetch_steps_reach_the_actor_processes_a_supervising_actor_starts():
    from actors.run import build_parser as actor_parser
    from actors.supervisor import actor_process_commands
    from impala_rep.config import DEFAULT_PARAM_PREFETCH_STEPS

    assert actor_parser().parse_args(["--learner-address", "h:1"]).param_prefetch_steps == DEFAULT_PARAM_PREFETCH_STEPS
    commands = actor_process_commands("127.0.0.1:1", [2, 2], seed=0, param_prefetch_steps=0)
    assert [actor_parser().parse_args(cmd[3:]).param_prefetch_steps for cmd in commands] == [0, 0]
    commands = actor_process_commands("127.0.0.1:1", [2], seed=0)
    assert "--param-prefetch-steps" not in commands[0]  # the child's own default


def test_unrolls_per_message_reaches_the_actor_processes(capsys):
    from actors.run import build_parser as actor_parser
    from actors.supervisor import actor_process_commands
    from impala_rep.flags import config_from_args
    from impala_rep.launch import build_parser

    parser = build_parser()
    assert config_from_args(parser.parse_args(["--env", "catch"])).unrolls_per_message == 8
    config = config_from_args(parser.parse_args(["--env", "catch", "--unrolls-per-message", "3"]))
    assert config.unrolls_per_message == 3
    commands = actor_process_commands("127.0.0.1:1", [2, 2], seed=0, unrolls_per_message=config.unrolls_per_message)
    assert [actor_parser().parse_args(cmd[3:]).unrolls_per_message for cmd in commands] == [3, 3]
    with pytest.raises(SystemExit):
        parser.parse_args(["--env", "catch", "--unrolls-per-message", "0"])
    assert "--unrolls-per-message" in capsys.readouterr().err


def test_time_budget_flag_takes_a_duration_and_anneals_over_it_unless_told_not_to(capsys):
    from impala_rep.flags import config_from_args
    from impala_rep.launch import build_parser

    parser = build_parser()
    plain = config_from_args(parser.parse_args(["--env", "catch"]))
    assert plain.time_budget_s is None and "anneal_seconds" not in plain.optimizer
    for text, seconds in (("90", 90.0), ("45s", 45.0), ("50m", 3000.0), ("1.5h", 5400.0), (" 2M ", 120.0)):
        config = config_from_args(parser.parse_args(["--env", "catch", "--time-budget", text]))
        assert config.time_budget_s == seconds and config.optimizer["anneal_seconds"] == seconds, text
        assert config.optimizer["anneal_steps"] > 0  # and over the steps, whichever is further along
        assert RunConfig.from_json(json.loads(config.dumps())) == config
    constant = config_from_args(parser.parse_args(["--env", "catch", "--time-budget", "50m", "--no-anneal"]))
    assert constant.time_budget_s == 3000.0 and "anneal_seconds" not in constant.optimizer
    for bad in ("0", "-5m", "nan", "inf", "ten", "5d", "m", ""):
        with pytest.raises(SystemExit):
            parser.parse_args(["--env", "catch", f"--time-budget={bad}"])
        assert "expected a positive duration: seconds, or a number with a unit s, m or h" in capsys.readouterr().err


def test_param_refresh_lag_flag_reaches_the_config(capsys):
    from impala_rep.flags import config_from_args
    from impala_rep.launch import build_parser

    parser = build_parser()
    assert config_from_args(parser.parse_args(["--env", "catch"])).param_refresh_lag == "auto"
    assert config_from_args(parser.parse_args(["--env", "catch", "--param-refresh-lag", "4"])).param_refresh_lag == 4
    assert config_from_args(parser.parse_args(["--env", "catch", "--param-refresh-lag", "auto"])).param_refresh_lag == "auto"
    for bad, shown in (("0", "0"), ("1001", "1001"), ("soon", "'soon'")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--env", "catch", "--param-refresh-lag", bad])
        assert (f"--param-refresh-lag: expected 'auto' or a whole number of learner versions from 1 to 1000, "
                f"got {shown}") in capsys.readouterr().err


def test_param_refresh_lag_auto_is_one_on_a_cpu_learner_and_eight_on_accelerators():
    from impala_rep.config import resolve_param_refresh_lag

    assert resolve_param_refresh_lag("auto", "cpu") == 1
    assert resolve_param_refresh_lag("auto", "gpu") == resolve_param_refresh_lag("auto", "tpu") == 8
    assert resolve_param_refresh_lag(3, "gpu") == resolve_param_refresh_lag(3, "cpu") == 3


def test_learner_auto_is_planned_as_the_kind_it_resolves_to():
    """--learner auto on a host without an accelerator is planned as --learner cpu (replicas
    side by side, actors sized by cost), and on a GPU host not as a CPU learner."""
    from impala_rep.launch import cpu_replicas, resolve_auto_learner

    auto = RunConfig(env="catch", learner="auto", batch_size=16)
    none = lambda kind: []  # noqa: E731
    config, why = resolve_auto_learner(auto, none)
    assert config.learner == "cpu" and why == "--learner auto: no TPU or GPU on this host"
    assert cpu_replicas(config, 2) == (2, "one per learner thread that divides the batch of 16")
    config, why = resolve_auto_learner(auto, lambda kind: ["/gpu:0", "/gpu:1"] if kind == "GPU" else [])
    assert config.learner == "gpu" and why == "--learner auto: 2 GPU(s)"
    config, why = resolve_auto_learner(RunConfig(env="catch", learner="auto", tpu_address="grpc://10.0.0.2:8470"),
                                       none)
    assert config.learner == "tpu" and why == "--learner auto: --tpu-address grpc://10.0.0.2:8470"
    assert resolve_auto_learner(RunConfig(env="catch", learner="cpu"), none) == (RunConfig(env="catch"), None)


def test_flags_that_other_settings_make_do_nothing_are_named(capsys):
    from impala_rep.flags import config_from_args, ignored_flags
    from impala_rep.launch import build_parser

    parser = build_parser()
    config = config_from_args(parser.parse_args(["--env", "catch", "--tpu-address", "grpc://h:1", "--eval-greedy",
                                                 "--replay-unrolls", "64"]))
    assert ignored_flags(config) == [
        "--tpu-address is for --learner tpu or auto; this run's learner is cpu, so it is not used.",
        "--eval-greedy applies to the evaluations of --eval-episodes N, and there are none (--eval-episodes 0).",
        "--replay-unrolls sizes the buffer of --replay-ratio, which is 0: nothing is replayed.",
    ]
    assert ignored_flags(config_from_args(parser.parse_args(["--env", "catch"]))) == []
    with pytest.raises(SystemExit):
        parser.parse_args(["--env", "catch", "--bins", "1"])
    assert "--bins: expected an integer of at least 2, got 1" in capsys.readouterr().err


def test_max_actor_streams_flag_reaches_the_config(capsys):
    from impala_rep.flags import config_from_args
    from impala_rep.flags import CommandLineParser, add_learner_flags
    from impala_rep.launch import build_parser

    alone = CommandLineParser(prog="python -m learner.run")  # learner.run's flags
    add_learner_flags(alone)
    for parser in (build_parser(), alone):
        assert config_from_args(parser.parse_args(["--env", "catch"])).max_actor_streams == 64
        assert config_from_args(parser.parse_args(["--env", "catch", "--max-actor-streams", "200"])).max_actor_streams == 200
        with pytest.raises(SystemExit):
            parser.parse_args(["--env", "catch", "--max-actor-streams", "0"])
        assert "--max-actor-streams: expected a positive integer, got 0" in capsys.readouterr().err


def test_learner_threads_flag_takes_a_count_or_auto(capsys):
    from impala_rep.launch import build_parser

    parser = build_parser()
    assert parser.parse_args(["--env", "catch"]).learner_threads == "auto"
    assert parser.parse_args(["--env", "catch", "--learner-threads", "3"]).learner_threads == 3
    for bad in ("0", "two", "-1"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--env", "catch", "--learner-threads", bad])
        assert f"expected a positive number of threads or 'auto', got '{bad}'" in capsys.readouterr().err


def test_launcher_sizes_learner_threads_from_the_probed_costs():
    from impala_rep.launch import choose_learner_threads

    cheap_env = {"env": {"seconds_per_step": 5e-6}, "policy": {"seconds_per_step": 2.7e-4}}
    dear_env = {"env": {"seconds_per_step": 1.4e-3}, "policy": {"seconds_per_step": 2.6e-4}}
    threads, why = choose_learner_threads("auto", 2, cheap_env, fallback=1)
    assert threads == 2 and "0.27 ms" in why
    assert "the learner step an estimated 0.81 ms (the learner step was not timed)" in why
    # The learner probe's measurement replaces the estimate (1.02 of 2 cores: one thread).
    measured = dict(cheap_env, learner={"seconds_per_step": 1.5e-4})
    threads, why = choose_learner_threads("auto", 2, dict(measured, policy={"seconds_per_step": 1.4e-4}), fallback=2)
    assert threads == 1 and "the learner step 0.15 ms of CPU" in why and "1.02 of 2 cores" in why
    failed = dict(cheap_env, learner_error="timing the learner step took more than 180 s")
    threads, why = choose_learner_threads("auto", 2, failed, fallback=1)
    assert threads == 2 and "an estimated 0.81 ms (timing the learner step took more than 180 s)" in why
    assert choose_learner_threads("auto", 2, dear_env, fallback=1)[0] == 1
    assert choose_learner_threads(4, 2, cheap_env, fallback=1) == (4, "--learner-threads")
    # Without costs (the policy could not be timed) the learner gets the cores the actors leave.
    threads, why = choose_learner_threads("auto", 8, {"env": cheap_env["env"], "error": "could not time the policy: x"},
                                          fallback=6)
    assert threads == 6 and "could not time the policy" in why


def test_launcher_sizes_actor_processes_from_the_probed_costs():
    import types

    from impala_rep.launch import choose_actor_processes

    config = types.SimpleNamespace(actors=32, actor_processes=None)
    synthetic = {"env": {"seconds_per_step": 0.0}, "policy": {"seconds_per_step": 1.4e-4},
                 "learner": {"seconds_per_step": 2.2e-4}}
    cartpole = {"env": {"seconds_per_step": 6.9e-4}, "policy": {"seconds_per_step": 1.3e-4},
                "learner": {"seconds_per_step": 2.1e-4}}
    processes, why = choose_actor_processes(config, 2, synthetic, planned=2, by_cost=True)
    assert processes == 1 and "rounded up, are 1" in why
    assert choose_actor_processes(config, 2, cartpole, planned=2, by_cost=True)[0] == 2
    # Not a CPU learner, or no costs: the plan's one process per core.
    assert choose_actor_processes(config, 2, synthetic, planned=2, by_cost=False) == (2, "one per core")
    assert choose_actor_processes(config, 2, {"error": "could not time the policy"}, planned=2, by_cost=True) == (
        2, "one per core")
    config.actor_processes = 2
    assert choose_actor_processes(config, 2, synthetic, planned=2, by_cost=True) == (2, "--actor-processes")


def _stub_launcher(monkeypatch, learner_seconds: float, cores: int = 2) -> list:
    """Makes impala_rep.launch.main plan on ``cores`` cores with synthetic-like probed costs (env 0, policy
    0.14 ms, the learner step ``learner_seconds`` per agent step) and stop before starting any
    process; returns the list the RunConfigs it would have trained with are appended to."""
    import learner.run
    from impala_rep import launch, plan, probe

    def probe_env(env_id, env_kwargs, costs=None):
        return PIXELS_84, {"env": {"seconds_per_step": 0.0}, "policy": {"seconds_per_step": 1.4e-4}}

    started = []
    monkeypatch.setattr(plan, "available_cores", lambda: cores)
    monkeypatch.setattr(plan, "available_memory_mb", lambda: 8 * 1024)
    monkeypatch.setattr(probe, "probe_env", probe_env)
    monkeypatch.setattr(launch, "time_learner",
                        lambda config, spec, c: c.update(learner={"seconds_per_step": learner_seconds}))
    monkeypatch.setattr(learner.run, "configure_logging", lambda: None)
    monkeypatch.setattr(learner.run, "configure_tensorflow_env", lambda: None)  # keeps this process's environment
    monkeypatch.setattr(learner.run, "configure_threads", lambda threads, replicas: None)
    monkeypatch.setattr(learner.run, "start_trainer", lambda config, spec: (started.append(config), (None, None))[1])
    return started


def test_launcher_starts_the_actor_processes_the_costs_ask_for(monkeypatch, caplog):
    """main re-plans with the count by cost: 32 envs in 2 processes where one per core gives 4."""
    from impala_rep import launch

    # The learner's share is 2.50 of 4 cores: 3 threads; the actors' 1.50, times 1.25, 2 processes.
    _stub_launcher(monkeypatch, 2.33e-4, cores=4)
    with caplog.at_level("INFO", logger="impala_rep.launch"):
        assert launch.main(["--env", "catch", "--actors", "32", "--learner", "cpu"]) == 2
    assert "plan: 32 actors in 2 process(es) (16 envs each)" in caplog.text, caplog.text
    assert "rounded up, are 2)" in caplog.text and "learner threads: 3 " in caplog.text
    assert "plan: 32 actors in 4 process(es)" not in caplog.text  # no re-plan: the learner leaves a core
    caplog.clear()
    with caplog.at_level("INFO", logger="impala_rep.launch"):
        assert launch.main(["--env", "catch", "--actors", "32", "--learner", "cpu", "--actor-processes", "1"]) == 2
    assert "plan: 32 actors in 1 process(es) (32 envs each)" in caplog.text and "(--actor-processes)" in caplog.text


def test_launcher_refuses_a_replay_buffer_the_memory_cannot_hold(monkeypatch, capsys):
    from impala_rep import launch

    started = _stub_launcher(monkeypatch, 1.5e-4)
    with pytest.raises(SystemExit) as exit_:
        launch.main(["--env", "catch", "--actors", "32", "--learner", "cpu", "--replay-ratio", "0.5",
                     "--replay-unrolls", "1000000"])
    assert exit_.value.code == 2 and started == []
    err = capsys.readouterr().err
    assert "the learner's buffers alone hold about" in err and "use a smaller --replay-unrolls" in err, err


def test_fill_actor_processes_gives_niced_actors_a_process_per_core():
    import types

    from impala_rep.launch import fill_actor_processes

    config = types.SimpleNamespace(actors=32, actor_processes=None)
    assert fill_actor_processes(config, 2, 1, "by cost", filling=True) == (
        2, "one per core: niced actors fill the cores the learner's threads leave idle")
    assert fill_actor_processes(config, 2, 1, "by cost", filling=False) == (1, "by cost")
    assert fill_actor_processes(config, 2, 2, "by cost", filling=True) == (2, "by cost")
    assert fill_actor_processes(types.SimpleNamespace(actors=1, actor_processes=None), 2, 1, "by cost", True) == (
        1, "by cost")  # one env: one process
    config.actor_processes = 1
    assert fill_actor_processes(config, 2, 1, "--actor-processes", filling=True) == (1, "--actor-processes")


def test_launcher_nices_actors_and_adds_processes_when_the_learner_fills_the_cores(monkeypatch, caplog):
    """A learner whose share of the work is 1.56 of 2 cores gets 2 threads: the actors are
    niced to fill its gaps, in one process per core; either flag given keeps its own choice."""
    from impala_rep import launch

    started = _stub_launcher(monkeypatch, 5e-4)
    base = ["--env", "catch", "--actors", "32", "--learner", "cpu"]
    with caplog.at_level("INFO", logger="impala_rep.launch"):
        assert launch.main(base) == 2
    assert "learner threads: 2" in caplog.text and "actor nice: 19" in caplog.text, caplog.text
    assert "plan: 32 actors in 2 process(es) (16 envs each)" in caplog.text
    assert "(one per core: niced actors fill the cores the learner's threads leave idle)" in caplog.text
    assert started[-1].actor_nice == 19
    assert started[-1].actor_processes == 2  # config.json records the processes that ran, not null
    caplog.clear()
    with caplog.at_level("INFO", logger="impala_rep.launch"):
        assert launch.main(base + ["--actor-processes", "1"]) == 2
    assert "32 actors in 2 process(es)" not in caplog.text and started[-1].actor_nice == 19
    caplog.clear()
    with caplog.at_level("INFO", logger="impala_rep.launch"):
        assert launch.main(base + ["--actor-nice", "0"]) == 2
    assert "32 actors in 2 process(es)" not in caplog.text and started[-1].actor_nice == 0


def test_cpu_learner_gets_one_replica_per_thread_that_divides_the_batch():
    import dataclasses

    from impala_rep.launch import cpu_replicas

    cfg = RunConfig(env="catch", batch_size=32)
    assert cpu_replicas(cfg, 2)[0] == 2 and "divides the batch of 32" in cpu_replicas(cfg, 2)[1]
    assert cpu_replicas(cfg, 1)[0] == 1
    assert cpu_replicas(dataclasses.replace(cfg, batch_size=9), 2)[0] == 1  # 9 unrolls do not split in two
    assert cpu_replicas(dataclasses.replace(cfg, batch_size=9), 4)[0] == 3
    assert cpu_replicas(dataclasses.replace(cfg, replicas=4), 2) == (4, "--replicas")
    assert cpu_replicas(dataclasses.replace(cfg, learner="gpu"), 2) == (None, "not a CPU learner")


def test_actor_process_commands_split_ids_seeds_and_options():
    from actors.run import build_parser as actor_parser
    from actors.supervisor import actor_process_commands

    commands = actor_process_commands("127.0.0.1:5", [3, 2], seed=7, id_prefix="host", nice=4, tls_ca="ca.pem",
                                      give_up_after=30.0)
    parsed = [actor_parser().parse_args(cmd[3:]) for cmd in commands]  # [python, -m, actors.run, ...]
    assert [cmd[:3] for cmd in commands] == [[sys.executable, "-m", "actors.run"]] * 2
    assert [(p.actors, p.actor_processes, p.actor_id, p.seed) for p in parsed] == [(3, 1, "host-0", 1007),
                                                                                     (2, 1, "host-1", 2007)]
    assert all(p.nice == 4 and p.tls_ca == "ca.pem" and p.give_up_after == 30.0 for p in parsed)
    assert all("--token" not in cmd for cmd in commands)  # the token travels in the environment


def test_actors_run_with_several_processes_supervises_the_split(monkeypatch):
    import actors.run
    import actors.supervisor

    seen = {}

    class GivesUp:  # stands in for the supervisor: records what it would start, then gives up
        all_given_up = all_done = True
        all_finished = False
        diverged = None

        def __init__(self, commands, max_restarts, env, log_dir=None):
            seen.update(commands=commands, env=env)

        def start(self):
            seen["started"] = True

        def poll(self):
            pass

        def stop(self):
            seen["stopped"] = True

    monkeypatch.setattr(actors.supervisor, "ActorSupervisor", GivesUp)
    monkeypatch.setattr(actors.run.signal, "signal", lambda *_: None)  # keep pytest's own handlers
    code = actors.run.main(["--learner-address", "127.0.0.1:1", "--actors", "5", "--actor-processes", "2",
                            "--token", "s3cret", "--nice", "3"])
    assert code == 1  # every process gave up
    parsed = [actors.run.build_parser().parse_args(cmd[3:]) for cmd in seen["commands"]]
    assert [(p.actors, p.nice) for p in parsed] == [(3, 3), (2, 3)]
    assert seen["env"]["IMPALA_REP_TOKEN"] == "s3cret" and seen["started"] and seen["stopped"]

    # A process that found the run diverged stops the others and the exit status says so.
    class Diverged(GivesUp):
        all_given_up = all_done = False
        diverged = "actor process 1's policy gave NaN or infinite log-probabilities with parameters version 3"

    monkeypatch.setattr(actors.supervisor, "ActorSupervisor", Diverged)
    seen.clear()
    code = actors.run.main(["--learner-address", "127.0.0.1:1", "--actors", "2", "--actor-processes", "2"])
    assert code == actors.supervisor.DIVERGED_EXIT_CODE and seen["stopped"]

    # Every process stopped because the learner's run is over: a normal end, status 0.
    class Finished(GivesUp):
        all_given_up = False
        all_finished = all_done = True

    monkeypatch.setattr(actors.supervisor, "ActorSupervisor", Finished)
    seen.clear()
    code = actors.run.main(["--learner-address", "127.0.0.1:1", "--actors", "2", "--actor-processes", "2"])
    assert code == 0 and seen["stopped"]


def test_actor_process_env_sets_one_thread_each_and_egl_unless_set(monkeypatch):
    from impala_rep.launch import actor_environment
    from impala_rep.plan import actor_process_env

    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    monkeypatch.setenv("LP_NUM_THREADS", "4")
    monkeypatch.delenv("MUJOCO_GL", raising=False)
    env = actor_process_env()
    assert [env[name] for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")] == ["1"] * 3
    assert env["LP_NUM_THREADS"] == "0"  # llvmpipe renders in the actor's own thread
    assert env["MUJOCO_GL"] == "egl"
    monkeypatch.setenv("MUJOCO_GL", "osmesa")
    assert actor_process_env()["MUJOCO_GL"] == "osmesa"  # a user's choice stays
    assert actor_environment("s3cret")["IMPALA_REP_TOKEN"] == "s3cret"
    monkeypatch.delenv("IMPALA_REP_TOKEN", raising=False)
    assert "IMPALA_REP_TOKEN" not in actor_environment(None)


def test_eval_flags_reach_the_config_and_bad_values_are_sentences(capsys):
    from impala_rep.config import ConfigError, RunConfig
    from impala_rep.flags import config_from_args
    from impala_rep.launch import build_parser

    parser = build_parser()
    config = config_from_args(parser.parse_args(["--env", "catch", "--eval-episodes", "7", "--eval-greedy"]))
    assert (config.eval_episodes, config.eval_greedy) == (7, True)
    assert config_from_args(parser.parse_args(["--env", "catch"])).eval_episodes == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--env", "catch", "--eval-episodes", "-1"])
    assert "expected a whole number (0 or more), got -1" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="eval-episodes must be a whole number of episodes"):
        RunConfig(eval_episodes=-3)


def test_desync_steps_default_to_one_dmc_episode_and_bad_values_are_sentences(capsys):
    from impala_rep.config import MAX_DESYNC_STEPS, ConfigError, RunConfig, actor_view
    from impala_rep.flags import config_from_args
    from impala_rep.launch import build_parser

    parser = build_parser()

    def desync(*argv):
        return config_from_args(parser.parse_args(list(argv))).desync_steps

    # dm_control tasks last 1000 control steps: one episode of agent steps at the action repeat.
    assert desync("--env", "dmc/cartpole-swingup") == 250
    assert desync("--env", "dmc/cartpole-swingup", "--env-arg", "action_repeat=8") == 125
    assert desync("--env", "dmc/walker-walk", "--env-arg", "action_repeat=3") == 334
    assert desync("--env", "catch") == 0
    assert desync("--env", "dmc/cartpole-swingup", "--desync-steps", "0") == 0
    assert desync("--env", "catch", "--desync-steps", "9") == 9
    config = config_from_args(parser.parse_args(["--env", "catch", "--desync-steps", "9"]))
    assert actor_view(config, {})["desync_steps"] == 9
    with pytest.raises(SystemExit):
        parser.parse_args(["--env", "catch", "--desync-steps", "-1"])
    assert "expected a whole number (0 or more), got -1" in capsys.readouterr().err
    for bad in (-1, MAX_DESYNC_STEPS + 1, 2.5, True):
        with pytest.raises(ConfigError, match="desync-steps must be a whole number of agent steps"):
            RunConfig(desync_steps=bad)


def test_replay_flags_reach_the_config_and_bad_values_are_sentences(capsys):
    from impala_rep.config import ConfigError
    from impala_rep.flags import config_from_args
    from impala_rep.launch import build_parser

    parser = build_parser()
    config = config_from_args(parser.parse_args(["--env", "catch", "--replay-ratio", "0.25", "--replay-unrolls", "64"]))
    assert (config.replay_ratio, config.replay_unrolls) == (0.25, 64)
    assert (config_from_args(parser.parse_args(["--env", "catch"])).replay_ratio) == 0.0
    # The run's agent steps count fresh unrolls only, so replay stretches the learning-rate anneal
    # over the learner steps the run really takes: 6,400 steps / (10 x 32 fresh) = 20 learner steps,
    # / (10 x 16 fresh) = 40 with half of each batch replayed.
    run = ["--env", "catch", "--total-steps", "6400", "--unroll-length", "10", "--batch-size", "32"]
    assert config_from_args(parser.parse_args(run)).optimizer["anneal_steps"] == 20
    assert config_from_args(parser.parse_args(run + ["--replay-ratio", "0.5"])).optimizer["anneal_steps"] == 40
    for bad in ("-0.5", "1.5"):
        with pytest.raises(ConfigError, match="replay-ratio must be at least 0 and below 1"):
            config_from_args(parser.parse_args(["--env", "catch", "--replay-ratio", bad]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--env", "catch", "--replay-unrolls", "0"])
    assert "expected a positive integer, got 0" in capsys.readouterr().err


def test_a_logdir_that_cannot_hold_a_run_is_a_sentence_before_anything_starts(tmp_path, capsys):
    from impala_rep.launch import main

    broken = tmp_path / "broken"
    broken.symlink_to(tmp_path / "missing-target")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    cases = [
        (str(broken), f"--logdir {broken} is a broken symbolic link (to {tmp_path / 'missing-target'})"),
        (str(a_file), f"--logdir {a_file} exists and is not a directory"),
        (str(a_file / "run"), f"--logdir {a_file / 'run'} cannot be created: {a_file} is not a directory"),
    ]
    for logdir, sentence in cases:
        with pytest.raises(SystemExit) as exc:
            main(["--env", "catch", "--actors", "1", "--logdir", logdir])
        assert exc.value.code == 2
        assert sentence in capsys.readouterr().err
    # Nothing was created on the way: the checks do not make the run directory.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "broken"]


def test_a_new_logdir_under_a_writable_directory_passes_the_check(tmp_path):
    from impala_rep.flags import check_logdir

    check_logdir(str(tmp_path / "runs" / "new"))  # does not exist yet: fine
    check_logdir(str(tmp_path))  # an existing directory: fine
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "address, sentence",
    [
        ("nothing", "--learner-address must be HOST:PORT, got 'nothing'."),
        (":50051", "--learner-address must be HOST:PORT, got ':50051'."),
        ("127.0.0.1:99999", "the port must be a number from 1 to 65535, got '99999'"),
        ("127.0.0.1:0", "the port must be a number from 1 to 65535, got '0'"),
        ("localhost:http", "the port must be a number from 1 to 65535, got 'http'"),
    ],
)
def test_actor_learner_address_is_checked(address, sentence, capsys):
    # gRPC would take port 99999 as 34463 (modulo 65536) and wait there for a learner.
    from actors.run import check_address, main

    with pytest.raises(SystemExit):
        main(["--learner-address", address])
    assert sentence in capsys.readouterr().err
    assert check_address("127.0.0.1:50051") is None and check_address("[::1]:50051") is None


def test_actor_process_stops_on_sigterm_while_the_learner_is_away(tmp_path):
    import signal
    import socket
    import subprocess
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "actor.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "actors.run", "--learner-address", f"127.0.0.1:{port}",
                                 "--give-up-after", "120"], stdout=out, stderr=subprocess.STDOUT)
    try:
        time.sleep(3)  # imports done, retrying the handshake with backoff
        assert proc.poll() is None, log.read_text()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        assert time.monotonic() - t0 < 15  # before: it waited out --give-up-after (120 s here)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()
    assert f"stopped while waiting for the learner at 127.0.0.1:{port}" in log.read_text()


def test_load_policy_refuses_non_finite_parameters_and_malformed_metadata(tmp_path):
    import json as json_

    import numpy as np

    import envs
    from impala_rep.export import PolicyLoadError, load_policy, save_policy
    from impala_rep.networks import NetworkConfig
    from impala_rep.networks.numpy_backend import NumpyNetwork
    from impala_rep.specs import env_spec_from_dm_env

    spec = env_spec_from_dm_env(envs.make("catch", seed=0))
    net = NumpyNetwork(NetworkConfig(), spec.observations, spec.action, seed=3)
    meta = {"env": "catch", "env_spec": spec.to_json(), "network": {}, "frame_stack": {}}
    diverged = dict(net.params)
    name = sorted(diverged)[-1]
    diverged[name] = np.full_like(diverged[name], np.nan)
    save_policy(str(tmp_path / "nan"), diverged, meta)
    with pytest.raises(PolicyLoadError, match=f"holds NaN or infinite values \\(in {name}\\).*diverged"):
        load_policy(str(tmp_path / "nan"))
    for case, edit, sentence in [
        ("list", lambda m: [], "holds list, not a JSON object"),
        ("noenv", lambda m: {k: v for k, v in m.items() if k != "env"}, "'env' must be an env id"),
        ("kwargs", lambda m: dict(m, env_kwargs=[1]), "'env_kwargs' an object"),
    ]:
        policy_json = tmp_path / case / "policy.json"
        save_policy(str(tmp_path / case), net.params, meta)
        policy_json.write_text(json_.dumps(edit(json_.loads(policy_json.read_text()))))
        with pytest.raises(PolicyLoadError, match=sentence):
            load_policy(str(tmp_path / case))


def test_evaluate_checks_its_output_paths_before_running_episodes(tmp_path, capsys, monkeypatch):
    import impala_rep.evaluate as ev

    ran = []
    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: ran.append(a) or {})
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        (["--report", str(tmp_path)], f"--report {tmp_path} exists and is not a file"),
        (["--video", str(a_file / "v.mp4")], f"--video {a_file / 'v.mp4'} cannot be created: {a_file} is not a directory"),
        (["--video", str(tmp_path / "v.txt")], "name a video file ending in one of .mp4, .gif"),
    ]
    for argv, sentence in cases:
        assert ev.main([str(tmp_path), *argv]) == 2
        assert sentence in capsys.readouterr().err
    assert not ran  # no episode ran for any of them


@pytest.mark.parametrize(
    "argv, sentence",
    [
        (["--discount", "nan"], "--discount: expected a discount from 0 to 1 (a finite number), got 'nan'"),
        (["--discount", "1.5"], "--discount: expected a discount from 0 to 1, got 1.5"),
        (["--learning-rate", "inf"], "--learning-rate: expected a positive number (a finite number), got 'inf'"),
        (["--learning-rate", "0"], "--learning-rate: expected a positive number, got 0"),
        (["--entropy-cost", "-0.1"], "--entropy-cost: expected a number of 0 or more, got -0.1"),
        (["--baseline-torso-scale", "1.5"], "--baseline-torso-scale: expected a share from 0 to 1, got 1.5"),
        (["--popart", "1.5"], "--popart: expected a step size from 0 to 1, got 1.5"),
        (["--popart-terms", "baseline"], "--popart-terms baseline needs --popart STEP_SIZE"),
        (["--clip-norm", "0"], "--clip-norm: expected a positive number, got 0"),
        (["--rmsprop-epsilon", "0"], "--rmsprop-epsilon: expected a positive number, got 0"),
        (["--rmsprop-epsilon", "nan"], "--rmsprop-epsilon: expected a positive number (a finite number), got 'nan'"),
        (["--rmsprop-epsilon-scale", "sigma"], "--rmsprop-epsilon-scale sigma needs --popart STEP_SIZE"),
        (["--rmsprop-epsilon-scale", "popart"], "argument --rmsprop-epsilon-scale: invalid choice: 'popart'"),
        (["--reward-scale", "inf"], "--reward-scale: expected a positive number (a finite number), got 'inf'"),
        (["--replay-ratio", "nan"], "--replay-ratio: expected a number (a finite number), got 'nan'"),
        (["--seed", "-5"], "--seed: expected a whole number from 0 to 2147483647, got -5"),
        (["--env-arg", "seed=3"], "seed is not an env arg: each env's seed comes from --seed"),
        (["--tls-cert", "/no/such.pem", "--tls-key", "/no/such.key"], "--tls-cert /no/such.pem is not a file"),
    ],
)
def test_bad_numbers_seeds_and_files_are_sentences_before_anything_starts(argv, sentence, capsys):
    from impala_rep.launch import main

    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        main(["--env", "catch", "--actors", "1", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert sentence in err and "Traceback" not in err, err
    assert time.monotonic() - t0 < 5  # before the probes


@pytest.mark.parametrize(
    "argv, sentence",
    [
        (["--give-up-after", "nan"], "--give-up-after must be a positive number of seconds (or inf: never), got nan"),
        (["--max-actor-restarts", "-1", "--actors", "2", "--actor-processes", "2"],
         "--max-actor-restarts must be 0 or more, got -1"),
        (["--tls-ca", "/no/such.pem"], "--tls-ca /no/such.pem is not a file"),
        (["--seed", "-1"], "--seed: expected a whole number from 0 to 4293918720, got -1"),
    ],
)
def test_actor_flags_are_checked(argv, sentence, capsys):
    from actors.run import main

    with pytest.raises(SystemExit):
        main(["--learner-address", "127.0.0.1:50051", *argv])
    assert sentence in capsys.readouterr().err


def test_a_half_written_metrics_record_is_cut_off_when_a_run_resumes(tmp_path):
    from learner.run import open_metrics_log

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"time": 1, "agent_steps": 10}\n{"time": 2, "agent_st')
    with open_metrics_log(str(path)) as f:
        f.write('{"time": 3, "agent_steps": 30}\n')
    assert [json.loads(line)["agent_steps"] for line in path.read_text().splitlines()] == [10, 30]
    path.write_text('{"time": 1, "agent_steps": 10}\n')  # a whole file is left as it is
    with open_metrics_log(str(path)) as f:
        f.write('{"time": 3, "agent_steps": 30}\n')
    assert [json.loads(line)["agent_steps"] for line in path.read_text().splitlines()] == [10, 30]
    with open_metrics_log(str(tmp_path / "new.jsonl")) as f:  # and a new one is created
        f.write("{}\n")
    assert (tmp_path / "new.jsonl").read_text() == "{}\n"


def test_ctrl_c_while_probing_ends_the_launch_without_a_traceback(monkeypatch):
    import impala_rep.probe
    from impala_rep.launch import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(impala_rep.probe, "probe_env", interrupted)
    assert main(["--env", "catch", "--actors", "1"]) == 130


def test_a_run_directory_is_taken_by_one_learner_and_its_parts_must_be_directories(tmp_path):
    import os

    from impala_rep.flags import check_logdir
    from learner.run import lock_run_dir

    first = lock_run_dir(str(tmp_path))
    try:
        with pytest.raises(ValueError, match=f"{tmp_path} is in use by another learner \\(pid {os.getpid()}\\)"):
            lock_run_dir(str(tmp_path))
    finally:
        first.close()
    lock_run_dir(str(tmp_path)).close()  # free again once the first learner let go
    (tmp_path / "checkpoints").write_text("not a directory")
    with pytest.raises(ValueError, match="checkpoints is not a directory, and the run writes one there"):
        check_logdir(str(tmp_path))


def test_a_fresh_start_keeps_the_earlier_runs_metrics_apart(tmp_path):
    from learner.run import open_metrics_log

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"time": 1, "agent_steps": 10}\n')
    with open_metrics_log(str(path), fresh=True) as f:
        f.write('{"time": 5, "agent_steps": 1}\n')
    assert path.read_text() == '{"time": 5, "agent_steps": 1}\n'
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("metrics-before-")]
    assert len(kept) == 1 and kept[0].read_text() == '{"time": 1, "agent_steps": 10}\n'
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="is a directory, and the run writes its metrics there"):
        open_metrics_log(str(tmp_path / "dir"))


def test_the_largest_run_seed_gives_actor_seeds_the_actors_accept(capsys):
    from actors.run import build_parser as actor_parser
    from actors.run import main as actor_main
    from actors.supervisor import actor_process_commands
    from impala_rep.flags import MAX_SEED

    commands = actor_process_commands("127.0.0.1:50051", [8] * 16, MAX_SEED)
    seeds = [actor_parser().parse_args(cmd[3:]).seed for cmd in commands]
    assert seeds[-1] == MAX_SEED + 16000 and seeds[-1] + 8 < 2**32  # NumPy's RandomState limit
    # --give-up-after inf (never) is accepted: the error is the next check's.
    with pytest.raises(SystemExit):
        actor_main(["--learner-address", "127.0.0.1:50051", "--give-up-after", "inf", "--actors", "2",
                    "--actor-processes", "2", "--max-actor-restarts", "-1"])
    err = capsys.readouterr().err
    assert "--max-actor-restarts must be 0 or more" in err and "error: --give-up-after" not in err


def test_a_file_system_without_locks_runs_unlocked_with_a_warning(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    from learner.run import lock_run_dir

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level("WARNING"):
        assert lock_run_dir(str(tmp_path)) is None
    assert "nothing stops a second learner from using this run directory" in caplog.text


@pytest.mark.parametrize(
    "message, expected",
    [
        ("no TPU is attached to this host: run on a TPU VM, pass tpu='grpc://HOST:PORT' for a remote TPU, or use "
         "kind='cpu' or 'gpu'.",
         "no TPU is attached to this host: run on a TPU VM, pass --tpu-address grpc://HOST:PORT for a remote TPU, "
         "or use --learner cpu or --learner gpu."),
        ("no GPU is visible to TensorFlow (...), or use kind='cpu'.", "no GPU is visible to TensorFlow (...), or use --learner cpu."),
        ("4 GPU replicas were asked for but this host has 2 GPU(s): use num_replicas<=2.",
         "4 GPU replicas were asked for but this host has 2 GPU(s): use --replicas 2 or fewer."),
        ("num_replicas=4 but the TPU has 8 cores; leave num_replicas unset to use them all.",
         "--replicas 4 but the TPU has 8 cores; leave --replicas out to use them all."),
        ("a multiple of 4 (e.g. 8) or change num_replicas.", "a multiple of 4 (e.g. 8) or change --replicas."),
        ("the batch lacks 'reward'.", "the batch lacks 'reward'."),
    ],
)
def test_learner_errors_name_flags_on_the_command_line(message, expected):
    from impala_rep.flags import in_flag_terms

    assert in_flag_terms(message) == expected


def test_the_replicators_own_sentences_come_out_in_flag_terms():
    # The sentences as impala_rep.replicator writes them (read from its source), so that a
    # reworded one cannot slip past the table. Its multi-worker API (devices_per_worker) has no
    # flags and is left as it is.
    import inspect
    import re

    from impala_rep import replicator
    from impala_rep.flags import in_flag_terms

    source = inspect.getsource(replicator)
    advice = [s for s in re.findall(r'"([^"]*)"', source)
              if ("kind='" in s or "tpu='" in s) and "devices_per_worker" not in s]
    assert len(advice) >= 4, advice  # no GPU; no TPU (attached, reachable, initialised)
    for sentence in advice:
        out = in_flag_terms(sentence)
        assert "kind=" not in out and "tpu=" not in out, (sentence, out)


def test_the_learner_alone_takes_param_refresh_lag():
    # learner.run builds its parser from add_learner_flags alone: a setting the learner's server
    # applies to remote actors must be there, not only among the launcher's actor flags.
    import argparse

    from impala_rep.flags import add_learner_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_learner_flags(parser)
    config = config_from_args(parser.parse_args(["--env", "catch", "--param-refresh-lag", "8"]))
    assert config.param_refresh_lag == 8
    with pytest.raises(SystemExit):
        parser.parse_args(["--param-refresh-lag", "0"])


def test_supervisor_does_not_restart_an_actor_whose_learner_finished(tmp_path):
    from actors.supervisor import FINISHED_EXIT_CODE, SUPERVISED_ENV

    # The child sees that it is supervised (and so exits FINISHED_EXIT_CODE, not 0, when the
    # learner says its run is over); the supervisor then stops counting it, without restarts.
    finished = [sys.executable, "-c",
                f"import os, sys; sys.exit({FINISHED_EXIT_CODE} if os.environ.get({SUPERVISED_ENV!r}) == '1' else 9)"]
    sup = ActorSupervisor([finished, finished], log_dir=str(tmp_path), max_restarts=5)
    sup.start()
    events = []
    try:
        assert _wait(lambda: events.extend(sup.poll()) or sup.all_finished)
    finally:
        sup.stop()
    assert [a.restarts for a in sup.actors] == [0, 0] and sup.all_done and not sup.all_given_up
    assert all("the learner's run is over" in e for e in events) and len(events) == 2, events


def test_a_bad_flag_is_one_sentence_without_the_usage_block(capsys):
    from impala_rep.launch import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--actors", "zero"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("python -m impala_rep.launch: error: argument --actors: expected a positive integer")
    assert "usage:" not in err and err.rstrip().endswith("(`python -m impala_rep.launch --help` lists the flags.)")
    assert len(err.strip().splitlines()) == 2, err
