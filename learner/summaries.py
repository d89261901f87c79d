"""Scalar summaries of a metrics record, written in one compiled call.

``tf.summary.scalar`` run eagerly costs about 0.15 ms of CPU per scalar, so the 60-70 scalars
of one learner metrics record took 9 ms of the learner's main thread (measured on the
twenty-first session's 2-core host), once per ``--log-interval``. :class:`ScalarWriter`
compiles one ``tf.function`` per set of names that writes them all from one float32
vector: about 0.5 ms per record after the first (which traces, about 0.2 s).

TensorFlow is imported lazily: importing this module configures nothing.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
from typing import Any, Callable, Dict, List, Mapping, Tuple

import numpy as np

__all__ = ["ScalarWriter", "trim_events_after"]

log = logging.getLogger("impala_rep.learner")


class ScalarWriter:
    """Writes ``{name: number}`` records as scalar summaries at a step.

    Args:
      writer: a ``tf.summary`` writer (``tf.summary.create_file_writer``).
      max_functions: how many distinct sets of names get a compiled writer; a record with a
        set beyond them is written eagerly (same events, slower), so records whose names
        keep changing never grow memory without bound.
    """

    def __init__(self, writer: Any, max_functions: int = 8):
        if int(max_functions) < 0:
            raise ValueError(f"max_functions must be 0 or more, got {max_functions}.")
        self._writer = writer
        self._max = int(max_functions)
        self._functions: Dict[Tuple[str, ...], Callable] = {}

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        """Writes every value of ``values`` as a float32 scalar summary at ``step``."""
        import tensorflow as tf

        names = tuple(values)
        if not names:
            return
        vector = np.array([float(values[n]) for n in names], np.float32)
        function = self._functions.get(names)
        if function is None and len(self._functions) < self._max:
            function = self._functions[names] = self._compile(names)
        if function is not None:
            function(vector, np.int64(step))
            return
        with self._writer.as_default(step=int(step)):
            for name, value in zip(names, vector):
                tf.summary.scalar(name, value)

    @property
    def compiled(self) -> int:
        """How many sets of names have a compiled writer."""
        return len(self._functions)

    def _compile(self, names: Tuple[str, ...]) -> Callable:
        import tensorflow as tf

        writer = self._writer

        @tf.function(
            input_signature=[tf.TensorSpec([len(names)], tf.float32), tf.TensorSpec([], tf.int64)],
            autograph=False,
        )
        def write(vector, step):
            with writer.as_default(step=step):
                for i, name in enumerate(names):
                    tf.summary.scalar(name, vector[i])

        return write


def trim_events_after(directory: str, step: int, aside: str) -> List[str]:
    """Cuts the events after ``step`` out of the event files in ``directory``, for a run
    resumed from a checkpoint at ``step``.

    A run stopped (or killed) after its last checkpoint wrote summaries of training that the
    checkpoint does not hold; the resumed run writes its own at the same steps, and
    TensorBoard's curves would double back over both. Each event file with events after
    ``step`` is moved into ``aside`` (nothing is deleted) and replaced by a copy of its records
    up to ``step``, byte for byte. A file that cannot be read to its end (cut short by a kill)
    keeps what can be read. Returns the names of the files trimmed; a file that cannot be
    trimmed is left as it was, with a warning.
    """
    import tensorflow as tf
    from google.protobuf.message import DecodeError
    from tensorflow.core.util import event_pb2

    trimmed = []
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        kept, later = [], False
        try:
            for record in tf.data.TFRecordDataset(path).as_numpy_iterator():
                if event_pb2.Event.FromString(record).step > step:
                    later = True
                else:
                    kept.append(record)
        except (tf.errors.OpError, DecodeError, ValueError) as exc:  # DataLossError: cut short
            if not later and not kept:
                log.warning("cannot read %s (%s); its events are left as they are", path, exc)
                continue
            later = True  # what follows the damage is dropped with the events after the checkpoint
        if not later:
            continue
        name, tmp = os.path.basename(path), path + ".trimmed"
        kept_whole = os.path.join(aside, name)
        try:
            with tf.io.TFRecordWriter(tmp) as writer:
                for record in kept:
                    writer.write(record)
            os.makedirs(aside, exist_ok=True)
            shutil.copy2(path, kept_whole)  # the original stays in place until the copy is whole
            os.replace(tmp, path)
        except (OSError, tf.errors.OpError) as exc:
            log.warning("cannot cut the events after step %d out of %s (%s); TensorBoard will draw them "
                        "beside the resumed run's", step, path, exc)
            for partial in (tmp, kept_whole):
                if os.path.exists(partial):
                    os.remove(partial)
            continue
        trimmed.append(name)
    return trimmed
