"""BatchProcessor: items from any number of callers, grouped into batches for one worker thread
(or several, `workers=`/`replicas=`, on one shared queue).

One implementation serves threads and asyncio alike. A call puts its items in a priority queue
(`queue.py`) and waits: a thread on a lock, a coroutine on a Waiter (a minimal future) of its
own loop (`groups.py`, `waiter.py`). A worker (`worker.py`) takes a batch when `batch_size`
items (or `max_batch_cost`; with `length=`, of one length bucket) are queued, or `timeout_ms`
after the first of them arrived; it runs the function and hands each caller its results. Results
for asyncio callers are handed over once per loop per batch, not once per item. The batch size
moves with a latency target and after out-of-memory errors (`sizing.py`). This module holds the
callers' side.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Sequence

from .errors import BatchSizeMismatch, DeadlineExceeded, QueueFull, WorkerDied, Withdrawn
from .groups import _Group, _LoopBuffer, hand_over, new_lock
from .lengths import bucket_function, checked_length
from .options import check_options
from .queue import ITEMS, RunQueue
from .results import Failure, unwrap, value
from .sizing import BatchSizer
from .stats import BatchStats, StatsRecorder
from .waiter import Waiter, resolve
from .worker import NEW_REPLICA, Worker, WorkerSlot

__all__ = ["IDLE_EXIT_S", "BatchProcessor", "BatchSizeMismatch", "DeadlineExceeded", "QueueFull", "WorkerDied"]

# The worker thread ends after this many seconds without items (the next call starts another), so
# that an idle batcher holds no thread, and a method's batcher does not keep its instance alive.
IDLE_EXIT_S = 2.0
# Every processor alive, to be reset in a forked child (`_after_fork`).
_live: weakref.WeakSet = weakref.WeakSet()


def _reset_after_fork() -> None:
    for processor in list(_live):
        processor._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
# Each thread keeps the one-item group of its last plain call for its next one: a finished
# group's lock is held again by its caller, as a new one's is, so reuse skips making a lock.
_spare = threading.local()


class BatchProcessor(RunQueue, Worker):
    def __init__(self, fn: Callable[[list], Sequence | Any], *, batch_size: int = 32, timeout_ms: float = 5.0,
                 small_batch_threshold: int = 8, max_queue: int | None = None, block_when_full: bool = False,
                 cost: Callable[[Any], float] | None = None, max_batch_cost: float | None = None,
                 split_on_error: bool = True, target_latency_ms: float | None = None, min_batch_size: int = 1,
                 length: Callable[[Any], float] | None = None, buckets: Sequence[float] | str | None = None,
                 workers: int | None = None, replicas: Sequence | Callable[[int], Any] | None = None,
                 name: str | None = None):
        check_options(batch_size=batch_size, timeout_ms=timeout_ms, small_batch_threshold=small_batch_threshold,
                      max_queue=max_queue, block_when_full=block_when_full, cost=cost, max_batch_cost=max_batch_cost,
                      split_on_error=split_on_error, target_latency_ms=target_latency_ms,
                      min_batch_size=min_batch_size, length=length, buckets=buckets)
        self.fn = fn
        self.timeout = timeout_ms / 1000
        self.small_batch_threshold = small_batch_threshold
        self.max_queue, self.block_when_full = max_queue, block_when_full
        self.max_batch_cost = max_batch_cost
        # `length`: each item's length in tokens (its own run, its bucket, padded-token budgets)
        self.length = None if length is None else checked_length(length)
        self._bucket_of = bucket_function(buckets)
        if cost is not None:
            cost = checked_length(cost, "cost", "the item's share of max_batch_cost")
        self.cost = cost
        self._item_cost = cost or self.length  # one run per item, so that batches can be cut at any item
        self.split_on_error = split_on_error
        self.name = name or getattr(fn, "__qualname__", "function")
        # `batch_size`: the size batches are cut at now, read on the callers' hot path; the sizer
        # moves it within [min_batch_size, max_batch_size].
        self.max_batch_size = batch_size
        self._sizer = BatchSizer(batch_size, min_batch_size, None if target_latency_ms is None
                                 else target_latency_ms / 1000)
        self.batch_size = self._sizer.limit
        self.clock = time.perf_counter  # times the function, for the batch size and the stats
        self.replicas = replicas  # passed to the function as `replica=` when given
        self._slots = _worker_slots(workers, replicas)
        self.workers = len(self._slots)
        self._replica_factory = replicas if callable(replicas) else None
        self._factory_failures: set[tuple[int, type]] = set()  # (slot, error type) already logged
        lock = self._lock = new_lock()
        self._cond = threading.Condition(lock)  # the workers wait here for items
        self._room = threading.Condition(lock)  # callers wait here for queue room (block_when_full)
        self._results_lock = new_lock()  # workers fill the result slots of groups they may share
        self._init_queue()
        self._stats = StatsRecorder()
        self._worker: threading.Thread | None = None  # set while every slot has a worker thread
        self._buffers: dict[asyncio.AbstractEventLoop, _LoopBuffer] = {}
        self._idle = 0  # workers that wait for a first item (and must be woken for it)
        _live.add(self)

    def _after_fork(self) -> None:
        """In a child process: its worker threads were not copied (only the thread that forked
        was), and a lock a parent's thread held is held for ever. New locks, no workers: the
        child's first call starts its own; replicas from a factory are made again (a CUDA context
        does not survive a fork). What was queued stays queued and runs in the child too."""
        lock = self._lock = new_lock()
        self._cond = threading.Condition(lock)
        self._room = threading.Condition(lock)
        self._results_lock = new_lock()
        self._worker = None
        self._idle = 0
        self._buffers = {}
        for slot in self._slots:
            slot.thread, slot.loop, slot.done = None, None, []
            if self._replica_factory is not None:
                slot.replica = NEW_REPLICA

    @property
    def idle_exit_s(self) -> float:
        """Read by the worker each time it idles, so that setting IDLE_EXIT_S here takes effect."""
        return IDLE_EXIT_S

    # ---- threads -------------------------------------------------------------------------
    def submit(self, items: Sequence, priority: int = 0, timeout: float | None = None,
               solo: bool = False) -> _Group:
        """From a thread: queue `items` as one group; `wait` on it. `solo`: the caller holds several
        groups at once (imap), so this one is woken on its own, not in a chain."""
        n = len(items)
        group = _Group(n, None)
        group.solo = solo or timeout is not None
        if n == 0:
            group.wake()
            return group
        now = time.monotonic()
        deadline = now + timeout if timeout is not None else None
        small = 0 if n <= self.small_batch_threshold else 1
        cost = self._item_cost
        if cost is None:
            self._push([(list(items), group, 0, n, deadline, now)], priority, small)
        else:  # one run per item, so that batches can be cut at any item
            self._push_items([(priority, small, ([item], group, pos, cost(item), deadline, now))
                              for pos, item in enumerate(items)], n, True)
        return group

    def call_one(self, item: Any) -> Any:
        """From a thread, the common case (one item, no priority, deadline or cost), kept short."""
        # Taken out while in use, so that a nested call (a signal handler) makes its own.
        group = _spare.__dict__.pop("group", None) or _Group(1, None)
        now = time.monotonic()
        queued = False
        try:
            with self._lock:  # the Condition's own lock: `with self._cond` adds two Python calls
                if self.max_queue is not None:
                    self._wait_for_room(1)
                if self._worker is None:  # first, so that a worker that cannot start leaves nothing queued
                    self._start_worker()
                q = self._queues.get((0, 0, 0))
                if q is None:
                    q = self._queue((0, 0, 0))
                q.append(([item], group, 0, 1, None, now))
                queued = True
                size = self._size = self._size + 1
                if size == 1:
                    self._first_arrival = now
                    if self._idle:
                        self._cond.notify()
                elif size >= self.batch_size:
                    self._cond.notify()
            group.wait()
        except BaseException:
            # Interrupted once queued, before its wait began (a signal between the two): its
            # group may head a chain of wake-ups, which went no further than it.
            if queued and not group.waited:
                group.leave()
            raise
        results = group.results
        r, results[0] = results[0], None
        group.remaining, group.waited, group.woken = 1, False, False
        _spare.group = group  # not reached if the wait was interrupted: the group may still be queued
        return value(r)

    def withdraw(self, groups: Iterable[_Group]) -> int:
        """Take the items of `groups` that are still queued off the queue: their caller stopped
        waiting (an imap left early), so running them would only delay other callers. Their
        slots get a Withdrawn failure, so that nothing waits on them; items already in a batch
        finish. Returns how many were taken off."""
        groups = list(groups)
        with self._cond:
            runs = self._withdraw(set(map(id, groups)))
        if not runs:
            return 0
        finished: list[_Group] = []
        self._fail_runs(runs, Withdrawn(f"{self.name}: taken off the queue unrun, its caller stopped waiting"),
                        finished, withdrawn=True)
        hand_over(finished)
        return sum(len(run[ITEMS]) for run in runs)

    def wait(self, group: _Group, timeout: float | None) -> list:
        if timeout is None:
            group.wait()
        elif not group.lock.acquire(timeout=max(timeout, 0)):
            raise DeadlineExceeded(f"{self.name}: no result within the {timeout}s deadline")
        return unwrap(group.results)

    # ---- asyncio -------------------------------------------------------------------------
    def submit_async(self, items: Sequence, loop: asyncio.AbstractEventLoop, priority: int = 0,
                     timeout: float | None = None) -> tuple[_Group, int, int]:
        """From a coroutine on `loop`: add `items` to the loop's current group, which is queued
        at the end of this turn of the loop (or at once when it holds a batch). Await the
        group's results [start:stop] (`await_group`)."""
        buf = self._buffers.get(loop)
        if buf is None:
            buf = self.open_buffer(loop)
        if self.max_queue is not None:
            n = len(items) + len(buf.items)
            if n > self.max_queue or self._size + n > self.max_queue:
                raise QueueFull(f"{self.name}: the queue holds max_queue={self.max_queue} items; retry "
                                f"later, or create the batcher with block_when_full=True")
        group = buf.group
        start = len(buf.items)
        buf.items.extend(items)
        if priority or timeout is not None:
            buf.flags = True
            buf.meta.append((start, len(items), priority, None if timeout is None else time.monotonic() + timeout))
        if len(buf.items) >= self.batch_size:
            self.flush_buffer(buf, False)
        return group, start, start + len(items)

    def open_buffer(self, loop: asyncio.AbstractEventLoop) -> _LoopBuffer:
        """The loop's buffer for this turn; it is queued when the turn ends."""
        buf = self._buffers[loop] = _LoopBuffer(loop)
        buf.group = _Group(0, loop)
        loop.call_soon(self.flush_buffer, buf, True)
        return buf

    def flush_buffer(self, buf: _LoopBuffer, from_loop: bool) -> None:
        if from_loop:  # the end of the loop's turn: forget the buffer (no closed loop is kept)
            if self._buffers.get(buf.loop) is buf:
                del self._buffers[buf.loop]
        items = buf.items
        if not items:
            return
        group, meta = buf.group, buf.meta
        buf.items, buf.meta = [], []
        buf.group = None if from_loop else _Group(0, buf.loop)
        n = len(items)
        group.results = [None] * n
        group.remaining = n
        now = time.monotonic()
        cost = self._item_cost
        try:
            if not buf.flags and cost is None:  # the common case: one run for the whole turn
                self._push([(items, group, 0, n, None, now)], 0, 0)
                return
            buf.flags = False
            prios, deadlines = [0] * n, [None] * n
            for start, k, priority, deadline in meta:
                prios[start:start + k] = [priority] * k
                deadlines[start:start + k] = [deadline] * k
            if cost is not None:  # one run per item, so that batches can be cut at any item
                self._push_items([(prios[pos], 0, ([item], group, pos, cost(item), deadlines[pos], now))
                                  for pos, item in enumerate(items)], n, False)
                return
            for pos, item in enumerate(items):  # rare: priorities or deadlines, item by item
                self._push([([item], group, pos, 1, deadlines[pos], now)], prios[pos], 0)
        except BaseException as e:  # noqa: BLE001 - e.g. no worker thread could start: the group's
            group.results = [Failure(e)] * n  # callers (several tasks) get the error, not a wait
            buf.loop.call_soon(resolve, [group])

    async def await_group(self, group: _Group, start: int, stop: int, timeout: float | None,
                          asked: float | None = None) -> list:
        """The group's results [start:stop]; DeadlineExceeded after `timeout` seconds (what is
        left of the `asked` deadline, which the error names)."""
        waiter = Waiter(group, start, stop)
        if timeout is None:
            try:
                return await waiter
            except asyncio.CancelledError:
                self._withdraw_own(group, start, stop)
                raise
        # The deadline cancels this caller's waiter alone (the others in its group wait on). Not
        # asyncio.wait_for: its inner task would raise a KeyboardInterrupt or SystemExit that the
        # function raised out of the caller's event loop as well, after the caller got it.
        expired = []
        handle = asyncio.get_running_loop().call_later(max(timeout, 0), lambda: waiter.cancel() and expired.append(1))
        try:
            return await waiter
        except asyncio.CancelledError:
            self._withdraw_own(group, start, stop)
            if expired:
                raise DeadlineExceeded(f"{self.name}: no result within the "
                                       f"{timeout if asked is None else asked:g}s deadline") from None
            raise
        finally:
            handle.cancel()

    def _withdraw_own(self, group: _Group, start: int, stop: int) -> None:
        """A cancelled asyncio caller: its items still queued are taken off the queue when the group
        is its own (items of other callers of the same loop turn may share a group; they stay)."""
        if not group.resolved and start == 0 and stop == len(group.results):
            self.withdraw([group])

    @property
    def stats(self) -> BatchStats:
        return self._stats.snapshot(self._size, self.batch_size, self._sizer.ooms)


