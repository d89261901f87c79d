"""Scalar summaries of a metrics record, written in one compiled call.

``tf.summary.scalar`` run eagerly costs about 0.15 ms of CPU per scalar, so the 60-70 scalars
of one learner metrics record took 9 ms of the learner's main thread (measured on the
twenty-first session's 2-core host), once per ``--log-interval``. :class:`ScalarWriter`
compiles one ``tf.function`` per set of names that writes them all from one float32
vector: about 0.5 ms per record after the first (which traces, about 0.2 s).

TensorFlow is imported lazily: importing this module configures nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Tuple

import numpy as np

__all__ = ["ScalarWriter"]


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
