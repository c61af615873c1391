"""`bp.dynamically` against the `batched` package on the same no-op function, in one run (issue 5).

Batch size 64, timeout 5 ms. asyncio: 20,000 tasks each awaiting one call, twice: with a plain
function (batched runs it in a thread per batch, ours on its worker thread) and with an `async def`
one (batched awaits it on the callers' loop, ours runs it on its worker's own loop). Threads: 64
threads making 5,000 calls in all. Thread pool: `ThreadPoolExecutor(64).map(f, items)` over 5,000 items
(each pool thread calls f once per item and returns; the executor alone, with a function that returns
at once, is reported for reference). After a warm-up, each measurement alternates ours and theirs, seven
rounds; the median of each is reported. Prints a markdown table and writes benchmarks/results/dynamic.json.

Every measurement starts with `gc.collect()` (the collector stays on while it runs). Both libraries share
one heap of ~170,000 objects (both import torch), where a full collection costs ~100 ms; without the
collect, whether a measurement pays for one depends on what the previous measurement left behind, so
one side pays for the other's garbage and single rounds swing by 1.6x.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import batched
from common import save_results

import batchprompt as bp


def noop(items: list) -> list:
    return items


async def anoop(items: list) -> list:
    return items


def asyncio_rate(make, n: int) -> float:
    """`make()` builds the batched function inside the loop (batched's binds to its first loop)."""
    async def main():
        call = make()
        return await asyncio.gather(*(call(i) for i in range(n)))

    gc.collect()
    t0 = time.perf_counter()
    out = asyncio.run(main())
    dt = time.perf_counter() - t0
    assert list(out) == list(range(n))
    return n / dt


def thread_rate(call, threads: int, total: int) -> float:
    per = total // threads
    start = threading.Barrier(threads + 1)
    bad = []

    def worker(k: int) -> None:
        start.wait()
        for i in range(per):
            if call(k * per + i) != k * per + i:
                bad.append(i)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    gc.collect()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    assert not bad
    return per * threads / dt


def pool_rate(call, pool: ThreadPoolExecutor, total: int) -> float:
    gc.collect()
    t0 = time.perf_counter()
    out = list(pool.map(call, range(total)))
    dt = time.perf_counter() - t0
    assert out == list(range(total))
    return total / dt


def identity(x):
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--callers", type=int, default=20_000)
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--calls", type=int, default=5_000)
    args = ap.parse_args()
    opts = dict(batch_size=64, timeout_ms=5.0)
    ours = bp.dynamically(**opts)(noop)
    theirs_sync = batched.dynamically(**opts)(noop)
    rates: dict[str, list[float]] = {k: [] for k in ("ours_asyncio", "batched_asyncio", "ours_asyncio_async_fn",
                                                     "batched_asyncio_async_fn", "ours_threads", "batched_threads",
                                                     "ours_pool", "batched_pool", "pool_alone")}
    pool = ThreadPoolExecutor(args.threads)
    asyncio_rate(lambda: bp.dynamically(**opts)(noop).acall, 2000)  # warm-up, not counted
    asyncio_rate(lambda: batched.aio.dynamically(**opts)(noop), 2000)
    asyncio_rate(lambda: bp.dynamically(**opts)(anoop).acall, 2000)
    asyncio_rate(lambda: batched.aio.dynamically(**opts)(anoop), 2000)
    thread_rate(ours, args.threads, 640)
    thread_rate(theirs_sync, args.threads, 640)
    for call in (ours, theirs_sync, identity):
        pool_rate(call, pool, 640)
    for _ in range(args.rounds):
        rates["ours_asyncio"].append(asyncio_rate(lambda: bp.dynamically(**opts)(noop).acall, args.callers))
        rates["batched_asyncio"].append(asyncio_rate(lambda: batched.aio.dynamically(**opts)(noop), args.callers))
        rates["ours_asyncio_async_fn"].append(
            asyncio_rate(lambda: bp.dynamically(**opts)(anoop).acall, args.callers))
        rates["batched_asyncio_async_fn"].append(
            asyncio_rate(lambda: batched.aio.dynamically(**opts)(anoop), args.callers))
        rates["ours_threads"].append(thread_rate(ours, args.threads, args.calls))
        rates["batched_threads"].append(thread_rate(theirs_sync, args.threads, args.calls))
        rates["ours_pool"].append(pool_rate(ours, pool, args.calls))
        rates["batched_pool"].append(pool_rate(theirs_sync, pool, args.calls))
        rates["pool_alone"].append(pool_rate(identity, pool, args.calls))
    pool.shutdown()
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = {"asyncio": med["ours_asyncio"] / med["batched_asyncio"],
             "asyncio_async_fn": med["ours_asyncio_async_fn"] / med["batched_asyncio_async_fn"],
             "threads": med["ours_threads"] / med["batched_threads"],
             "pool": med["ours_pool"] / med["batched_pool"]}
    save_results("dynamic", dict(rates=rates, median=med, ratio=ratio))
    print("| callers | batchprompt (items/s) | batched (items/s) | ratio |\n|---|---|---|---|")
    print(f"| {args.callers:,} asyncio tasks | {med['ours_asyncio']:,.0f} | {med['batched_asyncio']:,.0f} | "
          f"{ratio['asyncio']:.2f}x |")
    print(f"| {args.callers:,} asyncio tasks, `async def` function | {med['ours_asyncio_async_fn']:,.0f} | "
          f"{med['batched_asyncio_async_fn']:,.0f} | {ratio['asyncio_async_fn']:.2f}x |")
    print(f"| {args.threads} threads, {args.calls:,} calls | {med['ours_threads']:,.0f} | "
          f"{med['batched_threads']:,.0f} | {ratio['threads']:.2f}x |")
    print(f"| ThreadPoolExecutor({args.threads}).map, {args.calls:,} items | {med['ours_pool']:,.0f} | "
          f"{med['batched_pool']:,.0f} | {ratio['pool']:.2f}x |")
    print(f"\nthe executor alone (a function that returns at once): {med['pool_alone']:,.0f} items/s")
    print(f"median of {args.rounds} alternating rounds; ours: {ours.stats}")


if __name__ == "__main__":
    main()
