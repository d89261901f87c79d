"""Agent networks: plan, output shapes, TF/NumPy parity, LSTM resets, gradients, strategies.

Shape letters: T transitions per unroll (T+1 steps), B batch.
"""

import numpy as np
import pytest
import tensorflow as tf

from impala_rep.losses import LossConfig, impala_loss
from impala_rep.networks import NetworkConfig, NumpyNetwork, plan_network
from impala_rep.networks.tf_backend import POPART_SIGMA_RANGE, TFNetwork, popart_sigma
from impala_rep.distributions import make_policy
from impala_rep.specs import ArraySpec

PARITY_ATOL = 1e-4
PIXELS = ArraySpec("pixels", (36, 40, 6), "uint8")
VECTOR = ArraySpec("position", (5,), "float32")
OBS = {"pixels": PIXELS, "position": VECTOR}
ACTIONS = {
    "categorical": ArraySpec("action", (), "int32", num_values=4),
    "gaussian": ArraySpec("action", (2,), "float32", minimum=-1.0, maximum=1.0),
    "discretised": ArraySpec("action", (2,), "float32", minimum=-1.0, maximum=1.0),
}


def small_config(torso="auto", lstm=None, kind="categorical", **kwargs):
    return NetworkConfig(torso=torso, hidden_size=32, mlp_sizes=(16, 8), lstm_size=lstm, policy=kind, bins=5, **kwargs)


def random_obs(obs_specs, lead, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for key, spec in obs_specs.items():
        shape = tuple(lead) + spec.shape
        if spec.dtype == "uint8":
            out[key] = rng.integers(0, 256, size=shape, dtype=np.uint8)
        else:
            out[key] = rng.normal(size=shape).astype(spec.dtype)
    return out


def numpy_unroll(net, obs, first, state):
    """Steps the NumPy network through [T+1, B] inputs; returns stacked outputs."""
    params, values = [], []
    for t in range(first.shape[0]):
        p, v, state = net.step({k: x[t] for k, x in obs.items()}, state, first[t])
        params.append(p)
        values.append(v)
    return {k: np.stack([p[k] for p in params]) for k in params[0]}, np.stack(values)


# -- plan --


def test_plan_of_the_published_architectures():
    policy = make_policy(ACTIONS["categorical"], NetworkConfig())
    frames = {"pixels": ArraySpec("pixels", (84, 84, 9), "uint8")}
    shallow = plan_network(NetworkConfig(), frames, policy).param_shapes
    assert shallow["torso/pixels/conv_0/kernel"] == (8, 8, 9, 16)
    assert shallow["torso/pixels/conv_1/kernel"] == (4, 4, 16, 32)
    assert shallow["torso/pixels/dense/kernel"] == (9 * 9 * 32, 256)
    deep = plan_network(NetworkConfig(torso="deep", lstm_size=256), frames, policy).param_shapes
    convs = [n for n in deep if n.endswith("kernel") and "conv" in n]
    assert len(convs) == 3 * (1 + 2 * 2)
    assert deep["torso/pixels/section_0/conv/kernel"] == (3, 3, 9, 16)
    assert deep["torso/pixels/section_1/res_1/conv_0/kernel"] == (3, 3, 32, 32)
    assert deep["torso/pixels/dense/kernel"] == (11 * 11 * 32, 256)  # 84 -> 42 -> 21 -> 11
    assert deep["core/lstm/kernel"] == (256, 1024) and deep["core/lstm/recurrent_kernel"] == (256, 1024)
    assert deep["policy/logits/kernel"] == (256, 4) and deep["value/kernel"] == (256, 1)


def test_mlp_torso_flattens_every_key():
    plan = plan_network(small_config(torso="mlp"), OBS, make_policy(ACTIONS["categorical"]))
    assert [t.kind for t in plan.torsos] == ["mlp", "mlp"]
    assert plan.param_shapes["torso/pixels/dense_0/kernel"] == (36 * 40 * 6, 16)
    assert plan.core_input_size == 16


def test_auto_torso_uses_cnn_for_pixels_and_mlp_for_vectors():
    plan = plan_network(small_config(), OBS, make_policy(ACTIONS["categorical"]))
    assert {t.key: t.kind for t in plan.torsos} == {"pixels": "shallow", "position": "mlp"}
    assert plan.core_input_size == 32 + 8


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"torso": "resnet"}, ValueError),
        ({"policy": "beta"}, ValueError),
        ({"hidden_size": 0}, ValueError),
        ({"mlp_sizes": ()}, ValueError),
        ({"mlp_sizes": (16, -1)}, ValueError),
        ({"mlp_sizes": 16}, TypeError),
        ({"lstm_size": 0}, ValueError),
        ({"bins": 1}, ValueError),
    ],
)
def test_network_config_validation(kwargs, error):
    with pytest.raises(error, match=list(kwargs)[0]):
        NetworkConfig(**kwargs)


