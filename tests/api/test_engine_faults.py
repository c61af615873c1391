"""Faults around the engine thread: every item is answered, and no waiter is left blocked."""
from __future__ import annotations

import itertools
import sys
import threading

import pytest

import batchprompt as bp
import batchprompt.api.batch as batch_module

from ..conftest import SPAM_SYSTEM

pytestmark = pytest.mark.slow


def test_a_prompt_the_engine_refuses_to_queue_fails_alone(lm, engine32, monkeypatch, messages):
    real, calls = engine32.add_request, itertools.count()

    def add_request(prompt, params=None, request_id=None, **kwargs):
        n = next(calls)
        if n == 1:  # as when llguidance cannot build the tokenizer a grammar needs
            raise RuntimeError("cannot build the grammar's tokenizer")
        if n == 3:  # fails after the engine took it: the engine must not keep it
            real(prompt, params, request_id, **kwargs)
            raise RuntimeError("failed half-way")
        return real(prompt, params, request_id, **kwargs)

    monkeypatch.setattr(engine32, "add_request", add_request)
    results = lm.create_batch(messages[:5]).wait(timeout=60)
    assert sorted(r.error for r in results if not r.ok) == [
        "the engine could not queue this prompt: RuntimeError: cannot build the grammar's tokenizer",
        "the engine could not queue this prompt: RuntimeError: failed half-way"]
    assert sum(r.ok for r in results) == 3
    assert lm.prompt(messages[0])  # the engine thread goes on
    lm._service.call(lambda: None).result(30)  # the half-added request is gone from the engine
    assert not lm._service.call(engine32.has_unfinished).result(30)


def test_a_result_handler_that_raises_still_answers_its_item(lm, monkeypatch, messages):
    def to_result(index, out, *args):
        if index == 1 and out.error is None:
            raise ValueError("a bug while reading the output")
        return real(index, out, *args)

    real = batch_module.to_result
    monkeypatch.setattr(batch_module, "to_result", to_result)
    results = lm.create_batch(messages[:3]).wait(timeout=60)
    assert [r.ok for r in results] == [True, False, True]
    assert results[1].error == "the result could not be handled: ValueError: a bug while reading the output"


def test_a_result_that_cannot_be_read_at_all_still_answers_every_item(lm, monkeypatch, messages):
    """Reading an output failed also on the error output the backend then hands over (a
    signature changed under a wrapper, say): no item was answered, and wait() never ended."""
    def to_result(*args):
        raise TypeError("to_result() takes from 2 to 3 positional arguments but 4 were given")

    monkeypatch.setattr(batch_module, "to_result", to_result)
    results = lm.create_batch(messages[:3]).wait(timeout=60)
    assert [r.error for r in results] == ["the result could not be handled: TypeError: to_result() takes from 2 "
                                          "to 3 positional arguments but 4 were given"] * 3


def test_when_the_engine_thread_dies_every_waiter_gets_the_error_and_the_next_call_a_fresh_engine(
        engine32, monkeypatch, messages):
    lm = bp.LanguageModel.create(system=SPAM_SYSTEM, model=engine32, max_tokens=6)
    service = lm._service
    real, broken = engine32.has_unfinished, threading.Event()

    def has_unfinished():  # the engine thread's own loop fails, outside any guarded step
        if broken.is_set():
            raise RuntimeError("the engine's state is lost")
        return real()

    monkeypatch.setattr(engine32, "has_unfinished", has_unfinished)
    first, second = lm.create_batch(messages[:3]), lm.create_batch(messages[3:20])
    broken.set()
    first.start()
    second.start()
    for batch in (first, second):
        results = batch.wait(timeout=60)
        assert {r.error for r in results} == {
            "the engine stopped: RuntimeError: the engine's state is lost (the next call starts a fresh engine)"}
        assert all(r.retryable for r in results)  # not the prompts' fault: a job does not journal them
    service._thread.join(30)
    service._dispatcher.join(30)
    assert not service._thread.is_alive() and not service._dispatcher.is_alive()
    with pytest.raises(bp.EngineStoppedError, match="state is lost.*create a new session"):
        lm.prompt(messages[0])

    monkeypatch.setattr(engine32, "has_unfinished", real)  # the engine is sound again
    with bp.LanguageModel.create(system=SPAM_SYSTEM, model=engine32, max_tokens=6) as fresh:
        assert fresh._service is not service
        assert fresh.prompt(messages[0])
    lm.destroy()


