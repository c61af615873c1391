"""bp.dynamically with several workers on one queue: replicas (a list, or a factory), and a worker
that dies is replaced without losing its batch."""
from __future__ import annotations

import asyncio
import threading

import pytest

import batchprompt as bp
from batchprompt.dynamic import WorkerDied

from .helpers import LIMIT_S, aoutcome, outcome, run_threads


def test_two_workers_each_take_batches_with_their_own_replica():
    """Each batch waits until a batch is running on the other worker too: with one worker only,
    the barrier breaks (after LIMIT_S) and the callers get the error."""
    both = threading.Barrier(2, timeout=LIMIT_S)
    seen = []

    @bp.dynamically(batch_size=2, timeout_ms=5, replicas=["gpu0", "gpu1"])
    def tag(items, replica):
        both.wait()
        seen.append((replica, threading.current_thread().name))
        return [f"{replica}:{x}" for x in items]

    out = outcome(lambda: tag.many(list(range(8))))
    assert [o.split(":")[1] for o in out] == [str(i) for i in range(8)]
    assert {r for r, _ in seen} == {"gpu0", "gpu1"}
    assert {name.rsplit(".", 1)[-1] for _, name in seen} == {"tag-0", "tag-1"}  # dynamically-<qualname>-<i>


def test_a_replica_factory_runs_on_each_workers_thread_once():
    made = []

    def load(index):
        made.append((index, threading.current_thread().name))
        return f"model{index}"

    @bp.dynamically(batch_size=4, timeout_ms=5, workers=3, replicas=load)
    def run(items, replica):
        return [replica] * len(items)

    assert set(outcome(lambda: run.many(list(range(40))))) <= {"model0", "model1", "model2"}
    assert run_threads(lambda i: run(i), 20) and outcome(lambda: run.many([1, 2])) != []
    assert sorted((i, name.rsplit(".", 1)[-1]) for i, name in made) == [(i, f"run-{i}") for i in range(3)]


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_worker_that_dies_is_replaced_and_its_batch_runs_again(is_async):
    """The function raises WorkerDied on replica 0's first batch: that worker ends, a new one
    (with a new replica from the factory) takes its slot, and the batch runs again: every caller
    gets its result. The first batch of each replica waits for the other's, so both run one."""
    made, calls = [], []
    lock = threading.Lock()
    firsts = threading.Barrier(2, timeout=LIMIT_S)

    def load(index):
        with lock:
            made.append(index)
            return {"index": index, "generation": made.count(index)}

    def body(items, replica):
        with lock:
            calls.append((replica["index"], replica["generation"], list(items)))
            first = not replica.setdefault("ran", False)
            replica["ran"] = True
        if first and replica["generation"] == 1:
            firsts.wait()
            if replica["index"] == 0:
                raise WorkerDied("lost the device")
        return [x * 10 for x in items]

    if is_async:
        async def fn(items, replica):
            await asyncio.sleep(0)
            return body(items, replica)
    else:
        fn = body
    f = bp.dynamically(batch_size=4, timeout_ms=5, workers=2, replicas=load)(fn)

    async def tasks():
        return await asyncio.gather(*(aoutcome(f.acall(i)) for i in range(100, 120)))

    assert outcome(lambda: f.many(list(range(40)))) == [x * 10 for x in range(40)]
    assert outcome(lambda: asyncio.run(tasks())) == [x * 10 for x in range(100, 120)]
    dead = [items for index, gen, items in calls if (index, gen) == (0, 1)]
    assert len(dead) == 1  # one batch died with its worker...
    rerun = [items for index, gen, items in calls if items == dead[0] and (index, gen) != (0, 1)]
    assert len(rerun) == 1  # ... and ran again, once, on another worker
    assert sorted(made) == [0, 0, 1] and f.stats.workers_replaced == 1 and f.stats.errors == 0


def test_an_item_whose_batch_kills_a_worker_twice_fails_with_worker_died():
    @bp.dynamically(batch_size=4, timeout_ms=5, workers=2)
    def fragile(items):
        if "poison" in items:
            raise WorkerDied("crashed on poison")
        return [x.upper() for x in items]

    assert isinstance(outcome(lambda: fragile("poison")), WorkerDied)
    assert fragile.stats.workers_replaced == 2 and fragile.stats.errors == 1
    assert outcome(lambda: fragile.many(["a", "b", "c"])) == ["A", "B", "C"]  # the new workers serve


def test_many_workers_fill_one_callers_results_together():
    """One `many` call spread over batches that four workers run at once: every slot is filled
    once, and the caller wakes when all are in."""
    @bp.dynamically(batch_size=8, timeout_ms=5, workers=4)
    def double(items):
        return [2 * x for x in items]

    for _ in range(5):
        assert outcome(lambda: double.many(list(range(1000)))) == [2 * x for x in range(1000)]

    async def tasks():
        return await asyncio.gather(*(double.acall(i) for i in range(2000)))

    assert outcome(lambda: asyncio.run(tasks())) == [2 * x for x in range(2000)]


def test_worker_options_are_checked():
    with pytest.raises(ValueError, match="workers must be an int from 1 to 1024 \\(each worker is a thread\\), got 0"):
        bp.dynamically(workers=0)
    # It started threads until the process could start no more, anywhere, and left ~22,000 behind.
    with pytest.raises(ValueError, match="workers must be an int from 1 to 1024 .*got 1000000"):
        bp.dynamically(workers=1_000_000)
    with pytest.raises(ValueError, match="workers=3 but 2 replicas"):
        bp.dynamically(workers=3, replicas=["a", "b"])
    with pytest.raises(ValueError, match="replicas=\\[\\] holds no replica"):
        bp.dynamically(replicas=[])
    with pytest.raises(ValueError, match="a list .* or a factory"):
        bp.dynamically(replicas="cuda:0")


def test_a_replica_that_cannot_be_made_is_said_once(caplog):
    """replicas(1) raising left worker 0 to do everything without a word, and was tried again
    on each later call (a model load that runs out of memory, every time)."""
    def factory(i):
        if i == 1:
            raise RuntimeError("no cuda:1")
        return f"r{i}"

    @bp.dynamically(replicas=factory, workers=2, timeout_ms=1)
    def f(items, replica):
        return [(x, replica) for x in items]

    with caplog.at_level("WARNING", logger="batchprompt"):
        for _ in range(3):
            assert f.many([1, 2, 3], timeout=LIMIT_S) == [(1, "r0"), (2, "r0"), (3, "r0")]
    said = [r.getMessage() for r in caplog.records if "replicas(1) raised" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(".f: replicas(1) raised RuntimeError: no cuda:1; worker 1 does not "
                                               "run until a later call's replicas(1) succeeds"), said