def test_shallow_torso_rejects_small_images():
    tiny = {"pixels": ArraySpec("pixels", (19, 24, 3), "uint8")}
    with pytest.raises(ValueError, match="too small for the shallow CNN"):
        NumpyNetwork(NetworkConfig(), tiny, ACTIONS["categorical"])
    NumpyNetwork(NetworkConfig(torso="deep"), tiny, ACTIONS["categorical"])  # any size works


@pytest.mark.parametrize("torso", ["shallow", "deep"])
def test_cnn_torso_on_vectors_only_is_refused(torso):
    # A CNN torso asked for where no observation is an image used to build an MLP silently
    # while config.json and policy.json said shallow/deep.
    vectors = {"state": ArraySpec("state", (5,), "float32")}
    with pytest.raises(ValueError, match=f"the {torso} torso is a CNN for image observations.*'state' \\[5\\].*--network mlp"):
        NumpyNetwork(NetworkConfig(torso=torso), vectors, ACTIONS["categorical"])
    NumpyNetwork(NetworkConfig(torso="auto"), vectors, ACTIONS["categorical"])  # auto: the MLP
    mixed = dict(vectors, pixels=ArraySpec("pixels", (84, 84, 3), "uint8"))  # pixels_state: CNN + MLP
    NumpyNetwork(NetworkConfig(torso=torso), mixed, ACTIONS["categorical"])


# -- shapes and parity --


@pytest.mark.parametrize("kind", sorted(ACTIONS))
def test_output_shapes_for_every_action_kind(kind):
    config = small_config(kind=kind, lstm=8)
    net = TFNetwork(config, OBS, ACTIONS[kind])
    T1, B = 3, 2
    params, values = net.unroll(random_obs(OBS, (T1, B)), np.zeros((T1, B), bool), net.initial_state(B))
    assert set(params) == set(net.policy.param_shapes)
    for name, shape in net.policy.param_shapes.items():
        assert tuple(params[name].shape) == (T1, B) + shape and params[name].dtype == tf.float32
    assert tuple(values.shape) == (T1, B) and values.dtype == tf.float32
    np_net = NumpyNetwork(config, OBS, ACTIONS[kind])
    p, v, state = np_net.step(random_obs(OBS, (B,)), np_net.initial_state(B), np.ones(B, bool))
    assert {n: x.shape for n, x in p.items()} == {n: (B,) + s for n, s in np_net.policy.param_shapes.items()}
    assert v.shape == (B,) and v.dtype == np.float32
    assert {n: x.shape for n, x in state.items()} == {"h": (B, 8), "c": (B, 8)}
    action, log_prob = np_net.policy.sample_np(p, np.random.default_rng(0))
    assert action.shape == (B,) + np_net.policy.action_spec.shape and log_prob.shape == (B,)


