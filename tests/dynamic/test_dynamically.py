"""bp.dynamically: batching across threads and asyncio, ordering, deadlines, limits, errors, tensors."""
from __future__ import annotations

import asyncio
import contextvars
import signal
import threading

import numpy as np
import pytest
import torch

import batchprompt as bp
from batchprompt.dynamic import BatchSizeMismatch

from .helpers import LIMIT_S, Recorder, in_function, outcome, queued, run_threads, wait_until


@pytest.mark.parametrize("options", [{}, {"priority": 1}, {"timeout": 30}])
def test_amany_of_no_items_returns_at_once(options):
    """As many([]) does: it waited for ever (its loop turn's group held nothing, so nothing ran
    it), or until its deadline, which it then missed."""
    f = bp.dynamically(batch_size=4)(lambda xs: xs)

    async def main():
        return await asyncio.wait_for(f.amany([], **options), LIMIT_S)

    assert asyncio.run(main()) == []


def test_one_item_many_items_threads_and_asyncio():
    rec = Recorder()
    f = bp.dynamically(batch_size=16, timeout_ms=20)(rec)
    assert f(3) == 30
    assert f.many([1, 2, 3]) == [10, 20, 30]
    assert f.many([]) == []
    assert run_threads(f, 40) == [i * 10 for i in range(40)]

    async def main():
        singles = await asyncio.gather(*(f.acall(i) for i in range(50)))
        several = await f.amany([7, 8])
        return singles, several

    singles, several = asyncio.run(main())
    assert singles == [i * 10 for i in range(50)] and several == [70, 80]
    assert max(len(b) for b in rec.batches) == 16  # calls were batched, never beyond batch_size
    assert all(len(b) <= 16 for b in rec.batches)
    s = f.stats
    assert s.items == 1 + 3 + 40 + 50 + 2 and s.batches == len(rec.batches) and s.mean_batch_size > 1
    assert s.p99_latency_ms >= s.p50_latency_ms > 0 and s.items_per_s > 0 and s.errors == 0


def test_async_function_and_methods():
    @bp.dynamically(batch_size=8, timeout_ms=5)
    async def double(items):
        await asyncio.sleep(0)
        return [2 * x for x in items]

    assert double(4) == 8
    assert asyncio.run(double.acall(5)) == 10

    class Model:
        def __init__(self, k):
            self.k = k

        @bp.dynamically(batch_size=4, timeout_ms=5)
        def predict(self, items):
            return [self.k * x for x in items]

    a, b = Model(2), Model(3)
    assert a.predict(5) == 10 and b.predict(5) == 15
    assert a.predict.many([1, 2]) == [2, 4]
    assert a.predict is a.predict and a.predict is not b.predict  # one processor per instance
    assert asyncio.run(b.predict.acall(1)) == 3


def test_an_idle_worker_ends_and_frees_a_methods_instance(monkeypatch):
    """The worker thread ends after IDLE_EXIT_S without items, so a method's batcher does not keep
    its instance (and its model) alive; the next call starts a new worker."""
    import gc
    import weakref

    from batchprompt.dynamic import processor
    monkeypatch.setattr(processor, "IDLE_EXIT_S", 0.5)

    class Model:
        @bp.dynamically(batch_size=4, timeout_ms=1)
        def predict(self, items):
            return [x + 1 for x in items]

        @bp.dynamically(batch_size=4, timeout_ms=1)
        async def apredict(self, items):
            return [x + 2 for x in items]

    model = Model()
    assert model.predict(1) == 2 and model.apredict(1) == 3
    workers = [model.predict.processor._worker, model.apredict.processor._worker]
    for w in workers:
        w.join(LIMIT_S)
        assert not w.is_alive()
    assert model.predict(2) == 3 and model.apredict(2) == 4  # a new worker (and a new loop)
    again = [model.predict.processor._worker, model.apredict.processor._worker]
    assert again[0] is not workers[0] and again[1] is not workers[1]
    ref = weakref.ref(model)
    del model
    for w in again:
        w.join(LIMIT_S)
    gc.collect()
    assert ref() is None
    assert not [t for t in threading.enumerate() if "test_an_idle_worker" in t.name]


