"""bp.dynamically: imap / aimap stream an iterable in input order, with bounded memory."""
from __future__ import annotations

import asyncio
import threading

import pytest

import batchprompt as bp

from .helpers import LIMIT_S, Recorder, in_function, outcome, wait_until


class Source:
    """An iterable that counts the items taken from it."""

    def __init__(self, n: int):
        self.n, self.taken = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.taken += 1
            yield i


def test_imap_yields_in_order_and_never_holds_more_than_max_in_flight():
    f = bp.dynamically(batch_size=16, timeout_ms=1)(lambda items: [x * 2 for x in items])
    source = Source(5000)
    held = []

    def consume():
        out = []
        for i, r in enumerate(f.imap(source, max_in_flight=100)):
            held.append(source.taken - i)  # taken from the iterable and not yet yielded (this one included)
            out.append(r)
        return out

    assert outcome(consume) == [2 * i for i in range(5000)]
    assert max(held) <= 100 and max(held) > 25  # bounded, and several chunks were in flight at once


def test_imap_stops_taking_items_while_max_in_flight_wait_for_results():
    rec = Recorder(hold_first=True)
    f = bp.dynamically(batch_size=8, timeout_ms=1)(rec)
    source = Source(1000)
    out = []
    t = threading.Thread(target=lambda: out.extend(f.imap(source, max_in_flight=40)))
    t.start()
    assert rec.started.wait(LIMIT_S)
    wait_until(lambda: source.taken == 40 and in_function(t, "wait"), "imap waits with 40 items in flight")
    assert source.taken == 40 and out == []
    rec.release.set()
    t.join(LIMIT_S)
    assert out == [10 * i for i in range(1000)]


def test_imap_with_several_of_its_chunks_in_one_batch():
    """max_in_flight=16 against batch_size=16: chunks of 4, so one batch holds four chunks of one
    imap, which waits on them oldest first. Callers of a batch are woken newest first, in chains
    where each wakes the next: an imap's chunks must not be in such a chain (its oldest chunk
    would wait for a wake-up from a newer one, which the same thread waits on only later)."""
    rec = Recorder(hold_first=True)
    f = bp.dynamically(batch_size=16, timeout_ms=60_000)(rec)  # batches close only when full
    out = []
    t = threading.Thread(target=lambda: out.extend(f.imap(range(64), max_in_flight=16)), daemon=True)
    t.start()
    assert rec.started.wait(LIMIT_S)
    assert rec.batches[0] == list(range(16))  # four chunks of 4
    rec.release.set()
    t.join(LIMIT_S)
    assert out == [10 * i for i in range(64)]


def test_imap_results_stay_in_order_when_a_later_batch_finishes_first():
    later_done = threading.Event()

    @bp.dynamically(batch_size=4, timeout_ms=1, workers=2)
    def slow_first(items):
        if 0 in items:
            assert later_done.wait(LIMIT_S)  # the first batch finishes after a later one
        else:
            later_done.set()
        return [x + 1 for x in items]

    assert outcome(lambda: list(slow_first.imap(range(40), max_in_flight=16))) == list(range(1, 41))


def test_imap_raises_an_items_error_at_its_turn():
    @bp.dynamically(batch_size=4, timeout_ms=1)
    def inverse(items):
        return [ZeroDivisionError("zero") if x == 0 else 1 / x for x in items]

    got = []

    def consume():
        for r in inverse.imap([1, 2, 0, 4]):
            got.append(r)

    assert isinstance(outcome(consume), ZeroDivisionError) and got == [1, 0.5]


def _failing_source(n: int):
    yield from range(n)
    raise RuntimeError("the source failed")


async def _failing_async_source(n: int):
    for i in range(n):
        yield i
    raise RuntimeError("the source failed")