@pytest.mark.parametrize("kind", sorted(ACTIONS))
@pytest.mark.parametrize("lstm", [None, 8])
@pytest.mark.parametrize("torso", ["shallow", "deep", "mlp"])
def test_tf_numpy_parity(torso, lstm, kind):
    config = small_config(torso=torso, lstm=lstm, kind=kind)
    tf_net = TFNetwork(config, OBS, ACTIONS[kind])
    np_net = NumpyNetwork(config, OBS, ACTIONS[kind], seed=1)
    assert {k: v.shape for k, v in np_net.params.items()} == {k: v.shape for k, v in tf_net.get_params().items()}
    np_net.set_params(tf_net.get_params())
    T1, B = 4, 3
    rng = np.random.default_rng(2)
    obs = random_obs(OBS, (T1, B), seed=3)
    first = rng.random((T1, B)) < 0.3
    state = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in np_net.initial_state(B).items()}
    tf_params, tf_values = tf_net.unroll(obs, first, state)
    np_params, np_values = numpy_unroll(np_net, obs, first, state)
    np.testing.assert_allclose(np_values, tf_values.numpy(), atol=PARITY_ATOL, rtol=0)
    for name in tf_params:
        np.testing.assert_allclose(np_params[name], tf_params[name].numpy(), atol=PARITY_ATOL, rtol=0)
    assert np.abs(tf_values.numpy()).max() > 1e-3  # the comparison is not between zeros


def test_uint8_inputs_are_scaled_by_255():
    float_obs = {"pixels": ArraySpec("pixels", PIXELS.shape, "float32"), "position": VECTOR}
    config = small_config(torso="deep")
    net_u8 = TFNetwork(config, OBS, ACTIONS["categorical"])
    net_f = TFNetwork(config, float_obs, ACTIONS["categorical"])
    net_f.set_params(net_u8.get_params())
    obs = random_obs(OBS, (2, 2))
    scaled = dict(obs, pixels=obs["pixels"].astype(np.float32) / 255.0)
    _, v_u8 = net_u8.unroll(obs, np.zeros((2, 2), bool), {})
    _, v_f = net_f.unroll(scaled, np.zeros((2, 2), bool), {})
    np.testing.assert_allclose(v_u8.numpy(), v_f.numpy(), atol=1e-5)
    np_u8 = NumpyNetwork(config, OBS, ACTIONS["categorical"])
    np_u8.set_params(net_u8.get_params())
    _, v, _ = np_u8.step({k: x[0] for k, x in obs.items()}, {}, np.zeros(2, bool))
    np.testing.assert_allclose(v, v_f.numpy()[0], atol=PARITY_ATOL)


@pytest.mark.parametrize("backend", ["tf", "numpy"])
def test_lstm_state_resets_where_first(backend):
    config = small_config(torso="mlp", lstm=8)
    tf_net = TFNetwork(config, OBS, ACTIONS["categorical"])
    np_net = NumpyNetwork(config, OBS, ACTIONS["categorical"])
    np_net.set_params(tf_net.get_params())
    T1, B = 5, 2
    rng = np.random.default_rng(4)
    first = np.zeros((T1, B), bool)
    first[2, 0] = True  # env 0 starts a new episode at step 2

    def run(obs, state):
        if backend == "tf":
            _, v = tf_net.unroll(obs, first, state)
            return v.numpy()
        return numpy_unroll(np_net, obs, first, state)[1]

    obs_a = random_obs(OBS, (T1, B), seed=5)
    obs_b = {k: x.copy() for k, x in obs_a.items()}
    for k in obs_b:  # change steps before the reset and the initial state
        obs_b[k][:2] = random_obs(OBS, (2, B), seed=6)[k]
    state_a = {k: rng.normal(size=(B, 8)).astype(np.float32) for k in ("h", "c")}
    state_b = {k: rng.normal(size=(B, 8)).astype(np.float32) for k in ("h", "c")}
    v_a, v_b = run(obs_a, state_a), run(obs_b, state_b)
    np.testing.assert_allclose(v_a[2:, 0], v_b[2:, 0], atol=1e-6)  # env 0 forgot the past
    assert np.all(np.abs(v_a[2:, 1] - v_b[2:, 1]) > 1e-7)  # env 1 remembers it
    assert np.all(np.abs(v_a[:2] - v_b[:2]) > 1e-7)


