"""The batcher's queue: runs of items, FIFO per (priority, size class), taken a batch at a time.

A mixin of BatchProcessor: its state lives on the processor, under the processor's lock, so that
the callers' hot path (`call_one`) reaches it without a further object.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from operator import itemgetter

from .errors import QueueFull

# The queue holds runs: consecutive items of one group, as a plain tuple (few objects, so that
# a flood of callers costs the garbage collector little):
# (items, group, position of items[0] in the group's results, cost, deadline or None, time queued)
_Run = tuple
ITEMS, GROUP, POS, COST, DEADLINE, QUEUED = range(6)
_items_of, _deadline_of, _queued_of = itemgetter(ITEMS), itemgetter(DEADLINE), itemgetter(QUEUED)


class RunQueue:
    """Queues by (-priority, small-call rank), each a deque, so that pushes and pops of many
    items stay in C; `_keys` is sorted, the first key is served first."""

    def _init_queue(self) -> None:
        self._queues: dict[tuple[int, int], deque[_Run]] = {}
        self._keys: list[tuple[int, int]] = []
        self._size = 0
        self._queued_cost = 0.0
        self._first_arrival = 0.0

    def _push(self, runs: list[_Run], priority: int, small: int) -> None:
        now = time.monotonic()
        with self._cond:
            n = sum(len(r[ITEMS]) for r in runs) if len(runs) > 1 else len(runs[0][ITEMS])
            if self.max_queue is not None and runs[0][GROUP].loop is None:
                self._wait_for_room(n)
            if self._worker is None:  # first, so that a worker that cannot start leaves nothing queued
                self._start_worker()
            was_empty = not self._size
            self._queue((-priority, small)).extend(runs)
            self._size += n
            if self.cost is not None:
                self._queued_cost += sum(r[COST] for r in runs)
            if was_empty:
                self._first_arrival = now
            if (was_empty and self._idle) or self._size >= self.batch_size or (
                    self.max_batch_cost is not None and self._queued_cost >= self.max_batch_cost):
                self._cond.notify()

    def _queue(self, key: tuple[int, int]) -> deque:
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = deque()
            bisect.insort(self._keys, key)
        return q

    def _wait_for_room(self, n: int) -> None:
        if n > self.max_queue:
            raise QueueFull(f"{self.name}: {n} items exceed max_queue={self.max_queue}")
        while self._size + n > self.max_queue:
            if not self.block_when_full:
                raise QueueFull(f"{self.name}: the queue holds max_queue={self.max_queue} items; retry "
                                f"later, or create the batcher with block_when_full=True")
            self._room.wait()

    def _pop_batch(self) -> list[_Run]:
        """Under the lock: take the next batch off the queue."""
        if len(self._keys) == 1 and self._size <= self.batch_size and self.cost is None:
            batch = list(self._queues.pop(self._keys.pop()))  # the common case, in C
            count, cost = self._size, 0.0
        else:
            batch, count, cost = self._take_runs()
        self._size -= count
        if self.cost is not None:
            self._queued_cost -= cost
        self._first_arrival = time.monotonic()
        if self.max_queue is not None:
            self._room.notify_all()
        return batch

    def _take_runs(self) -> tuple[list[_Run], int, float]:
        """Runs for one batch, by priority then arrival, cut at batch_size or max_batch_cost."""
        batch: list[_Run] = []
        count, cost, full = 0, 0.0, False
        for key in list(self._keys):
            q = self._queues[key]
            while q and not full:
                run = q[0]
                k = len(run[ITEMS])
                if self.max_batch_cost is not None and batch and cost + run[COST] > self.max_batch_cost:
                    full = True
                    break
                room = self.batch_size - count
                if k <= room:
                    q.popleft()
                    batch.append(run)
                    count += k
                    cost += run[COST]
                else:  # the run is longer than the room: split it (count mode only)
                    items, group, pos, _, deadline, queued = run
                    batch.append((items[:room], group, pos, room, deadline, queued))
                    q[0] = (items[room:], group, pos + room, k - room, deadline, queued)
                    count += room
                full = count >= self.batch_size
            if not q:
                del self._queues[key]
                self._keys.remove(key)
            if full:
                break
        return batch, count, cost

    def _drain(self) -> list[_Run]:
        """Under the lock: take every queued run (the worker failed; they are failed)."""
        runs = [run for key in self._keys for run in self._queues[key]]
        self._queues.clear()
        self._keys.clear()
        self._size = 0
        self._queued_cost = 0.0
        self._room.notify_all()
        return runs
