"""How much of a run's network RMSProp's epsilon governs (sixty-eighth session).

For each run directory, reads the latest checkpoint's RMSProp slots (the running mean square of
each weight's gradient) and prints the share of weights whose mean square is under epsilon (0.01,
`OptimizerConfig.epsilon`, added inside the root): for those, a step is about lr * g / 0.1 rather
than lr * g / RMS(g).

    .venv/bin/python docs/benchmarks/sixty-eighth-session/optimizer_rms.py RUN [RUN ...]
"""
import os
import sys

import numpy as np
import tensorflow as tf

from learner.step import OptimizerConfig

EPSILON = OptimizerConfig().epsilon  # no flag sets another, so every run trained with it


def main(runs):
    for run in runs:
        ckpt = tf.train.latest_checkpoint(os.path.join(run, "checkpoints"))
        if ckpt is None:
            raise SystemExit(f"{run} has no checkpoint under {run}/checkpoints: give a run directory.")
        reader = tf.train.load_checkpoint(ckpt)
        slots = [reader.get_tensor(name).ravel() for name, shape in tf.train.list_variables(ckpt)
                 if name.startswith("optimizer/_variables/") and shape]
        ms = np.concatenate(slots)
        print(f"{os.path.basename(os.path.normpath(run))} {os.path.basename(ckpt)}: {ms.size} weights, "
              f"mean square under epsilon for {np.mean(ms < EPSILON):.3f}, under epsilon/10 for "
              f"{np.mean(ms < EPSILON / 10):.3f}, median mean square {np.median(ms):.3g}")


if __name__ == "__main__":
    main(sys.argv[1:] or sys.exit(__doc__))