@pytest.mark.parametrize(
    "torso, lstm, kind",
    [("deep", 8, "categorical"), ("deep", 8, "gaussian"), ("deep", 8, "discretised"), ("shallow", None, "categorical"), ("mlp", 8, "gaussian")],
)
def test_gradients_reach_every_trainable_variable(torso, lstm, kind):
    config = small_config(torso=torso, lstm=lstm, kind=kind)
    net = TFNetwork(config, OBS, ACTIONS[kind])
    policy = net.policy
    T1, B = 4, 2
    obs = random_obs(OBS, (T1, B), seed=7)
    rng = np.random.default_rng(8)
    np_params = {n: rng.normal(size=(T1, B) + s).astype(np.float32) for n, s in policy.param_shapes.items()}
    action, blp = policy.sample_np(np_params, rng)
    batch = {
        "action": action,
        "reward": rng.normal(size=(T1, B)).astype(np.float32),
        "discount": np.ones((T1, B), np.float32),
        "step_type": np.ones((T1, B), np.uint8),
        "behaviour_log_prob": blp,
    }
    with tf.GradientTape() as tape:
        params, values = net.unroll(obs, np.zeros((T1, B), bool), net.initial_state(B))
        loss, _ = impala_loss(policy, params, values, batch, LossConfig())
    grads = tape.gradient(loss, net.trainable_variables)
    assert len(net.trainable_variables) == len(net.plan.param_shapes)
    names = list(net.named_variables)
    missing = [n for n, g in zip(names, grads) if g is None or not np.any(g.numpy() != 0)]
    assert not missing, f"no gradient reaches {missing}"


@pytest.mark.parametrize("torso, lstm", [("shallow", None), ("mlp", 8)])
def test_value_torso_scale_scales_only_the_value_gradient_into_the_shared_layers(torso, lstm):
    config = small_config(torso=torso, lstm=lstm, kind="gaussian")
    nets = {k: TFNetwork(config, OBS, ACTIONS["gaussian"], value_torso_scale=k) for k in (1.0, 0.25, 0.0)}
    for net in nets.values():
        for name, var in net.named_variables.items():
            var.assign(nets[1.0].named_variables[name])
    obs = random_obs(OBS, (3, 2), seed=11)
    first = np.array([[True, False], [False, False], [False, True]])
    weights = tf.constant(np.random.default_rng(12).normal(size=(3, 2)).astype(np.float32))

    def grads(net, of):
        with tf.GradientTape() as tape:
            params, values = net.unroll(obs, first, net.initial_state(2))
            target = tf.reduce_sum(weights * values) if of == "value" else tf.reduce_sum(params["mean"])
        g = tape.gradient(target, list(net.named_variables.values()))
        return params, values, {n: (np.zeros(v.shape) if x is None else x.numpy())
                                for (n, v), x in zip(net.named_variables.items(), g)}

    params_1, values_1, value_1 = grads(nets[1.0], "value")
    shared = [n for n in value_1 if not n.startswith(("value/", "policy/"))]
    assert shared and all(np.any(value_1[n] != 0) for n in shared)
    policy_1 = grads(nets[1.0], "policy")[2]
    for k in (0.25, 0.0):
        params_k, values_k, value_k = grads(nets[k], "value")
        # The same outputs, bit for bit: only the backward pass differs.
        np.testing.assert_array_equal(values_k.numpy(), values_1.numpy())
        for name in params_1:
            np.testing.assert_array_equal(params_k[name].numpy(), params_1[name].numpy())
        for name in ("value/kernel", "value/bias"):  # the value head learns as fast as before
            np.testing.assert_allclose(value_k[name], value_1[name], rtol=1e-6)
        for name in shared:
            np.testing.assert_allclose(value_k[name], k * value_1[name], rtol=1e-5, atol=1e-7, err_msg=name)
        # The policy's gradient is untouched.
        policy_k = grads(nets[k], "policy")[2]
        for name in policy_1:
            np.testing.assert_allclose(policy_k[name], policy_1[name], rtol=1e-6, err_msg=name)
    for bad in (1.5, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match="value_torso_scale must be a number in \\[0, 1\\]"):
            TFNetwork(config, OBS, ACTIONS["gaussian"], value_torso_scale=bad)


