"""Time-major batches from the unroll queue (TensorFlow-free).

A batch of B unrolls (each T+1 steps) is a flat ``dict[str, np.ndarray]``:

  ``observation/<key>``   [T+1, B, ...]   keys that are not frame-stacked
  ``frames/<key>``        [T+K, B, H, W, C]  frame-stacked keys: the unroll's K-1
                                          ``frame_prefix/<key>`` frames, then its T+1 frames;
                                          the learner's network stacks them (by the rule of
                                          :mod:`impala_rep.framestack`) without building the
                                          [T+1, B, H, W, C*K] stack
  ``step_type``           [T+1, B] uint8
  ``reward``, ``discount``, ``behaviour_log_prob``   [T+1, B] float32
  ``action``              [T+1, B, *action]
  ``core_state/<name>``   [B, ...]
  ``policy_version``      [B] int64      parameter version that produced each unroll

ready for ``Replicator.distribute(batch, axis=1)``. Episode returns and lengths of episodes
that finished in the batch's unrolls travel beside it (:class:`Batch`).

Usage::

    batcher = Batcher(unroll_queue, unroll_spec, frame_stack={"pixels": 3}, batch_size=32)
    batch = batcher.next_batch(timeout=60)
    metrics = learner.train(batch.tensors)
    lag = policy_lag(batch.tensors["policy_version"], params.version)
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

from impala_rep.config import replayed_per_batch
from impala_rep.framestack import aligned_empty
from impala_rep.specs import ArraySpec
from learner.queue import UnrollQueue
from learner.validation import ValidUnroll

__all__ = ["Batch", "Batcher", "PrefetchingBatcher", "ReplayBuffer", "batch_layout", "batch_unrolls", "policy_lag"]


@dataclasses.dataclass(frozen=True)
class Batch:
    """One learner batch plus what metrics need."""

    tensors: Dict[str, np.ndarray]
    episode_returns: np.ndarray  # [E] float64, episodes that finished in the fresh unrolls
    episode_lengths: np.ndarray  # [E] int64
    actor_ids: List[str]
    fresh_unrolls: Optional[int] = None  # unrolls new from the queue (the rest replayed); None: all

    @property
    def fresh(self) -> int:
        """Unrolls in this batch that come straight from the actors (not replayed)."""
        return self.batch_size if self.fresh_unrolls is None else self.fresh_unrolls

    @property
    def batch_size(self) -> int:
        return int(self.tensors["policy_version"].shape[0])


def _is_per_step(key: str) -> bool:
    return not key.startswith("core_state/") and not key.startswith("frame_prefix/")


def batch_layout(
    unroll_spec: Mapping[str, ArraySpec],
    batch_size: int,
    frame_stack: Optional[Mapping[str, int]] = None,
) -> Dict[str, tuple]:
    """``{key: (shape, dtype)}`` of the arrays :func:`batch_unrolls` returns for ``batch_size``
    unrolls (see module docstring), ``policy_version`` included."""
    frame_stack = {k: int(v) for k, v in (frame_stack or {}).items() if int(v) > 1}
    b = int(batch_size)
    out: Dict[str, tuple] = {}
    for key, spec in unroll_spec.items():
        if key.startswith("frame_prefix/"):
            continue
        dtype = np.dtype(spec.dtype)
        obs_key = key.split("/", 1)[1] if key.startswith("observation/") else None
        if obs_key in frame_stack:
            out[f"frames/{obs_key}"] = ((spec.shape[0] + frame_stack[obs_key] - 1, b) + tuple(spec.shape[1:]), dtype)
        elif _is_per_step(key):
            out[key] = ((spec.shape[0], b) + tuple(spec.shape[1:]), dtype)
        else:
            out[key] = ((b,) + tuple(spec.shape), dtype)
    out["policy_version"] = ((b,), np.dtype(np.int64))
    return out


def batch_unrolls(
    unrolls: Sequence[ValidUnroll],
    unroll_spec: Mapping[str, ArraySpec],
    frame_stack: Optional[Mapping[str, int]] = None,
    out: Optional[Mapping[str, np.ndarray]] = None,
) -> Batch:
    """Stacks validated unrolls into a time-major :class:`Batch` (see module docstring).

    ``out``: arrays of :func:`batch_layout`'s shapes and dtypes to write into (for example a
    slot of shared memory, :mod:`learner.intake`) instead of new ones.
    """
    if not unrolls:
        raise ValueError("batch_unrolls needs at least one unroll.")
    frame_stack = {k: int(v) for k, v in (frame_stack or {}).items() if int(v) > 1}
    layout = batch_layout(unroll_spec, len(unrolls), frame_stack)
    if out is None:
        arrays = {key: aligned_empty(shape, dtype) for key, (shape, dtype) in layout.items()}  # TF reads them in place
    else:
        arrays = dict(out)
        for key, (shape, dtype) in layout.items():
            have = arrays.get(key)
            if have is None or have.shape != shape or have.dtype != dtype:
                raise ValueError(
                    f"batch_unrolls(out=...) needs {key!r} of shape {shape} and dtype {dtype.name}, got "
                    + ("none" if have is None else f"{have.shape} {have.dtype.name}") + ".")
    for key in layout:
        arr = arrays[key]
        if key == "policy_version":
            arr[:] = [u.policy_version for u in unrolls]
        elif key.startswith("frames/"):
            # [T+K, B, H, W, C]: prefix then frames, each unroll's written once (no stack built).
            obs_key = key.split("/", 1)[1]
            k, frames_key, prefix_key = frame_stack[obs_key], f"observation/{obs_key}", f"frame_prefix/{obs_key}"
            for i, u in enumerate(unrolls):
                arr[:k - 1, i] = u.tensors[prefix_key]
                arr[k - 1:, i] = u.tensors[frames_key]
        elif _is_per_step(key):
            for i, u in enumerate(unrolls):
                arr[:, i] = u.tensors[key]
        else:
            for i, u in enumerate(unrolls):
                arr[i] = u.tensors[key]
    returns, lengths = _episodes(unrolls)
    return Batch(tensors={k: arrays[k] for k in layout}, episode_returns=returns, episode_lengths=lengths,
                 actor_ids=[u.actor_id for u in unrolls])


def _episodes(unrolls: Sequence[ValidUnroll]):
    """Returns and lengths of the episodes that finished in ``unrolls``: ([E] float64, [E] int64)."""
    returns = [u.episode_returns for u in unrolls if u.episode_returns.size]
    lengths = [u.episode_lengths for u in unrolls if u.episode_lengths.size]
    return (np.concatenate(returns) if returns else np.zeros([0], np.float64),
            np.concatenate(lengths) if lengths else np.zeros([0], np.int64))


class ReplayBuffer:
    """The ``capacity`` newest unrolls trained on, sampled uniformly (IMPALA's experience replay).

    Bound: ``capacity`` unrolls; adding to a full buffer drops the oldest. Sampling draws
    without replacement within one call.
    """

    def __init__(self, capacity: int, seed: int = 0):
        if int(capacity) < 1:
            raise ValueError(f"replay capacity must be at least 1 unroll, got {capacity}.")
        self.capacity = int(capacity)
        self._items: "collections.deque[ValidUnroll]" = collections.deque(maxlen=self.capacity)
        self._rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, unrolls: Sequence[ValidUnroll]) -> None:
        self._items.extend(unrolls)

    def sample(self, n: int) -> List[ValidUnroll]:
        """``min(n, len(self))`` distinct unrolls, uniformly at random."""
        n = min(int(n), len(self._items))
        if n <= 0:
            return []
        return [self._items[i] for i in self._rng.choice(len(self._items), size=n, replace=False)]


class Batcher:
    """Takes ``batch_size`` unrolls at a time from the queue and stacks them.

    With ``replay_ratio`` R > 0, ``round(R * batch_size)`` of each batch's unrolls are drawn
    from a :class:`ReplayBuffer` of the ``replay_capacity`` (default 8 batches) newest unrolls
    trained on before (fewer while it fills) and
    the rest come fresh from the queue; every batch has at least one fresh unroll. Replayed
    unrolls keep the behaviour log-probabilities they were acted with, so V-trace corrects
    for their older policies. The batch's episode returns, and ``Batch.fresh``, count only
    the fresh unrolls.

    Bound: holds one batch at a time (the caller's) plus the replay buffer; ``batch_size``
    must not exceed the queue's capacity.
    """

    def __init__(
        self,
        unroll_queue: UnrollQueue,
        unroll_spec: Mapping[str, ArraySpec],
        batch_size: int,
        frame_stack: Optional[Mapping[str, int]] = None,
        replay_ratio: float = 0.0,
        replay_capacity: Optional[int] = None,
        seed: int = 0,
    ):
        if not 1 <= int(batch_size) <= unroll_queue.capacity:
            raise ValueError(
                f"batch_size must be in [1, queue capacity {unroll_queue.capacity}], got {batch_size}."
            )
        if not 0 <= replay_ratio < 1:
            raise ValueError(f"replay_ratio must be at least 0 and below 1, got {replay_ratio}.")
        for key, k in (frame_stack or {}).items():
            if int(k) > 1 and f"frame_prefix/{key}" not in unroll_spec:
                raise ValueError(
                    f"frame_stack stacks {key!r} but the unroll spec has no 'frame_prefix/{key}'; "
                    "build the spec with impala_rep.specs.unroll_spec(..., frame_stack=...)."
                )
        self.queue = unroll_queue
        self.unroll_spec = dict(unroll_spec)
        self.batch_size = int(batch_size)
        self.frame_stack = dict(frame_stack or {})
        self.replay_per_batch = replayed_per_batch(self.batch_size, replay_ratio)
        self.replay: Optional[ReplayBuffer] = None
        if self.replay_per_batch > 0:
            self.replay = ReplayBuffer(replay_capacity or 8 * self.batch_size, seed=seed)

    def next_batch(self, timeout: Optional[float] = None, out: Optional[Mapping[str, np.ndarray]] = None) -> Batch:
        """Blocks for the batch's fresh unrolls; ``TimeoutError``/``QueueClosed`` as the queue.
        ``out``: arrays to write the batch into (:func:`batch_unrolls`)."""
        if self.replay is None:
            return batch_unrolls(self.queue.get_many(self.batch_size, timeout=timeout), self.unroll_spec,
                                 self.frame_stack, out=out)
        replayed_n = min(self.replay_per_batch, len(self.replay))
        fresh = self.queue.get_many(self.batch_size - replayed_n, timeout=timeout)
        replayed = self.replay.sample(replayed_n)
        self.replay.add(fresh)
        batch = batch_unrolls(list(fresh) + replayed, self.unroll_spec, self.frame_stack, out=out)
        returns, lengths = _episodes(fresh)  # replayed episodes were counted when they were fresh
        return dataclasses.replace(batch, episode_returns=returns, episode_lengths=lengths, fresh_unrolls=len(fresh))

    def __iter__(self):
        while True:
            yield self.next_batch()


class PrefetchingBatcher:
    """Builds the next batch on a background thread while the learner trains on this one.

    Stacking 32 unrolls (copying 14 MB of 84x84x3 frames) costs milliseconds of NumPy work
    that releases the GIL, as the TensorFlow step does, so the two overlap.
    Bound: one finished batch waits here, one more is being built.

    Usage::

        batches = PrefetchingBatcher(Batcher(queue, spec, batch_size=32))
        batch = batches.next_batch(timeout=1.0)   # TimeoutError / QueueClosed like Batcher
        batches.close()
    """

    def __init__(self, batcher: Batcher):
        self._batcher = batcher
        self._ready: "queue.Queue" = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._batcher.next_batch(timeout=0.5)
            except TimeoutError:
                continue
            except BaseException as exc:  # QueueClosed or a batching error: hand it over
                item = exc
            while not self._stop.is_set():
                try:
                    self._ready.put(item, timeout=0.5)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def next_batch(self, timeout: Optional[float] = None) -> Batch:
        try:
            item = self._ready.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no batch within {timeout} s.") from None
        if isinstance(item, BaseException):
            self._ready.put(item)  # every later call fails the same way
            raise item
        return item

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


def policy_lag(policy_versions, current_version: int) -> Dict[str, float]:
    """Policy lag (learner version minus the version that acted) over a batch: mean/max/min."""
    v = np.asarray(policy_versions, dtype=np.int64)
    if v.size == 0:
        raise ValueError("policy_lag needs at least one policy version.")
    lag = int(current_version) - v
    return {"policy_lag_mean": float(lag.mean()), "policy_lag_max": float(lag.max()), "policy_lag_min": float(lag.min())}
