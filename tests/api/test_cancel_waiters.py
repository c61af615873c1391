"""A waiter that goes away cancels its work in the engine: Ctrl-C in a blocking call, a
cancelled or timed-out task, an iteration left early, an event loop that closed."""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

import pytest

from batchprompt.api.batch import Batch, Prepared

from .conftest import EngineSpy

pytestmark = pytest.mark.slow

N = 40  # prompts; the service feeds 8 at a time here, so most are still waiting to be fed


@pytest.fixture()
def prompts(messages):
    return [f"{m} ({i})" for i, m in enumerate(messages * 2)][:N]


@pytest.fixture(autouse=True)
def long_answers(engine32, monkeypatch):
    """Every request runs to max_tokens (no end-of-sequence token stops it), so none can finish
    in the first step, which the spy holds until the cancel arrives."""
    monkeypatch.setattr(engine32, "eos_token_ids", frozenset())


@pytest.fixture(autouse=True)
def narrow_window(lm, monkeypatch):
    monkeypatch.setattr(lm._service, "_window", lambda: 8)


@pytest.fixture()
def ctrl_c():
    """A function that, from any thread, raises KeyboardInterrupt in the main thread as Ctrl-C
    does. A signal that lands while the main thread runs Python code is handled at once, but
    one that lands just before it blocks in a lock is handled only when the lock is released;
    so it is sent again until handled, and the handler raises once."""
    main = threading.main_thread()
    assert threading.current_thread() is main
    pressed = threading.Event()

    def handler(signum, frame):
        if not pressed.is_set():
            pressed.set()
            raise KeyboardInterrupt

    def press():
        for _ in range(100):
            signal.pthread_kill(main.ident, signal.SIGUSR1)
            if pressed.wait(0.1):
                return

    previous = signal.signal(signal.SIGUSR1, handler)
    yield press
    signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("call", ["wait", "batch_prompt", "prompt", "iterate"])
def test_ctrl_c_in_a_blocking_call_cancels_its_work(lm, engine32, monkeypatch, prompts, ctrl_c, call):
    spy = EngineSpy(lm._service, engine32, monkeypatch, hold_at_step=1, on_hold=ctrl_c)
    run = {"wait": lambda: lm.create_batch(prompts, max_tokens=16).wait(),
           "batch_prompt": lambda: lm.batch_prompt(prompts, max_tokens=16),
           "prompt": lambda: lm.prompt(prompts[0], max_tokens=16),
           "iterate": lambda: list(lm.create_batch(prompts, max_tokens=16))}[call]
    with pytest.raises(KeyboardInterrupt):
        run()
    _assert_stopped_while_held(spy, 1 if call == "prompt" else N)


@pytest.mark.parametrize("call", ["abatch_prompt", "aprompt", "wait_async", "async_for"])
def test_cancelling_the_awaiting_task_cancels_its_work(lm, engine32, monkeypatch, prompts, call):
    spy = EngineSpy(lm._service, engine32, monkeypatch, hold_at_step=1)

    async def consume():
        async for _ in lm.create_batch(prompts, max_tokens=16):
            pass

    start = {"abatch_prompt": lambda: lm.abatch_prompt(prompts, max_tokens=16),
             "aprompt": lambda: lm.aprompt(prompts[0], max_tokens=16),
             "wait_async": lambda: lm.create_batch(prompts, max_tokens=16).wait_async(),
             "async_for": consume}[call]

    async def main():
        task = asyncio.ensure_future(start())
        assert await asyncio.to_thread(spy.held.wait, 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _assert_stopped_while_held(spy, 1 if call == "aprompt" else N)


def test_a_timeout_of_wait_for_cancels_its_work(lm, engine32, monkeypatch, prompts):
    spy = EngineSpy(lm._service, engine32, monkeypatch, hold_at_step=1)

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(lm.abatch_prompt(prompts, max_tokens=16), timeout=0.5)

    asyncio.run(main())
    spy.assert_cancel_reached_the_engine(N)
    assert spy.ran_to_the_end() == 0 and len(spy.added) < N


def _assert_stopped_while_held(spy: EngineSpy, total: int) -> None:
    """The engine was held at its first step until the cancel came: what it held was aborted
    there, nothing ran to its end, and what it had not been fed never was."""
    spy.assert_cancel_reached_the_engine(total)
    assert spy.aborted() >= 1 and spy.ran_to_the_end() == 0
    assert len(spy.added) < total or total == 1


def _batch_with_a_first_result(lm, prompts) -> Batch:
    """A batch whose item 0 fails before the engine, so it is there to read before any step."""
    prepared = lm._prepare(prompts, {"max_tokens": 16})
    prepared[0] = Prepared(0, None, prepared[0].params, "refused before the engine")
    return Batch(lm._service, prepared)


@pytest.mark.parametrize("kind", ["for", "async for"])
def test_leaving_an_iteration_early_cancels_the_rest(lm, engine32, monkeypatch, prompts, caplog, kind):
    spy = EngineSpy(lm._service, engine32, monkeypatch, hold_at_step=1)
    batch = _batch_with_a_first_result(lm, prompts)
    if kind == "for":
        for first, _ in batch:
            break
    else:
        async def main():
            async for index, _ in batch:
                return index
        first = asyncio.run(main())
    results = batch.wait(timeout=60)
    assert first == 0
    assert [r.finish_reason for r in results[1:]] == ["cancelled"] * (N - 1)
    spy.assert_cancel_reached_the_engine(N)
    assert spy.ran_to_the_end() == 0 and len(spy.added) < N
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_an_iteration_whose_event_loop_closed_cancels_the_rest_quietly(lm, engine32, monkeypatch, prompts,
                                                                      caplog):
    spy = EngineSpy(lm._service, engine32, monkeypatch)
    batch = _batch_with_a_first_result(lm, prompts)
    loop = asyncio.new_event_loop()
    results = batch.__aiter__()
    assert loop.run_until_complete(results.__anext__())[0] == 0
    loop.close()  # with the iteration open: the next result finds the loop closed
    done = batch.wait(timeout=60)
    spy.assert_cancel_reached_the_engine(N)
    # the first window ran (its results found the loop closed); the rest was never fed
    assert spy.ran_to_the_end() >= 1 and len(spy.added) < N
    assert [r.finish_reason for r in done if r.ok] == ["length"] * spy.ran_to_the_end()
    assert [r.finish_reason for r in done if not r.ok][1:] == ["cancelled"] * (N - 1 - spy.ran_to_the_end())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    asyncio.run(results.aclose())