def test_popart_keeps_the_values_through_each_update_of_the_statistics_and_exports_them_folded(tmp_path):
    config = small_config(torso="shallow", lstm=8, kind="gaussian")
    net = TFNetwork(config, OBS, ACTIONS["gaussian"], popart=True)
    plain = TFNetwork(config, OBS, ACTIONS["gaussian"])
    for name, var in plain.named_variables.items():
        var.assign(net.named_variables[name])
    obs = random_obs(OBS, (3, 2), seed=13)
    first = np.array([[True, False], [False, False], [False, True]])

    def values(n):
        return n.unroll(obs, first, n.initial_state(2))[1].numpy()

    # No statistics yet: mu 0, sigma 1, the plain network's values.
    assert [float(x) for x in net.value_stats()] == [0.0, 1.0]
    np.testing.assert_array_equal(values(net), values(plain))
    before = values(net)
    raw_kernel = net.named_variables["value/kernel"].numpy().copy()
    # The first batch's statistics are its own (mean 50, standard deviation 10) ...
    mu, sigma = net.update_value_stats(50.0, 50.0 ** 2 + 10.0 ** 2, 1e-3)
    assert (float(mu), float(sigma)) == pytest.approx((50.0, 10.0), rel=1e-6)
    np.testing.assert_allclose(values(net), before, atol=1e-5)  # float32 at 50: ulps of 4e-6
    np.testing.assert_allclose(net.named_variables["value/kernel"].numpy(), raw_kernel / 10.0, rtol=1e-6)
    # ... then averages until 1/updates falls below the step size: mean 55, mean square 3112.5.
    mu, sigma = net.update_value_stats(60.0, 60.0 ** 2 + 5.0 ** 2, 1e-3)
    assert (float(mu), float(sigma)) == pytest.approx((55.0, np.sqrt(3112.5 - 55.0 ** 2)), rel=1e-5)
    np.testing.assert_allclose(values(net), before, atol=1e-5)
    # The exported parameters carry the statistics: the NumPy backend computes the same values.
    exported = net.get_params()
    np_net = NumpyNetwork(config, OBS, ACTIONS["gaussian"])
    np_net.set_params(exported)
    state = {k: np.zeros((2,) + shape, np.float32) for k, shape in config.core_state_shapes().items()}
    np.testing.assert_allclose(numpy_unroll(np_net, obs, first, state)[1], before, atol=PARITY_ATOL)
    for name in exported:
        if not name.startswith("value/"):
            np.testing.assert_array_equal(exported[name], net.named_variables[name].numpy())
    # set_params takes them back as get_params gives them.
    other = TFNetwork(config, OBS, ACTIONS["gaussian"], popart=True)
    tf.train.Checkpoint(network=other).read(tf.train.Checkpoint(network=net).write(str(tmp_path / "ckpt")))
    assert [float(x) for x in other.value_stats()] == pytest.approx([float(mu), float(sigma)])
    np.testing.assert_allclose(values(other), before, atol=1e-5)
    other.set_params(exported)
    np.testing.assert_allclose(other.named_variables["value/kernel"].numpy(),
                               net.named_variables["value/kernel"].numpy(), rtol=1e-5)
    np.testing.assert_allclose(values(other), before, atol=1e-5)
    with pytest.raises(ValueError, match="built without popart"):
        plain.value_stats()
    with pytest.raises(TypeError, match="popart must be True or False"):
        TFNetwork(config, OBS, ACTIONS["gaussian"], popart=3e-4)


def test_popart_sigma_is_the_statistics_standard_deviation_within_its_bounds():
    # From arrays as a checkpoint reader gives them, and from tensors.
    assert float(popart_sigma(np.float32(55.0), np.float32(3112.5))) == pytest.approx(np.sqrt(87.5), rel=1e-5)
    assert float(popart_sigma(tf.constant(0.0), tf.constant(4.0))) == pytest.approx(2.0)
    # float32 rounding can make mean_square fall under mean^2: the variance is held at 0, sigma at the floor.
    assert float(popart_sigma(np.float32(3.0), np.float32(8.999))) == pytest.approx(POPART_SIGMA_RANGE[0])
    assert float(popart_sigma(np.float32(7.0), np.float32(49.0))) == pytest.approx(POPART_SIGMA_RANGE[0])
    assert float(popart_sigma(np.float32(0.0), np.float32(1e14))) == pytest.approx(POPART_SIGMA_RANGE[1])


