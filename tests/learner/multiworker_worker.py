"""One worker of the two-process multiworker learner test, plus the tiny model the learner tests share.

Run as a script (by ``test_learner_step.py``)::

    python multiworker_worker.py --ports 23456,23457 --index 0 --steps 3 --out params0.npz

creates a ``multiworker`` replicator over workers on 127.0.0.1 at those ports, trains
``--steps`` learner steps of :class:`TinyNetwork` on the same seeded global batches in every
worker (each worker's replica takes its slice of ``B``) and saves the parameters and the
step counter to ``--out``.

Importing this module has no side effects (TensorFlow is imported inside functions).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

__all__ = ["A", "D", "TinyNetwork", "tiny_policy", "tiny_batch_spec", "tiny_batches"]

A, D = 3, 5  # actions, observation size


def _tiny_network_class():
    import tensorflow as tf

    class TinyNetwork(tf.Module):
        """A linear policy/value network over one vector observation ``obs`` [T+1, B, D].

        Stands in for ``TFNetwork`` (same ``unroll``/``get_params`` interface) in tests that
        check the replication machinery rather than the architecture.
        """

        def __init__(self, seed: int = 0):
            super().__init__(name="tiny")
            rng = np.random.default_rng(seed)
            self.kernel = tf.Variable((0.3 * rng.normal(size=(D, A + 1))).astype(np.float32), name="kernel")
            self.bias = tf.Variable(np.zeros(A + 1, np.float32), name="bias")

        @property
        def trainable_variables(self):
            return (self.kernel, self.bias)

        def unroll(self, obs, first, initial_state):
            del first, initial_state
            out = tf.einsum("tbd,da->tba", obs["obs"], self.kernel) + self.bias
            return {"logits": out[..., :A]}, out[..., A]

        def get_params(self):
            return {"kernel": self.kernel.numpy(), "bias": self.bias.numpy()}

        def set_params(self, params):
            self.kernel.assign(params["kernel"])
            self.bias.assign(params["bias"])

    return TinyNetwork


def TinyNetwork(seed: int = 0):  # noqa: N802 - a class factory that reads like the class
    return _tiny_network_class()(seed)


def tiny_policy():
    from impala_rep.distributions import make_policy
    from impala_rep.specs import ArraySpec

    return make_policy(ArraySpec("action", (), "int32", num_values=A))


def tiny_batch_spec(unroll_length: int, batch_size: int):
    from impala_rep.specs import ArraySpec
    from learner.step import make_batch_spec

    return make_batch_spec(
        {"obs": ArraySpec("obs", (D,), "float32")}, tiny_policy().action_spec, unroll_length, batch_size
    )


def tiny_batches(num: int, unroll_length: int, batch_size: int, seed: int = 1):
    """``num`` random global batches ``[T+1, B]`` with episode ends (FIRST/MID/LAST) in them."""
    rng = np.random.default_rng(seed)
    steps = unroll_length + 1
    out = []
    for _ in range(num):
        step_type = rng.choice(np.array([0, 1, 2], np.uint8), size=(steps, batch_size), p=[0.15, 0.7, 0.15])
        discount = np.where((step_type == 2) & (rng.uniform(size=step_type.shape) < 0.5), 0.0, 1.0)
        out.append(
            {
                "observation/obs": rng.normal(size=(steps, batch_size, D)).astype(np.float32),
                "step_type": step_type,
                "reward": rng.normal(size=(steps, batch_size)).astype(np.float32),
                "discount": discount.astype(np.float32),
                "action": rng.integers(0, A, size=(steps, batch_size)).astype(np.int32),
                "behaviour_log_prob": np.log(rng.uniform(0.2, 0.6, size=(steps, batch_size))).astype(np.float32),
                "policy_version": np.zeros(batch_size, np.int64),
            }
        )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", required=True, help="comma-separated ports of the workers on 127.0.0.1")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--unroll-length", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
    from impala_rep.replicator import make_replicator

    cluster = {
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in args.ports.split(",")]},
        "task": {"type": "worker", "index": args.index},
    }
    replicator = make_replicator("multiworker", cluster=json.dumps(cluster), timeout_seconds=60)

    from learner.step import LearnerStep

    learner = LearnerStep(
        replicator, TinyNetwork, tiny_policy(), tiny_batch_spec(args.unroll_length, args.batch_size)
    )
    for batch in tiny_batches(args.steps, args.unroll_length, args.batch_size):
        metrics = learner.train(batch)
    version, params = learner.get_params()
    np.savez(args.out, step=version, num_replicas=replicator.num_replicas, loss=metrics["loss"], **params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
