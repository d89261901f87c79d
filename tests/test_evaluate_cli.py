"""``python -m impala_rep.evaluate`` on exported policies (TensorFlow-free): videos of one-channel
images, a video that cannot be written keeps the episodes' report, another env id does not get
the training env's arguments, changed action bounds are refused, and hand-damaged exports are
sentences."""

import json
import os

import imageio.v2 as imageio
import numpy as np
import pytest

import envs
from impala_rep import evaluate as evaluate_module
from impala_rep.export import PolicyLoadError, load_policy, save_policy
from impala_rep.networks import NetworkConfig
from impala_rep.networks.numpy_backend import NumpyNetwork
from impala_rep.specs import env_spec_from_dm_env

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _plugin_path(monkeypatch):
    monkeypatch.syspath_prepend(TESTS_DIR)


def export(run_dir, env_id, env_kwargs=None, network=None):
    env_kwargs = dict(env_kwargs or {})
    spec = env_spec_from_dm_env(envs.make(env_id, seed=0, **env_kwargs))
    config = NetworkConfig(**(network or {}))
    net = NumpyNetwork(config, spec.observations, spec.action, seed=3)
    meta = {"env": env_id, "env_kwargs": env_kwargs, "env_spec": spec.to_json(), "network": dict(network or {}),
            "frame_stack": {}, "learner_step": 7, "agent_steps": 70}
    save_policy(os.path.join(run_dir, "policy"), net.params, meta)
    return os.path.join(run_dir, "policy")


def run(capsys, *argv):
    code = evaluate_module.main([*map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_video_of_one_channel_images_is_written_in_colour(tmp_path, capsys):
    export(tmp_path, "catch", {"pixels": True, "scale": 4})
    video = tmp_path / "catch.gif"  # a format that refuses one-channel frames
    code, out, err = run(capsys, tmp_path, "--episodes", "1", "--video", video)
    assert code == 0, err
    assert f"video written to {video}" in out
    frames = imageio.mimread(str(video))
    assert len(frames) == 10 and frames[0].shape[:2] == (40, 20) and frames[0].shape[-1] in (3, 4)


def test_a_video_that_cannot_be_written_keeps_the_episodes_report(tmp_path, capsys, monkeypatch):
    export(tmp_path, "catch", {"pixels": True})

    def refuse(path, frames, fps=30):
        raise OSError("No space left on device")

    monkeypatch.setattr(evaluate_module, "_write_video", refuse)
    code, out, err = run(capsys, tmp_path, "--episodes", "2", "--video", tmp_path / "v.mp4")
    assert code == 1
    assert (f"error: could not write the video {tmp_path / 'v.mp4'} (OSError: No space left on device); the report "
            "is written all the same.") in err
    with open(tmp_path / "eval" / "eval-7.json") as f:
        report = json.load(f)
    assert len(report["returns"]) == 2 and "video" not in report and report["video_error"]


def test_another_env_id_does_not_get_the_training_envs_arguments(tmp_path, capsys):
    export(tmp_path, "catch", {"rows": 10})  # the default, written out as a run would record it
    code, out, err = run(capsys, tmp_path, "--episodes", "1", "--env", "plugin_envs:make_catch")
    assert code == 0, err  # before: "does not accept the option(s) rows"
    with open(tmp_path / "eval" / "eval-7.json") as f:
        report = json.load(f)
    assert report["env"] == "plugin_envs:make_catch" and report["env_kwargs"] == {}
    code, out, err = run(capsys, tmp_path, "--episodes", "1")  # the same env: its arguments carry over
    assert code == 0, err
    with open(tmp_path / "eval" / "eval-7-1.json") as f:
        assert json.load(f)["env_kwargs"] == {"rows": 10}


def test_a_dmc_policy_exported_without_coarse_shapes_is_evaluated_with_the_coarse_shapes_it_trained_on(tmp_path,
                                                                                                        capsys):
    export(tmp_path, "dmc/cartpole-swingup", {"observation": "state", "action_repeat": 8})  # recorded before
    code, out, err = run(capsys, tmp_path, "--episodes", "1")
    assert code == 0, err
    with open(tmp_path / "eval" / "eval-7.json") as f:
        assert json.load(f)["env_kwargs"] == {"observation": "state", "action_repeat": 8, "coarse_shapes": True}
    code, out, err = run(capsys, tmp_path, "--episodes", "1", "--env-arg", "coarse_shapes=false")
    assert code == 0, err
    with open(tmp_path / "eval" / "eval-7-1.json") as f:
        assert json.load(f)["env_kwargs"]["coarse_shapes"] is False


def test_an_env_whose_action_bounds_differ_is_refused(tmp_path, capsys):
    policy = export(tmp_path, "reach")
    with open(os.path.join(policy, "policy.json")) as f:
        meta = json.load(f)
    meta["env_spec"]["action"]["maximum"] = 2.0  # as if trained on an env acting in [-1, 2]
    with open(os.path.join(policy, "policy.json"), "w") as f:
        json.dump(meta, f)
    load_policy(policy)  # still a valid export
    code, out, err = run(capsys, tmp_path, "--episodes", "1")
    assert code == 2
    assert "the action's bounds are [-1., 1.], the policy's [-1., 2.]" in err, err
    assert "Evaluate on the env and --env-arg values it was trained with." in err


@pytest.mark.parametrize("damage, words", [
    (lambda d: _save_npy(os.path.join(d, "params.npz")), "params.npz is missing or corrupt"),
    (lambda d: _edit_meta(d, frame_stack=[]), "does not describe a network this version can build"),
    (lambda d: _edit_meta(d, env_spec={"observations": [], "action": {}}), "does not describe a network"),
])
def test_a_damaged_export_is_a_sentence(tmp_path, damage, words):
    policy = export(tmp_path, "catch")
    damage(policy)
    with pytest.raises(PolicyLoadError) as info:
        load_policy(policy)
    assert words in str(info.value)


def _edit_meta(directory, **changes):
    path = os.path.join(directory, "policy.json")
    with open(path) as f:
        meta = json.load(f)
    meta.update(changes)
    with open(path, "w") as f:
        json.dump(meta, f)


def _save_npy(path):
    with open(path, "wb") as f:  # one array (.npy), not the archive of named arrays
        np.save(f, np.zeros(3))
