"""How much of a run's network RMSProp's epsilon governs (sixty-eighth session).

For each run directory, reads the latest checkpoint's RMSProp slots (the running mean square of
each weight's gradient) and prints the share of weights whose mean square is under the run's
epsilon (its config.json's `--rmsprop-epsilon`, else `OptimizerConfig.epsilon`'s 0.01, added
inside the root): for those, a step is about lr * g / sqrt(epsilon) rather than lr * g / RMS(g).

    .venv/bin/python docs/benchmarks/sixty-eighth-session/optimizer_rms.py RUN [RUN ...]
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

from learner.step import OptimizerConfig



def run_epsilon(run):
    """The epsilon the run trained with (runs at the default do not write it)."""
    with open(os.path.join(run, "config.json")) as f:
        return json.load(f).get("optimizer", {}).get("epsilon", OptimizerConfig().epsilon)


def main(runs):
    for run in runs:
        ckpt = tf.train.latest_checkpoint(os.path.join(run, "checkpoints"))
        if ckpt is None:
            raise SystemExit(f"{run} has no checkpoint under {run}/checkpoints: give a run directory.")
        reader = tf.train.load_checkpoint(ckpt)
        slots = [reader.get_tensor(name).ravel() for name, shape in tf.train.list_variables(ckpt)
                 if name.startswith("optimizer/_variables/") and shape]
        ms = np.concatenate(slots)
        epsilon = run_epsilon(run)
        print(f"{os.path.basename(os.path.normpath(run))} {os.path.basename(ckpt)}: {ms.size} weights, "
              f"mean square under epsilon ({epsilon:g}) for {np.mean(ms < epsilon):.3f}, under epsilon/10 for "
              f"{np.mean(ms < epsilon / 10):.3f}, median mean square {np.median(ms):.3g}")


if __name__ == "__main__":
    main(sys.argv[1:] or sys.exit(__doc__))
