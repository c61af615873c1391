"""bp.dynamically at the edges: a forked child, the caller's event loop after a KeyboardInterrupt
or SystemExit, tuple outputs of the tensor variant, streams within max_queue, pickling, methods of
classes without a __dict__, and a replica factory that fails."""
from __future__ import annotations

import asyncio
import os
import pickle
import sys
import threading

import pytest
import torch

import batchprompt as bp

from .helpers import LIMIT_S, Recorder, outcome


@bp.dynamically(batch_size=4, timeout_ms=1)
def doubled(items):
    return [x * 2 for x in items]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_gets_its_own_worker():
    """Forked while the parent's worker thread was alive: the child's call returned nothing, ever."""
    assert doubled(1) == 2  # the parent's worker is alive now (it idles for seconds before it ends)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, end without running the parent's tests
        code = 1
        try:
            got = doubled.many([20, 1], timeout=5)
            os.write(write, repr(got).encode())
            code = 0
        except BaseException as e:  # noqa: BLE001
            os.write(write, repr(e).encode())
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    answer = os.read(read, 1000).decode()
    os.close(read)
    assert answer == "[40, 2]" and os.waitstatus_to_exitcode(status) == 0, answer
    assert doubled(3) == 6  # the parent's batcher goes on


@pytest.mark.parametrize("stop", [SystemExit, KeyboardInterrupt])
def test_a_stop_raised_by_the_function_reaches_a_caller_with_a_timeout_and_not_its_loop(stop):
    """With timeout= the caller caught the SystemExit, and then asyncio.run raised it again and
    cancelled the loop's other tasks."""
    calls = []

    def fn(items):
        calls.append(items)
        if len(calls) == 1:
            raise stop()
        return list(items)

    f = bp.dynamically(batch_size=4, timeout_ms=1)(fn)

    async def other():
        await asyncio.sleep(0.2)
        return "other done"

    async def main():
        task = asyncio.create_task(other())
        with pytest.raises(stop):
            await f.acall(1, timeout=LIMIT_S)
        assert await f.acall(2, timeout=LIMIT_S) == 2
        return await task

    assert asyncio.run(main()) == "other done"


def test_a_call_timeout_ends_the_wait_of_that_caller_alone():
    release = threading.Event()

    def hold(items):
        release.wait(LIMIT_S)
        return list(items)

    f = bp.dynamically(batch_size=8, timeout_ms=20)(hold)

    async def main():
        patient = asyncio.create_task(f.acall(1))
        with pytest.raises(bp.DeadlineExceeded):
            await f.acall(2, timeout=0.1)
        release.set()
        return await patient

    assert asyncio.run(main()) == 1


def test_the_tensor_variant_splits_a_tuple_output_per_item():
    """A tuple (sums, maxes) went to the callers whole: with as many items as parts, caller 0
    got both sums and caller 1 both maxes."""
    @bp.dynamically(batch_size=2, timeout_ms=20, tensors=True)
    def stats(batch):
        ids = batch["input_ids"].float()
        return ids.sum(dim=1), ids.max(dim=1).values

    got = stats.many([{"input_ids": torch.arange(3)}, {"input_ids": torch.arange(5)}])
    assert [tuple(float(v) for v in g) for g in got] == [(3.0, 2.0), (10.0, 4.0)]


@pytest.mark.parametrize("output, named", [
    (lambda b: torch.tensor(1.0), "shape ()"),
    (lambda b: {"score": 7}, r"\['score'\]"),
    (lambda b: torch.zeros(3, 2), r"shape \(3, 2\)"),
])
def test_a_tensor_output_without_a_row_per_item_is_a_batch_size_mismatch(output, named):
    f = bp.dynamically(batch_size=2, timeout_ms=20, tensors=True)(output)
    with pytest.raises(bp.BatchSizeMismatch, match=named):
        f.many([{"input_ids": torch.arange(3)}, {"input_ids": torch.arange(5)}])


def test_a_stream_keeps_within_max_queue():
    """max_in_flight above max_queue failed at the first item, with no other caller."""
    f = bp.dynamically(batch_size=4, timeout_ms=1, max_queue=8)(Recorder())
    assert list(f.imap(range(100))) == [x * 10 for x in range(100)]

    async def main():
        return [r async for r in f.aimap(range(50))]

    assert asyncio.run(main()) == [x * 10 for x in range(50)]


def test_errors_put_in_slots_count_in_the_stats():
    f = bp.dynamically(batch_size=4, timeout_ms=20)(lambda items: [ValueError(x) if x < 0 else x for x in items])
    with pytest.raises(ValueError):
        f.many([1, -1, -2])
    assert f(3) == 3
    assert f.stats.errors == 2


