"""The worker: one thread per batcher that takes batches off the queue, runs the function on
them and hands each caller its results.

A mixin of BatchProcessor. The worker outlives every error: whatever the function raises
(`BaseException`s such as CancelledError and SystemExit included) goes to the callers of its
batch, and an error in the worker's own bookkeeping fails the callers concerned and never
leaves one waiting.
"""
from __future__ import annotations

import asyncio
import inspect
import threading
import time
from itertools import chain

from .errors import BatchSizeMismatch, DeadlineExceeded
from .groups import _Group, hand_over
from .queue import DEADLINE, GROUP, ITEMS, POS, QUEUED, _deadline_of, _items_of, _queued_of, _Run
from .results import Failure


class Worker:
    def _start_worker(self) -> None:
        """Under the lock. `_worker` is set once the thread runs: if it cannot start, the next
        call tries again (instead of waiting on a thread that never ran)."""
        worker = threading.Thread(target=self._run, name=f"dynamically-{self.name}", daemon=True)
        worker.start()
        self._worker = worker

    def _run(self) -> None:
        try:
            while True:
                batch = self._take()
                if batch is None:
                    return
                hand_over(self._serve(batch))
        except BaseException as e:
            self._abandon(e)
            raise  # a defect in the batcher: reported by threading.excepthook

    def _take(self) -> list[_Run] | None:
        """The next batch; None when the worker has been idle for `idle_exit_s` and should end."""
        with self._cond:
            while True:
                if not self._size:
                    # Expect more soon: wait one timeout without asking callers to wake us for
                    # their first item (a wake-up then only costs a GIL hand-off); then idle.
                    self._cond.wait(self.timeout)
                    if not self._size:
                        self._idle = True
                        self._cond.wait(self.idle_exit_s)
                        self._idle = False
                        if not self._size:  # end; a caller seeing no worker starts another
                            self._worker = None
                            self._close_loop()  # under the lock: the next worker makes its own
                            return None
                full = self._size >= self.batch_size or (
                    self.max_batch_cost is not None and self._queued_cost >= self.max_batch_cost)
                left = self._first_arrival + self.timeout - time.monotonic()
                if full or left <= 0:
                    break
                self._cond.wait(left)
            return self._pop_batch()

    def _abandon(self, error: BaseException) -> None:
        """The worker's loop failed outside a batch: fail every queued caller with the error and
        end, so that the next call starts a new worker."""
        with self._cond:
            if self._worker is not threading.current_thread():  # it failed as it ended: the queue
                return  # may already be a new worker's
            self._worker = None
            self._idle = False
            runs = self._drain()
            self._close_loop()
        finished: list[_Group] = []
        for run in runs:
            self._fail(run, error, finished)
        hand_over(finished)

    def _close_loop(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def _serve(self, batch: list[_Run]) -> list[_Group]:
        """Run one batch; the groups it finished. Never raises: if the worker's own bookkeeping
        fails, the callers of the batch get the error."""
        finished: list[_Group] = []
        try:
            now = time.monotonic()
            live = batch
            if list(map(_deadline_of, batch)).count(None) != len(batch):  # some run has a deadline
                live = []
                for run in batch:
                    if run[DEADLINE] is not None and run[DEADLINE] < now:
                        self._fail(run, DeadlineExceeded(
                            f"{self.name}: the deadline passed while the item was queued"), finished)
                    else:
                        live.append(run)
            if live:
                self._process(live, finished, now)
        except BaseException as e:  # noqa: BLE001 - a defect here must not strand the callers
            self._fail_unfinished(batch, e, finished)
        return finished

    def _call_fn(self, items: list) -> list:
        out = self.fn(items)
        if inspect.isawaitable(out):  # an async function: run it on the worker's own loop
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            out = self._loop.run_until_complete(out)  # usable again after any error, SystemExit too
        if not hasattr(out, "__len__") or not hasattr(out, "__getitem__") or isinstance(out, (str, bytes, dict)):
            raise BatchSizeMismatch(f"{self.name} returned {type(out).__name__}, not a list of {len(items)} results")
        if type(out) is not list:  # here, so that a sequence that cannot be read fails as the function
            out = list(out)
        if len(out) != len(items):
            raise BatchSizeMismatch(f"{self.name} returned {len(out)} results for a batch of {len(items)} items")
        return out

    def _process(self, runs: list[_Run], finished: list[_Group], started: float | None = None) -> None:
        """Run the function on the runs' items and put the results in their groups' slots.
        `started`: when the batch was taken (given once per batch, for the stats, and not again
        for the halves of a split)."""
        items = runs[0][ITEMS] if len(runs) == 1 else list(chain.from_iterable(map(_items_of, runs)))
        singles = len(items) == len(runs)  # one item per run (thread calls): no slicing below
        queued = list(map(_queued_of, runs))
        if started is not None:
            self._stats.batch(len(items), sum((started - q) * len(r[ITEMS]) for q, r in zip(queued, runs)))
        try:
            out = self._call_fn(items)
        except BatchSizeMismatch as e:  # the whole batch's callers get this error
            for run in runs:
                self._fail(run, e, finished)
            return
        except Exception as e:  # noqa: BLE001
            if self.split_on_error and len(items) > 1:  # isolate the culprit: bisect and retry
                ones = [([item], run[GROUP], run[POS] + i, 1, run[DEADLINE], run[QUEUED])
                        for run in runs for i, item in enumerate(run[ITEMS])]
                mid = len(ones) // 2
                self._process(ones[:mid], finished)
                self._process(ones[mid:], finished)
            else:
                for run in runs:
                    self._fail(run, e, finished)
            return
        except BaseException as e:  # noqa: BLE001 - CancelledError, SystemExit, KeyboardInterrupt:
            for run in runs:  # a stop, not one item's fault, so not retried; the worker goes on
                self._fail(run, e, finished)
            return
        end = time.monotonic()
        lat = self._stats.latencies
        if singles:
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

    def _fail(self, run: _Run, error: BaseException, finished: list[_Group]) -> None:
        k = len(run[ITEMS])
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
