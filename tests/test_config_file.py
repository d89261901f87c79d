"""``--config RUN_DIR|FILE``: a new run starts from an earlier run's config.json, the flags
given on the command line override it, and a bad file is one sentence (TensorFlow-free)."""

import json

import pytest

from impala_rep.config import ConfigError, RunConfig
from impala_rep.flags import (CONFIG_NOT_CARRIED, CommandLineParser, add_learner_flags, config_from_args,
                              parse_flags)
from impala_rep.launch import build_parser

CHEETAH = ["--env", "dmc/cheetah-run", "--env-arg", "coarse_shapes=false", "--env-arg", "size=[64, 64]",
           "--policy", "discretised", "--bins", "11", "--clip-norm", "1000", "--actors", "16",
           "--unroll-length", "10", "--batch-size", "16", "--total-steps", "30000000", "--time-budget", "60m",
           "--log-interval", "30", "--checkpoint-interval", "600", "--eval-episodes", "10", "--eval-greedy",
           "--seed", "1", "--replay-ratio", "0.5"]
# Every setting away from its default, the derived ones (reward scale, warm-up, desync) too.
CATCH = ["--env", "catch", "--env-arg", "rows=7", "--learner", "auto", "--tpu-address", "grpc://10.0.0.1:8470",
         "--frame-stack", "2", "--network", "mlp", "--lstm-size", "8", "--policy", "categorical",
         "--discount", "0.9", "--learning-rate", "0.001", "--entropy-cost", "0.02", "--baseline-cost", "0.25",
         "--baseline-torso-scale", "0.5", "--popart", "3e-4", "--popart-terms", "policy",
         "--rmsprop-epsilon", "1e-05", "--rmsprop-epsilon-scale", "sigma",
         "--reward-scale", "0.5", "--reward-clip", "1", "--no-anneal", "--lr-warmup", "7", "--jit",
         "--learner-precision", "bfloat16", "--overlap-publish", "on", "--intake", "process",
         "--replay-ratio", "0.25", "--replay-unrolls", "64", "--total-steps", "5000", "--seed", "9",
         "--queue-unrolls", "40", "--desync-steps", "5", "--keep-checkpoints", "2", "--checkpoint-interval",
         "never", "--log-interval", "never", "--param-refresh-lag", "3", "--max-actor-streams", "7",
         "--actors", "6", "--max-actor-restarts", "2", "--unrolls-per-message", "3"]


def _config(argv, parser=None):
    args, _, _ = parse_flags(parser or build_parser(), argv)
    return config_from_args(args)


def _saved_run(tmp_path, argv, name="earlier"):
    """A run directory holding the config.json the launcher writes for ``argv``."""
    run = tmp_path / name
    run.mkdir()
    config = _config(argv + ["--logdir", str(run)])
    (run / "config.json").write_text(config.dumps())
    return run, config


def _carried(config):
    return {k: v for k, v in config.to_json().items() if k not in CONFIG_NOT_CARRIED}


@pytest.mark.parametrize("argv", [CHEETAH, CATCH], ids=["cheetah", "every-setting"])
def test_a_run_started_from_another_runs_config_has_its_settings(tmp_path, argv):
    run, earlier = _saved_run(tmp_path, argv)
    again = _config(["--config", str(run), "--logdir", str(tmp_path / "again")])
    assert _carried(again) == _carried(earlier)
    assert again.logdir == str(tmp_path / "again")
    # The file itself, not only its directory.
    assert _carried(_config(["--config", str(run / "config.json"), "--logdir", str(tmp_path / "b")])) == \
        _carried(earlier)


def test_flags_given_override_the_file_and_env_args_merge_by_key(tmp_path):
    run, earlier = _saved_run(tmp_path, CHEETAH)
    config = _config(["--config", str(run), "--seed", "2", "--env-arg", "size=84", "--batch-size", "32",
                      "--logdir", str(tmp_path / "seed2")])
    assert config.seed == 2 and config.batch_size == 32
    assert config.env_kwargs == {"coarse_shapes": False, "size": 84}
    assert config.replay_ratio == 0.5 and config.optimizer["clip_norm"] == 1000.0 and config.eval_greedy
    # The learning rate anneals over the new batch's learner steps, as the flags derive it.
    assert config.optimizer["anneal_steps"] == _config(CHEETAH + ["--batch-size", "32"]).optimizer["anneal_steps"]
    assert config.optimizer["anneal_steps"] != earlier.optimizer["anneal_steps"]


