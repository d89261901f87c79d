"""``--capture-spikes N``: what the learner keeps so that a sudden collapse of its policy can
be replayed, step by step, after the run.

The collapse this is for (docs/RESULTS.md, sixty-second session): in two walker-walk hours the
policy's entropy jumped from 0.6-0.8 to 6.4 and the value head's mean from about 60 to 3 within
one 30-second logging window, and both came back a minute later. The metrics of the run cannot
say which update did it, nor why; replaying the updates from a state before it can.

:class:`SpikeCapture` keeps, in memory, the learner's full state (the same objects as its
checkpoints) from at least N and fewer than 2N learner steps ago, written to TensorFlow's
``ram://`` file system every N steps, and a copy of every batch trained on since. When a step's
entropy (``entropy_mean``, measured on its batch before its update) rises above the median of
the kept steps' by more than :data:`ENTROPY_RISE` nats and more than that median, it writes
them out to
``LOGDIR/captures/step-S/`` (S: the learner step of that update):

- ``checkpoint/`` the state before the first kept update (``tf.train.Checkpoint`` files);
- ``batches.npz`` each kept update's batch, as ``<i>/<key>`` arrays;
- ``steps.json`` each kept update's learner step, seconds trained (the learning rate anneals
  over them) and metrics as the run computed them;
- ``config.json`` and ``env_spec.json``: the run's settings and its env's spec, which
  ``scripts/replay_capture.py`` rebuilds the learner step from.

Training goes on after a capture; the next may come once N more steps have passed, and at most
:data:`MAX_CAPTURES` per process. The memory it takes is about 2N batches (a walker-walk batch
of 16 unrolls is 7.4 MB); each kept batch is a copy (a batch's arrays may be a buffer the
batcher refills), and each snapshot a checkpoint write to memory.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import shutil
import tempfile
from typing import Any, Deque, Dict, List, Mapping, Optional, Tuple

import numpy as np

log = logging.getLogger("impala_rep.learner")

__all__ = ["ENTROPY_RISE", "MAX_CAPTURES", "SpikeCapture", "read_capture"]

# A step whose entropy is above the kept steps' median by this many nats, and by as much as that
# median (so, where it is positive, at least twice it), is a collapse. The policy's entropy falls
# as it learns; late in a walker-walk hour it moves by a few tenths between batches (0.5-0.9
# nats for 6 actions of 11 bins), and the collapse raised it from 0.7 to 6.4. Early on it moves
# more: at 4 minutes (sixty-third session) it went between 3.5 and 5.6 over 24 steps and then to
# 6.7, which a rise of 1 nat alone took for a collapse; and at 0.4-0.5M agent steps a 30-second
# window's highest reached 2.4 over steps that ended it at 1.0. The median, not the highest:
# the sixty-fourth session's collapse (30-second windows whose highest had been 1.2-2.4, then one
# that ended at 8.4, and the greedy policy saved within it scored 35) made no capture under the
# highest with a rise of 1 nat: so it rose over several steps, none past twice the highest before
# it, which keeps the highest right behind the rise; the median of 16 to 32 steps does not follow.
ENTROPY_RISE = 2.0
# Captures written per learner process at most (each is about 2N batches on disk).
MAX_CAPTURES = 3

_ids = itertools.count()


class SpikeCapture:
    """Keeps the last ``history`` to ``2 * history`` learner updates replayable (module docstring).

    ``checkpoint`` is the trainer's ``tf.train.Checkpoint``; ``describe`` maps the names of the
    files every capture holds besides the state and batches (``config.json``,
    ``env_spec.json``) to their text.
    """

    def __init__(self, checkpoint: Any, logdir: str, history: int, describe: Mapping[str, str],
                 options: Any = None, rise: float = ENTROPY_RISE, max_captures: int = MAX_CAPTURES):
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"capture-spikes must be a positive number of learner steps, got {history!r}.")
        self.history = history
        self.rise = float(rise)
        self.max_captures = int(max_captures)
        self._checkpoint = checkpoint
        self._options = options
        self._describe = dict(describe)
        self._dir = os.path.join(logdir, "captures")
        self._ram = f"ram://impala_rep-capture-{os.getpid()}-{next(_ids)}"
        # (learner step the state is at, checkpoint prefix), oldest first: at most two.
        self._snapshots: Deque[Tuple[int, str]] = collections.deque()
        # One per kept update, oldest first: (learner step before it, batch copy, step record).
        self._kept: Deque[Tuple[int, Dict[str, np.ndarray], Dict[str, Any]]] = collections.deque()
        self._pending: Optional[Tuple[int, Dict[str, np.ndarray], float]] = None
        self._quiet_until = -1  # no capture at or before this learner step (one was just written)
        self.captured: List[str] = []

    def before_step(self, learner_step: int, tensors: Mapping[str, Any], train_seconds: float) -> None:
        """Called with the batch of the update about to run on the state at ``learner_step``."""
        import tensorflow as tf

        if self._kept and self._kept[-1][0] != learner_step - 1 or (
                self._pending is not None and self._pending[0] != learner_step):
            self._reset()  # a step went by without this seeing it: the kept updates no longer follow on
        if not self._snapshots or learner_step - self._snapshots[-1][0] >= self.history:
            prefix = self._checkpoint.write(f"{self._ram}/{learner_step}/state", options=self._options)
            self._snapshots.append((learner_step, prefix))
            if len(self._snapshots) > 2:
                old_step, _ = self._snapshots.popleft()
                tf.io.gfile.rmtree(f"{self._ram}/{old_step}")
            first = self._snapshots[0][0]
            while self._kept and self._kept[0][0] < first:
                self._kept.popleft()
        self._pending = (learner_step, {k: np.array(v, copy=True) for k, v in tensors.items()}, float(train_seconds))

    def after_step(self, metrics: Mapping[str, Any]) -> Optional[str]:
        """Called with the metrics of the update :meth:`before_step` announced; returns the
        capture's directory when this update's entropy made one."""
        if self._pending is None:
            return None
        learner_step, tensors, seconds = self._pending
        self._pending = None
        values = {k: float(np.asarray(v)) for k, v in metrics.items()}
        record = {"learner_step": learner_step, "train_seconds": seconds, "metrics": values}
        entropy = values.get("entropy_mean")
        kept = [r["metrics"]["entropy_mean"] for _, _, r in self._kept if "entropy_mean" in r["metrics"]]
        baseline = float(np.median(kept)) if kept else None
        self._kept.append((learner_step, tensors, record))
        if (entropy is None or baseline is None or not self.is_collapse(entropy, baseline)
                or learner_step <= self._quiet_until or len(self.captured) >= self.max_captures):
            return None
        try:
            path = self._write(learner_step + 1)
        except OSError as exc:
            log.warning("the policy's entropy rose from a median of %.3g to %.3g nats at learner step %d, but its capture "
                        "could not be written (%s); training goes on.", baseline, entropy, learner_step + 1, exc)
            return None
        finally:
            self._quiet_until = learner_step + self.history
        self.captured.append(path)
        log.warning("the policy's entropy rose from a median of %.3g to %.3g nats at learner step %d: the %d updates "
                    "up to it and the state before them are in %s (replay them with python "
                    "scripts/replay_capture.py %s)", baseline, entropy, learner_step + 1, len(self._kept), path, path)
        return path

    def is_collapse(self, entropy: float, baseline: float) -> bool:
        """Whether a step's ``entropy`` is a collapse after kept steps whose median was ``baseline``."""
        return entropy > baseline + max(self.rise, abs(baseline))

    def _write(self, step: int) -> str:
        """Writes the oldest snapshot and every kept update to captures/step-<step>, atomically."""
        import tensorflow as tf

        first, prefix = self._snapshots[0]
        os.makedirs(self._dir, exist_ok=True)
        final = os.path.join(self._dir, f"step-{step}")
        tmp = tempfile.mkdtemp(prefix=f".step-{step}-", dir=self._dir)
        try:
            os.makedirs(os.path.join(tmp, "checkpoint"))
            folder, stem = prefix.rsplit("/", 1)
            for name in tf.io.gfile.listdir(folder):
                if name.startswith(stem + "."):
                    tf.io.gfile.copy(f"{folder}/{name}", os.path.join(tmp, "checkpoint", name))
            kept = list(self._kept)  # all from the oldest snapshot on: before_step drops older ones
            np.savez(os.path.join(tmp, "batches.npz"),
                     **{f"{i}/{key}": array for i, (_, tensors, _) in enumerate(kept) for key, array in tensors.items()})
            with open(os.path.join(tmp, "steps.json"), "w") as f:
                json.dump({"state_learner_step": first, "checkpoint": f"checkpoint/{stem}",
                           "steps": [record for _, _, record in kept]}, f, indent=1)
            for name, text in self._describe.items():
                with open(os.path.join(tmp, name), "w") as f:
                    f.write(text)
            if os.path.exists(final):  # a resumed run reaching the same step again: the newer replaces it
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def _reset(self) -> None:
        import tensorflow as tf

        self._snapshots.clear()
        self._kept.clear()
        self._pending = None
        if tf.io.gfile.exists(self._ram):
            tf.io.gfile.rmtree(self._ram)

    def close(self) -> None:
        """Frees the memory it holds (the snapshots in ``ram://`` and the kept batches)."""
        self._reset()


