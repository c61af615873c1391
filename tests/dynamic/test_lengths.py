"""bp.dynamically: length-aware batching (length=, buckets=), padded-token budgets, padding efficiency."""
from __future__ import annotations

import asyncio
import bisect
import math
import random
import threading

import numpy as np
import pytest

import batchprompt as bp

from .helpers import LIMIT_S, Recorder, aoutcome, outcome, queued


def words(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{i}:" + "x" * rng.randint(1, 40) for i in range(n)]


def recorded(**options):
    batches: list[list[str]] = []
    lock = threading.Lock()

    def fn(items):
        with lock:
            batches.append(list(items))
        return [f"<{x}>" for x in items]

    return bp.dynamically(**{"batch_size": 16, "timeout_ms": 5, **options})(fn), batches


def test_buckets_never_mix_lengths_and_each_caller_gets_its_own_result():
    bounds = [8, 16, 32]
    f, batches = recorded(length=len, buckets=bounds)
    texts = words(300)

    async def tasks():
        return await asyncio.gather(*(aoutcome(f.acall(t)) for t in texts[200:]))

    many = threading.Thread(target=lambda: out.__setitem__("many", f.many(texts[:100])))
    out: dict = {}
    many.start()
    threads = [threading.Thread(target=lambda t=t: out.__setitem__(t, f(t))) for t in texts[100:200]]
    for t in threads:
        t.start()
    from_tasks = outcome(lambda: asyncio.run(tasks()))
    for t in [many, *threads]:
        t.join(LIMIT_S)
    assert out.pop("many") == [f"<{t}>" for t in texts[:100]]
    assert out == {t: f"<{t}>" for t in texts[100:200]} and from_tasks == [f"<{t}>" for t in texts[200:]]
    assert sum(map(len, batches)) == 300
    for b in batches:
        assert len({bisect.bisect_left(bounds, len(x)) for x in b}) == 1, b  # one bucket per batch
        assert len(b) <= 16


def test_automatic_buckets_keep_the_longest_within_sqrt2_of_the_shortest():
    f, batches = recorded(length=len, buckets="auto")
    texts = words(400, seed=1)
    assert outcome(lambda: f.many(texts)) == [f"<{t}>" for t in texts]
    assert len(batches) > 1
    for b in batches:
        lengths = [len(x) for x in b]
        assert max(lengths) <= math.sqrt(2) * min(lengths), lengths


def test_a_padded_token_budget_cuts_batches_at_count_times_longest():
    f, batches = recorded(batch_size=64, length=len, max_batch_cost=100)
    texts = words(200, seed=2)
    assert outcome(lambda: f.many(texts)) == [f"<{t}>" for t in texts]
    for b in batches:
        assert len(b) == 1 or len(b) * max(map(len, b)) <= 100
    assert any(len(b) > 1 for b in batches)


def test_padding_efficiency_is_reported_and_buckets_raise_it():
    texts = words(400, seed=3)
    plain, _ = recorded(batch_size=32, length=len)
    bucketed, _ = recorded(batch_size=32, length=len, buckets="auto")
    for f in (plain, bucketed):
        assert outcome(lambda: f.many(texts)) == [f"<{t}>" for t in texts]
    p, b = plain.stats.padding_efficiency, bucketed.stats.padding_efficiency
    assert 0 < p < b <= 1
    assert b > 0.8  # within a bucket the longest is at most 1.41x the shortest
    unmeasured, _ = recorded()
    unmeasured.many(texts[:4])
    assert unmeasured.stats.padding_efficiency is None


def test_a_queued_bucket_waits_while_the_full_one_goes_first():
    """The worker is busy; short items trickle in, and then enough long ones for a batch: the
    long batch goes as soon as the worker is free, and the short ones follow."""
    rec = Recorder(hold_first=True)
    f = bp.dynamically(batch_size=4, timeout_ms=60_000, length=abs, buckets=[10])(rec)
    first = threading.Thread(target=f.many, args=([1, 1, 1, 1],))  # a full batch: it goes at once
    first.start()
    assert rec.started.wait(LIMIT_S)
    calls = [threading.Thread(target=f, args=(x,)) for x in (2, 3, 100, 200, 300, 400)]
    for i, t in enumerate(calls):
        t.start()
        queued(f, i + 1)
    rec.release.set()
    first.join(LIMIT_S)
    calls[-1].join(LIMIT_S)
    assert rec.batches[1] == [100, 200, 300, 400]  # a full bucket, although 2 and 3 came first
    assert f.stats.queue_size == 2  # the short ones wait for their bucket to fill or time out
    with f.processor._cond:
        f.processor._first_arrival -= 60  # as if their timeout had passed
        f.processor._cond.notify()
    for t in calls:
        t.join(LIMIT_S)
    assert rec.batches[2] == [2, 3]


def test_the_tensor_variant_buckets_by_its_own_lengths():
    shapes = []

    @bp.dynamically(batch_size=8, timeout_ms=20, pad_token={"input_ids": 0}, buckets=[4, 8])
    def total(batch):
        shapes.append(tuple(batch["input_ids"].shape))
        return batch["input_ids"].sum(axis=1)

    items = [{"input_ids": np.arange(1, n + 1)} for n in (2, 7, 3, 8, 1, 6)]
    assert outcome(lambda: total.many(items)) == [n * (n + 1) // 2 for n in (2, 7, 3, 8, 1, 6)]
    assert sorted(shapes) == [(3, 3), (3, 8)]  # lengths 1-3 together, 6-8 together
    assert total.stats.padding_efficiency == pytest.approx((2 + 3 + 1 + 7 + 8 + 6) / (3 * 3 + 3 * 8))


def test_length_options_are_checked():
    with pytest.raises(ValueError, match="give length= too"):
        bp.dynamically(buckets=[8, 16])
    with pytest.raises(ValueError, match="increasing"):
        bp.dynamically(length=len, buckets=[16, 8])
    with pytest.raises(ValueError, match="'auto' or a list"):
        bp.dynamically(length=len, buckets="some")
    with pytest.raises(ValueError, match="cost= or length=, not both"):
        bp.dynamically(length=len, cost=len, max_batch_cost=10)
    f = bp.dynamically(length=lambda item: "long")(lambda items: items)
    with pytest.raises(ValueError, match="length\\(item\\) returned 'long'"):
        f("a")