def test_a_top_level_batched_function_pickles_by_name():
    assert pickle.loads(pickle.dumps(doubled)) is doubled
    local = bp.dynamically(lambda items: items)
    with pytest.raises((TypeError, pickle.PicklingError), match="top level"):
        pickle.dumps(local)


def test_batched_methods_of_classes_without_an_instance_dict():
    class Slotted:
        __slots__ = ("k", "__weakref__")

        def __init__(self, k):
            self.k = k

        @bp.dynamically(batch_size=4, timeout_ms=1)
        def run(self, items):
            return [x * self.k for x in items]

    class Bare:
        __slots__ = ()

        @bp.dynamically(batch_size=4, timeout_ms=1)
        def run(self, items):
            return list(items)

    a, b = Slotted(2), Slotted(3)
    assert (a.run(5), b.run(5)) == (10, 15)
    # A temporary instance: it was gone before its batch ran ("its instance is gone"). Outside
    # an assert, whose rewriting keeps the temporary alive.
    got = (Slotted(4).run(5), Slotted(4).run.many([1, 2]), asyncio.run(Slotted(5).run.acall(2)),
           list(Slotted(6).run.imap([1, 2])))
    assert got == (20, [4, 8], 10, [6, 12])
    with pytest.raises(TypeError, match="__weakref__"):
        Bare().run(1)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="dataclass(weakref_slot=) is 3.11's")
def test_equal_slotted_instances_have_a_batcher_each():
    """The batchers were found by equality: two equal frozen dataclasses shared one, and b.f(1)
    ran on a (2, not 10); an unhashable one was refused as if it had no __weakref__."""
    import dataclasses

    @dataclasses.dataclass(frozen=True, slots=True, weakref_slot=True)
    class Scaled:
        name: str
        scale: int = dataclasses.field(compare=False)

        @bp.dynamically(batch_size=4, timeout_ms=1)
        def f(self, items):
            return [x * self.scale for x in items]

    @dataclasses.dataclass(slots=True, weakref_slot=True)  # eq without frozen: unhashable
    class Mutable:
        scale: int

        @bp.dynamically(batch_size=4, timeout_ms=1)
        def f(self, items):
            return [x * self.scale for x in items]

    a, b = Scaled("m", 2), Scaled("m", 10)
    assert a == b and (a.f(1), b.f(1)) == (2, 10)
    assert Mutable(3).f(2) == 6
    with pytest.raises(TypeError, match="priority must be an integer"):  # at the call, as a function's
        a.f.imap([1], priority="x")


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="classmethod no longer wraps descriptors")
def test_a_batched_classmethod():
    class Model:
        factor = 4

        @classmethod
        @bp.dynamically(batch_size=4, timeout_ms=1)
        def run(cls, items):
            return [x * cls.factor for x in items]

    assert Model.run(2) == 8


def test_a_failing_replica_factory_reaches_the_callers_and_prints_no_thread_traceback(monkeypatch):
    hooked = []
    monkeypatch.setattr(threading, "excepthook", lambda args: hooked.append(args))

    def factory(i):
        raise RuntimeError("no GPU here")

    f = bp.dynamically(batch_size=4, timeout_ms=1, replicas=factory)(lambda items, replica: list(items))
    with pytest.raises(RuntimeError, match="no GPU here"):
        f(1, timeout=LIMIT_S)
    with pytest.raises(RuntimeError, match="no GPU here"):  # the next call tries the factory again
        f(2, timeout=LIMIT_S)
    assert hooked == []


@pytest.mark.parametrize("call, items", [("amany", [1, 2, 3, 4]), ("acall", 1)])
def test_a_cancelled_async_call_takes_its_queued_items_off_the_queue(call, items):
    """They stayed queued and ran for nobody, ahead of later calls (acall's after amany's were
    taken off)."""
    rec = Recorder(hold_first=True)
    f = bp.dynamically(batch_size=2, timeout_ms=1)(rec)

    async def main():
        first = asyncio.create_task(f.acall(0))  # runs, held
        while not rec.started.is_set():
            await asyncio.sleep(0.001)
        gone = asyncio.create_task(getattr(f, call)(items))
        await asyncio.sleep(0.05)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        rec.release.set()
        return await first, await f.acall(5)

    assert asyncio.run(main()) == (0, 50)
    assert rec.batches == [[0], [5]] and f.stats.withdrawn == (len(items) if call == "amany" else 1)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_a_stop_that_leaves_the_loop_still_wakes_the_other_callers_of_the_batch(stop):
    """The first task let the function's KeyboardInterrupt out of the loop; the other callers of
    the batch were never woken, and asyncio.run hung for ever cancelling them."""
    def fn(items):
        if "stop" in items:
            raise stop()
        return list(items)

    f = bp.dynamically(batch_size=4, timeout_ms=20)(fn)

    async def main():
        await asyncio.gather(f.acall("stop"), f.acall("other"), return_exceptions=True)

    got = outcome(lambda: asyncio.run(main()), limit=LIMIT_S)
    assert isinstance(got, stop), got


