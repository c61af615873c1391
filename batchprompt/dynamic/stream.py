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


def imap(processor, items: Iterable, max_in_flight: int, priority: int) -> Iterator:
    max_in_flight, chunk = in_flight_limit(processor, max_in_flight)
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


async def aimap(processor, items: Iterable | AsyncIterable, max_in_flight: int, priority: int) -> AsyncIterator:
    max_in_flight, chunk = in_flight_limit(processor, max_in_flight)
    loop = asyncio.get_running_loop()
    take = _async_taker(items)
    pending: deque = deque()  # (group, start, stop), oldest first
    in_flight = 0
    exhausted = False
    failed: Exception | None = None  # the iterable's own error, raised after what it gave before
    try:
        while True:
            while not exhausted and in_flight < max_in_flight:
                part, failed = await take(min(chunk, max_in_flight - in_flight))
                if part:
                    pending.append(await _submit(processor, part, loop, priority))
                    in_flight += len(part)
                if not part or failed is not None:
                    exhausted = True
                    break
            if not pending:
                if failed is not None:
                    raise failed
                return
            group, start, stop = pending[0]
            waiter = Waiter(group, start, stop)
            try:
                await waiter
            except BaseException:
                if waiter.is_cancelled or not group.resolved:  # this task was cancelled: not an item's error
                    raise
            pending.popleft()
            in_flight -= stop - start
            for r in group.results[start:stop]:
                yield value(r)
    finally:  # left early: what is still queued would run for nobody (a group is this loop
        # turn's: other callers' items may share it, so only a group of this stream's own goes)
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
    """`take(n)`: up to n next items, from a plain or an async iterable, and the error it raised
    after them, if it did (as `_take`)."""
    if hasattr(items, "__aiter__"):
        source = items.__aiter__()

        async def take(n: int) -> tuple[list[Any], Exception | None]:
            part: list[Any] = []
            for _ in range(n):
                try:
                    part.append(await source.__anext__())
                except StopAsyncIteration:
                    break
                except Exception as e:  # noqa: BLE001  (raised once the items before it are yielded)
                    return part, e
            return part, None
    else:
        plain = iter(items)

        async def take(n: int) -> tuple[list[Any], Exception | None]:
            return _take(plain, n)
    return take
