"""Exports the policy of any checkpoint a run keeps, for evaluation.

    python -m learner.export RUN_DIR [--step N] [--out DIR]

A run exports its newest policy to ``RUN_DIR/policy`` with every checkpoint, and its
``tf.train.CheckpointManager`` keeps the last ``--keep-checkpoints`` checkpoints. This reads one
of them (``--step N``: the checkpoint at learner step N, ``ckpt-N``; default the newest) into the
network the run's export describes, and writes its policy in the same TensorFlow-free format to
``RUN_DIR/exports/ckpt-N`` (or ``--out``), for ``python -m impala_rep.evaluate``, which calls this
itself for ``--checkpoint N``. TensorFlow runs here, so nothing renders in this process.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Dict, Optional

__all__ = ["EXPORTS", "ExportError", "kept_checkpoints", "export_checkpoint", "checkpoint_export_dir", "main"]

log = logging.getLogger("impala_rep.export")


class ExportError(ValueError):
    """A checkpoint cannot be exported; the message says why and what to do."""


# The run directory's folder of checkpoint exports (TensorFlow-free to import, as this module is:
# impala_rep.evaluate finds them by it).
EXPORTS = "exports"
# Where a checkpoint of a --popart run holds the value targets' mean (TFNetwork's statistics).
POPART_STATS_KEY = "network/_value_stats/mean/.ATTRIBUTES/VARIABLE_VALUE"


def checkpoint_export_dir(run_dir: str, step: int) -> str:
    """Where a checkpoint's policy is exported by default: ``RUN_DIR/exports/ckpt-STEP``."""
    return os.path.join(run_dir, EXPORTS, f"ckpt-{step}")


def kept_checkpoints(run_dir: str) -> Dict[int, str]:
    """``{learner step: checkpoint path}`` for the checkpoints the run keeps (oldest first)."""
    import tensorflow as tf

    directory = os.path.join(run_dir, "checkpoints")
    state = tf.train.get_checkpoint_state(directory) if os.path.isdir(directory) else None
    if state is None:
        raise ExportError(f"{run_dir} holds no checkpoints ({directory} has no index of them); give the directory "
                          "of a run that has saved one (it saves every --checkpoint-interval and when it ends).")
    kept = {}
    for path in state.all_model_checkpoint_paths:
        name = os.path.basename(path)
        if name.startswith("ckpt-") and name[5:].isdigit() and os.path.exists(path + ".index"):
            kept[int(name[5:])] = path
    if not kept:
        raise ExportError(f"the checkpoint index in {directory} names no checkpoint that is there; give the "
                          "directory of a run that has saved one.")
    return dict(sorted(kept.items()))


def export_checkpoint(run_dir: str, step: Optional[int] = None, out: Optional[str] = None) -> str:
    """Exports the policy of the run's checkpoint at learner step ``step`` (default the newest)
    to ``out`` (default :func:`checkpoint_export_dir`); returns that directory. Raises
    :class:`ExportError` with a sentence when it cannot."""
    import numpy as np
    import tensorflow as tf

    from impala_rep.export import PolicyLoadError, load_policy, save_policy
    from impala_rep.networks import NetworkConfig
    from impala_rep.networks.tf_backend import TFNetwork
    from impala_rep.specs import stacked_observation_specs

    if not os.path.isdir(run_dir):
        raise ExportError(f"{run_dir} is not a directory; give a run directory (the launcher's --logdir).")
    kept = kept_checkpoints(run_dir)
    if step is None:
        step = max(kept)
    elif step not in kept:
        raise ExportError(f"{run_dir} keeps checkpoints at learner steps {', '.join(map(str, kept))}, not at {step} "
                          "(a run keeps its last --keep-checkpoints of them).")
    path = kept[step]
    try:  # the network, env and frame stacking as the run exports them (the same for all its checkpoints)
        newest = load_policy(os.path.join(run_dir, "policy"))
    except PolicyLoadError as exc:
        raise ExportError(f"the run's exported policy describes the network to read the checkpoint into, and it "
                          f"cannot be loaded: {exc}") from None
    status = None
    try:
        # A run with --popart keeps the value statistics beside the network; they fold into
        # the value head the policy exports (TFNetwork.param_tensors).
        popart = tf.train.load_checkpoint(path).has_tensor(POPART_STATS_KEY)
        network = TFNetwork(NetworkConfig(**newest.metadata["network"]),
                            stacked_observation_specs(newest.env_spec.observations, newest.frame_stack),
                            newest.env_spec.action, popart=popart)
        status = tf.train.Checkpoint(network=network).restore(path)
        status.assert_existing_objects_matched()
        reader = tf.train.load_checkpoint(path)
        counters = {name: reader.get_tensor(f"{name}/.ATTRIBUTES/VARIABLE_VALUE")
                    for name in ("agent_steps", "train_seconds") if reader.has_tensor(f"{name}/.ATTRIBUTES/VARIABLE_VALUE")}
    except (AssertionError, ValueError, tf.errors.OpError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"cannot read the network from {path}: it is corrupt, or another run's than the policy "
                          f"exported in {run_dir}/policy (TensorFlow says: {first[:300]}).") from None
    finally:
        if status is not None:
            status.expect_partial()  # the optimizer's state and counters are not the network's
    params = network.get_params()
    bad = sorted(name for name, value in params.items() if not np.all(np.isfinite(value)))
    if bad:
        raise ExportError(f"{path} holds NaN or infinite parameters (in {', '.join(bad[:3])}): the run had diverged "
                          "by then; export an earlier checkpoint.")
    metadata = {k: v for k, v in newest.metadata.items() if k not in ("format", "version", "train_seconds")}
    metadata.update(learner_step=step, checkpoint=os.path.basename(path),
                    agent_steps=int(counters.get("agent_steps", 0)))
    if "train_seconds" in counters:
        metadata["train_seconds"] = round(float(counters["train_seconds"]), 1)
    out = out or checkpoint_export_dir(run_dir, step)
    try:
        return save_policy(out, params, metadata)
    except OSError as exc:
        raise ExportError(f"cannot write the policy to {out} ({exc.strerror or exc}); give another --out.") from None


def main(argv=None) -> int:
    from impala_rep.flags import CommandLineParser
    from learner.run import configure_logging, configure_tensorflow_env

    configure_logging()
    configure_tensorflow_env()
    parser = CommandLineParser(prog="python -m learner.export",
                               description="Export the policy of a checkpoint a run keeps, for impala_rep.evaluate.")
    parser.add_argument("run_dir", help="the run directory (the launcher's --logdir)")
    parser.add_argument("--step", type=int, default=None, metavar="N",
                        help="the checkpoint at learner step N (ckpt-N); default the newest")
    parser.add_argument("--out", default=None, help="where to write the policy (default RUN_DIR/exports/ckpt-N)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.run_dir, args.step, args.out)
    except ExportError as exc:
        print(f"python -m learner.export: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
