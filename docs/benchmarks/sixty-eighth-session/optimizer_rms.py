"""How much of a run's network RMSProp's epsilon governs (sixty-eighth session).

For each run directory, reads the latest checkpoint's RMSProp slots (the running mean square of
each weight's gradient) and prints the share of weights whose mean square is under the run's
epsilon (its config.json's `--rmsprop-epsilon`, else `OptimizerConfig.epsilon`'s 0.01, added
inside the root): for those, a step is about lr * g / sqrt(epsilon) rather than lr * g / RMS(g).
A run with `--rmsprop-epsilon-scale sigma` (seventieth session) used that over PopArt's sigma
squared, the checkpoint's sigma at its last update.

It also counts, for each bias whose shape no other variable of the network shares (the shallow
network's dense layer and policy head), the units whose mean square is exactly 0 (sixty-ninth
session): a slot decays by 0.99 an update and reaches 0 in float32 only after several thousand
updates with no gradient at all, so those units' ReLUs were silent on every input of those
batches, capacity the network no longer uses.

    .venv/bin/python docs/benchmarks/sixty-eighth-session/optimizer_rms.py RUN [RUN ...]
"""
import collections
import json
import os
import sys

import numpy as np
import tensorflow as tf

from impala_rep.networks.tf_backend import popart_sigma
from learner.step import OptimizerConfig


def run_epsilon(run, reader, shapes):
    """The epsilon the run trained with at its checkpoint (runs at the default do not write it)."""
    with open(os.path.join(run, "config.json")) as f:
        optimizer = json.load(f).get("optimizer", {})
    epsilon = optimizer.get("epsilon", OptimizerConfig().epsilon)
    if optimizer.get("epsilon_scale", "fixed") == "sigma":
        stat = {key: reader.get_tensor(next(n for n in shapes if f"_value_stats/{key}/" in n))
                for key in ("mean", "mean_square")}
        sigma = float(popart_sigma(stat["mean"], stat["mean_square"]))  # as TFNetwork.value_stats
        epsilon /= sigma ** 2
    return epsilon


def main(runs):
    for run in runs:
        ckpt = tf.train.latest_checkpoint(os.path.join(run, "checkpoints"))
        if ckpt is None:
            raise SystemExit(f"{run} has no checkpoint under {run}/checkpoints: give a run directory.")
        reader = tf.train.load_checkpoint(ckpt)
        shapes = {name: tuple(shape) for name, shape in tf.train.list_variables(ckpt)}
        slots = {name: reader.get_tensor(name) for name, shape in shapes.items()
                 if name.startswith("optimizer/_variables/") and shape}
        ms = np.concatenate([slot.ravel() for slot in slots.values()])
        epsilon = run_epsilon(run, reader, shapes)
        print(f"{os.path.basename(os.path.normpath(run))} {os.path.basename(ckpt)}: {ms.size} weights, "
              f"mean square under epsilon ({epsilon:g}) for {np.mean(ms < epsilon):.3f}, under epsilon/10 for "
              f"{np.mean(ms < epsilon / 10):.3f}, median mean square {np.median(ms):.3g}; "
              f"units with no gradient: {silent_units(shapes, slots)}")


def silent_units(shapes, slots):
    """'layer n of m, ...' for the network's uniquely shaped biases (slots are matched by shape)."""
    network = collections.Counter(s for n, s in shapes.items() if n.startswith("network/"))
    by_shape = collections.Counter(slot.shape for slot in slots.values())
    found = []
    for name, shape in sorted(shapes.items()):
        if name.startswith("network/") and "bias/" in name and network[shape] == 1 and by_shape[shape] == 1:
            slot = next(v for v in slots.values() if v.shape == shape)
            layer = name[len("network/_named/"):].split("/")[0].replace(".S", "/").rsplit("/", 1)[0]
            found.append(f"{layer} {int(np.sum(slot == 0))} of {slot.size}")
    return ", ".join(found)


if __name__ == "__main__":
    main(sys.argv[1:] or sys.exit(__doc__))
