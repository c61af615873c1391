"""bp.dynamically: the worker outlives every error, and no caller is left waiting.

Whatever the function raises, BaseExceptions included (CancelledError from an async function,
SystemExit, KeyboardInterrupt), goes to the callers of its batch; a failure of the worker's own
bookkeeping fails the callers concerned. Either way later calls work. Every call here runs with a
bounded wait, so that a stranded caller fails the test instead of hanging it.
"""
from __future__ import annotations

import asyncio
import threading

import pytest

import batchprompt as bp

from .helpers import LIMIT_S, aoutcome, outcome

STOPS = [asyncio.CancelledError, SystemExit, KeyboardInterrupt]


def batcher(body, is_async: bool, **options):
    """`body(items)` batched, as a plain or an async function."""
    if is_async:
        async def fn(items):
            await asyncio.sleep(0)
            return body(items)
    else:
        def fn(items):
            return body(items)
    return bp.dynamically(**{"batch_size": 4, "timeout_ms": 5, **options})(fn)


def upper(items):
    return [x.upper() for x in items]


def asyncio_outcomes(*make_calls):
    """On a new loop, each `make_call()` awaited in a task of its own, all started in one turn of
    the loop (so that their items share a batch): the results or exceptions, bounded."""
    async def main():
        return await asyncio.gather(*(aoutcome(make()) for make in make_calls))

    return outcome(lambda: asyncio.run(main()))


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("stop", STOPS, ids=lambda e: e.__name__)
def test_a_base_exception_from_the_function_reaches_its_callers_and_the_worker_goes_on(stop, is_async):
    calls = []

    def body(items):
        calls.append(list(items))
        if any(x.startswith("stop") for x in items):
            raise stop()
        return upper(items)

    f = batcher(body, is_async)
    assert isinstance(outcome(lambda: f("stop-1", timeout=LIMIT_S)), stop)
    assert isinstance(outcome(lambda: f("stop-2")), stop)
    assert isinstance(outcome(lambda: f.many(["stop-3", "a"])), stop)
    assert [type(e) for e in asyncio_outcomes(lambda: f.acall("stop-4"), lambda: f.amany(["stop-5"]))] == [stop, stop]
    assert calls[2] == ["stop-3", "a"] and ["a"] not in calls  # a stop is not retried item by item
    assert outcome(lambda: f("b")) == "B"  # the worker goes on, for threads and asyncio callers
    assert asyncio_outcomes(lambda: f.acall("c"), lambda: f.amany(["d", "e"])) == ["C", ["D", "E"]]
    assert f.stats.errors == 6


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("stop", STOPS, ids=lambda e: e.__name__)
def test_a_base_exception_while_a_failing_batch_is_split_reaches_that_caller_alone(stop, is_async):
    """The batch fails with an Exception, so it is split and retried; one of its halves then
    raises a BaseException: the callers in that half get it, the others their results."""
    calls = []

    def body(items):
        calls.append(list(items))
        if "bad" in items and len(items) > 1:
            raise ValueError("a batch with 'bad' in it")
        if items == ["bad"]:
            raise stop()
        return upper(items)

    f = batcher(body, is_async, batch_size=8)
    out = asyncio_outcomes(*(lambda x=x: f.acall(x) for x in ["a", "bad", "b", "c"]))
    assert out[0] == "A" and isinstance(out[1], stop) and out[2:] == ["B", "C"]
    assert calls[0] == ["a", "bad", "b", "c"] and ["bad"] in calls  # the split was in play
    threads = [outcome(lambda x=x: f(x)) for x in ["d", "bad", "e"]]
    assert threads[0] == "D" and isinstance(threads[1], stop) and threads[2] == "E"
    assert isinstance(outcome(lambda: f.many(["f", "bad", "g"])), stop)
    assert outcome(lambda: f.many(["h", "i"])) == ["H", "I"]


