"""The workers: threads that take batches off the shared queue, run the function on them and hand
each caller its results. One by default; `workers=N` or `replicas=[...]` for more, each with its
own replica (a model on its own device) passed to the function as `replica=`.

A mixin of BatchProcessor. A worker outlives every error of the function: whatever it raises
(`BaseException`s such as CancelledError and SystemExit included) goes to the callers of its
batch, an out-of-memory error splits the batch and lowers the batch size, and an error in the
worker's own bookkeeping fails the callers concerned and never leaves one waiting. A worker dies
only when the function raises WorkerDied (or an error escapes its loop): a new worker takes its
slot and the unfinished part of its batch runs once more.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from itertools import chain

from .errors import BatchSizeMismatch, DeadlineExceeded, WorkerDied
from .groups import _Group, hand_over
from .queue import COST, DEADLINE, GROUP, ITEMS, POS, QUEUED, RERUN, _deadline_of, _items_of, _queued_of, _Run
from .results import Failure
from .sizing import is_out_of_memory, release_cached_memory

log = logging.getLogger("batchprompt")
#: The processor whose batch this thread runs (its workers' threads only).
serving = threading.local()
NEW_REPLICA = object()  # the slot's replica is made by the factory when its worker starts


class WorkerSlot:
    """One worker's own state: its thread (None while it has none), its event loop (for an async
    function), its replica, and the runs of its current batch whose results are in (`done`: on
    the worker's death, the rest is run again)."""

    __slots__ = ("index", "thread", "loop", "replica", "done")

    def __init__(self, index: int, replica=None):
        self.index, self.replica = index, replica
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.done: list[_Run] = []


class Worker:
    def _start_worker(self) -> None:
        """Under the lock: start a worker in each slot without one. `_worker` is set once all run
        (so that the callers' hot path tests one attribute); if one cannot start, the next call
        tries again (instead of waiting on a thread that never ran)."""
        for slot in self._slots:
            if slot.thread is None:
                self._start_slot(slot)
        self._worker = self._slots[0].thread

    def _start_slot(self, slot: WorkerSlot) -> None:
        name = f"dynamically-{self.name}" + (f"-{slot.index}" if self.workers > 1 else "")
        thread = threading.Thread(target=self._run, args=(slot,), name=name, daemon=True)
        thread.start()
        slot.thread = thread

    def _run(self, slot: WorkerSlot) -> None:
        serving.processor = self
        batch: list[_Run] | None = None
        finished: list[_Group] = []
        if slot.replica is NEW_REPLICA:  # made on the worker's own thread (a CUDA context, say)
            try:
                slot.replica = self._replica_factory(slot.index)
            except BaseException as e:  # noqa: BLE001 - the callers get the factory's error (the next
                # call tries again); not a defect of the batcher. Said once per slot and kind of error:
                # a slot whose replica failed left the others to do its work without a word.
                if (slot.index, type(e)) not in self._factory_failures:
                    self._factory_failures.add((slot.index, type(e)))
                    log.warning("%s: replicas(%d) raised %s: %s; worker %d does not run until a later call's "
                                "replicas(%d) succeeds", self.name, slot.index, type(e).__name__, e, slot.index,
                                slot.index)
                self._died(slot, e, None, finished)
                return
        try:
            while True:
                batch = self._take(slot)
                if batch is None:
                    return
                self._serve(batch, finished, slot)
                batch = None
                ready, finished = finished, []
                hand_over(ready)
        except BaseException as e:
            self._died(slot, e, batch, finished)
            if not isinstance(e, WorkerDied):
                raise  # a defect in the batcher: reported by threading.excepthook

    def _take(self, slot: WorkerSlot) -> list[_Run] | None:
        """The next batch; None when the worker has been idle for `idle_exit_s` and should end."""
        with self._cond:
            while True:
                if not self._size:
                    # Expect more soon: wait one timeout without asking callers to wake us for
                    # their first item (a wake-up then only costs a GIL hand-off); then idle.
                    self._cond.wait(self.timeout)
                    if not self._size:
                        self._idle += 1
                        self._cond.wait(self.idle_exit_s)
                        self._idle -= 1
                        if not self._size:  # end; a caller seeing no worker starts another
                            slot.thread = self._worker = None
                            self._close_loop(slot)  # under the lock: the next worker makes its own
                            return None
                left = self._first_arrival + self.timeout - time.monotonic()
                if left <= 0 or self._full():
                    break
                self._cond.wait(left)
            return self._pop_batch()

    def _died(self, slot: WorkerSlot, error: BaseException, batch: list[_Run] | None,
              finished: list[_Group]) -> None:
        """The worker ends with `error`. Died in a batch: a new worker takes the slot at once, and
        the batch's unfinished items are queued again (once: those already run again fail). Died
        between batches with no other worker left: the queued callers get the error (the next call
        starts a worker)."""
        rerun, lost = self._unfinished(slot, batch)
        if isinstance(error, WorkerDied):
            log.warning("%s: worker %d died (%s); %d items run again on a new worker, %d fail",
                        self.name, slot.index, error, len(rerun), len(lost))
        with self._cond:
            if slot.thread is threading.current_thread():  # else it died as it ended: the slot
                slot.thread = self._worker = None  # (and the queue) may be a new worker's
                self._stats.replaced += 1
                self._close_loop(slot)
                if self._replica_factory is not None:
                    slot.replica = NEW_REPLICA  # the factory makes a new one
                if batch is not None:  # died in a batch: replaced at once, to run it again
                    try:
                        self._start_slot(slot)
                        if all(s.thread is not None for s in self._slots):
                            self._worker = self._slots[0].thread
                        if rerun:
                            self._requeue(rerun)
                            rerun = []
                    except BaseException:  # noqa: BLE001 - no thread: these items fail below
                        pass
                if not any(s.thread is not None for s in self._slots):
                    lost += self._drain()  # nobody is left to serve the queue
        self._fail_runs(lost + rerun, error, finished)
        hand_over(finished)

    def _unfinished(self, slot: WorkerSlot, batch: list[_Run] | None) -> tuple[list[_Run], list[_Run]]:
        """One-item runs for the items of `batch` whose results are not in: (to run again, already
        run again once)."""
        rerun: list[_Run] = []
        lost: list[_Run] = []
        if batch is None:
            return rerun, lost
        covered = {(id(r[GROUP]), r[POS] + i) for r in slot.done for i in range(len(r[ITEMS]))}
        slot.done = []
        for run in batch:
            group, pos, items = run[GROUP], run[POS], run[ITEMS]
            for i, item in enumerate(items):
                if (id(group), pos + i) not in covered:
                    one = ([item], group, pos + i, run[COST] if len(items) == 1 else 1, run[DEADLINE], run[QUEUED])
                    (lost if len(run) > RERUN else rerun).append(one)
        return rerun, lost

    def _close_loop(self, slot: WorkerSlot) -> None:
        if slot.loop is not None:
            slot.loop.close()
            slot.loop = None

    def _serve(self, batch: list[_Run], finished: list[_Group], slot: WorkerSlot) -> None:
        """Run one batch; the groups it finishes go in `finished`. Raises only WorkerDied: if the
        worker's own bookkeeping fails, the callers of the batch get the error."""
        slot.done = []
        try:
            now = time.monotonic()
            live = batch
            if list(map(_deadline_of, batch)).count(None) != len(batch):  # some run has a deadline
                live = []
                expired = []
                for run in batch:
                    (expired if run[DEADLINE] is not None and run[DEADLINE] < now else live).append(run)
                self._fail_runs(expired, DeadlineExceeded(
                    f"{self.name}: the deadline passed while the item was queued"), finished, slot)
            if live:
                self._process(live, finished, slot, now)
        except WorkerDied:
            raise
        except BaseException as e:  # noqa: BLE001 - a defect here must not strand the callers
            self._fail_unfinished(batch, e, finished)

    def _call_fn(self, items: list, slot: WorkerSlot) -> list:
        n = len(items)  # before the call: the function may change its list
        out = self.fn(items) if self.replicas is None else self.fn(items, replica=slot.replica)
        if inspect.isawaitable(out):  # an async function: run it on the worker's own loop
            if slot.loop is None:
                slot.loop = asyncio.new_event_loop()
            out = slot.loop.run_until_complete(out)  # usable again after any error, SystemExit too
        if not hasattr(out, "__len__") or not hasattr(out, "__getitem__") or isinstance(out, (str, bytes, dict)):
            raise BatchSizeMismatch(f"{self.name} returned {type(out).__name__}, not a list of {n} results")
        if type(out) is not list:  # here, so that a sequence that cannot be read fails as the function
            out = list(out)
        if len(out) != n:
            raise BatchSizeMismatch(f"{self.name} returned {len(out)} results for a batch of {n} items")
        return out

    def _process(self, runs: list[_Run], finished: list[_Group], slot: WorkerSlot,
                 started: float | None = None) -> int:
        """Run the function on the runs' items and put the results in their groups' slots; the
        largest count the function ran without error (a split runs several). `started`: when the
        batch was taken (given once per batch, for the stats and the batch size, and not again
        for the halves of a split)."""
        # A list of the function's own, also for one run: a function that appended to or popped from
        # the run's list (returning it) passed the length check, and its callers waited for ever.
        items = list(runs[0][ITEMS]) if len(runs) == 1 else list(chain.from_iterable(map(_items_of, runs)))
        queued = list(map(_queued_of, runs))
        if started is not None:
            with self._results_lock:
                self._stats.batch(len(items), sum((started - q) * len(r[ITEMS]) for q, r in zip(queued, runs)))
                if self.length is not None:
                    self._stats.padding([r[COST] for r in runs])  # one item per run
        clock = self.clock
        t0 = clock()
        try:
            out = self._call_fn(items, slot)
        except BatchSizeMismatch as e:  # the whole batch's callers get this error
            self._fail_runs(runs, e, finished, slot)
            return 0
        except WorkerDied:
            raise
        except Exception as e:  # noqa: BLE001
            memory = is_out_of_memory(e)
            if memory:  # not the items' fault: retried in halves (and later batches kept smaller)
                release_cached_memory()
            if not (memory or self.split_on_error) or len(items) == 1:
                self._fail_runs(runs, e, finished, slot)
                return 0
            ones = [([item], run[GROUP], run[POS] + i, run[COST] if len(run[ITEMS]) == 1 else 1,
                     *run[DEADLINE:]) for run in runs for i, item in enumerate(run[ITEMS])]
            mid = len(ones) // 2  # bisect and retry
            fitted = max(self._process(ones[:mid], finished, slot), self._process(ones[mid:], finished, slot))
            if memory and started is not None:  # the batch as taken ran out: cap the size at what ran
                with self._lock:
                    self._sizer.out_of_memory(len(items), fitted)
                    self.batch_size = self._sizer.limit
            return fitted
        except BaseException as e:  # noqa: BLE001 - CancelledError, SystemExit, KeyboardInterrupt:
            self._fail_runs(runs, e, finished, slot)  # a stop, not one item's fault, so not retried
            return 0
        elapsed = clock() - t0
        if started is not None:
            self._stats.batch_times.append(elapsed)
            if self._sizer.active:
                with self._lock:
                    self._sizer.observe(len(items), elapsed)
                    self.batch_size = self._sizer.limit
        self._finish(runs, out, queued, finished, slot)
        return len(items)

    def _finish(self, runs: list[_Run], out: list, queued: list[float], finished: list[_Group],
                slot: WorkerSlot) -> None:
        end = time.monotonic()
        lat = self._stats.latencies
        with self._results_lock:  # several workers may fill one group's slots
            slot.done.extend(runs)
            failed = sum(isinstance(r, BaseException) for r in out)  # errors the function put in slots
            if failed:
                self._stats.errors += failed
            if len(out) == len(runs):  # one item per run (thread calls): no slicing
                lat.extend([end - q for q in queued])
                for run, result in zip(runs, out):
                    group = run[GROUP]
                    group.results[run[POS]] = result
                    group.remaining -= 1
                    if not group.remaining:
                        finished.append(group)
                return
            off = 0
            for run, q in zip(runs, queued):
                k = len(run[ITEMS])
                group, pos = run[GROUP], run[POS]
                group.results[pos:pos + k] = out[off:off + k]
                lat.extend([end - q] * k)
                off += k
                group.remaining -= k
                if group.remaining == 0:
                    finished.append(group)

    def _fail_runs(self, runs: list[_Run], error: BaseException, finished: list[_Group],
                   slot: WorkerSlot | None = None, withdrawn: bool = False) -> None:
        """Fill the runs' slots with `error`; the groups this finishes go in `finished`. Counted
        as errors, or (`withdrawn`) as items taken off the queue unrun."""
        with self._results_lock:
            if slot is not None:
                slot.done.extend(runs)
            for run in runs:
                k = len(run[ITEMS])
                if withdrawn:
                    self._stats.withdrawn += k
                else:
                    self._stats.errors += k
                group, pos = run[GROUP], run[POS]
                group.results[pos:pos + k] = [Failure(error)] * k
                group.remaining -= k
                if group.remaining == 0:
                    finished.append(group)

    def _fail_unfinished(self, batch: list[_Run], error: BaseException, finished: list[_Group]) -> None:
        """The batch's bookkeeping failed part way: fail each run whose group is not finished. A
        run counted before the failure is counted again, so its group may finish early (with
        the error) but is never left waiting."""
        with self._results_lock:
            done = set(map(id, finished))
            for run in batch:
                group = run[GROUP]
                if id(group) in done:
                    continue
                k = len(run[ITEMS])
                group.results[run[POS]:run[POS] + k] = [Failure(error)] * k
                group.remaining -= k
                if group.remaining <= 0:
                    done.add(id(group))
                    finished.append(group)
