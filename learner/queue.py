"""The bounded unroll queue between the gRPC service and the batcher (TensorFlow-free).

Bound: at most ``capacity`` validated unrolls are held. A producer (one gRPC stream handler
per actor stream) that finds the queue full blocks in :meth:`UnrollQueue.put`; while it
blocks it reads no further messages from its stream, so gRPC flow control stops that actor
(its sends block once the HTTP/2 window, 64 KiB to a few MiB, is full). Memory held by the
learner's transport is therefore bounded by

    capacity * max_message_bytes + 2 * max_streams * max_batch_bytes   (+ gRPC's receive windows)

— the queue, plus per stream handler the message waiting to enter it (one unroll, or an
``UnrollBatch`` of several) and the batch whose unrolls are being taken from the queue's head
(a queued unroll is a view on its message's bytes, so the message lives until its last
unroll leaves; every byte of an accepted batch belongs to a valid unroll).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Generic, List, Optional, TypeVar

__all__ = ["QueueClosed", "UnrollQueue"]

T = TypeVar("T")


class QueueClosed(RuntimeError):
    """The queue was closed (the learner is shutting down)."""


class UnrollQueue(Generic[T]):
    """Bounded FIFO with blocking ``put`` (backpressure) and blocking ``get``.

    Usage::

        q = UnrollQueue(capacity=64)
        q.put(unroll)               # in a stream handler: blocks while full
        batch = q.get_many(32)      # in the batcher: blocks until 32 are there
    """

    def __init__(self, capacity: int):
        if int(capacity) < 1:
            raise ValueError(f"queue capacity must be at least 1, got {capacity}.")
        self.capacity = int(capacity)
        self._items: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._not_empty = threading.Condition(self._lock)
        self._closed = False
        self.total_put = 0
        self.total_got = 0
        self.max_size_seen = 0
        self.producer_wait_s = 0.0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def fill(self) -> float:
        """Fraction of the capacity in use, in [0, 1]."""
        return len(self._items) / self.capacity

    @property
    def closed(self) -> bool:
        return self._closed

    def put(
        self,
        item: T,
        timeout: Optional[float] = None,
        cancelled: Optional[Callable[[], bool]] = None,
        poll_s: float = 0.1,
    ) -> bool:
        """Appends ``item``, blocking while the queue is full.

        Returns False (item not queued) when ``timeout`` passes or ``cancelled()`` turns
        true (checked every ``poll_s``); raises :class:`QueueClosed` after :meth:`close`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._not_full:
            if len(self._items) >= self.capacity:
                start = time.monotonic()
                try:
                    while len(self._items) >= self.capacity and not self._closed:
                        if cancelled is not None and cancelled():
                            return False
                        wait = poll_s
                        if deadline is not None:
                            wait = min(wait, deadline - time.monotonic())
                            if wait <= 0:
                                return False
                        self._not_full.wait(wait)
                finally:
                    self.producer_wait_s += time.monotonic() - start
            if self._closed:
                raise QueueClosed("the unroll queue is closed; the learner is shutting down.")
            self._items.append(item)
            self.total_put += 1
            if len(self._items) > self.max_size_seen:
                self.max_size_seen = len(self._items)
            self._not_empty.notify()
            return True

    def get_many(self, n: int, timeout: Optional[float] = None) -> List[T]:
        """Removes and returns exactly ``n`` items (n <= capacity), waiting for them.

        Raises ``TimeoutError`` when fewer than ``n`` arrive within ``timeout`` (nothing is
        removed then) and :class:`QueueClosed` when the queue is closed and has too few.
        """
        n = int(n)
        if not 1 <= n <= self.capacity:
            raise ValueError(f"get_many needs 1 <= n <= capacity ({self.capacity}), got {n}.")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._not_empty:
            while len(self._items) < n:
                if self._closed:
                    raise QueueClosed("the unroll queue is closed; the learner is shutting down.")
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    raise TimeoutError(
                        f"only {len(self._items)} of {n} unrolls arrived within {timeout} s; are actors connected?"
                    )
                self._not_empty.wait(wait)
            out = [self._items.popleft() for _ in range(n)]
            self.total_got += n
            self._not_full.notify_all()
            return out

    def get(self, timeout: Optional[float] = None) -> T:
        """Removes and returns one item (see :meth:`get_many`)."""
        return self.get_many(1, timeout)[0]

    def close(self) -> None:
        """Wakes every waiter; later puts raise :class:`QueueClosed`."""
        with self._lock:
            self._closed = True
            self._not_full.notify_all()
            self._not_empty.notify_all()