def read_capture(path: str) -> Tuple[Dict[str, Any], List[Dict[str, np.ndarray]]]:
    """``(steps, batches)`` of a capture directory: ``steps.json`` and each kept update's batch."""
    try:
        with open(os.path.join(path, "steps.json")) as f:
            steps = json.load(f)
        with np.load(os.path.join(path, "batches.npz")) as data:
            batches: List[Dict[str, np.ndarray]] = [{} for _ in steps["steps"]]
            for name in data.files:
                index, key = name.split("/", 1)
                batches[int(index)][key] = data[name]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise ValueError(f"{path} is not a whole capture of --capture-spikes (steps.json and batches.npz "
                         f"in a captures/step-S directory of a run): {exc}.") from None
    if any(not b for b in batches):
        raise ValueError(f"{path}: batches.npz lacks some of the updates steps.json lists; the capture is damaged.")
    return steps, batches


# The loss settings a replay can change (RunConfig.loss keys, the learner's flags of those names).
REPLAY_LOSS_KEYS = ("baseline_cost", "entropy_cost", "reward_scale", "baseline_torso_scale", "popart",
                    "popart_terms")
# Those of them that are words (LossConfig checks them), the rest numbers.
REPLAY_LOSS_WORDS = ("popart_terms",)


def layer_of(name: str) -> str:
    """The layer a parameter belongs to (``torso/pixels/conv_0/kernel`` -> ``torso/pixels/conv_0``)."""
    return name.rsplit("/", 1)[0]


