"""A process forked from one whose engine runs (multiprocessing's default start on Linux)."""
from __future__ import annotations

import multiprocessing
import os

import pytest

import batchprompt as bp
from batchprompt.device import FORKED_CUDA

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")]


def _run_forked(ctx, child) -> int:
    """`child` run in a forked process: its exit code (a failure if it hangs)."""
    proc = ctx.Process(target=child)
    proc.start()
    proc.join(90)
    if proc.is_alive():
        proc.kill()
        pytest.fail("the forked child hung")
    return proc.exitcode


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
        try:
            out.put(bp.batch_prompt([messages[0]], model=engine32, max_tokens=3)[0].text)
        except Exception as e:  # noqa: BLE001
            out.put(f"{type(e).__name__}: {e}")

    assert _run_forked(ctx, child) == 0
    error, text = out.get(), out.get()
    assert "the process this one was forked from" in error and "'spawn'" in error, error
    if engine32.runner.device.type == "cuda":  # CUDA cannot run in a forked child: said at once, and how to
        # start one that can (it was "the session's system prompt cannot run: the model failed on this step")
        assert text == f"RuntimeError: {FORKED_CUDA}", text
    else:
        assert text == expected  # greedy, float32: the child's own engine answers as the parent's
    assert lm.prompt(messages[0]) == expected  # the parent's engine goes on
    lm.destroy()


def test_a_batch_running_at_the_fork_is_answered_in_the_child(engine32, messages):
    """A batch that was running when the process forked waited for ever in the child (wait(),
    iteration, wait_async): its requests were in the parent's engine, which no thread of the
    child steps. Each is answered at once with the fork's error; the parent's batch goes on."""
    lm = bp.LanguageModel.create(model=engine32, max_tokens=200, min_tokens=200)  # still running at the fork
    batch = lm.create_batch(messages[:8]).start()
    ctx = multiprocessing.get_context("fork")
    out = ctx.SimpleQueue()

    def child() -> None:
        try:
            results = batch.wait(timeout=30)
            out.put(sorted({(r.finish_reason, "forked from" in (r.error or "")) for r in results}))
        except BaseException as e:  # noqa: BLE001
            out.put(f"{type(e).__name__}: {e}")

    _run_forked(ctx, child)
    assert out.get() == [("error", True)]
    batch.cancel()  # the parent's batch is its own: cancelled here, not waited for
    assert lm.prompt(messages[0], max_tokens=2, min_tokens=0)
    lm.destroy()


def test_cuda_in_a_child_forked_from_a_cuda_process_is_refused_naming_spawn(monkeypatch, engine32):
    """Such a child's first step failed ("Cannot re-initialize CUDA in forked subprocess", after
    the model had loaded, as a failure of the system prompt). Where PyTorch says this process is
    such a child, a CUDA device is refused as it is asked for: by name, or by default."""
    import torch

    from batchprompt.device import resolve_device

    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for device in ("auto", "cuda"):
        with pytest.raises(RuntimeError, match="'spawn'"):
            resolve_device(device)
    assert resolve_device("cpu").type == "cpu"
    bp.shutdown(engine32)  # as in such a child, where the registry starts empty
    monkeypatch.setattr(engine32.runner, "device", torch.device("cuda"))
    with pytest.raises(RuntimeError, match="forked from one that used CUDA"):
        bp.LanguageModel.create(model=engine32)