@pytest.mark.parametrize("max_in_flight", [1024, 4])
def test_an_iterables_own_error_comes_after_the_results_of_what_it_gave(max_in_flight):
    """As `map`: the results of the items taken before the iterable raised, then its error. They
    were lost (none of 10 yielded; with max_in_flight=4, 7 of 10)."""
    f = bp.dynamically(batch_size=64, timeout_ms=5)(lambda items: [x * 2 for x in items])
    got = []

    def consume():
        for r in f.imap(_failing_source(10), max_in_flight=max_in_flight):
            got.append(r)

    error = outcome(consume)
    assert isinstance(error, RuntimeError) and str(error) == "the source failed"
    assert got == [x * 2 for x in range(10)]

    async def consume_async(items):
        out = []
        try:
            async for r in f.aimap(items, max_in_flight=max_in_flight):
                out.append(r)
        except RuntimeError as e:
            return out, e
        return out, None

    for items in (_failing_source(10), _failing_async_source(10)):
        out, error = asyncio.run(asyncio.wait_for(consume_async(items), LIMIT_S))
        assert out == [x * 2 for x in range(10)] and str(error) == "the source failed"


def test_aimap_streams_plain_and_async_iterables_in_order_with_bounded_memory():
    f = bp.dynamically(batch_size=16, timeout_ms=1)(lambda items: [x * 3 for x in items])
    taken = 0
    held = []

    async def numbers():
        nonlocal taken
        for i in range(3000):
            taken += 1
            yield i

    async def main():
        plain = [r async for r in f.aimap(range(500), max_in_flight=64)]
        out = []
        async for r in f.aimap(numbers(), max_in_flight=64):
            held.append(taken - len(out))
            out.append(r)
        return plain, out

    plain, out = outcome(lambda: asyncio.run(main()))
    assert plain == [3 * i for i in range(500)] and out == [3 * i for i in range(3000)]
    assert max(held) <= 64


def test_aimap_raises_an_items_error_at_its_turn_and_can_be_cancelled():
    rec = Recorder(hold_first=True)
    f = bp.dynamically(batch_size=4, timeout_ms=1)(lambda items: [KeyError(x) if x == 2 else x for x in items])
    g = bp.dynamically(batch_size=4, timeout_ms=1)(rec)

    async def main():
        got = []
        with pytest.raises(KeyError):
            async for r in f.aimap([0, 1, 2, 3]):
                got.append(r)
        consumer = asyncio.create_task(anext(g.aimap(range(10))))
        await asyncio.to_thread(rec.started.wait, LIMIT_S)
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        rec.release.set()
        return got

    assert outcome(lambda: asyncio.run(main())) == [0, 1]


class Gate:
    """A batch function whose first batch runs at once; the next waits for `gate` (so that
    the rest of the queue is still there), then all run."""

    def __init__(self):
        self.batches: list[list] = []
        self.second = threading.Event()
        self.gate = threading.Event()

    def __call__(self, items: list) -> list:
        self.batches.append(list(items))
        if len(self.batches) == 2:
            self.second.set()
            self.gate.wait(LIMIT_S)
        return [x * 10 for x in items]

    def ran(self) -> list:
        return [x for batch in self.batches for x in batch if x != 100]


def test_an_imap_left_early_takes_its_queued_items_off_the_queue():
    """A consumer that stops (a break, an error, Ctrl-C) leaves items nobody will read: they
    are withdrawn unrun, not run ahead of later callers (all 20 ran before)."""
    fn = Gate()
    g = bp.dynamically(batch_size=2, timeout_ms=1)(fn)
    source = Source(20)
    stream = g.imap(source, max_in_flight=20)  # queued in chunks of 2 as the feed takes them
    assert next(stream) == 0
    assert fn.second.wait(LIMIT_S)  # the second batch runs (held), the rest are queued
    wait_until(lambda: source.taken == 20, "the feed takes every item")
    stream.close()  # the consumer leaves
    fn.gate.set()
    assert g.many([100]) == [1000]
    ran = fn.ran()  # the two batches that ran before the close: the first item (alone, or with the
    # second, as the feed had taken it when the consumer queued it) and the next chunk
    assert ran == list(range(len(ran))) and 2 <= len(ran) <= 4, fn.batches
    # the rest withdrawn unrun (all but the last item, where the feed had not queued it yet)
    assert 20 - len(ran) - 1 <= g.stats.withdrawn <= 20 - len(ran), (fn.batches, g.stats)


