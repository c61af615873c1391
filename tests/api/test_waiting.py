"""What waiting on a batch guarantees: it ends after every callback of the batch has run, it
never misses a batch that completes while it registers, and a callback may wait too."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytestmark = pytest.mark.slow


def _collect(batch, how: str):
    if how == "wait":
        return batch.start().wait(timeout=60)
    if how == "iterate":
        return [r for _, r in sorted(batch)]

    async def wait_async():
        return await asyncio.wait_for(batch.wait_async(), 60)

    async def async_for():
        return [r for _, r in sorted([item async for item in batch])]

    return asyncio.run({"wait_async": wait_async, "async_for": async_for}[how]())


@pytest.mark.parametrize("how", ["wait", "iterate", "wait_async", "async_for"])
def test_waiting_ends_after_every_callback_of_the_batch(lm, messages, how):
    seen, complete = [], []

    def on_result(index, result):
        time.sleep(0.05)  # slow callbacks: a waiter that does not wait for them reads too early
        seen.append(index)

    def on_complete(results):
        time.sleep(0.3)
        complete.append(results)

    batch = lm.create_batch(messages[:4]).on_result(on_result).on_complete(on_complete)
    results = _collect(batch, how)
    assert sorted(seen) == [0, 1, 2, 3]
    assert complete == [results]


def test_a_callback_may_wait_for_its_own_batch(lm, messages):
    got = {}
    batch = lm.create_batch(messages[:3])
    # On the callback thread, wait() waits for the results: the other callbacks cannot run
    # until this one returns, so waiting for them would wait for ever.
    batch.on_result(lambda i, r: got.setdefault("on_result", batch.wait(timeout=60)))
    batch.on_complete(lambda results: got.setdefault("on_complete", batch.wait(timeout=60)))
    results = batch.wait(timeout=60)
    assert got == {"on_result": results, "on_complete": results}


def test_wait_async_sees_a_batch_that_completes_while_it_registers(lm, messages):
    completing, registered = threading.Event(), threading.Event()

    class PausingEvent(threading.Event):
        """The batch's 'every result is in' flag: it pauses as it is set, after the batch has
        handed out its completion callbacks, until wait_async has registered."""

        def set(self):
            completing.set()
            registered.wait(10)
            super().set()

    batch = lm.create_batch(messages[:2]).on_complete(lambda results: None)
    batch._done = PausingEvent()

    async def main():
        batch.start()
        assert await asyncio.to_thread(completing.wait, 60)
        waiter = asyncio.ensure_future(batch.wait_async())
        for _ in range(3):
            await asyncio.sleep(0)  # the waiter runs up to its await
        registered.set()
        return await asyncio.wait_for(waiter, 30)

    results = asyncio.run(main())
    assert [r.index for r in results] == [0, 1] and all(r.ok for r in results)
