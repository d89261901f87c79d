"""The actor-side network modules never import TensorFlow (see DESIGN.md: TF + MuJoCo crash).

Runs in a fresh interpreter so that nothing this pytest process imported can hide an import.
"""

import subprocess
import sys
import textwrap


def test_numpy_backend_distributions_and_config_import_no_tensorflow():
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import impala_rep.networks
        from impala_rep.networks import NetworkConfig, NumpyNetwork
        from impala_rep.networks.config import plan_network
        from impala_rep.networks.numpy_backend import NumpyNetwork as _N
        from impala_rep.distributions import make_policy
        from impala_rep.losses import LossConfig  # the config is TF-free as well
        import impala_rep.vtrace  # TensorFlow is imported inside the functions only
        from impala_rep.specs import ArraySpec

        obs = {"pixels": ArraySpec("pixels", (84, 84, 9), "uint8"), "v": ArraySpec("v", (3,), "float32")}
        for action, kind in [
            (ArraySpec("action", (), "int32", num_values=4), "auto"),
            (ArraySpec("action", (2,), "float32", minimum=-1, maximum=1), "gaussian"),
            (ArraySpec("action", (2,), "float32", minimum=-1, maximum=1), "discretised"),
        ]:
            for torso in ("shallow", "deep"):
                net = NumpyNetwork(NetworkConfig(torso=torso, lstm_size=16, policy=kind), obs, action)
                rng = np.random.default_rng(0)
                batch = {"pixels": rng.integers(0, 256, (2, 84, 84, 9), dtype=np.uint8),
                         "v": rng.normal(size=(2, 3)).astype(np.float32)}
                params, value, state = net.step(batch, net.initial_state(2), np.ones(2, bool))
                a, lp = net.policy.sample_np(params, rng)
                net.policy.to_env_action(a[0])
                net.policy.mode_np(params)
        LossConfig()
        print("tensorflow" in sys.modules)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False", "an actor-side module imported TensorFlow"
