"""Frame stacking that is sent once and rebuilt on the learner.

TensorFlow-free (actor side). One rule, used by the env wrapper, the actor and the learner:

  the stacked observation at step t is the concatenation, along the last axis, of the K
  newest frames of the *current episode*, oldest first; at the first step of an episode the
  missing older frames are copies of that first frame.

The actor therefore only needs to send each step's newest frame plus, once per unroll, the
K-1 frames that preceded step 0 (``frame_prefix``); :func:`rebuild_stack` restores exactly
what :class:`FrameStacker` produced on the actor. The learner does not build the stacks: its
network takes the single frames and stacks them in its graph by the same rule
(``impala_rep.networks.tf_backend.stack_sources``); :func:`rebuild_stack` is the NumPy
statement of the rule, for tests and for reading batches.

Usage::

    stacker = FrameStacker(k=3)
    obs = stacker.push(frame, first=timestep.first())   # [H, W, C*3]
    prefix = stacker.history()                           # [2, H, W, C], before push
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from impala_rep.specs import STEP_FIRST

__all__ = ["FrameStacker", "FrameHistory", "rebuild_stack", "aligned_empty", "ALIGNMENT"]

# TensorFlow's CPU tensors must start on a 64-byte boundary (Eigen's EIGEN_MAX_ALIGN_BYTES);
# the learner hands arrays so aligned to TensorFlow without a copy (learner.step).
ALIGNMENT = 64


def aligned_empty(shape, dtype, alignment: int = ALIGNMENT) -> np.ndarray:
    """``np.empty(shape, dtype)`` whose data starts on an ``alignment``-byte boundary.

    NumPy's own large allocations start 16 bytes past a page boundary, which TensorFlow
    cannot use in place.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


