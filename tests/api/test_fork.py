"""A process forked from one whose engine runs (multiprocessing's default start on Linux)."""
from __future__ import annotations

import multiprocessing
import os

import pytest

import batchprompt as bp

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")]


def test_a_forked_child_gets_an_error_from_the_parents_session_and_an_engine_of_its_own(engine32, messages):
    """The child has copies of the parent's sessions but not the engine's threads: a call on one
    waited for ever, and so did a new session there (the registry handed it the parent's engine)."""
    lm = bp.LanguageModel.create(model=engine32, max_tokens=3)
    expected = lm.prompt(messages[0])
    ctx = multiprocessing.get_context("fork")
    out = ctx.SimpleQueue()

    def child() -> None:
        try:
            lm.prompt(messages[0])
            out.put("the parent's session answered")
        except bp.EngineStoppedError as e:
            out.put(str(e))
        except Exception as e:  # noqa: BLE001
            out.put(f"{type(e).__name__}: {e}")
        out.put(bp.batch_prompt([messages[0]], model=engine32, max_tokens=3)[0].text)

    proc = ctx.Process(target=child)
    proc.start()
    proc.join(90)
    if proc.is_alive():
        proc.kill()
        pytest.fail("the forked child hung")
    assert proc.exitcode == 0
    error, text = out.get(), out.get()
    assert "the process this one was forked from" in error and "'spawn'" in error, error
    assert text == expected  # greedy, float32: the child's own engine answers as the parent's
    assert lm.prompt(messages[0]) == expected  # the parent's engine goes on
    lm.destroy()