def test_an_aimap_left_early_takes_its_queued_items_off_the_queue():
    fn = Gate()
    g = bp.dynamically(batch_size=2, timeout_ms=1)(fn)

    source = Source(20)

    async def main():
        stream = g.aimap(source, max_in_flight=20)
        assert await anext(stream) == 0
        await asyncio.to_thread(fn.second.wait, LIMIT_S)
        while source.taken < 20:  # the feed takes every item (bounded by outcome's limit)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # and queues its last chunk
        await stream.aclose()
        fn.gate.set()
        return await g.amany([100])

    assert outcome(lambda: asyncio.run(main())) == [1000]
    ran = fn.ran()
    assert len(ran) < 20 and 20 - len(ran) - 1 <= g.stats.withdrawn <= 20 - len(ran), (fn.batches, g.stats)


def test_max_in_flight_is_checked():
    f = bp.dynamically()(lambda items: items)
    with pytest.raises(ValueError, match="max_in_flight must be an int >= 1"):
        next(f.imap([1], max_in_flight=0))


def test_an_iterable_that_waits_for_a_result_gets_it_and_a_slow_one_holds_back_none():
    """Taken on the consumer's thread, in chunks, an item's result waits until the next items
    came: an iterable fed by the results (a crawler) waited for ever, and a slow one held back
    every result already done until its next item. imap(own_thread=True) takes them on a thread
    of its own; aimap takes an async iterable's in a task of its own."""
    f = bp.dynamically(batch_size=8, timeout_ms=2)(lambda items: [x * 2 for x in items])
    seen = threading.Event()

    def fed_by_its_results():
        yield 1
        yield 2 if seen.wait(LIMIT_S / 2) else "the result of 1 never came"

    def collect(items, got_one: threading.Event) -> list:
        out = []
        for r in f.imap(items, own_thread=True):
            out.append(r)
            got_one.set()
        return out

    assert outcome(lambda: collect(fed_by_its_results(), seen)) == [2, 4]
    late = threading.Event()

    def slow():
        yield 1
        late.wait(LIMIT_S)  # until the first result is in
        yield 3

    assert outcome(lambda: collect(slow(), late)) == [2, 6]

    async def fed_async(event):
        yield 1
        try:
            await asyncio.wait_for(event.wait(), LIMIT_S / 2)
            yield 2
        except asyncio.TimeoutError:
            yield "the result of 1 never came"

    async def consume_async():
        event, out = asyncio.Event(), []
        async for r in f.aimap(fed_async(event)):
            out.append(r)
            event.set()
        return out

    assert asyncio.run(asyncio.wait_for(consume_async(), LIMIT_S)) == [2, 4]


def test_an_iterable_bound_to_its_thread_is_read_on_it_unless_own_thread_is_asked():
    """A sqlite3 cursor (check_same_thread) is read where it was made: taken on a thread of
    imap's own, it failed ("SQLite objects created in a thread can only be used in that same thread")."""
    import sqlite3

    f = bp.dynamically(batch_size=8, timeout_ms=1)(lambda items: [x.upper() for x in items])
    db = sqlite3.connect(":memory:")
    db.execute("create table t(s)")
    db.executemany("insert into t values (?)", [(f"row{i}",) for i in range(20)])
    rows = (r[0] for r in db.execute("select s from t order by rowid"))
    assert list(f.imap(rows)) == [f"ROW{i}" for i in range(20)]  # on this thread, where the cursor was made
    with pytest.raises(TypeError, match="own_thread must be True or False"):
        list(f.imap([1], own_thread="yes"))