class FrameStacker:
    """Keeps the K newest frames of one episode (or of B episodes with ``batch_size``).

    The stacked observation itself is the state: each push shifts every pixel's K*C values
    by C and writes the new frame into the newest C. The shift is one strided copy of
    ``(K-1)*C``-element blocks (viewed as opaque bytes), about 6x faster than rebuilding the
    stack from a [K, H, W, C] history for 16 frames of 84x84x3.
    """

    def __init__(self, k: int, batch_size: Optional[int] = None):
        if int(k) < 1:
            raise ValueError(f"frame stack depth must be at least 1, got {k}.")
        self.k = int(k)
        self.batch_size = batch_size
        # [B, H, W, K*C] (B=1 without batch_size), and the buffer the next push writes to.
        self._stack: Optional[np.ndarray] = None
        self._spare: Optional[np.ndarray] = None

    def history(self) -> np.ndarray:
        """The K-1 newest frames held now, oldest first: [(B,) K-1, H, W, C].

        Taken just before pushing step 0 of an unroll, this is the unroll's frame prefix.
        """
        if self._stack is None:
            raise ValueError("FrameStacker.history() called before any frame was pushed.")
        b, h, w, kc = self._stack.shape
        frames = self._stack.reshape(b, h, w, self.k, kc // self.k)[:, :, :, 1:]  # [B, H, W, K-1, C]
        hist = np.ascontiguousarray(np.moveaxis(frames, 3, 1))  # [B, K-1, H, W, C]
        return hist if self.batch_size is not None else hist[0]

    def push(self, frame: np.ndarray, first) -> np.ndarray:
        """Adds the newest frame(s); ``first`` (bool or [B] bools) starts a new episode.

        Returns the stacked observation [(B,) H, W, C*K] (a new array each call).
        """
        frame = np.asarray(frame)
        if self.batch_size is None:
            if frame.ndim != 3:
                raise ValueError(f"FrameStacker expects [H, W, C] frames, got shape {frame.shape}.")
            return self._push(frame[None], np.array([bool(first)]))[0]
        if frame.ndim != 4 or frame.shape[0] != self.batch_size:
            raise ValueError(
                f"FrameStacker expects [{self.batch_size}, H, W, C] frames, got shape {frame.shape}."
            )
        return self._push(frame, np.broadcast_to(np.asarray(first, dtype=bool), (self.batch_size,)))

    def _push(self, frame: np.ndarray, first: np.ndarray) -> np.ndarray:
        frame = np.ascontiguousarray(frame)
        stack = self._stack
        if stack is None:
            self._stack = np.concatenate([frame] * self.k, axis=-1)
            self._spare = np.empty_like(self._stack)
            return self._stack.copy()
        if stack.shape[:3] + (stack.shape[3] // self.k,) != frame.shape or stack.dtype != frame.dtype:
            raise ValueError(
                f"FrameStacker got a frame of shape {frame.shape[1:]} and dtype {frame.dtype} after frames "
                f"of shape {stack.shape[1:3] + (stack.shape[3] // self.k,)} and dtype {stack.dtype}."
            )
        out = self._spare
        _shift_in(stack, out, frame, self.k)
        if first.any():
            out[first] = np.concatenate([frame[first]] * self.k, axis=-1)
        self._stack, self._spare = out, stack
        return out.copy()


class FrameHistory:
    """The K newest frames of each of B episodes, by the stacking rule, held by reference.

    Where :class:`FrameStacker` builds the stacked observation, this keeps the K per-step
    batches ``[B, ...]`` themselves (a list, oldest first), so a push costs no copy: the
    batches are shared with the caller, who must not modify one after pushing it. Where an
    episode starts, the older entries of those rows become copies of the new frame (the older
    batches are copied first, so a shared batch is never written). Any per-frame batch works,
    not only pixels.
    """

    def __init__(self, k: int):
        if int(k) < 1:
            raise ValueError(f"frame stack depth must be at least 1, got {k}.")
        self.k = int(k)
        self._items: Optional[List[np.ndarray]] = None

    @property
    def empty(self) -> bool:
        return self._items is None

    def items(self) -> List[np.ndarray]:
        """The K batches, oldest first (the stack of row b is their row b, in order)."""
        if self._items is None:
            raise ValueError("FrameHistory.items() called before any frame was pushed.")
        return list(self._items)

    def push(self, frames: np.ndarray, first: np.ndarray) -> None:
        """Adds the newest batch; ``first`` [B] bools mark rows that start an episode."""
        first = np.asarray(first, dtype=bool)
        if first.shape != frames.shape[:1]:
            raise ValueError(f"first must have shape [{frames.shape[0]}], got {list(first.shape)}.")
        if self._items is None:
            self._items = [frames] * self.k
            return
        old = self._items[-1]
        if frames.shape != old.shape or frames.dtype != old.dtype:
            raise ValueError(
                f"FrameHistory got a batch of shape {frames.shape} and dtype {frames.dtype} after "
                f"batches of shape {old.shape} and dtype {old.dtype}."
            )
        items = self._items[1:] + [frames]
        if first.any():
            for i in range(self.k - 1):
                items[i] = items[i].copy()
                items[i][first] = frames[first]
        self._items = items


def _shift_in(src: np.ndarray, dst: np.ndarray, frame: np.ndarray, k: int) -> None:
    """dst = src's newest K-1 frames followed by ``frame``; all C-contiguous, [B, H, W, K*C]."""
    pixels = frame.size // frame.shape[-1]
    frame_bytes = frame.shape[-1] * frame.itemsize
    pixel_bytes = k * frame_bytes

    def column(array: np.ndarray, first_frame: int, frames: int) -> np.ndarray:
        # Frames [first_frame, first_frame + frames) of every pixel, each run one opaque item.
        return np.ndarray((pixels,), np.dtype((np.void, frames * frame_bytes)), buffer=array,
                          offset=first_frame * frame_bytes, strides=(pixel_bytes,))

    if k > 1:
        column(dst, 0, k - 1)[...] = column(src, 1, k - 1)
    column(dst, k - 1, 1)[...] = frame.reshape(-1).view(np.dtype((np.void, frame_bytes)))


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
    batch_shape = step_type.shape[1:]
    n = int(np.prod(batch_shape, dtype=np.int64))
    pixel_shape = frames.shape[1 + len(batch_shape):]  # [H, W, C]
    frames = np.ascontiguousarray(frames).reshape((steps, n) + pixel_shape)
    prefix = prefix.reshape((k - 1, n) + pixel_shape)
    first = step_type.reshape(steps, n) == STEP_FIRST
    out = aligned_empty((steps, n) + pixel_shape[:-1] + (pixel_shape[-1] * k,), frames.dtype)
    # Step 0: the prefix frames then frame 0, or K copies of frame 0 where it is FIRST.
    out[0] = np.concatenate([np.where(first[0].reshape((n,) + (1,) * len(pixel_shape)), frames[0], p) for p in prefix]
                            + [frames[0]], axis=-1)
    # Later steps: the actor's rule, one strided shift per step (FrameStacker's _shift_in),
    # and K copies of the frame where an episode starts.
    for t in range(1, steps):
        _shift_in(out[t - 1], out[t], frames[t], k)
        if first[t].any():
            out[t][first[t]] = np.concatenate([frames[t][first[t]]] * k, axis=-1)
    return out.reshape(step_type.shape + pixel_shape[:-1] + (pixel_shape[-1] * k,))