class Rows:
    """A result sequence read by index only, as some array types are (no slices)."""

    def __init__(self, values, broken: bool = False):
        self.values, self.broken = values, broken

    def __len__(self):
        return len(self.values)

    def __getitem__(self, i):
        if not isinstance(i, int):
            raise TypeError("Rows takes int indices")
        if self.broken:
            raise RuntimeError("cannot read row")
        return self.values[i]


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_results_that_cannot_be_sliced_or_read_do_not_stop_the_worker(is_async):
    f = batcher(lambda items: Rows(upper(items), broken="broken" in items), is_async)
    assert outcome(lambda: f.many(["a", "b"])) == ["A", "B"]  # several items per caller: sliced before
    assert isinstance(outcome(lambda: f.many(["c", "broken"])), RuntimeError)
    assert outcome(lambda: f("d")) == "D"
    assert asyncio_outcomes(lambda: f.amany(["e", "f"]), lambda: f.acall("g")) == [["E", "F"], "G"]


def test_a_failure_in_the_workers_bookkeeping_fails_that_batch_and_the_worker_goes_on():
    f = batcher(upper, False)
    p = f.processor
    record = p._stats.batch

    def broken(*args):
        del p._stats.batch  # once
        raise RuntimeError("stats failed")

    p._stats.batch = broken
    assert isinstance(outcome(lambda: f.many(["a", "b"])), RuntimeError)
    assert p._stats.batch == record
    assert outcome(lambda: f("c")) == "C"
    assert asyncio_outcomes(lambda: f.acall("d")) == ["D"]


def test_a_worker_that_fails_between_batches_fails_the_queued_callers_reports_and_is_replaced(monkeypatch):
    """The worker's own loop fails outside a batch (here while it cuts the next one): every
    queued caller gets the error, threading.excepthook reports it, and the next call starts a
    new worker."""
    reported = []
    seen = threading.Event()

    def hook(args):
        reported.append((args.exc_type, args.thread.name))
        seen.set()

    monkeypatch.setattr(threading, "excepthook", hook)
    # Batches are cut run by run (cost), and close at 3 items, so that all three are in the first.
    f = batcher(upper, False, batch_size=3, timeout_ms=60_000, cost=len, max_batch_cost=100)
    p = f.processor
    cut = p._take_runs

    def broken():
        del p._take_runs  # once
        raise RuntimeError("cutting failed")

    p._take_runs = broken
    out = asyncio_outcomes(lambda: f.acall("a"), lambda: f.amany(["b", "c"]))
    assert [type(e) for e in out] == [RuntimeError, RuntimeError]
    assert seen.wait(LIMIT_S)
    assert [(kind, name.startswith("dynamically-")) for kind, name in reported] == [(RuntimeError, True)]
    assert p._take_runs == cut
    assert outcome(lambda: f.many(["d", "e", "f"])) == ["D", "E", "F"]
    assert asyncio_outcomes(lambda: f.acall("g"), lambda: f.amany(["h", "i"])) == ["G", ["H", "I"]]


def test_a_worker_that_cannot_start_fails_the_call_and_the_next_call_starts_one(monkeypatch):
    """Starting the worker thread fails (too many threads): the callers get the error, on
    threads and on asyncio, and the next call starts a worker."""
    start = threading.Thread.start

    def cannot_start(thread):
        if thread.name.startswith("dynamically-"):
            raise RuntimeError("can't start new thread")
        start(thread)

    f = batcher(upper, False)
    monkeypatch.setattr(threading.Thread, "start", cannot_start)
    assert isinstance(outcome(lambda: f("a", timeout=LIMIT_S)), RuntimeError)
    assert isinstance(outcome(lambda: f("b")), RuntimeError)
    out = asyncio_outcomes(lambda: f.acall("c"), lambda: f.amany(["d", "e"]))
    assert [type(e) for e in out] == [RuntimeError, RuntimeError]
    monkeypatch.undo()
    assert outcome(lambda: f("f", timeout=LIMIT_S)) == "F"
    assert outcome(lambda: f("g")) == "G"
    assert asyncio_outcomes(lambda: f.acall("h")) == ["H"]
