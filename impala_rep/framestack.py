"""Frame stacking that is sent once and rebuilt on the learner.

TensorFlow-free (actor side). One rule, used by the env wrapper, the actor and the learner:

  the stacked observation at step t is the concatenation, along the last axis, of the K
  newest frames of the *current episode*, oldest first; at the first step of an episode the
  missing older frames are copies of that first frame.

The actor therefore only needs to send each step's newest frame plus, once per unroll, the
K-1 frames that preceded step 0 (``frame_prefix``); :func:`rebuild_stack` restores exactly
what :class:`FrameStacker` produced on the actor.

Usage::

    stacker = FrameStacker(k=3)
    obs = stacker.push(frame, first=timestep.first())   # [H, W, C*3]
    prefix = stacker.history()                           # [2, H, W, C], before push
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from impala_rep.specs import STEP_FIRST

__all__ = ["FrameStacker", "rebuild_stack"]


class FrameStacker:
    """Keeps the K newest frames of one episode (or of B episodes with ``batch_size``)."""

    def __init__(self, k: int, batch_size: Optional[int] = None):
        if int(k) < 1:
            raise ValueError(f"frame stack depth must be at least 1, got {k}.")
        self.k = int(k)
        self.batch_size = batch_size
        self._frames: Optional[np.ndarray] = None  # [(B,) K, H, W, C]

    def history(self) -> np.ndarray:
        """The K-1 newest frames held now, oldest first: [(B,) K-1, H, W, C].

        Taken just before pushing step 0 of an unroll, this is the unroll's frame prefix.
        """
        if self._frames is None:
            raise ValueError("FrameStacker.history() called before any frame was pushed.")
        if self.batch_size is None:
            return self._frames[1:].copy()
        return self._frames[:, 1:].copy()

    def push(self, frame: np.ndarray, first) -> np.ndarray:
        """Adds the newest frame(s); ``first`` (bool or [B] bools) starts a new episode.

        Returns the stacked observation [(B,) H, W, C*K].
        """
        frame = np.asarray(frame)
        if self.batch_size is None:
            if frame.ndim != 3:
                raise ValueError(f"FrameStacker expects [H, W, C] frames, got shape {frame.shape}.")
            if self._frames is None or bool(first):
                self._frames = np.repeat(frame[None], self.k, axis=0)
            else:
                self._frames = np.concatenate([self._frames[1:], frame[None]], axis=0)
            return _concat_channels(self._frames)
        if frame.ndim != 4 or frame.shape[0] != self.batch_size:
            raise ValueError(
                f"FrameStacker expects [{self.batch_size}, H, W, C] frames, got shape {frame.shape}."
            )
        first = np.broadcast_to(np.asarray(first, dtype=bool), (self.batch_size,))
        if self._frames is None:
            self._frames = np.repeat(frame[:, None], self.k, axis=1)
        else:
            self._frames = np.concatenate([self._frames[:, 1:], frame[:, None]], axis=1)
            if first.any():
                self._frames[first] = np.repeat(frame[first][:, None], self.k, axis=1)
        return _concat_channels(self._frames, axis_k=1)


def _concat_channels(frames: np.ndarray, axis_k: int = 0) -> np.ndarray:
    """[.., K, H, W, C] -> [.., H, W, K*C] (oldest frame in the lowest channels)."""
    moved = np.moveaxis(frames, axis_k, -2)  # [.., H, W, K, C]
    return np.ascontiguousarray(moved.reshape(moved.shape[:-2] + (-1,)))


def rebuild_stack(frames: np.ndarray, prefix: np.ndarray, step_type: np.ndarray) -> np.ndarray:
    """Rebuilds stacked observations from single frames.

    Args:
      frames: [T+1, (B,) H, W, C] newest frame of each step.
      prefix: [K-1, (B,) H, W, C] frames before step 0 (ignored where step 0 is FIRST).
      step_type: [T+1, (B,)] dm_env step types.

    Returns:
      [T+1, (B,) H, W, C*K], equal to what :class:`FrameStacker` produced on the actor.
    """
    frames = np.asarray(frames)
    prefix = np.asarray(prefix)
    step_type = np.asarray(step_type)
    k = prefix.shape[0] + 1
    if k == 1:
        return frames
    steps = frames.shape[0]
    if step_type.shape != frames.shape[: step_type.ndim] or step_type.shape[0] != steps:
        raise ValueError(
            f"step_type shape {step_type.shape} does not match frames shape {frames.shape}."
        )
    if prefix.shape[1:] != frames.shape[1:]:
        raise ValueError(
            f"frame prefix shape {prefix.shape} does not match frames shape {frames.shape}."
        )
    seq = np.concatenate([prefix, frames], axis=0)  # [K-1+T+1, (B,) H, W, C]
    batch_shape = step_type.shape[1:]
    n = int(np.prod(batch_shape, dtype=np.int64))
    seq = seq.reshape((seq.shape[0], n) + frames.shape[1 + len(batch_shape):])
    # Index (into seq) of the first step of the episode each step belongs to; steps before
    # any FIRST inside the unroll belong to an episode that started at or before the prefix.
    idx = np.arange(steps)[:, None] + (k - 1)  # [T+1, 1]
    first = step_type.reshape(steps, n) == STEP_FIRST
    start = np.maximum.accumulate(np.where(first, idx, 0), axis=0)  # [T+1, N]
    column = np.arange(n)[None, :]
    c = seq.shape[-1]
    out = np.empty((steps, n) + seq.shape[2:-1] + (c * k,), dtype=seq.dtype)
    # Copy whole pixels (C channels as one opaque element) rather than single channels, and
    # gather whole frames by indexing the two leading axes: an index broadcast to every
    # pixel (take_along_axis) is about 20x slower for 32 x 21 frames of 84x84x3.
    pixel = np.dtype((np.void, c * seq.dtype.itemsize))
    seq_px = np.ascontiguousarray(seq).view(pixel)[..., 0]  # [K-1+T+1, N, H, W]
    out_px = out.view(pixel)  # [T+1, N, H, W, K]
    for j in range(k):  # oldest frame first
        src = np.maximum(idx - (k - 1 - j), start)  # clamp to the episode's first frame
        out_px[..., j] = seq_px[src, column]
    return out.reshape(frames.shape[:-1] + (c * k,))