def test_settings_derived_by_default_are_derived_again_for_another_env_or_budget(tmp_path):
    run, earlier = _saved_run(tmp_path, CHEETAH)
    assert earlier.loss["reward_scale"] == 0.25 and earlier.desync_steps == 250
    other = _config(["--config", str(run), "--env", "catch", "--logdir", str(tmp_path / "catch")])
    # Another env: cheetah's env args and its derived reward scale and desync steps stay behind.
    assert other.env == "catch" and other.env_kwargs == {}
    assert other.loss["reward_scale"] == 1.0 and other.desync_steps == 0
    assert other.network["policy"] == "discretised"  # the rest is carried
    short = _config(["--config", str(run), "--total-steps", "4000", "--logdir", str(tmp_path / "short")])
    assert short.optimizer["warmup_steps"] == _config(CHEETAH + ["--total-steps", "4000"]).optimizer["warmup_steps"]
    assert short.optimizer["warmup_steps"] != earlier.optimizer["warmup_steps"]
    # Set by hand in the earlier run, they are carried even to another env.
    run2, _ = _saved_run(tmp_path, CATCH, name="catch-run")
    config = _config(["--config", str(run2), "--env", "catch", "--logdir", str(tmp_path / "c2")])
    assert config.loss["reward_scale"] == 0.5 and config.desync_steps == 5 and config.optimizer["warmup_steps"] == 7
    assert config.env_kwargs == {"rows": 7}  # the same env, given again: its env args come along


def test_every_dmc_run_records_its_coarse_shapes_and_an_earlier_record_without_them_is_read_as_coarse(tmp_path):
    # What a run's frames look like is in its config, given or not, so that no later default moves it.
    assert _config(["--env", "dmc/walker-walk"]).env_kwargs == {"coarse_shapes": True}
    assert _config(["--env", "dmc/walker-walk", "--env-arg", "coarse_shapes=false"]).env_kwargs == {"coarse_shapes": False}
    assert _config(["--env", "catch"]).env_kwargs == {}
    assert RunConfig(env="dmc/walker-walk", env_kwargs={"size": 64}).env_kwargs == {"size": 64, "coarse_shapes": True}
    # cheetah-run's default is the model's shapes (envs.dmc.MODEL_SHAPES_TASKS).
    assert RunConfig(env="dmc/cheetah-run", env_kwargs={"size": 64}).env_kwargs == {"size": 64, "coarse_shapes": False}
    assert _config(["--env", "dmc/cheetah-run"]).env_kwargs == {"coarse_shapes": False}
    with pytest.raises(ConfigError, match="env_kwargs must be a mapping of env arguments"):
        RunConfig(env="catch", env_kwargs=["rows=7"])
    # A config.json from before coarse_shapes was recorded: repeated with the shapes it rendered.
    run, earlier = _saved_run(tmp_path, CHEETAH)
    data = json.loads((run / "config.json").read_text())
    del data["env_kwargs"]["coarse_shapes"]
    (run / "config.json").write_text(json.dumps(data))
    args, _, carried = parse_flags(build_parser(), ["--config", str(run), "--logdir", str(tmp_path / "again")])
    assert "--env-arg=coarse_shapes=true" in carried
    assert config_from_args(args).env_kwargs == {"size": [64, 64], "coarse_shapes": True}


def test_where_a_run_writes_is_served_and_is_planned_is_not_carried(tmp_path):
    token_argv = CATCH + ["--bind", "0.0.0.0", "--port", "5005", "--token", "s3cret", "--no-resume",
                          "--actor-processes", "3", "--actor-nice", "4", "--replicas", "2", "--batch-size", "32"]
    run, earlier = _saved_run(tmp_path, token_argv)
    assert earlier.bind == "0.0.0.0" and earlier.actor_processes == 3
    config = _config(["--config", str(run), "--logdir", str(tmp_path / "new")])
    assert (config.bind, config.port, config.token, config.resume) == ("127.0.0.1", 0, None, True)
    assert (config.actor_processes, config.replicas) == (None, None)
    assert config.actor_nice == 10 and config.batch_size == 32


def test_the_learner_alone_takes_the_file_without_the_launchers_actor_settings(tmp_path):
    run, earlier = _saved_run(tmp_path, CATCH)
    parser = CommandLineParser(prog="python -m learner.run")
    add_learner_flags(parser)
    args, file, carried = parse_flags(parser, ["--config", str(run), "--logdir", str(tmp_path / "alone")])
    assert file == str(run / "config.json")
    assert not any(flag.startswith(("--actors=", "--unrolls-per-message=", "--max-actor-restarts="))
                   for flag in carried)
    config = config_from_args(args)
    assert config.param_refresh_lag == 3 and config.network == earlier.network and config.seed == 9


