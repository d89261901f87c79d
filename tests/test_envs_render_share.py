"""Shared rendering contexts for DM Control envs (``envs.render_share``): the same frames bit for
bit as contexts of their own, shared only where that is safe, and freed with the last env.

Runs without TensorFlow (MuJoCo renders here).
"""

import gc
import threading

import numpy as np
import pytest

import envs
from envs import dmc, render_share

SIZE = 32


def _mjr_ptr(env):
    return env.physics.contexts.mujoco.ptr


def _rollout(env_id, seeds, share, steps=8):
    """Frames of len(seeds) envs stepped in turn with the same random actions; the envs."""
    made = [envs.make(env_id, seed=s, size=SIZE, render="fast", share_context=share) for s in seeds]
    rng = np.random.default_rng(0)
    frames = [[env.reset().observation["pixels"]] for env in made]
    for _ in range(steps):
        for out, env in zip(frames, made):
            spec = env.action_spec()
            action = rng.uniform(spec.minimum, spec.maximum, spec.shape).astype(spec.dtype)
            out.append(env.step(action).observation["pixels"])
    return np.asarray(frames), made


def _close(made):
    for env in made:
        env.close()


def _same_frames_and_shared(env_id):
    own, own_envs = _rollout(env_id, [0, 1, 2], share=False)
    assert len({id(_mjr_ptr(e)) for e in own_envs}) == 3  # the baseline really is unshared
    _close(own_envs)
    shared, shared_envs = _rollout(env_id, [0, 1, 2], share=True)
    assert len({id(_mjr_ptr(e)) for e in shared_envs}) == 1
    _close(shared_envs)
    assert own.std() > 0  # rendered something
    np.testing.assert_array_equal(shared, own, err_msg=env_id)


# reacher sets its target's size per task, fish and manipulator have meshes and textures.
@pytest.mark.parametrize("env_id", ["dmc/cartpole-swingup", "dmc/walker-walk", "dmc/reacher-hard",
                                    "dmc/fish-swim", "dmc/manipulator-bring_ball"])
def test_shared_contexts_render_the_same_frames(env_id):
    _same_frames_and_shared(env_id)


@pytest.mark.slow
def test_every_domain_renders_the_same_frames_shared():
    domains = {}
    for env_id in dmc.dmc_ids():
        domains.setdefault(env_id.split("/")[1].split("-")[0], env_id)
    for env_id in domains.values():
        if env_id.startswith("dmc/quadruped"):
            continue  # height field: never shared (test below)
        _same_frames_and_shared(env_id)


def test_tasks_of_one_domain_share_and_other_domains_do_not():
    a = envs.make("dmc/reacher-easy", seed=0, size=SIZE)
    b = envs.make("dmc/reacher-hard", seed=1, size=SIZE)  # the target's size differs: scene, not context
    c = envs.make("dmc/walker-walk", seed=0, size=SIZE)
    d = envs.make("dmc/reacher-easy", seed=0, size=SIZE + 8)  # another offscreen buffer size
    assert _mjr_ptr(a) is _mjr_ptr(b)
    assert _mjr_ptr(c) is not _mjr_ptr(a) and _mjr_ptr(d) is not _mjr_ptr(a)
    _close([a, b, c, d])


def test_height_field_models_are_not_shared():
    made = [envs.make("dmc/quadruped-escape", seed=s, size=SIZE) for s in (0, 1)]
    assert _mjr_ptr(made[0]) is not _mjr_ptr(made[1])
    assert not isinstance(made[0].physics.contexts.mujoco, render_share._MjrRef)
    _close(made)


def test_render_signature_follows_what_the_context_is_made_of():
    a = envs.make("dmc/cartpole-swingup", seed=0, size=SIZE)
    b = envs.make("dmc/cartpole-balance", seed=5, size=SIZE)
    c = envs.make("dmc/walker-walk", seed=0, size=SIZE)
    sig = lambda env: render_share.render_signature(env.physics.model.ptr)  # noqa: E731
    assert sig(a) == sig(b) != sig(c)
    model = a.physics.model.ptr
    before = sig(a)
    model.mat_texrepeat[0] += 1  # a texture's tiling is part of the context
    assert sig(a) != before
    model.mat_texrepeat[0] -= 1
    assert sig(a) == before
    _close([a, b, c])


def test_closing_one_env_keeps_the_others_rendering_and_the_last_frees_them():
    base = render_share.shared_context_count()
    frames, made = _rollout("dmc/cartpole-swingup", [3, 4], share=True, steps=2)
    assert render_share.shared_context_count() == base + 1
    made[0].close()
    assert render_share.shared_context_count() == base + 1
    # The survivor renders what an env with contexts of its own renders for the same state.
    ref = envs.make("dmc/cartpole-swingup", seed=4, size=SIZE, render="fast", share_context=False)
    ref.reset()
    ref.physics.set_state(made[1].physics.get_state())
    ref.physics.forward()
    np.testing.assert_array_equal(made[1].render(), ref.render())
    made[1].close()
    assert render_share.shared_context_count() == base
    _close([ref])


def test_envs_dropped_without_close_release_their_contexts():
    base = render_share.shared_context_count()
    made = [envs.make("dmc/cartpole-swingup", seed=s, size=SIZE) for s in (0, 1)]
    assert render_share.shared_context_count() == base + 1
    del made
    gc.collect()
    assert render_share.shared_context_count() == base


def test_threads_do_not_share_contexts():
    here = envs.make("dmc/cartpole-swingup", seed=0, size=SIZE)
    there = {}

    def make_and_render():
        env = envs.make("dmc/cartpole-swingup", seed=0, size=SIZE)
        there["ptr"] = _mjr_ptr(env)
        there["frame"] = env.reset().observation["pixels"]
        env.close()

    thread = threading.Thread(target=make_and_render)
    thread.start()
    thread.join(60)
    assert there["ptr"] is not _mjr_ptr(here)
    np.testing.assert_array_equal(there["frame"], here.reset().observation["pixels"])
    _close([here])


def test_a_thread_with_another_threads_id_gets_contexts_of_its_own(monkeypatch):
    # Thread ids are reused once a thread ends, while its envs may live on with their context
    # current on that thread. Make every thread look like the same id.
    monkeypatch.setattr(render_share, "_thread_id", lambda: 1)
    ptrs, frames = [], []
    first_ready, second_done = threading.Event(), threading.Event()

    def make_and_render(ready, wait_for):
        env = envs.make("dmc/cartpole-swingup", seed=0, size=SIZE)
        ptrs.append(_mjr_ptr(env))
        frames.append(env.reset().observation["pixels"])
        ready.set()
        wait_for.wait(60)
        env.close()  # on its own thread, where its context is current

    first = threading.Thread(target=make_and_render, args=(first_ready, second_done))
    first.start()
    assert first_ready.wait(60)
    second_ready = threading.Event()
    second = threading.Thread(target=make_and_render, args=(second_ready, second_done))
    second.start()
    second_ready.wait(60)  # both envs alive now
    second_done.set()
    second.join(60)
    first.join(60)
    assert len(frames) == 2, "a thread failed to render"
    assert ptrs[0] is not ptrs[1]
    np.testing.assert_array_equal(frames[0], frames[1])


def test_share_context_option_is_checked():
    with pytest.raises(envs.EnvError, match="share_context must be true or false"):
        envs.make("dmc/cartpole-swingup", share_context="yes", size=SIZE)
