"""A stand-in for the trainer's batcher in tests that drive ``Trainer.train`` directly."""

from __future__ import annotations

import time
from typing import Optional, Tuple

import numpy as np

from impala_rep.config import RunConfig
from learner.batcher import Batch

STEP_AGENT_STEPS = 4 * 5  # a catch_config trainer's batch size x unroll length


def catch_config(logdir, **kwargs) -> RunConfig:
    """A small run of ``catch`` (batches of 4 unrolls of 5 steps) in ``logdir``: no budget to
    speak of and no progress record before 60 s unless the caller says otherwise."""
    kwargs.setdefault("total_steps", 10**9)
    kwargs.setdefault("log_interval_s", 60.0)
    return RunConfig(env=kwargs.pop("env", "catch"), logdir=str(logdir), batch_size=4, unroll_length=5, **kwargs)


class FixedBatches:
    """``n`` random batches of the trainer's batch spec, then none (``TimeoutError`` after
    ``idle`` seconds, else the caller's timeout). ``episode``: ``(return, length)`` of one
    episode each batch reports finished (default: none)."""

    def __init__(self, spec, n: int, batch_size: int = 4, seed: int = 0,
                 episode: Optional[Tuple[float, int]] = None, idle: Optional[float] = None):
        rng = np.random.default_rng(seed)
        self.idle = idle
        self.batches = []
        returns, lengths = (np.array([episode[0]]), np.array([episode[1]], np.int64)) if episode else (
            np.zeros(0), np.zeros(0, np.int64))
        for _ in range(n):
            tensors = {}
            for key, s in spec.items():
                if key == "step_type":
                    tensors[key] = np.ones(s.shape, np.uint8)
                elif key == "discount":
                    tensors[key] = np.ones(s.shape, np.float32)
                elif s.num_values is not None:
                    tensors[key] = rng.integers(0, s.num_values, s.shape).astype(s.dtype)
                elif np.dtype(s.dtype).kind in "ui":
                    tensors[key] = rng.integers(0, 2, s.shape).astype(s.dtype)
                else:
                    tensors[key] = (rng.normal(size=s.shape) - (3.0 if key == "behaviour_log_prob" else 0.0)).astype(s.dtype)
            tensors["policy_version"] = np.zeros(batch_size, np.int64)
            self.batches.append(Batch(tensors, returns, lengths, []))

    def next_batch(self, timeout=None):
        if not self.batches:
            time.sleep(self.idle if self.idle is not None else (timeout or 0))
            raise TimeoutError
        return self.batches.pop(0)

    def close(self):
        pass
