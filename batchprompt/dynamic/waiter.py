"""Waiter: one asyncio caller's wait for its items in a group shared with other callers.

Callers on one event loop that submit in the same turn of the loop share one group, whose
results arrive together. Each caller awaits a Waiter of its own, a minimal future in the form
that `asyncio.Task` drives (`_asyncio_future_blocking`, `add_done_callback`, `result`, `cancel`):

- cancelling one caller (`task.cancel()`, `asyncio.wait_for`) wakes that caller alone with
  CancelledError; the others keep waiting for their results (a shared asyncio.Future would be
  cancelled for all of them);
- when the group's results arrive, one loop callback (`resolve`) steps all its callers' tasks,
  instead of one scheduled callback per caller.

A Waiter is awaited by exactly one task, once, and is not handed to user code, so it has only
the methods a task calls.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from .results import unwrap, value


class Waiter:
    __slots__ = ("group", "start", "stop", "is_cancelled", "callback", "context", "_asyncio_future_blocking")

    def __init__(self, group, start: int, stop: int | None):
        """Results [start:stop] of `group` (stop None: the single result at `start`)."""
        self.group = group
        self.start, self.stop = start, stop
        self.is_cancelled = False
        self.callback: Callable | None = None
        self.context = None
        self._asyncio_future_blocking = False

    # ---- awaiting: `await waiter` yields the waiter itself to the task, once -------------
    def __await__(self):
        return self

    __iter__ = __await__

    def __next__(self):
        if not self.done():
            self._asyncio_future_blocking = True
            return self
        raise StopIteration(self.result())

    # ---- the future protocol the task uses -------------------------------------------------
    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self.group.loop

    def done(self) -> bool:
        return self.is_cancelled or self.group.resolved

    def add_done_callback(self, fn: Callable, *, context=None) -> None:
        if self.done():
            self.group.loop.call_soon(fn, self, context=context)
            return
        if self.callback is not None:
            raise RuntimeError("a batching waiter is awaited by one task only")
        self.callback, self.context = fn, context
        self.group.waiters.append(self)

    def cancel(self, msg: Any = None) -> bool:
        """Wake this caller alone with CancelledError. Its items stay in their batch (the
        function may be running them); their results are dropped."""
        if self.done():
            return False
        self.is_cancelled = True
        if self.callback is not None:
            self.group.loop.call_soon(self.callback, self, context=self.context)
        return True

    def result(self) -> Any:
        if self.is_cancelled:
            raise asyncio.CancelledError()
        if not self.group.resolved:
            raise asyncio.InvalidStateError("the batch has not finished")
        results = self.group.results
        if self.stop is None:
            return value(results[self.start])
        return unwrap(results, self.start, self.stop)


def resolve(groups: list) -> None:
    """On the callers' event loop: the groups' results are in; step every waiting task."""
    waiters = []
    for group in groups:
        group.resolved = True
        waiters += group.waiters
        group.waiters = []
    _wake(waiters)


def _wake(waiters: list[Waiter]) -> None:
    for i, w in enumerate(waiters):
        if w.is_cancelled:  # already woken by cancel()
            continue
        try:
            if w.context is not None:
                w.context.run(w.callback, w)
            else:
                w.callback(w)
        except (KeyboardInterrupt, SystemExit):
            # A task let the function's KeyboardInterrupt out, and asyncio stops its loop with it:
            # the other callers are woken on the loop's next turn (asyncio.run's clean-up), or
            # they would wait for ever, and cannot even be cancelled.
            if i + 1 < len(waiters):
                w.group.loop.call_soon(_wake, waiters[i + 1:])
            raise
        except BaseException as e:  # noqa: BLE001 - one caller's failure must not strand the others
            w.group.loop.call_exception_handler({"message": "batching: waking a caller failed", "exception": e})