@pytest.mark.parametrize("call", ["prompt", "prompt_streaming"])
def test_a_prompt_waiting_when_the_engine_thread_dies_raises_engine_stopped(engine32, monkeypatch, messages, call):
    """It raised a plain ValueError (what a bad prompt raises), though the prompt was not at fault
    and a batch's results said retryable; a stopped engine's calls raise EngineStoppedError."""
    lm = bp.LanguageModel.create(system=SPAM_SYSTEM, model=engine32, max_tokens=6)
    real = engine32.has_unfinished

    def has_unfinished():  # fails once the prompt is in the engine
        if real():
            raise RuntimeError("the engine's state is lost")
        return False

    monkeypatch.setattr(engine32, "has_unfinished", has_unfinished)
    with pytest.raises(bp.EngineStoppedError, match="state is lost"):
        if call == "prompt":
            lm.prompt(messages[0])
        else:
            "".join(lm.prompt_streaming(messages[0]))
    lm._service._thread.join(30)
    monkeypatch.setattr(engine32, "has_unfinished", real)
    lm.destroy()


def test_a_callback_that_raises_system_exit_does_not_stop_the_others(lm, messages):
    first = lm.create_batch(messages[:2]).on_complete(lambda results: sys.exit("a callback exits"))
    first.wait(timeout=60)
    got = []
    second = lm.create_batch(messages[2:4]).on_complete(got.append)
    results = second.wait(timeout=60)
    assert got == [results]


def test_a_callback_that_raises_each_time_logs_one_traceback_then_counts(caplog):
    """An on_tokens that raised on every token wrote a traceback each time: 339 of them, 2,712
    lines, for 20 short prompts."""
    import logging

    from batchprompt.api.callbacks import _run

    def broken(index, ids):
        raise ValueError("bad token")

    with caplog.at_level(logging.ERROR, logger="batchprompt"):
        for _ in range(100):
            _run(broken, (0, [1]))
    records = [r for r in caplog.records if "broken" in r.getMessage()]
    assert len(records) == 3, [r.getMessage() for r in records]  # the first, then at 10 and 100
    assert records[0].exc_info and "further ValueError errors are counted" in records[0].getMessage()
    assert "has raised ValueError 10 times; the last: bad token" in records[1].getMessage()
    assert "has raised ValueError 100 times" in records[2].getMessage() and not records[2].exc_info


@pytest.mark.parametrize("stop", [SystemExit, KeyboardInterrupt])
def test_a_callback_s_other_kind_of_error_is_logged_too(caplog, monkeypatch, stop):
    """Only a callback's first error was printed: its SystemExit after a ValueError left no trace."""
    import logging

    from batchprompt.api import callbacks
    from batchprompt.api.callbacks import _run

    monkeypatch.setattr(callbacks, "_raised", {})  # each parameter's flaky is the same code

    def flaky(index, result):
        raise (ValueError("bad") if index == 0 else stop("leave"))

    with caplog.at_level(logging.ERROR, logger="batchprompt"):
        for index in (0, 0, 1):
            _run(flaky, (index, None))
    records = [r for r in caplog.records if "flaky" in r.getMessage()]
    assert [r.getMessage().split(" raised ")[1].split(";")[0] for r in records] == ["ValueError", stop.__name__]
    assert all(r.exc_info for r in records)
