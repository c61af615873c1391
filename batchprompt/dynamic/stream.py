"""Streaming an iterable through a batcher: `f.imap(items)` and `f.aimap(items)` yield results in
input order while later items are still queued, and never hold more than `max_in_flight` items
taken from the iterable and not yet yielded, so an iterable of millions streams in bounded memory.

Items are queued in chunks (one group each); the oldest chunk's results are yielded as soon as
it is done. An item's error is raised when its turn comes, and ends the iteration (as `map`).
So does an error of the iterable itself, after the results of every item taken before it (as
`map`: they were lost, those in flight withdrawn unrun).
"""
from __future__ import annotations

import asyncio
import contextvars
import threading
from collections import deque
from itertools import islice
from typing import Any, AsyncIterable, AsyncIterator, Iterable, Iterator

from .errors import QueueFull
from .results import value
from .waiter import Waiter


def in_flight_limit(processor, max_in_flight: int) -> tuple[int, int]:
    """(max_in_flight, chunk size): within the batcher's max_queue, which a stream that queues
    more than it holds would fill by itself; chunks big enough to fill batches, small enough that
    a few are in flight at once."""
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
    if processor.max_queue is not None:
        max_in_flight = min(max_in_flight, processor.max_queue)
    return max_in_flight, max(1, min(processor.max_batch_size, max_in_flight // 4))


def imap(processor, items: Iterable, max_in_flight: int, priority: int, own_thread: bool = False) -> Iterator:
    """`own_thread`: the items are taken on a thread of their own (`_Feed`), not the consumer's."""
    max_in_flight, chunk = in_flight_limit(processor, max_in_flight)
    if own_thread:
        yield from _fed(processor, items, max_in_flight, chunk, priority)
        return
    source = iter(items)
    pending: deque = deque()  # groups, oldest first
    in_flight = 0  # items taken from `source` and not yet yielded
    exhausted = False
    failed: Exception | None = None  # the iterable's own error, raised after what it gave before
    try:
        while True:
            while not exhausted and in_flight < max_in_flight:
                part, failed = _take(source, min(chunk, max_in_flight - in_flight))
                if part:
                    pending.append(processor.submit(part, priority, solo=True))  # waited on oldest first
                    in_flight += len(part)
                if not part or failed is not None:
                    exhausted = True
                    break
            if not pending:
                if failed is not None:
                    raise failed
                return
            group = pending[0]
            group.wait()
            pending.popleft()
            results = group.results
            in_flight -= len(results)
            for r in results:
                yield value(r)
    finally:  # left early (an error, Ctrl-C, a break): what is still queued would run for nobody
        if pending:
            processor.withdraw(pending)


def _take(source: Iterator, n: int) -> tuple[list, Exception | None]:
    """Up to `n` next items of `source`, and the error it raised after them, if it did."""
    part: list = []
    try:
        part.extend(islice(source, n))
    except Exception as e:  # noqa: BLE001  (handed back: raised once the items before it are yielded)
        return part, e
    return part, None


def _fed(processor, items: Iterable, max_in_flight: int, chunk: int, priority: int) -> Iterator:
    feed = _Feed(processor, iter(items), max_in_flight, chunk, priority)
    try:
        while True:
            group = feed.oldest()
            if group is None:  # the iterable ended (or failed) and everything taken is yielded
                if feed.failed is not None:
                    raise feed.failed
                return
            group.wait()
            results = group.results
            feed.yielded(len(results))
            for r in results:
                yield value(r)
    finally:  # left early (an error, Ctrl-C, a break): what is still queued would run for nobody
        feed.stop()


class _Feed:
    """Takes the items from the iterable on a thread of its own, as multiprocessing's imap does
    (imap's `own_thread=True`). Taken on the consumer's thread, an item's result waits until the
    next items came: an iterable that waits for a result (a crawler fed by what it finds) waits
    for ever, and a slow one holds back every result already done. On a thread of its own, the
    iterable must not be bound to the consumer's (a sqlite3 cursor is). The items taken are
    queued in chunks of up to `chunk`; whatever has been taken is queued whenever the consumer
    would otherwise wait."""

    def __init__(self, processor, source: Iterator, max_in_flight: int, chunk: int, priority: int):
        self._processor, self._source, self._priority = processor, source, priority
        self._max, self._chunk = max_in_flight, chunk
        self._cond = threading.Condition()
        self._part: list = []  # taken and not queued yet
        self._pending: deque = deque()  # queued groups, oldest first
        self._in_flight = 0  # taken and not yet yielded
        self._ended = self._stopped = False
        self.failed: Exception | None = None  # the iterable's own error, raised after what it gave before
        # In the caller's context (its contextvars), as the iterable would have run there.
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._run,),
                                        name="batchprompt-imap-feed", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        reserved = False  # a place in max_in_flight taken for the next item
        try:
            while True:
                with self._cond:
                    while self._in_flight >= self._max and not self._stopped:
                        self._cond.wait()
                    if self._stopped:
                        return
                    self._in_flight += 1
                    reserved = True
                try:
                    item = next(self._source)
                except StopIteration:
                    return
                except Exception as e:  # noqa: BLE001  (handed back: raised once the items before it are yielded)
                    self.failed = e
                    return
                with self._cond:
                    if self._stopped:
                        return
                    self._part.append(item)
                    reserved = False
                    if len(self._part) >= self._chunk:
                        self._queue()
                        self._cond.notify_all()
                    elif len(self._part) == 1:  # the consumer may wait for a first item
                        self._cond.notify_all()
        finally:
            with self._cond:
                self._ended = True
                self._in_flight -= reserved
                self._cond.notify_all()

    def _queue(self) -> None:
        """Queue what has been taken as one group (under the lock: groups stay in input order)."""
        part, self._part = self._part, []
        self._pending.append(self._processor.submit(part, self._priority, solo=True))

    def oldest(self):
        """The oldest group queued (what has been taken is queued first), waiting for the feed
        to take an item while there is none; None once the iterable is done and all is yielded."""
        with self._cond:
            while True:
                if self._part:
                    self._queue()
                if self._pending:
                    return self._pending[0]
                if self._ended:
                    return None
                self._cond.wait()

    def yielded(self, n: int) -> None:
        with self._cond:
            self._pending.popleft()
            self._in_flight -= n
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            pending, self._pending = list(self._pending), deque()
            self._cond.notify_all()
        if pending:
            self._processor.withdraw(pending)


async def aimap(processor, items: Iterable | AsyncIterable, max_in_flight: int, priority: int) -> AsyncIterator:
    """`imap` for asyncio, its items taken by a task of their own (as `_Feed`'s thread takes them)."""
    max_in_flight, chunk = in_flight_limit(processor, max_in_flight)
    loop = asyncio.get_running_loop()
    take = _async_taker(items)
    pending: deque = deque()  # (group, start, stop), oldest first
    part: list = []  # taken and not queued yet
    in_flight = 0  # taken and not yet yielded
    ended = False
    failed: Exception | None = None  # the iterable's own error, raised after what it gave before
    changed, room, queuing = asyncio.Event(), asyncio.Event(), asyncio.Lock()

    async def queue_part() -> None:  # under `queuing`: the groups stay in input order
        if part:
            taken = part[:]
            del part[:]
            pending.append(await _submit(processor, taken, loop, priority))

    async def feed() -> None:
        nonlocal in_flight, ended, failed
        reserved = False
        try:
            while True:
                while in_flight >= max_in_flight:
                    room.clear()
                    await room.wait()
                in_flight += 1
                reserved = True
                got, item, failed = await take()
                if not got:
                    return
                part.append(item)
                reserved = False
                if len(part) >= chunk:
                    async with queuing:
                        await queue_part()
                changed.set()
        finally:
            ended = True
            in_flight -= reserved
            changed.set()

    feeder = asyncio.ensure_future(feed())
    try:
        while True:
            async with queuing:
                await queue_part()
            if not pending:
                if ended and not part:
                    if failed is not None:
                        raise failed
                    return
                changed.clear()
                if not part and not ended:
                    await changed.wait()
                continue
            group, start, stop = pending[0]
            waiter = Waiter(group, start, stop)
            try:
                await waiter
            except BaseException:
                if waiter.is_cancelled or not group.resolved:  # this task was cancelled: not an item's error
                    raise
            pending.popleft()
            in_flight -= stop - start
            room.set()
            for r in group.results[start:stop]:
                yield value(r)
    finally:  # left early: what is still queued would run for nobody (a group is this loop
        # turn's: other callers' items may share it, so only a group of this stream's own goes)
        feeder.cancel()
        own = [group for group, start, stop in pending if start == 0 and stop == len(group.results)]
        if own:
            processor.withdraw(own)


async def _submit(processor, part: list, loop: asyncio.AbstractEventLoop, priority: int) -> tuple:
    while True:
        try:
            return processor.submit_async(part, loop, priority, None)
        except QueueFull:
            if not processor.block_when_full:
                raise
            await asyncio.sleep(processor.timeout or 0.001)  # never block the event loop on a lock


def _async_taker(items: Iterable | AsyncIterable):
    """`take()`: (True, the next item, None), or (False, None, the error the iterable raised, or
    None where it ended), from a plain or an async iterable."""
    if hasattr(items, "__aiter__"):
        source = items.__aiter__()

        async def take() -> tuple[bool, Any, Exception | None]:
            try:
                return True, await source.__anext__(), None
            except StopAsyncIteration:
                return False, None, None
            except Exception as e:  # noqa: BLE001  (raised once the items before it are yielded)
                return False, None, e
    else:
        plain = iter(items)

        async def take() -> tuple[bool, Any, Exception | None]:
            try:
                return True, next(plain), None
            except StopIteration:
                return False, None, None
            except Exception as e:  # noqa: BLE001
                return False, None, e
    return take
