"""Replays the learner updates a run's ``--capture-spikes`` kept around a collapse of its policy.

    .venv/bin/python scripts/replay_capture.py runs/walker/captures/step-2214
    .venv/bin/python scripts/replay_capture.py runs/walker/captures/step-2214 --learning-rate 3e-4 --json

One line per update, from the state the capture holds: the learner step it ran on; the policy's
entropy, the value head's mean, the gradient norm (before clipping) and the baseline loss, as
the run recorded them and as the replay computes them (they agree when the replay reproduces
the run); the entropy and value mean of the capture's last batch on the state before the update
(flat when that batch's entropy is the batch's own, rising when the updates raised it); and how
far the update moved each layer (the norm of its change over the norm of its parameters before)
and how far it shifted each layer's kernel weights all together (their mean change over their
mean magnitude before: the sign says whether the update scaled up or down what the layer passes
on). ``--learning-rate``, ``--clip-norm``, ``--baseline-cost``, ``--entropy-cost``,
``--reward-scale``, ``--baseline-torso-scale``, ``--popart`` and ``--popart-terms`` replay with other settings, to see
whether the collapse still comes (PopArt's statistics, when the run had none, start from the
first replayed batch's value targets). See ``learner/capture.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from impala_rep.losses import POPART_TERMS  # noqa: E402 (TensorFlow-free)
from learner.capture import REPLAY_LOSS_KEYS, REPLAY_LOSS_WORDS, replay_capture  # noqa: E402 (TensorFlow only when it replays)

SHOWN = ("entropy_mean", "value_mean", "grad_norm", "baseline_loss")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("capture", help="a captures/step-S directory of a run")
    parser.add_argument("--learning-rate", type=float, default=None, help="replay with this learning rate")
    parser.add_argument("--clip-norm", type=float, default=None, help="replay with this gradient clip norm")
    for key in REPLAY_LOSS_KEYS:
        if key in REPLAY_LOSS_WORDS:
            parser.add_argument(f"--{key.replace('_', '-')}", choices=POPART_TERMS, default=None,
                                help=f"replay with this {key.replace('_', ' ')}")
        else:
            parser.add_argument(f"--{key.replace('_', '-')}", type=float, default=None,
                                help=f"replay with this {key.replace('_', ' ')}")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.capture):
        parser.error(f"{args.capture} is not a directory: give a captures/step-S directory of a run that had "
                     "--capture-spikes.")
    from learner.run import configure_logging, configure_tensorflow_env, configure_threads
    from impala_rep.plan import available_cores

    configure_logging()
    configure_tensorflow_env()
    try:  # the replicas the run's step had (a capture without a readable config.json is a sentence below)
        with open(os.path.join(args.capture, "config.json")) as f:
            replicas = json.load(f).get("replicas") or 1
    except (OSError, ValueError, AttributeError):
        replicas = 1
    configure_threads(available_cores(), replicas)

    try:
        loss = {k: getattr(args, k) for k in REPLAY_LOSS_KEYS if getattr(args, k) is not None}
        rows, _ = replay_capture(args.capture, learning_rate=args.learning_rate, clip_norm=args.clip_norm, loss=loss)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    layers = list(rows[0]["update"]) if rows else []
    kernels = list(rows[0]["shift"]) if rows else []
    print("step  " + "  ".join(f"{m} (run/replay)" for m in SHOWN) + "  |  last batch's entropy, value_mean"
          "  |  update/norm: " + ", ".join(layers) + "  |  kernel shift: " + ", ".join(kernels))
    for r in rows:
        pairs = "  ".join(f"{r['recorded'].get(m, float('nan')):.4g}/{r['replayed'].get(m, float('nan')):.4g}"
                          for m in SHOWN)
        last = " ".join(f"{r['last_batch'].get(m, float('nan')):.4g}" for m in ("entropy_mean", "value_mean"))
        print(f"{r['learner_step']}  {pairs}  |  {last}  |  " + " ".join(f"{r['update'][k]:.2e}" for k in layers)
              + "  |  " + " ".join(f"{r['shift'][k]:+.1e}" for k in kernels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