class Clock:
    """time.monotonic under the test's control: a batch's window opens and closes when the test
    moves the clock, whatever the machine's speed. Counts the worker's reads."""

    def __init__(self):
        self.now = 1000.0
        self.worker_reads = 0

    def __call__(self) -> float:
        if threading.current_thread().name.startswith("dynamically-"):
            self.worker_reads += 1
        return self.now

    def move(self, f, seconds: float) -> None:
        """Move on, and wait until the batcher's worker has read the clock and waits again (or
        has run the batch)."""
        self.now += seconds
        reads, p = self.worker_reads, f.processor
        with p._cond:
            p._cond.notify()  # the worker reads the clock now, not at the end of its own wait
        wait_until(lambda: self.worker_reads > reads and in_function(p._worker, "wait"), "the worker reads the clock")


def test_a_batch_closes_after_the_timeout_since_its_first_item(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("time.monotonic", clock)
    rec = Recorder()
    f = bp.dynamically(batch_size=100, timeout_ms=300)(rec)
    first = threading.Thread(target=f, args=(1,))
    first.start()
    queued(f, 1)
    clock.move(f, 0.2)
    second = threading.Thread(target=f, args=(2,))  # within the first item's window
    second.start()
    queued(f, 2)
    clock.move(f, 0.09)  # 0.29 s after the first item: the window is still open
    assert rec.batches == [] and f.stats.queue_size == 2
    clock.move(f, 0.02)  # 0.31 s after the first item, 0.11 s after the second
    first.join(LIMIT_S), second.join(LIMIT_S)
    assert rec.batches == [[1, 2]]  # one batch, closed by the first item's timeout
    assert f.stats.mean_wait_ms == pytest.approx((310 + 110) / 2)


def _held(f, rec):
    """Start a batch that blocks, so that later calls queue up."""
    t = threading.Thread(target=f, args=(0,))
    t.start()
    assert rec.started.wait(LIMIT_S)
    return t


def test_small_calls_and_higher_priority_go_first():
    rec = Recorder(hold_first=True)
    f = bp.dynamically(batch_size=4, timeout_ms=1, small_batch_threshold=2)(rec)
    first = _held(f, rec)
    big = threading.Thread(target=f.many, args=([100, 101, 102, 103, 104, 105],))
    big.start()
    queued(f, 6)
    small = threading.Thread(target=f, args=(7,))
    small.start()
    queued(f, 7)
    urgent = threading.Thread(target=lambda: f(9, priority=5))
    urgent.start()
    queued(f, 8)
    rec.release.set()
    for t in (first, big, small, urgent):
        t.join(LIMIT_S)
    order = [x for b in rec.batches[1:] for x in b]
    assert order[:2] == [9, 7]  # priority first, then the small call, then the large one
    assert sorted(order[2:]) == [100, 101, 102, 103, 104, 105]


def test_thread_callers_of_a_batch_are_woken_newest_first():
    """Whoever reads results in submission order (ThreadPoolExecutor.map, a loop over futures)
    waits on the oldest caller of a batch: it is woken last in its chain, so that the reader
    wakes about once per batch, not every other caller."""
    n = 32
    rec = Recorder(hold_first=True)
    f = bp.dynamically(batch_size=n, timeout_ms=60_000)(rec)
    returned = []

    def call(i):
        assert f(i) == 10 * i
        returned.append(i)

    threads = []
    for i in range(n):  # one at a time, so that the queue order is 0, 1, ..., n - 1
        threads.append(threading.Thread(target=call, args=(i,)))
        threads[-1].start()
        if i < n - 1:
            queued(f, i + 1)
    rec.started.wait(LIMIT_S)
    rec.release.set()
    for t in threads:
        t.join(LIMIT_S)
    assert sorted(returned) == list(range(n))
    # In two chains of n/2, newest first: caller 0 comes after the n/2 - 1 others of its chain
    # (a margin for a thread preempted between its wake-up and its return). Oldest first, it
    # was the head of a chain, among the first two.
    assert returned.index(0) >= n // 4, returned


def _eight_callers_waiting():
    """A batcher of 9 whose first batch is held, 8 threads' calls queued in it: the main thread's
    call completes the batch."""
    rec = Recorder(hold_first=True)
    f = bp.dynamically(batch_size=9, timeout_ms=60_000)(rec)
    results = {}
    others = [threading.Thread(target=lambda i=i: results.__setitem__(i, f(i))) for i in range(1, 9)]
    for t in others:
        t.start()
    queued(f, 8)
    return rec, f, results, others


def test_a_caller_interrupted_between_queueing_and_waiting_does_not_stall_its_chain(monkeypatch):
    """A signal that lands after the item is queued and before the wait began (a window of a few
    bytecodes) left the caller's wake-up untaken: the callers after it in its chain of wake-ups
    waited for ever. Here the wait itself raises, as the signal would, before it blocks."""
    from batchprompt.dynamic import groups

    class Interrupted(Exception):
        pass

    rec, f, results, others = _eight_callers_waiting()
    real_wait = groups._Group.wait
    main = threading.current_thread()

    def wait(self):
        if threading.current_thread() is main:
            raise Interrupted
        return real_wait(self)

    monkeypatch.setattr(groups._Group, "wait", wait)
    with pytest.raises(Interrupted):
        f(0)
    monkeypatch.setattr(groups._Group, "wait", real_wait)
    rec.started.wait(LIMIT_S)
    rec.release.set()
    for t in others:
        t.join(LIMIT_S)
    assert results == {i: 10 * i for i in range(1, 9)}


def test_a_caller_interrupted_just_after_its_wake_up_still_wakes_its_chain(monkeypatch):
    """A signal that lands as the acquire of the caller's wake-up returns: the helper meant to
    take the wake-up in its place waited on the lock the caller already held, and the callers
    after it in its chain waited for ever (found with _thread.interrupt_main)."""
    from batchprompt.dynamic import groups, processor

    class Interrupted(Exception):
        pass

    main = threading.current_thread()

    class LandsAfterAcquire:
        """A lock whose second acquire in the main thread (the wait) takes it, then raises."""

        def __init__(self):
            self.lock, self.acquires = threading.Lock(), 0

        def acquire(self, *args, **kwargs):
            got = self.lock.acquire(*args, **kwargs)
            self.acquires += 1
            if self.acquires == 2 and threading.current_thread() is main:
                raise Interrupted
            return got

        def release(self):
            self.lock.release()

    rec, f, results, others = _eight_callers_waiting()
    processor._spare.__dict__.pop("group", None)  # the main thread's call makes a new group
    monkeypatch.setattr(groups, "new_lock", LandsAfterAcquire)
    caller = {}

    def release_when_all_queued():
        rec.started.wait(LIMIT_S)
        rec.release.set()

    threading.Thread(target=release_when_all_queued, daemon=True).start()
    try:
        f(0)
    except Interrupted:
        caller["raised"] = True
    monkeypatch.setattr(groups, "new_lock", threading.Lock)
    for t in others:
        t.join(LIMIT_S)
    assert caller == {"raised": True}
    assert results == {i: 10 * i for i in range(1, 9)}


def test_an_interrupted_thread_caller_does_not_stall_the_others_in_its_batch():
    """Ctrl-C while the main thread waits (here a signal handler that raises): that call raises,
    and the callers that its thread would have woken in its chain still get their results."""

    class Interrupted(Exception):
        pass

    def interrupt(*_):
        raise Interrupted

    rec = Recorder(hold_first=True)
    f = bp.dynamically(batch_size=9, timeout_ms=60_000)(rec)  # the batch closes at the 9th caller
    results = {}
    others = [threading.Thread(target=lambda i=i: results.__setitem__(i, f(i))) for i in range(1, 9)]
    main = threading.main_thread()
    for t in others:
        t.start()
    queued(f, 8)  # f(0), called next, is the newest in the batch, so the head of a chain

    def then_interrupt():
        try:
            rec.started.wait(LIMIT_S)  # the batch of all nine runs, held
            wait_until(lambda: in_function(main, "wait"), "f(0) waits for its result")
        finally:  # whatever happened, so that f(0) cannot wait forever
            signal.pthread_kill(main.ident, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    helper = threading.Thread(target=then_interrupt, daemon=True)
    try:
        helper.start()
        with pytest.raises(Interrupted):
            f(0)
    finally:
        helper.join(LIMIT_S)
        signal.signal(signal.SIGUSR1, previous)
    assert len(rec.batches) == 1 and sorted(rec.batches[0]) == list(range(9))
    rec.release.set()
    for t in others:
        t.join(LIMIT_S)
    assert results == {i: 10 * i for i in range(1, 9)}
    assert outcome(lambda: f.many(list(range(9, 18)))) == list(range(90, 180, 10))


def test_deadline_fails_the_item_and_spares_the_others():
    rec = Recorder(hold_first=True)
    f = bp.dynamically(batch_size=2, timeout_ms=1)(rec)
    first = _held(f, rec)
    errors, results = [], []

    def late():
        try:
            f(5, timeout=0.05)
        except bp.DeadlineExceeded as e:
            errors.append(e)

    t1 = threading.Thread(target=late)
    t2 = threading.Thread(target=lambda: results.append(f(6)))
    t1.start(), t2.start()
    t1.join(LIMIT_S)
    rec.release.set()
    t2.join(LIMIT_S), first.join(LIMIT_S)
    assert len(errors) == 1 and "deadline" in str(errors[0]) and results == [60]

    async def main():
        with pytest.raises(bp.DeadlineExceeded):
            rec.release.clear()
            rec.started.clear()
            threading.Thread(target=f, args=(0,)).start()
            await asyncio.to_thread(rec.started.wait, LIMIT_S)
            await f.acall(1, timeout=0.05)
        rec.release.set()

    asyncio.run(main())


def test_cancelling_one_asyncio_caller_spares_the_others_in_its_batch():
    """Callers on one loop share a group; cancelling one (task.cancel, wait_for) must wake that
    caller alone, at once, and leave the others their results, errors and contexts."""
    rec = Recorder(hold_first=True)
    f = bp.dynamically(batch_size=8, timeout_ms=1)(rec)
    tag = contextvars.ContextVar("tag")

    async def caller(i):
        tag.set(i)
        out = await f.acall(i)
        return out, tag.get()  # the task resumes in its own context

    async def main():
        tasks = [asyncio.create_task(caller(i)) for i in range(4)]
        await asyncio.to_thread(rec.started.wait, LIMIT_S)  # the batch holding all four is running
        tasks[1].cancel()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(f.acall(9), 0.05)  # a later caller gives up; nothing else moves
        assert not any(t.done() for i, t in enumerate(tasks) if i != 1)
        with pytest.raises(asyncio.CancelledError):
            await tasks[1]  # woken while the batch still runs
        rec.release.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    out = asyncio.run(main())
    assert isinstance(out[1], asyncio.CancelledError)
    assert [o for i, o in enumerate(out) if i != 1] == [(0, 0), (20, 2), (30, 3)]

    @bp.dynamically(batch_size=4, timeout_ms=5)
    def marks(items):
        return [KeyError(x) if x < 0 else x for x in items]

    async def mixed():
        return await asyncio.gather(marks.acall(1), marks.acall(-2), marks.amany([3, 4]),
                                    asyncio.wait_for(marks.acall(5), 5), return_exceptions=True)

    one, bad, many, in_time = asyncio.run(mixed())
    assert one == 1 and isinstance(bad, KeyError) and many == [3, 4] and in_time == 5


def test_queue_limit_raises_or_blocks():
    rec = Recorder(hold_first=True)
    f = bp.dynamically(batch_size=1, timeout_ms=1, max_queue=2)(rec)
    first = _held(f, rec)
    waiting = [threading.Thread(target=f, args=(i,)) for i in (1, 2)]
    for t in waiting:
        t.start()
    queued(f, 2)
    with pytest.raises(bp.QueueFull, match="max_queue=2"):
        f(3)
    with pytest.raises(bp.QueueFull):
        asyncio.run(f.acall(3))
    rec.release.set()
    for t in [first, *waiting]:
        t.join(LIMIT_S)

    rec2 = Recorder(hold_first=True)
    g = bp.dynamically(batch_size=1, timeout_ms=1, max_queue=1, block_when_full=True)(rec2)
    first = _held(g, rec2)
    second = threading.Thread(target=g, args=(1,))
    second.start()
    queued(g, 1)
    blocked = []
    t = threading.Thread(target=lambda: blocked.append(g(2)))
    t.start()
    wait_until(lambda: in_function(t, "_wait_for_room"), "g(2) waits for room")
    assert blocked == [] and g.stats.queue_size == 1  # waiting for room, not failed nor queued
    rec2.release.set()
    for th in (first, second, t):
        th.join(LIMIT_S)
    assert blocked == [20]


def test_batches_sized_by_cost():
    seen = []

    @bp.dynamically(batch_size=100, timeout_ms=20, cost=len, max_batch_cost=10)
    def lengths(items):
        seen.append(list(items))
        return [len(x) for x in items]

    words = ["aaaa", "bbb", "cc", "ddddd", "e", "ffffff", "gg", "hhh"]
    assert lengths.many(words) == [len(w) for w in words]
    assert all(sum(map(len, b)) <= 10 for b in seen) and len(seen) > 1


def test_a_failing_item_gets_the_error_and_the_others_get_results():
    @bp.dynamically(batch_size=8, timeout_ms=20)
    def picky(items):
        if "bad" in items:
            raise ValueError("cannot take 'bad'")
        return [x.upper() for x in items]

    out = [None] * 6

    def call(i, x):
        try:
            out[i] = picky(x)
        except ValueError as e:
            out[i] = e

    ts = [threading.Thread(target=call, args=(i, x)) for i, x in enumerate(["a", "b", "bad", "c", "d", "e"])]
    for t in ts:
        t.start()
    for t in ts:
        t.join(LIMIT_S)
    assert isinstance(out[2], ValueError)
    assert [o for i, o in enumerate(out) if i != 2] == ["A", "B", "C", "D", "E"]

    @bp.dynamically(batch_size=4, timeout_ms=5)
    def marks(items):
        return [KeyError(x) if x < 0 else x for x in items]

    assert marks(3) == 3
    with pytest.raises(KeyError):
        marks(-1)

    @bp.dynamically(batch_size=4, timeout_ms=5)
    def short(items):
        return items[:-1]

    with pytest.raises(BatchSizeMismatch, match="returned 1 results for a batch of 2"):
        short.many([1, 2])


def test_tensor_variant_pads_stacks_and_splits():
    shapes = []

    @bp.dynamically(batch_size=8, timeout_ms=20, pad_token={"input_ids": -1})
    def embed(batch):
        ids = batch["input_ids"]
        shapes.append(tuple(ids.shape))
        mask = batch["attention_mask"]
        return {"sum": (ids * mask).sum(axis=1), "first": ids[:, 0]}

    items = [{"input_ids": np.arange(1, n + 1), "attention_mask": np.ones(n, dtype=np.int64)} for n in (2, 5, 3)]
    out = embed.many(items)
    assert [o["sum"] for o in out] == [3, 15, 6] and [o["first"] for o in out] == [1, 1, 1]
    assert shapes == [(3, 5)]

    @bp.dynamically(batch_size=8, timeout_ms=20, tensors=True)
    def rows(batch):
        return batch["x"].float().sum(dim=1, keepdim=True)

    out = rows.many([{"x": torch.tensor([1, 2])}, {"x": torch.tensor([3])}])
    assert [o.tolist() for o in out] == [[3.0], [3.0]]


def test_options_are_checked():
    with pytest.raises(ValueError, match="batch_size"):
        bp.dynamically(batch_size=0)
    with pytest.raises(ValueError, match="cost= and max_batch_cost="):
        bp.dynamically(cost=len)


def test_a_priority_that_is_not_an_integer_is_refused_by_name():
    @bp.dynamically(batch_size=4)
    def double(xs):
        return [2 * x for x in xs]

    for call in (lambda: double(1, priority="high"), lambda: double.many([1], priority=1.5),
                 lambda: double.imap([1], priority="high"), lambda: double.aimap([1], priority=None),
                 lambda: asyncio.run(double.acall(1, priority="high"))):
        with pytest.raises(TypeError, match="priority must be an integer"):
            call()
    assert double(3, priority=2) == 6