def replay_capture(path: str, learner: str = "cpu", learning_rate: Optional[float] = None,
                   clip_norm: Optional[float] = None, loss: Optional[Mapping[str, float]] = None,
                   ) -> Tuple[List[Dict[str, Any]], Dict[str, np.ndarray]]:
    """Replays a capture's updates from its state: ``(rows, params)``, one row per update in
    order, and the network's parameters after the last.

    Each row holds the update's ``learner_step`` (the state it ran on), its metrics as the run
    recorded them (``recorded``) and as the replay computes them (``replayed``), the metrics
    of the capture's last batch (the one whose entropy made it) on the state before the update
    (``last_batch``: whether that batch's entropy comes from the updates before it, or from the
    batch, whose states the policy may be less sure of, whatever the updates), and for each
    layer the norm of the update's change to its parameters over their norm before it
    (``update``), and the mean change of its kernel's weights over their mean magnitude before
    it (``shift``: positive when the update raised them all together, which scales up what the
    layer passes on; in walker-walk captures this moved with the value head's error and the
    policy's entropy against it, docs/RESULTS.md). ``learning_rate`` and ``clip_norm``
    replace the run's, and ``loss`` some of its loss settings (:data:`REPLAY_LOSS_KEYS`: the
    run's ``--baseline-cost`` and so on), to see whether the collapse happens without its
    settings; the learning rate is the one before any annealing (the run's seconds trained are
    replayed as they were)."""
    import dataclasses

    import tensorflow as tf

    from impala_rep.config import RunConfig
    from impala_rep.replicator import make_replicator
    from impala_rep.specs import EnvSpec
    from learner.run import make_learner_step

    steps, batches = read_capture(path)
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = RunConfig.from_json(json.load(f))
        with open(os.path.join(path, "env_spec.json")) as f:
            env_spec = EnvSpec.from_json(json.load(f))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: its config.json or env_spec.json cannot be read ({exc}); the capture is damaged.") \
            from None
    optimizer = dict(config.optimizer)
    if learning_rate is not None:
        optimizer["learning_rate"] = float(learning_rate)
    if clip_norm is not None:
        optimizer["clip_norm"] = float(clip_norm)
    unknown = sorted(set(loss or {}) - set(REPLAY_LOSS_KEYS))
    if unknown:
        raise ValueError(f"a replay can change the loss's {', '.join(REPLAY_LOSS_KEYS)}, not {', '.join(unknown)}.")
    loss_settings = dict(config.loss, **{k: v if k in REPLAY_LOSS_WORDS else float(v)
                                         for k, v in (loss or {}).items()})
    config = dataclasses.replace(config, optimizer=optimizer, loss=loss_settings, learner=learner,
                                 replicas=config.replicas if learner == "cpu" == config.learner else None)
    step = make_learner_step(config, env_spec, make_replicator(learner, num_replicas=config.replicas))
    prefix = os.path.join(path, steps["checkpoint"])
    state = tf.train.Checkpoint(**step.checkpoint_objects())
    state.read(prefix).expect_partial()
    step.restore_configured_learning_rate()
    if int(step.step.numpy()) != steps["state_learner_step"]:
        raise ValueError(f"{path}: its checkpoint is at learner step {int(step.step.numpy())}, not the "
                         f"{steps['state_learner_step']} steps.json says; the capture is damaged.")
    rows = []
    scratch = f"ram://impala_rep-replay-{os.getpid()}-{next(_ids)}"
    before = {k: np.array(v, copy=True) for k, v in step.get_params()[1].items()}
    for record, batch in zip(steps["steps"], batches):
        if int(step.step.numpy()) != record["learner_step"]:
            raise ValueError(f"{path}: steps.json's updates do not follow on from one another at learner step "
                             f"{record['learner_step']}; the capture is damaged.")
        step.set_train_seconds(record["train_seconds"])
        # The last batch's metrics on this state: an update on it, undone.
        # (A fresh path each time: TensorFlow's ram:// file system does not truncate a file
        # written again, and the checkpoint read back failed its checksum.)
        held = state.write(f"{scratch}/{record['learner_step']}/state")
        last_batch = {k: float(np.asarray(v)) for k, v in step.train(batches[-1]).items()}
        state.read(held).assert_consumed()
        tf.io.gfile.rmtree(f"{scratch}/{record['learner_step']}")
        metrics, (_, params) = step.train_and_read(batch)
        after = {k: np.array(v, copy=True) for k, v in params.items()}
        change: Dict[str, List[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
        for name, value in before.items():
            sums = change[layer_of(name)]
            delta = after[name].astype(np.float64) - value
            sums[0] += float(np.sum(np.square(delta)))
            sums[1] += float(np.sum(np.square(value.astype(np.float64))))
            if name.endswith("/kernel"):  # the kernel's shift, all its weights together
                sums[2] += float(np.sum(delta))
                sums[3] += float(np.sum(np.abs(value)))
        rows.append({
            "learner_step": record["learner_step"],
            "recorded": record["metrics"],
            "replayed": {k: float(np.asarray(v)) for k, v in metrics.items()},
            "last_batch": last_batch,
            "update": {layer: float(np.sqrt(d / n)) if n > 0 else float(np.sqrt(d)) for layer, (d, n, _, _) in
                       sorted(change.items())},
            "shift": {layer: total / size for layer, (_, _, total, size) in sorted(change.items()) if size > 0},
        })
        before = after
    return rows, before
