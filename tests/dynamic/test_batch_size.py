"""bp.dynamically: the batch size follows a latency target, and falls after an out-of-memory error.

The function's time per batch is read from the processor's clock, which these tests replace with
one that the function itself moves: a batch "takes" what the test says, whatever the machine."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import batchprompt as bp
from batchprompt.dynamic import sizing

from .helpers import aoutcome, outcome, run_threads


class FunctionClock:
    """Stands in for the processor's clock: a batch of n items takes `per_item * n` seconds."""

    def __init__(self, per_item: float):
        self.now = 0.0
        self.per_item = per_item
        self.sizes: list[int] = []

    def __call__(self) -> float:
        return self.now

    def run(self, items: list) -> list:
        self.sizes.append(len(items))
        self.now += self.per_item * len(items)
        return [x * 2 for x in items]


def timed(clock: FunctionClock, **options):
    f = bp.dynamically(**{"batch_size": 64, "timeout_ms": 1, **options})(clock.run)
    f.processor.clock = clock
    return f


def test_the_batch_size_grows_to_a_latency_target_and_shrinks_when_batches_get_slower():
    clock = FunctionClock(per_item=0.001)  # 1 ms per item: 20 items make the 20 ms target
    f = timed(clock, target_latency_ms=20, min_batch_size=2)
    assert f.stats.batch_size == 2  # starts small
    assert outcome(lambda: f.many(list(range(1500)))) == [2 * x for x in range(1500)]
    grew = clock.sizes[:]
    rising = grew[:grew.index(19)]
    assert rising == list(range(2, 19))  # grew batch after batch, while under the target
    assert 16 <= f.stats.batch_size <= 20 and max(grew) <= 20  # then stays near the target, never over it
    assert 16 <= f.stats.p50_batch_ms <= 20

    clock.per_item = 0.004  # the function gets 4x slower: 5 items make the target
    clock.sizes.clear()
    assert outcome(lambda: f.many(list(range(400)))) == [2 * x for x in range(400)]
    assert 3 <= f.stats.batch_size <= 5
    assert clock.sizes[0] > 5 and max(clock.sizes[-10:]) <= 5  # came down to it


@pytest.mark.parametrize("target_ms, expected", [(10_000, 64), (0.5, 4)], ids=["loose", "tight"])
def test_the_batch_size_stays_within_min_batch_size_and_batch_size(target_ms, expected):
    clock = FunctionClock(per_item=0.001)
    f = timed(clock, target_latency_ms=target_ms, min_batch_size=4)
    assert outcome(lambda: f.many(list(range(2000)))) == [2 * x for x in range(2000)]
    assert f.stats.batch_size == expected
    assert all(4 <= n <= 64 for n in clock.sizes[:-1])  # the last batch takes what is left


def test_without_a_target_the_batch_size_is_fixed_and_batch_times_are_reported():
    clock = FunctionClock(per_item=0.001)
    f = timed(clock, batch_size=16)
    assert outcome(lambda: f.many(list(range(64)))) == [2 * x for x in range(64)]
    assert clock.sizes == [16, 16, 16, 16] and f.stats.batch_size == 16
    assert f.stats.p50_batch_ms == pytest.approx(16) and f.stats.p99_batch_ms == pytest.approx(16)