def test_unroll_under_xla_matches_eager():
    config = small_config(torso="shallow", lstm=8, kind="gaussian")
    net = TFNetwork(config, OBS, ACTIONS["gaussian"])
    obs = random_obs(OBS, (3, 2), seed=9)
    first = np.array([[True, False], [False, True], [False, False]])
    state = net.initial_state(2)
    eager = net.unroll(obs, first, state)
    xla = tf.function(net.unroll, jit_compile=True)(obs, first, state)
    np.testing.assert_allclose(xla[1].numpy(), eager[1].numpy(), atol=1e-5)
    np.testing.assert_allclose(xla[0]["log_std"].numpy(), eager[0]["log_std"].numpy(), atol=1e-5)


def test_builds_in_strategy_scope_and_runs_in_strategy_run():
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    assert len(devices) == 2, "tests/learner/conftest.py configures logical CPU devices"
    strategy = tf.distribute.MirroredStrategy(devices)
    config = small_config(torso="shallow", lstm=8)
    with strategy.scope():
        net = TFNetwork(config, OBS, ACTIONS["categorical"])
    assert isinstance(net.trainable_variables[0], tf.distribute.DistributedValues)
    T1, B = 3, 4
    obs = random_obs(OBS, (T1, B), seed=10)
    first = np.zeros((T1, B), bool)
    state = {k: np.zeros((B, 8), np.float32) for k in ("h", "c")}

    def per_replica(ctx):
        i = ctx.replica_id_in_sync_group
        cols = slice(2 * i, 2 * i + 2)
        return ({k: x[:, cols] for k, x in obs.items()}, first[:, cols], {k: s[cols] for k, s in state.items()})

    inputs = strategy.experimental_distribute_values_from_function(per_replica)

    @tf.function
    def step(inputs):
        return strategy.run(lambda o, f, s: net.unroll(o, f, s)[1], args=inputs)

    values = np.concatenate([v.numpy() for v in strategy.experimental_local_results(step(inputs))], axis=1)
    np.testing.assert_allclose(values, net.unroll(obs, first, state)[1].numpy(), atol=1e-5)


# -- parameters and input validation --


def test_checkpoint_round_trip(tmp_path):
    config = small_config(lstm=8)
    a = TFNetwork(config, OBS, ACTIONS["categorical"])
    b = TFNetwork(config, OBS, ACTIONS["categorical"])
    path = tf.train.Checkpoint(net=a).save(str(tmp_path / "ckpt"))
    tf.train.Checkpoint(net=b).restore(path).assert_consumed()
    for name, value in a.get_params().items():
        np.testing.assert_array_equal(b.get_params()[name], value)


@pytest.mark.parametrize("backend", ["tf", "numpy"])
def test_set_params_rejects_mismatches(backend):
    config = small_config()
    net = (TFNetwork if backend == "tf" else NumpyNetwork)(config, OBS, ACTIONS["categorical"])
    good = NumpyNetwork(config, OBS, ACTIONS["categorical"], seed=3).params
    net.set_params(good)
    got = net.get_params() if backend == "tf" else net.params
    np.testing.assert_array_equal(got["value/kernel"], good["value/kernel"])
    bad = dict(good)
    bad.pop("value/bias")
    with pytest.raises(ValueError, match=r"missing \['value/bias'\]"):
        net.set_params(bad)
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        net.set_params(dict(good, extra=np.zeros(1)))
    with pytest.raises(ValueError, match=r"'value/kernel' must have shape \[40, 1\], got \[40, 2\]"):
        net.set_params(dict(good, **{"value/kernel": np.zeros((40, 2))}))