def test_a_timeout_beyond_what_a_lock_takes_is_no_limit():
    """1e10 s passed the check, was queued, then raised OverflowError from the lock."""
    f = bp.dynamically(batch_size=4, timeout_ms=1)(Recorder())
    assert f(3, timeout=1e10) == 30 and f.many([1], timeout=1e12) == [10]


def test_a_slotted_instance_is_freed_with_its_batcher():
    import gc
    import time
    import weakref

    class Slotted:
        __slots__ = ("__weakref__",)

        @bp.dynamically(batch_size=4, timeout_ms=1)
        def run(self, items):
            return list(items)

    obj = Slotted()
    assert obj.run(1) == 1
    ref = weakref.ref(obj)
    del obj
    deadline = time.monotonic() + LIMIT_S
    while ref() is not None:  # the worker idles out after a few seconds and drops its last reference
        assert time.monotonic() < deadline, "the instance is kept alive by its batcher"
        gc.collect()
        time.sleep(0.1)


def test_an_infinite_bucket_boundary_is_refused():
    with pytest.raises(ValueError, match="buckets"):
        bp.dynamically(length=len, buckets=[32, float("inf")])


@pytest.mark.parametrize("bad, error, words", [
    ([1, 2, 3], TypeError, "an item is a dict of numpy arrays or torch tensors"),
    ({"ids": torch.arange(2)}, ValueError, "no 'input_ids', which pad_token names"),
    ({"input_ids": "abc"}, TypeError, "its 'input_ids' is a str"),
    ({"input_ids": torch.tensor(5)}, ValueError, "'input_ids' is a single number"),  # was stacked as [B], and the
    ({"input_ids": 5}, ValueError, "'input_ids' is a single number"),  # output's shape () blamed
])
def test_a_tensor_item_that_does_not_stack_fails_alone_naming_why(bad, error, words):
    """Such an item reached the function in a batch: a list raised AttributeError ('keys'), a
    missing key a bare KeyError from inside the user's function."""
    from concurrent.futures import ThreadPoolExecutor

    @bp.dynamically(batch_size=3, timeout_ms=300, pad_token={"input_ids": 0})
    def total(batch):
        return batch["input_ids"].sum(1)

    items = [{"input_ids": torch.arange(3)}, bad, {"input_ids": torch.arange(5)}]
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(total, item) for item in items]
        assert int(futures[0].result(LIMIT_S)) == 3 and int(futures[2].result(LIMIT_S)) == 10
        with pytest.raises(error, match=words):
            futures[1].result(LIMIT_S)
    assert int(total({"input_ids": [1, 2]})) == 3  # a list of numbers is an array too


def test_items_of_other_shapes_are_not_stacked_together():
    """A [2, 3] item among [L] items does not stack with them (a ValueError that says so splits
    the batch): it runs in a batch of its own and gets its own row."""
    from concurrent.futures import ThreadPoolExecutor

    seen = []

    @bp.dynamically(batch_size=3, timeout_ms=300, pad_token={"input_ids": 0})
    def total(batch):
        seen.append(tuple(batch["input_ids"].shape))
        return batch["input_ids"].sum(1)

    items = [{"input_ids": torch.arange(3)}, {"input_ids": torch.ones(2, 3)}, {"input_ids": torch.arange(5)}]
    with ThreadPoolExecutor(3) as pool:
        got = [f.result(LIMIT_S) for f in [pool.submit(total, item) for item in items]]
    assert [g.tolist() for g in got] == [3, [2.0, 2.0, 2.0], 10]
    assert (1, 2, 3) in seen and all(len(shape) == 2 for shape in seen if shape != (1, 2, 3))


