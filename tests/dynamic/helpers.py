"""Helpers for the bp.dynamically tests: a recording batch function, bounded waits, and waits for
defined points (a queue size, a thread blocked in a given function) instead of sleeps."""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

LIMIT_S = 10.0  # a bound on every wait, so that a broken batcher fails a test instead of hanging it


class Recorder:
    """A batch function that records its batches and can hold the first one until released."""

    def __init__(self, hold_first: bool = False):
        self.batches: list[list] = []
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()

    def __call__(self, items: list) -> list:
        self.batches.append(list(items))
        self.started.set()
        self.release.wait(LIMIT_S)
        return [x * 10 for x in items]


def run_threads(fn, n: int) -> list:
    out = [None] * n

    def worker(i):
        out[i] = fn(i)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(LIMIT_S)
    return out


def outcome(call: Callable[[], Any], limit: float = LIMIT_S) -> Any:
    """`call()` on a thread of its own: its result, or the exception it raised (any
    BaseException). Fails the test if it has not returned within `limit` seconds."""
    out: dict[str, Any] = {}

    def target():
        try:
            out["value"] = call()
        except BaseException as e:  # noqa: BLE001 - SystemExit and co. are what some tests expect
            out["value"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"the call did not return within {limit}s"
    return out["value"]


async def aoutcome(awaitable) -> Any:
    """The awaited result, or the exception it raised (any BaseException)."""
    try:
        return await awaitable
    except BaseException as e:  # noqa: BLE001
        return e


def wait_until(predicate: Callable[[], bool], what: str, limit: float = LIMIT_S) -> None:
    """Poll a state that the test waits for (a queue size, a thread's position)."""
    end = time.perf_counter() + limit  # not monotonic: a test may stand in for it
    while not predicate():
        assert time.perf_counter() < end, f"timed out waiting until {what}"
        time.sleep(0.001)


def queued(f, n: int) -> None:
    """Wait until the batcher of `f` holds `n` queued items."""
    wait_until(lambda: f.stats.queue_size == n, f"{n} items are queued")


def in_function(thread: threading.Thread, name: str) -> bool:
    """Whether `thread` is running (or blocked) inside a function named `name`."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False