def test_bad_observations_raise_value_error():
    net = NumpyNetwork(small_config(), OBS, ACTIONS["categorical"])
    obs = random_obs(OBS, (2,))
    with pytest.raises(ValueError, match=r"obs lacks keys \['position'\]"):
        net.step({"pixels": obs["pixels"]}, {}, np.zeros(2, bool))
    with pytest.raises(ValueError, match=r"obs\['position'\] must have shape \[B, 5\], got \[2, 4\]"):
        net.step(dict(obs, position=np.zeros((2, 4), np.float32)), {}, np.zeros(2, bool))
    tf_net = TFNetwork(small_config(), OBS, ACTIONS["categorical"])
    with pytest.raises(ValueError, match=r"obs\['pixels'\] must have shape \[T\+1, B, 36, 40, 6\]"):
        tf_net.unroll(dict(obs), np.zeros((1, 2), bool), {})


def test_initial_state_travels_with_the_unroll():
    config = small_config(torso="mlp", lstm=8)
    net = TFNetwork(config, OBS, ACTIONS["categorical"])
    obs = random_obs(OBS, (2, 1), seed=11)
    first = np.zeros((2, 1), bool)
    zero = net.unroll(obs, first, net.initial_state(1))[1].numpy()
    other = net.unroll(obs, first, {"h": np.ones((1, 8), np.float32), "c": np.ones((1, 8), np.float32)})[1].numpy()
    assert np.all(np.abs(zero - other) > 1e-7)
    with pytest.raises(ValueError, match="initial_state lacks 'h'"):
        net.unroll(obs, first, {})


# -- frame stacks built in the graph ------------------------------------------------------


def test_stack_sources_follow_the_frame_stacking_rule():
    """Gathering single frames by stack_sources gives exactly rebuild_stack's stacks (the
    actor's FrameStacker rule), for random episode starts, K = 1..4 and a batch axis."""
    from impala_rep.framestack import rebuild_stack
    from impala_rep.networks.tf_backend import stack_sources

    rng = np.random.default_rng(20)
    for _ in range(40):
        steps, b, k = int(rng.integers(1, 9)), int(rng.integers(1, 5)), int(rng.integers(1, 5))
        frames = rng.integers(0, 256, (steps + k - 1, b, 2, 3, 2)).astype(np.uint8)
        step_type = rng.choice(np.array([0, 1, 2], np.uint8), size=(steps, b), p=[0.3, 0.5, 0.2])
        src = stack_sources(step_type == 0, k).numpy()
        assert src.shape == (steps, b, k) and src.min() >= 0 and src.max() <= steps + k - 2
        gathered = np.concatenate([frames[src[:, :, j], np.arange(b)[None, :]] for j in range(k)], axis=-1)
        np.testing.assert_array_equal(gathered, rebuild_stack(frames[k - 1:], frames[:k - 1], step_type))