def test_a_call_from_inside_its_own_batch_is_refused_and_the_batcher_lives_on():
    """The inner call waited for a batch that could not start before the one running it ended:
    the caller hung (or got DeadlineExceeded), and every later call did too."""
    @bp.dynamically(batch_size=4, timeout_ms=1)
    def nested(items):
        if items[0] == "again":
            return [nested(1) for _ in items]
        return [x + 1 for x in items]

    @bp.dynamically(batch_size=4, timeout_ms=1)
    async def anested(items):
        if items[0] == "again":
            return [await anested.acall(1) for _ in items]
        return [x + 1 for x in items]

    for fn in (lambda x: nested(x, timeout=LIMIT_S), lambda x: asyncio.run(anested.acall(x, timeout=LIMIT_S))):
        with pytest.raises(RuntimeError, match="called from inside its own batch"):
            fn("again")
        assert fn(1) == 2  # the batcher still works
    assert doubled(3) == 6  # another batched function called from inside a batch is fine: see below

    @bp.dynamically(batch_size=4, timeout_ms=1)
    def chained(items):
        return [doubled(x) for x in items]

    assert chained(5) == 10


def test_batched_functions_that_call_each_other_in_a_circle_are_refused_and_live_on():
    """a -> b -> a: each batcher's worker waited on the other's for ever (a timeout gave
    DeadlineExceeded, and both batchers were dead from then on)."""
    @bp.dynamically(batch_size=4, timeout_ms=1)
    def a(items):
        return [b(x - 1) if x > 0 else "a" for x in items]

    @bp.dynamically(batch_size=4, timeout_ms=1)
    def b(items):
        return [a(x - 1) if x > 0 else "b" for x in items]

    with pytest.raises(RuntimeError, match=r"\.a was called from inside .*\.b's batch, while .*\.a's own batch waits"):
        a(2, timeout=LIMIT_S)
    assert (a(0, timeout=LIMIT_S), b(0, timeout=LIMIT_S), a(1, timeout=LIMIT_S)) == ("a", "b", "b")

    @bp.dynamically(batch_size=4, timeout_ms=1)
    async def c(items):
        return [await d.acall(x) for x in items]

    @bp.dynamically(batch_size=4, timeout_ms=1)
    async def d(items):
        return [await c.acall(x - 1) if x > 0 else "d" for x in items]

    async def run(x):
        return await c.acall(x, timeout=LIMIT_S)

    assert asyncio.run(run(0)) == "d"
    with pytest.raises(RuntimeError, match="each would wait for the other for ever"):
        asyncio.run(run(1))


@pytest.mark.parametrize("change", ["append", "pop"])
def test_a_function_that_changes_its_list_and_returns_it_is_a_size_mismatch(change):
    """The length check read the list after the function had changed it: a result too many or
    too few passed it, and the callers waited for ever (or got an unrelated IndexError)."""
    @bp.dynamically(batch_size=8, timeout_ms=1)
    def f(items):
        items.append("extra") if change == "append" else items.pop()
        return items

    for call in (lambda: f.many([1, 2, 3], timeout=LIMIT_S), lambda: f(1, timeout=LIMIT_S),
                 lambda: asyncio.run(f.amany([1, 2], timeout=LIMIT_S))):
        with pytest.raises(bp.BatchSizeMismatch):
            call()


def test_an_async_deadline_names_the_timeout_given():
    """It named what was left of it when the call waited: 'within the -0.004s deadline'."""
    @bp.dynamically(batch_size=1, timeout_ms=1, max_queue=1, block_when_full=True)
    async def slow(items):
        await asyncio.sleep(0.5)
        return items

    async def run():
        return await asyncio.gather(*(slow.acall(i, timeout=0.2) for i in range(3)), return_exceptions=True)

    errors = [r for r in asyncio.run(run()) if isinstance(r, bp.DeadlineExceeded)]
    assert errors and all("0.2s deadline" in str(e) for e in errors), errors


def test_a_circle_through_a_stream_is_refused_too():
    """imap/aimap from inside a batch were checked for a call of the function itself only: a
    circle through them hung, and both batchers were dead from then on."""
    @bp.dynamically(batch_size=8, timeout_ms=1)
    def a(items):
        return list(b.imap(items)) if items[0] > 0 else items

    @bp.dynamically(batch_size=8, timeout_ms=1)
    def b(items):
        return a.many([x - 1 for x in items]) if items[0] > 0 else items

    with pytest.raises(RuntimeError, match="each would wait for the other for ever"):
        a(1, timeout=LIMIT_S)
    assert (a(0, timeout=LIMIT_S), b(0, timeout=LIMIT_S)) == (0, 0)

    @bp.dynamically(batch_size=8, timeout_ms=1)
    async def c(items):
        return [x async for x in d.aimap(items)] if items[0] > 0 else items

    @bp.dynamically(batch_size=8, timeout_ms=1)
    async def d(items):
        return await c.amany([x - 1 for x in items]) if items[0] > 0 else items

    async def run(x):
        return await c.acall(x, timeout=LIMIT_S)

    with pytest.raises(RuntimeError, match="each would wait for the other for ever"):
        asyncio.run(run(1))
    assert asyncio.run(run(0)) == 0