def _error(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        parse_flags(build_parser(), argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_a_bad_settings_file_is_one_sentence(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no config.json" in _error(capsys, ["--config", str(empty)])
    assert "is not a file or a directory" in _error(capsys, ["--config", str(tmp_path / "missing")])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "is not JSON" in _error(capsys, ["--config", str(bad)])
    bad.write_text("[1, 2]")
    assert "holds a JSON list, not an object of settings" in _error(capsys, ["--config", str(bad)])
    bad.write_text(json.dumps({"env": "catch", "learning_rate": 0.1}))
    err = _error(capsys, ["--config", str(bad)])
    assert "does not know: learning_rate" in err and "the known ones are" in err
    bad.write_text(json.dumps({"optimizer": {"lr": 0.1}}))
    assert "optimizer has settings this version does not know: lr" in _error(capsys, ["--config", str(bad)])
    bad.write_text(json.dumps({"env": 3}))
    assert "env must be an env id" in _error(capsys, ["--config", str(bad)])
    bad.write_text(json.dumps({"env": "catch", "env_kwargs": ["rows=7"]}))
    assert "env_kwargs must be an object of env arguments" in _error(capsys, ["--config", str(bad)])
    bad.write_text(json.dumps({"env": "catch", "loss": 0.5}))
    assert "loss must be an object of discount" in _error(capsys, ["--config", str(bad)])


def test_a_bad_value_in_the_file_is_named_as_coming_from_it(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"env": "catch", "batch_size": 0}))
    err = _error(capsys, ["--config", str(bad)])
    assert "--batch-size" in err and f"in the settings {bad} gives" in err
    # The same value given on the command line overrides the file's, so it runs.
    assert _config(["--config", str(bad), "--batch-size", "8", "--logdir", str(tmp_path / "run")]).batch_size == 8
    bad.write_text(json.dumps({"env": "catch", "learner": "fpga"}))
    assert "--learner" in _error(capsys, ["--config", str(bad)])


def test_switches_the_file_turns_on_can_be_turned_off(tmp_path):
    run, earlier = _saved_run(tmp_path, CATCH + ["--eval-episodes", "3", "--eval-greedy"])
    assert earlier.jit_compile and earlier.eval_greedy and "anneal_steps" not in earlier.optimizer
    config = _config(["--config", str(run), "--no-jit", "--no-eval-greedy", "--anneal",
                      "--logdir", str(tmp_path / "off")])
    assert not config.jit_compile and not config.eval_greedy and config.optimizer["anneal_steps"] > 0
    assert not _config(["--env", "catch", "--logdir", str(tmp_path / "d")]).jit_compile  # defaults stay off


def test_a_resumed_dmc_run_keeps_the_shapes_it_started_with_and_a_new_one_takes_the_task_default(tmp_path):
    # A cheetah-run run started when the coarse shapes were every task's default: resuming it in
    # its logdir with the same command keeps them, where a new run takes the model's shapes.
    run = tmp_path / "cheetah"
    run.mkdir()
    record = _config(["--env", "dmc/cheetah-run", "--env-arg", "coarse_shapes=true", "--logdir", str(run)])
    (run / "config.json").write_text(record.dumps())
    again = ["--env", "dmc/cheetah-run", "--logdir", str(run)]
    assert _config(again).env_kwargs == {"coarse_shapes": True}
    assert _config(again + ["--no-resume"]).env_kwargs == {"coarse_shapes": False}
    # Given on the command line, it is what the run asks for (the learner then refuses a mismatch).
    assert _config(again + ["--env-arg", "coarse_shapes=false"]).env_kwargs == {"coarse_shapes": False}
    # A record from before coarse_shapes was written out rendered the coarse shapes.
    data = json.loads((run / "config.json").read_text())
    data["env_kwargs"] = {}
    (run / "config.json").write_text(json.dumps(data))
    assert _config(again).env_kwargs == {"coarse_shapes": True}
    # Another task's record there, or none that can be read: a new run's default.
    (run / "config.json").write_text(json.dumps(dict(data, env="dmc/walker-walk")))
    assert _config(again).env_kwargs == {"coarse_shapes": False}
    (run / "config.json").write_text("{not json")
    assert _config(again).env_kwargs == {"coarse_shapes": False}
    assert _config(["--env", "dmc/cheetah-run", "--logdir", str(tmp_path / "new")]).env_kwargs == \
        {"coarse_shapes": False}