@pytest.mark.parametrize("torso, lstm", [("shallow", None), ("deep", 8), ("mlp", None)])
def test_network_on_single_frames_equals_the_network_on_their_stacks(torso, lstm):
    """The learner's network stacks frames in its graph (the first convolution per frame):
    outputs and gradients equal those of the same network on the stacks rebuild_stack builds."""
    from impala_rep.framestack import rebuild_stack

    k, T1, B = 3, 5, 4
    obs_specs = {"pixels": ArraySpec("pixels", (36, 40, 3 * k), "uint8"), "position": VECTOR}
    net = TFNetwork(small_config(torso=torso, lstm=lstm, kind="gaussian"), obs_specs, ACTIONS["gaussian"])
    rng = np.random.default_rng(21)
    frames = rng.integers(0, 256, (T1 + k - 1, B, 36, 40, 3)).astype(np.uint8)
    step_type = np.ones((T1, B), np.uint8)
    step_type[0, 1] = step_type[2, 2] = step_type[3, 2] = step_type[4, 3] = 0  # episode starts
    first = step_type == 0
    position = rng.normal(size=(T1, B, 5)).astype(np.float32)
    stacked = {"pixels": rebuild_stack(frames[k - 1:], frames[:k - 1], step_type), "position": position}
    state = net.initial_state(B)

    def run(obs, **kwargs):
        with tf.GradientTape() as tape:
            params, values = net.unroll(obs, first, state, **kwargs)
            loss = tf.reduce_sum(values ** 2) + tf.reduce_sum(params["mean"] ** 2)
        return params, values, tape.gradient(loss, net.trainable_variables)

    want_params, want_values, want_grads = run(stacked)
    got_params, got_values, got_grads = run({"pixels": frames, "position": position}, frame_stack={"pixels": k})
    np.testing.assert_allclose(got_values.numpy(), want_values.numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got_params["mean"].numpy(), want_params["mean"].numpy(), atol=1e-5, rtol=1e-5)
    assert np.abs(want_values.numpy()).max() > 1e-3
    # Gradients are compared by norm, per variable. The deep torso max-pools after its first
    # convolution: where two inputs of a pool window lie within float32 rounding of each
    # other, the two computations (equal but for rounding) can pick different maxima and
    # route that gradient elsewhere. With the weights' unseeded initialisation that happened
    # in about 1 process in 10 (0.055% of a kernel gradient's norm, against 1e-6 otherwise).
    # A frame stacked wrongly, or left out of the backward pass, moves a gradient by far more.
    compared = 0
    for name, got, want in zip(net.named_variables, got_grads, want_grads):
        assert (got is None) == (want is None), name  # e.g. the log-std head takes no part in this loss
        if want is not None:
            error = np.linalg.norm(got.numpy() - want.numpy())
            assert error <= 1e-2 * np.linalg.norm(want.numpy()) + 1e-5, (name, error, np.linalg.norm(want.numpy()))
            compared += 1
    assert compared >= len(net.named_variables) - 2
    # A changed frame in an older slot changes the output: the frames really are stacked.
    frames[k - 2, 0] = 255 - frames[k - 2, 0]  # step 0's middle slot of unroll 0 (no episode start)
    changed = net.unroll({"pixels": frames, "position": position}, first, state, frame_stack={"pixels": k})[1]
    assert abs(float(changed[0, 0]) - float(want_values[0, 0])) > 1e-6
    np.testing.assert_allclose(changed.numpy()[:, 1:], want_values.numpy()[:, 1:], atol=1e-5, rtol=1e-5)


def test_single_frames_of_the_wrong_shape_get_a_sentence():
    obs_specs = {"pixels": ArraySpec("pixels", (36, 40, 9), "uint8")}
    net = TFNetwork(small_config(torso="shallow"), obs_specs, ACTIONS["categorical"])
    first = np.zeros((3, 2), bool)
    with pytest.raises(ValueError, match=r"obs\['pixels'\] must hold single frames \[T\+3, B, 36, 40, 3\]"):
        net.unroll({"pixels": np.zeros((5, 2, 36, 40, 9), np.uint8)}, first, {}, frame_stack={"pixels": 3})
    with pytest.raises(ValueError, match=r"stacked 2 deep, but the network's input has 9 channels"):
        net.unroll({"pixels": np.zeros((4, 2, 36, 40, 4), np.uint8)}, first, {}, frame_stack={"pixels": 2})
    with pytest.raises(ValueError, match=r"frame_stack names \['rgb'\]"):
        net.unroll({"pixels": np.zeros((5, 2, 36, 40, 3), np.uint8)}, first, {}, frame_stack={"rgb": 3})
    with pytest.raises(ValueError, match=r"first must have shape \[T\+1, B\], got \[3\]"):
        net.unroll({"pixels": np.zeros((5, 2, 36, 40, 3), np.uint8)}, first[:, 0], {}, frame_stack={"pixels": 3})
    lstm_net = TFNetwork(small_config(torso="shallow", lstm=4), obs_specs, ACTIONS["categorical"])
    with pytest.raises(ValueError, match=r"first must have shape \[T\+1, B\], got \[3\]"):
        lstm_net.unroll({"pixels": np.zeros((3, 2, 36, 40, 9), np.uint8)}, first[:, 0], lstm_net.initial_state(2))
