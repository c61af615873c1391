"""bp.dynamically's options and a call's timeout: a wrong one is one error naming it, before
anything is queued, never a worker thread that dies on it or a caller that waits for ever."""
from __future__ import annotations

import math
import threading

import pytest

import batchprompt as bp

from .helpers import Recorder, outcome


@pytest.mark.parametrize("options, named", [
    (dict(timeout_ms=float("nan")), "timeout_ms"),
    (dict(timeout_ms=float("inf")), "timeout_ms"),
    (dict(timeout_ms="5"), "timeout_ms"),
    (dict(timeout_ms=None), "timeout_ms"),
    (dict(batch_size=2.5), "batch_size"),
    (dict(batch_size="8"), "batch_size"),
    (dict(batch_size=None), "batch_size"),
    (dict(batch_size=True), "batch_size"),
    (dict(small_batch_threshold=-1), "small_batch_threshold"),
    (dict(small_batch_threshold=1.5), "small_batch_threshold"),
    (dict(small_batch_threshold=None), "small_batch_threshold"),
    (dict(min_batch_size=2.5), "min_batch_size"),
    (dict(max_queue=1.5), "max_queue"),
    (dict(block_when_full="yes"), "block_when_full"),
    (dict(split_on_error=1), "split_on_error"),
    (dict(cost=len, max_batch_cost=-1), "max_batch_cost"),
    (dict(cost=len, max_batch_cost=0), "max_batch_cost"),
    (dict(cost=len, max_batch_cost=float("nan")), "max_batch_cost"),
    (dict(length=len, max_batch_cost=-5), "max_batch_cost"),
    (dict(cost=5, max_batch_cost=10), "cost"),
    (dict(length="len"), "length"),
    (dict(pad_token=5), "pad_token"),
    (dict(target_latency_ms=float("inf")), "target_latency_ms"),
])
def test_a_bad_option_is_an_error_at_decoration_naming_it(options, named):
    with pytest.raises((ValueError, TypeError), match=named):
        bp.dynamically(**options)(lambda items: list(items))


def test_options_given_positionally_are_explained():
    """The @serve.batch(64) habit: 64 is not a function to wrap."""
    with pytest.raises(TypeError, match=r"by name, e.g. @bp.dynamically\(batch_size=64\)"):
        bp.dynamically(64)


@pytest.mark.parametrize("timeout", [float("nan"), -1, "1", True])
def test_a_bad_call_timeout_is_an_error_and_queues_nothing(timeout):
    rec = Recorder()
    f = bp.dynamically(batch_size=4, timeout_ms=1)(rec)
    with pytest.raises(ValueError, match="timeout"):
        f(7, timeout=timeout)
    with pytest.raises(ValueError, match="timeout"):
        f.many([8], timeout=timeout)
    assert f(1) == 10
    assert rec.batches == [[1]]  # neither 7 nor 8 ran


def test_an_infinite_call_timeout_is_no_limit():
    f = bp.dynamically(batch_size=4, timeout_ms=1)(Recorder())
    assert f(2, timeout=math.inf) == 20
    assert f.many([1, 2], timeout=float("inf")) == [10, 20]


def test_a_cost_function_that_returns_no_number_is_named():
    f = bp.dynamically(batch_size=4, timeout_ms=1, cost=lambda item: None, max_batch_cost=10)(Recorder())
    with pytest.raises(ValueError, match=r"cost\(item\) returned None for 3"):
        f(3)


def test_many_takes_any_iterable_and_refuses_a_string():
    f = bp.dynamically(batch_size=4, timeout_ms=1)(Recorder())
    assert f.many(x for x in (1, 2, 3)) == [10, 20, 30]
    with pytest.raises(TypeError, match="iterable of items"):
        f.many("abc")


def test_block_when_full_keeps_the_callers_deadline():
    """A caller that waits for room in a full queue still gets DeadlineExceeded on time."""
    release = threading.Event()

    def hold(items):
        release.wait(10)
        return list(items)

    f = bp.dynamically(batch_size=1, timeout_ms=1, max_queue=1, block_when_full=True)(hold)
    threading.Thread(target=lambda: f(0), daemon=True).start()  # running, held
    from .helpers import queued, wait_until
    wait_until(lambda: f.stats.batches == 1, "the first batch runs")
    threading.Thread(target=lambda: f(1), daemon=True).start()  # fills the queue
    queued(f, 1)
    try:
        got = outcome(lambda: f(2, timeout=0.3), limit=5)
        assert isinstance(got, bp.DeadlineExceeded), got

        import asyncio

        async def acaller():
            try:
                await f.acall(3, timeout=0.3)
            except bp.DeadlineExceeded as e:
                return e

        got = outcome(lambda: asyncio.run(acaller()), limit=5)
        assert isinstance(got, bp.DeadlineExceeded), got
    finally:
        release.set()


def test_one_call_of_more_items_than_max_queue_is_refused_at_once():
    """With block_when_full, amany of more items than max_queue waited for room for ever (a
    hang); many raised, without saying that no wait could ever fit it."""
    import asyncio

    f = bp.dynamically(batch_size=2, timeout_ms=1, max_queue=2, block_when_full=True)(lambda items: list(items))
    got = outcome(lambda: f.many([1, 2, 3]), limit=5)
    assert isinstance(got, bp.QueueFull) and "one call of 3 items can never fit" in str(got), got
    got = outcome(lambda: asyncio.run(f.amany([1, 2, 3])), limit=5)
    assert isinstance(got, bp.QueueFull) and "send at most 2 per call, or use imap()/aimap()" in str(got), got
    assert f.many([1, 2]) == [1, 2]
