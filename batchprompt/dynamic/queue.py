"""The batcher's queue: runs of items, FIFO per (priority, size class, length bucket), taken a
batch at a time.

A mixin of BatchProcessor: its state lives on the processor, under the processor's lock, so that
the callers' hot path (`call_one`) reaches it without a further object.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from operator import itemgetter

from .errors import DeadlineExceeded, QueueFull
from .lengths import BucketTally

# The queue holds runs: consecutive items of one group, as a plain tuple (few objects, so that
# a flood of callers costs the garbage collector little):
# (items, group, position of items[0] in the group's results, cost, deadline or None, time queued)
# With `cost=` or `length=`, a run holds one item and its cost is that item's cost or length. A
# run whose worker died is queued again with a seventh field (RERUN), so that it runs once more only.
_Run = tuple
ITEMS, GROUP, POS, COST, DEADLINE, QUEUED, RERUN = range(7)
_items_of, _deadline_of, _queued_of = itemgetter(ITEMS), itemgetter(DEADLINE), itemgetter(QUEUED)
# The queue key of runs queued again after their worker died: before every priority.
_RERUN_KEY = -(1 << 62)


class RunQueue:
    """Queues by (-priority, small-call rank, length bucket), each a deque, so that pushes and pops
    of many items stay in C; `_keys` is sorted, the first key is served first. With `length=`, the
    count and longest length of each bucket are kept, to see when one holds a batch."""

    def _init_queue(self) -> None:
        self._queues: dict[tuple[int, int, int], deque[_Run]] = {}
        self._keys: list[tuple[int, int, int]] = []
        self._size = 0
        self._queued_cost = 0.0
        self._first_arrival = 0.0
        self._buckets: dict[int, BucketTally] = {}  # with `length=`: the items queued per bucket

    def _push(self, runs: list[_Run], priority: int, small: int) -> None:
        """Runs of whole calls (no cost or length), under one key."""
        now = time.monotonic()
        with self._cond:
            n = sum(len(r[ITEMS]) for r in runs) if len(runs) > 1 else len(runs[0][ITEMS])
            if self.max_queue is not None and runs[0][GROUP].loop is None:
                self._wait_for_room(n, runs[0][DEADLINE])
            if self._worker is None:  # first, so that a worker that cannot start leaves nothing queued
                self._start_worker()
            was_empty = not self._size
            self._queue((-priority, small, 0)).extend(runs)
            self._size += n
            if was_empty:
                self._first_arrival = now
            if (was_empty and self._idle) or self._size >= self.batch_size:
                self._cond.notify()

    def _push_items(self, keyed: list[tuple[int, int, _Run]], n: int, thread_call: bool) -> None:
        """One-item runs with a cost or a length, each with its (priority, small) and, by its
        length, its bucket; `n` runs in all."""
        now = time.monotonic()
        bucket_of = self._bucket_of
        with self._cond:
            if self.max_queue is not None and thread_call:
                self._wait_for_room(n, keyed[0][2][DEADLINE])
            if self._worker is None:
                self._start_worker()
            was_empty = not self._size
            for priority, small, run in keyed:
                cost = run[COST]
                if self.length is None:
                    self._queue((-priority, small, 0)).append(run)
                    self._queued_cost += cost
                else:
                    bucket = bucket_of(cost)
                    self._queue((-priority, small, bucket)).append(run)
                    self._tally(bucket).add(cost)
            self._size += n
            if was_empty:
                self._first_arrival = now
            if (was_empty and self._idle) or self._full():
                self._cond.notify()

    def _requeue(self, runs: list[_Run]) -> None:
        """Under the lock: runs whose worker died, first in line, each marked to run once more only."""
        for run in runs:
            cost = run[COST]
            bucket = 0 if self.length is None else self._bucket_of(cost)
            self._queue((_RERUN_KEY, 0, bucket)).append(run[:RERUN] + (True,))
            if self.length is not None:
                self._tally(bucket).add(cost)
            elif self.cost is not None:
                self._queued_cost += cost
        was_empty = not self._size
        self._size += sum(len(r[ITEMS]) for r in runs)
        oldest = min(map(_queued_of, runs))
        self._first_arrival = oldest if was_empty else min(self._first_arrival, oldest)  # due now
        self._cond.notify()

    def _queue(self, key: tuple[int, int, int]) -> deque:
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = deque()
            bisect.insort(self._keys, key)
        return q

    def _tally(self, bucket: int) -> BucketTally:
        tally = self._buckets.get(bucket)
        if tally is None:
            tally = self._buckets[bucket] = BucketTally()
        return tally

    def _full(self) -> bool:
        """Under the lock: whether the queue holds a batch (of one bucket, with `length=`)."""
        if self.length is not None:
            return any(t.full(self.batch_size, self.max_batch_cost) for t in self._buckets.values())
        return self._size >= self.batch_size or (
            self.max_batch_cost is not None and self._queued_cost >= self.max_batch_cost)

    def _wait_for_room(self, n: int, deadline: float | None = None) -> None:
        """Under the lock: until the queue has room for `n` more items (block_when_full), or the
        call's deadline passes."""
        if n > self.max_queue:
            raise QueueFull(too_many_for_the_queue(self.name, n, self.max_queue))
        while self._size + n > self.max_queue:
            if not self.block_when_full:
                raise QueueFull(f"{self.name}: the queue holds max_queue={self.max_queue} items; retry "
                                f"later, or create the batcher with block_when_full=True")
            if deadline is None:
                self._room.wait()
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"{self.name}: no room in the queue (max_queue={self.max_queue}) within the "
                                       f"call's deadline")
            self._room.wait(left)

    def _pop_batch(self) -> list[_Run]:
        """Under the lock: take the next batch off the queue."""
        if len(self._keys) == 1 and self._size <= self.batch_size and self._item_cost is None:
            batch = list(self._queues.pop(self._keys.pop()))  # the common case, in C
            count, cost = self._size, 0.0
        elif self.length is not None:
            batch, count, cost = self._take_bucket()
        else:
            batch, count, cost = self._take_runs()
        self._size -= count
        if self.cost is not None:
            self._queued_cost -= cost
        if self.length is not None and self._size:
            # Every item is served within about timeout_ms of its arrival, whatever its bucket.
            self._first_arrival = min(q[0][QUEUED] for q in self._queues.values())
        else:
            self._first_arrival = time.monotonic()
        if self.max_queue is not None:
            self._room.notify_all()
        if self.workers > 1 and self._size and self._full():
            self._cond.notify()  # another batch is ready: wake a worker that waits for one
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
                    items, group, pos, _, deadline, queued, *rest = run
                    batch.append((items[:room], group, pos, room, deadline, queued, *rest))
                    q[0] = (items[room:], group, pos + room, k - room, deadline, queued, *rest)
                    count += room
                full = count >= self.batch_size
            if not q:
                del self._queues[key]
                self._keys.remove(key)
            if full:
                break
        return batch, count, cost

    def _take_bucket(self) -> tuple[list[_Run], int, float]:
        """With `length=`: one-item runs of one bucket, cut at batch_size or at max_batch_cost
        padded tokens (count x longest length). Of the highest priority queued: a bucket that holds
        a batch, else the one whose first item has waited longest."""
        top = self._keys[0][0]
        keys = [k for k in self._keys if k[0] == top]
        chosen = next((k[2] for k in keys if self._buckets[k[2]].full(self.batch_size, self.max_batch_cost)), None)
        if chosen is None:
            chosen = min(keys, key=lambda k: self._queues[k][0][QUEUED])[2]
        batch: list[_Run] = []
        longest, budget = 0.0, self.max_batch_cost
        for key in [k for k in self._keys if k[2] == chosen]:
            q = self._queues[key]
            while q and len(batch) < self.batch_size:
                m = max(longest, q[0][COST])
                if budget is not None and batch and (len(batch) + 1) * m > budget:
                    break
                batch.append(q.popleft())
                longest = m
            if not q:
                del self._queues[key]
                self._keys.remove(key)
            if q:  # the batch is full, by count or by padded tokens
                break
        tally = self._buckets[chosen]
        for run in batch:
            tally.remove(run[COST])
        if not tally.count:
            del self._buckets[chosen]
        return batch, len(batch), 0.0

    def _withdraw(self, groups: set[int]) -> list[_Run]:
        """Under the lock: take the queued runs of these groups (by id) off the queue."""
        taken: list[_Run] = []
        for key in list(self._keys):
            q = self._queues[key]
            if not any(id(run[GROUP]) in groups for run in q):
                continue
            kept = deque()
            for run in q:
                if id(run[GROUP]) not in groups:
                    kept.append(run)
                    continue
                taken.append(run)
                if self.length is not None:
                    tally = self._buckets[key[2]]
                    tally.remove(run[COST])
                    if not tally.count:
                        del self._buckets[key[2]]
                elif self.cost is not None:
                    self._queued_cost -= run[COST]
            if kept:
                self._queues[key] = kept
            else:
                del self._queues[key]
                self._keys.remove(key)
        if taken:
            self._size -= sum(len(run[ITEMS]) for run in taken)
            if self.max_queue is not None:
                self._room.notify_all()
        return taken

    def _drain(self) -> list[_Run]:
        """Under the lock: take every queued run (the worker failed; they are failed)."""
        runs = [run for key in self._keys for run in self._queues[key]]
        self._queues.clear()
        self._keys.clear()
        self._size = 0
        self._queued_cost = 0.0
        self._buckets.clear()
        self._room.notify_all()
        return runs


def too_many_for_the_queue(name: str, n: int, max_queue: int) -> str:
    """One call's items that no wait for room can ever fit (block_when_full or not)."""
    return (f"{name}: one call of {n} items can never fit a queue of max_queue={max_queue} items; send at most "
            f"{max_queue} per call, or use imap()/aimap(), which keep at most max_in_flight queued")