#: The most workers a batcher runs: each is a thread.
MAX_WORKERS = 1024


def _worker_slots(workers: int | None, replicas) -> list[WorkerSlot]:
    """One slot per worker, with its replica: from the list, made by the factory when the worker
    starts (NEW_REPLICA), or none."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or not 1 <= workers <= MAX_WORKERS):
        # 1,000,000 started threads until the process could start no more (any thread, anywhere)
        raise ValueError(f"workers must be an int from 1 to {MAX_WORKERS} (each worker is a thread), got {workers!r}")
    if replicas is None:
        return [WorkerSlot(i) for i in range(workers or 1)]
    if isinstance(replicas, (list, tuple)):
        if not replicas:
            raise ValueError("replicas=[] holds no replica: give one per worker, e.g. replicas=['cuda:0', 'cuda:1']")
        if workers is not None and workers != len(replicas):
            raise ValueError(f"workers={workers} but {len(replicas)} replicas: one worker runs per replica; "
                             f"leave out workers=")
        return [WorkerSlot(i, r) for i, r in enumerate(replicas)]
    if callable(replicas):
        return [WorkerSlot(i, NEW_REPLICA) for i in range(workers or 1)]
    raise ValueError(f"replicas= takes a list (one replica per worker) or a factory called with the worker's "
                     f"index, got {type(replicas).__name__}")