class OutOfMemory:
    """A batch function that runs out of memory above `limit` items while `tight` is set."""

    def __init__(self, limit: int, error=torch.OutOfMemoryError):
        self.limit, self.error = limit, error
        self.tight = True
        self.sizes: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, items: list) -> list:
        with self.lock:
            self.sizes.append(len(items))
        if "huge" in items or (self.tight and len(items) > self.limit):
            raise self.error("out of memory (test)")
        return [x.upper() for x in items]


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, MemoryError], ids=lambda e: e.__name__)
def test_out_of_memory_splits_the_batch_lowers_the_batch_size_and_no_caller_sees_it(error):
    oom = OutOfMemory(limit=8, error=error)
    f = bp.dynamically(batch_size=32, timeout_ms=5)(oom)
    words = [f"w{i}" for i in range(100)]
    assert outcome(lambda: f.many(words)) == [w.upper() for w in words]
    assert oom.sizes[0] == 32 and f.stats.out_of_memory >= 1
    assert f.stats.batch_size <= 8 and f.stats.errors == 0
    # Later callers, threads and asyncio tasks, get batches that fit, and their results.
    before = len(oom.sizes)
    assert run_threads(lambda i: f(f"t{i}"), 40) == [f"T{i}" for i in range(40)]

    async def tasks():
        return await asyncio.gather(*(aoutcome(f.acall(f"a{i}")) for i in range(50)))

    assert outcome(lambda: asyncio.run(tasks())) == [f"A{i}" for i in range(50)]
    # The size rises again by one step after batches pass (OOM_RECOVERY_BATCHES), and falls back.
    assert max(oom.sizes[before:]) <= 9 and f.stats.errors == 0


def test_an_item_that_runs_out_of_memory_alone_fails_alone():
    oom = OutOfMemory(limit=8)
    f = bp.dynamically(batch_size=16, timeout_ms=5)(oom)

    async def calls():
        return await asyncio.gather(*(aoutcome(f.acall(w)) for w in ["a", "b", "huge", "c"]))

    out = outcome(lambda: asyncio.run(calls()))
    assert out[:2] == ["A", "B"] and out[3] == "C" and isinstance(out[2], torch.OutOfMemoryError)
    assert f.stats.errors == 1 and f.stats.batch_size == 2  # the largest part of the batch that ran


def test_the_lowered_batch_size_rises_again_after_batches_pass(monkeypatch):
    monkeypatch.setattr(sizing, "OOM_RECOVERY_BATCHES", 2)
    oom = OutOfMemory(limit=8)
    f = bp.dynamically(batch_size=32, timeout_ms=5)(oom)
    assert outcome(lambda: f.many([f"w{i}" for i in range(32)])) == [f"W{i}" for i in range(32)]
    assert f.stats.batch_size == 8
    oom.tight = False  # memory is free again
    sizes = []
    for _ in range(40):
        assert outcome(lambda: f.many([f"w{i}" for i in range(64)]))[:1] == ["W0"]
        sizes.append(f.stats.batch_size)
        if sizes[-1] == 32:
            break
    assert sizes == sorted(sizes) and sizes[0] > 8 and sizes[-1] == 32  # step by step, back to batch_size


def test_a_rise_that_runs_out_of_memory_falls_back_to_the_size_that_ran(monkeypatch):
    monkeypatch.setattr(sizing, "OOM_RECOVERY_BATCHES", 2)
    oom = OutOfMemory(limit=8)  # always: every rise to 9 runs out of memory
    f = bp.dynamically(batch_size=32, timeout_ms=5)(oom)
    sizes = set()
    for _ in range(6):
        assert outcome(lambda: f.many([f"w{i}" for i in range(64)])) == [f"W{i}" for i in range(64)]
        sizes.add(f.stats.batch_size)
    assert sizes <= {8, 9} and f.stats.out_of_memory > 3 and f.stats.errors == 0  # not halved to 4 or 5


def test_sizing_options_are_checked():
    with pytest.raises(ValueError, match="target_latency_ms"):
        bp.dynamically(target_latency_ms=0)
    with pytest.raises(ValueError, match="min_batch_size must be between 1 and batch_size=8"):
        bp.dynamically(batch_size=8, min_batch_size=9)


def test_an_out_of_memory_error_is_recognized_by_type_name():
    class OutOfMemoryError(RuntimeError):  # as other libraries name theirs
        pass

    assert sizing.is_out_of_memory(torch.OutOfMemoryError("x")) and sizing.is_out_of_memory(MemoryError())
    assert sizing.is_out_of_memory(OutOfMemoryError()) and not sizing.is_out_of_memory(RuntimeError("x"))
