"""How many units of a run's network got no gradient for thousands of updates (sixty-ninth session).

For each run directory, reads the latest checkpoint's RMSProp slots (each weight's running mean
square of its gradient, decayed by 0.99 an update) and, for each bias of the network whose shape
no other variable shares, prints how many of its units have a mean square of exactly 0. A slot
decays to 0 in float32 only after several thousand updates with no gradient at all (0.99**9000 times
1e-5 is below float32's smallest number), so those units' ReLUs were silent on every input of
those batches: capacity the network no longer uses. The slots are matched to the network's
variables by shape, so only uniquely shaped biases are counted (the shallow network's dense
layer and policy head are).

    .venv/bin/python docs/benchmarks/sixty-ninth-session/silent_units.py RUN [RUN ...]
"""
import collections
import os
import sys

import numpy as np
import tensorflow as tf


def main(runs):
    for run in runs:
        ckpt = tf.train.latest_checkpoint(os.path.join(run, "checkpoints"))
        if ckpt is None:
            raise SystemExit(f"{run} has no checkpoint under {run}/checkpoints: give a run directory.")
        reader = tf.train.load_checkpoint(ckpt)
        names = dict(tf.train.list_variables(ckpt))
        slots = collections.defaultdict(list)
        for name, shape in names.items():
            if name.startswith("optimizer/_variables/") and shape:
                slots[tuple(shape)].append(name)
        found = []
        for name, shape in sorted(names.items()):
            if not (name.startswith("network/") and name.endswith("bias/.ATTRIBUTES/VARIABLE_VALUE")):
                continue
            same = [n for n, s in names.items() if n.startswith("network/") and tuple(s) == tuple(shape)]
            if len(same) != 1 or len(slots[tuple(shape)]) != 1:
                continue  # another variable of its shape: its slot cannot be told apart
            ms = reader.get_tensor(slots[tuple(shape)][0])
            layer = name[len("network/_named/"):].split("/")[0].replace(".S", "/").rsplit("/", 1)[0]
            found.append(f"{layer} {int(np.sum(ms == 0))} of {ms.size}")
        print(f"{os.path.basename(os.path.normpath(run))} {os.path.basename(ckpt)}: units with no gradient: "
              + ", ".join(found))


if __name__ == "__main__":
    main(sys.argv[1:] or sys.exit(__doc__))
