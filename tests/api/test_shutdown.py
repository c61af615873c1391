"""Releasing engines: bp.shutdown() and LanguageModel.close(); device= and dtype= on every
entry point. These build engines of their own (the embedded model, a small KV cache)."""
from __future__ import annotations

import asyncio
import gc
import re
import sys
import threading
import time
import weakref

import pytest
import torch

import batchprompt as bp
import batchprompt.api.service as service_module
from batchprompt.api.service import get_service

from ..conftest import SPAM_SYSTEM, sigint_default

pytestmark = pytest.mark.slow

SMALL = {"kv_cache_memory": 64 << 20, "max_num_batched_tokens": 256, "max_model_len": 1024}


def test_device_dtype_and_engine_options_reach_the_engine_from_every_entry_point(engine32, monkeypatch,
                                                                                 messages):
    calls = []

    def spy(model, **kwargs):
        calls.append((model, kwargs))
        return real(engine32)

    real = service_module.get_service
    monkeypatch.setattr(service_module, "get_service", spy)  # what the backend seam calls for a local model
    given = {"device": "cpu", "dtype": "float32", "engine_options": {"max_num_seqs": 8}}
    assert bp.batch_prompt(messages[:1], model="smollm2-135m", max_tokens=2, **given)[0].ok
    assert asyncio.run(bp.abatch_prompt(messages[:1], model="smollm2-135m", max_tokens=2, **given))[0].ok
    bp.LanguageModel.create(model="smollm2-135m", **given).destroy()
    assert calls == [("smollm2-135m", given)] * 3


def _raised(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        return e
    return None


def _hold_first_step_until_stopped(service):
    """The first step waits (at most 10 s) until the service is stopping, so that work is
    still in the engine when shutdown comes. Wraps the service, never the engine, which the
    test wants to see freed."""
    real, stepped = service._step, threading.Event()

    def step():
        if not stepped.is_set():
            stepped.set()
            for _ in range(100):
                if service.stopped:
                    break
                time.sleep(0.1)
        real()

    service._step = step
    return stepped


def test_shutdown_cancels_waiters_frees_the_engine_and_the_next_call_builds_a_fresh_one(messages):
    first = bp.batch_prompt(messages[:2], system=SPAM_SYSTEM, device="cpu", dtype="float32",
                            engine_options=SMALL, max_tokens=3)
    assert all(r.ok for r in first)
    service = get_service("smollm2-135m", device="cpu", dtype="float32")  # the one batch_prompt built
    assert next(service.engine.model.parameters()).dtype == torch.float32
    engine = weakref.ref(service.engine)
    lm = bp.LanguageModel.create(system=SPAM_SYSTEM, device="cpu", dtype="float32", max_tokens=40)
    assert lm._service is service
    stepped = _hold_first_step_until_stopped(service)
    pending = lm.create_batch(messages[:12]).start()
    assert stepped.wait(60)
    one = {}  # a prompt() cut off by the shutdown raised ValueError, as if its input were bad
    caller = threading.Thread(target=lambda: one.update(got=_raised(lm.prompt, messages[0])), daemon=True)
    caller.start()
    deadline = time.monotonic() + 30
    while not any(b is not pending and b._started_at for b in list(lm._batches)):
        assert time.monotonic() < deadline, "the prompt() never started"
        time.sleep(0.01)

    assert bp.shutdown("smollm2-135m") >= 1
    caller.join(60)
    assert isinstance(one.get("got"), bp.EngineStoppedError), one
    results = pending.wait(timeout=60)  # answered at once, not left waiting
    cancelled = [r for r in results if not r.ok]
    assert cancelled and {(r.finish_reason, r.error) for r in cancelled} == {
        ("cancelled", "the engine was shut down (bp.shutdown() or LanguageModel.close())")}
    assert all(r.retryable for r in cancelled)
    assert not service._thread.is_alive() and not service._dispatcher.is_alive()
    gc.collect()
    assert engine() is None, "the engine (weights, KV cache) is still referenced"
    with pytest.raises(bp.EngineStoppedError, match="shut down.*create a new session"):
        lm.prompt(messages[0])

    again = bp.batch_prompt(messages[:2], system=SPAM_SYSTEM, device="cpu", dtype="float32",
                            engine_options=SMALL, max_tokens=3)
    assert [r.text for r in again] == [r.text for r in first]
    fresh = get_service("smollm2-135m", device="cpu", dtype="float32")
    assert fresh is not service
    assert bp.shutdown("smollm2-135m") >= 1 and fresh.stopped


def test_a_batch_made_before_shutdown_and_started_after_comes_back_cancelled(messages):
    """Its start raised EngineStoppedError out of the stopped service's grammar look-up before
    its items were answered: the first wait() raised, every later one waited for ever, and
    on_complete never ran."""
    lm = bp.LanguageModel.create(system=SPAM_SYSTEM, device="cpu", dtype="float32", engine_options=SMALL,
                                 max_tokens=3)
    batch = lm.create_batch(messages[:2])
    completed = []
    batch.on_complete(completed.append)
    assert bp.shutdown("smollm2-135m") >= 1
    for _ in range(2):
        results = batch.wait(timeout=30)
        assert [r.finish_reason for r in results] == ["cancelled", "cancelled"], results
        assert all("shut down" in r.error for r in results)
    assert batch.done and len(completed) == 1


def test_close_releases_the_engine_once_no_other_session_uses_it(messages):
    lm = bp.LanguageModel.create(system=SPAM_SYSTEM, model="smollm2-135m", device="cpu", dtype="bfloat16",
                                 engine_options=SMALL, max_tokens=3)
    service = lm._service
    assert next(service.engine.model.parameters()).dtype == torch.bfloat16
    engine = weakref.ref(service.engine)
    other = lm.clone()
    lm.close()
    assert not service.stopped and other.prompt(messages[0])  # the clone still uses it
    other.close()
    assert service.stopped and not service._thread.is_alive() and not service._dispatcher.is_alive()
    gc.collect()
    assert engine() is None
    with pytest.raises(bp.SessionDestroyedError):
        other.prompt(messages[0])


def test_shutdown_with_a_timeout_returns_while_the_engine_is_stuck_in_a_step(engine32):
    """A server stopping must not wait without end for a step that never returns (it did: the
    join had no bound). With `timeout`, shutdown returns False in time; the thread ends after."""
    service = service_module.EngineService(engine32, name="stuck")
    release = threading.Event()
    stuck = service.call(lambda: release.wait(60))  # the engine thread is busy until released
    time.sleep(0.2)
    t0 = time.monotonic()
    assert service.shutdown(timeout=0.5) is False
    assert time.monotonic() - t0 < 5
    assert service._thread.is_alive()
    release.set()
    assert stuck.result(30) is True
    assert service.shutdown(timeout=30) is True
    assert not service._thread.is_alive() and not service._dispatcher.is_alive()


def test_a_script_that_ends_while_its_batch_runs_exits_cleanly(tmp_path):
    """The engine thread was left inside a step while the interpreter exited: PyTorch's C++
    aborted the process ("terminate called without an active exception", exit status 134)."""
    import subprocess
    import sys

    script = tmp_path / "ends_early.py"
    script.write_text(
        "import time\n"
        "import batchprompt as bp\n"
        "lm = bp.LanguageModel.create(max_tokens=200, engine_options={'kv_cache_memory': 64 << 20, "
        "'max_model_len': 1024})\n"
        "seen = []\n"
        "batch = lm.create_batch(['Write a long story about a cat'] * 8, min_tokens=200)\n"
        "batch.on_tokens(lambda index, ids: seen.append(len(ids))).start()\n"
        "deadline = time.monotonic() + 60\n"
        "while not seen and time.monotonic() < deadline:\n"  # the engine is inside its steps now
        "    time.sleep(0.05)\n"
        "print('leaving', bool(seen), flush=True)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "leaving True" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
    assert "terminate called" not in proc.stderr
    # The 8 repeated greedy prompts run as one request; the warning counts the prompts
    assert "the script ended with 8 prompts unfinished: cancelled" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap, which malloc_trim gives back")
def test_an_engine_built_again_after_a_shutdown_adds_no_memory():
    """glibc kept what a dropped engine freed: each bp.shutdown() and rebuild in one process
    added about 0.9 GB of RSS (1.0, 2.0, 2.6 GB after three), never given back."""
    import subprocess

    script = ("import os, batchprompt as bp\n"
              "def rss():\n"
              "    return int(next(x for x in open('/proc/self/status') if x.startswith('VmRSS')).split()[1]) // 1024\n"
              "seen = []\n"
              "for _ in range(3):\n"
              "    bp.batch_prompt(['Hello there'] * 8, max_tokens=4)\n"
              "    bp.shutdown()\n"
              "    seen.append(rss())\n"
              "print(*seen)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    first, _, third = map(int, p.stdout.split()[-3:])
    assert third - first < 300, p.stdout  # MB


def test_a_ctrl_c_while_the_model_loads_lets_the_load_end_before_the_exit():
    """The exit waited 10 s for the engine thread, then went on while the load ran PyTorch's C++:
    on a busy machine the process aborted ("terminate called without an active exception")."""
    import subprocess

    script = ("import os, signal, threading\n"
              "import batchprompt as bp\n"
              "import batchprompt.api.service as service\n"
              "service.EXIT_WAIT_S = 0.1  # the load surely outlasts it\n"
              "threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
              "try:\n"
              "    bp.LanguageModel.create()\n"
              "except KeyboardInterrupt:\n"
              "    print('interrupted while loading', flush=True)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                       preexec_fn=sigint_default)
    assert p.returncode == 0 and "interrupted while loading" in p.stdout, (p.returncode, p.stdout, p.stderr[-3000:])
    assert "the model is still loading: the exit waits for the load to end" in p.stderr, p.stderr[-3000:]
    assert "terminate called" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]


def test_a_ctrl_c_in_batch_prompt_then_the_end_of_the_script_is_no_forgotten_wait():
    """The Ctrl-C cancelled the batch, and the exit that followed said "the script ended with 8
    prompts unfinished ... Call wait() on a batch": the cancel had not yet run when the engine stopped."""
    from tests.exit_script import interrupt_a_batch

    interrupt_a_batch("max_tokens=8", [], timeout=300)


def test_a_script_that_ends_while_its_batch_runs_says_so_and_runs_no_callback_of_the_cut_results(tmp_path):
    """The exit spent its 10 s on the cancelled results' callbacks (a slow on_result ran for 10
    of 16 of them, each told 'cancelled'), dropped the rest and on_complete without a word,
    and nothing said why the prompts had no answers. The callbacks of results that come during
    the exit (a step that ends after it began) still run: every finished result gets its
    on_result, no cancelled one does, and the warning counts the cancelled prompts."""
    import subprocess
    import sys

    script = tmp_path / "ends_early_with_callbacks.py"
    script.write_text(
        "import atexit, collections, time\n"
        "ran = collections.Counter()\n"
        "batches = []\n"
        "def report():\n"  # registered first, so it runs after batchprompt's own exit hook
        "    done = collections.Counter(r.finish_reason for b in batches for r in b.results if r is not None)\n"
        "    print('REPORT', done['cancelled'], sum(done.values()) - done['cancelled'], ran['ok'], ran['cancelled'],"
        " ran['complete'], flush=True)\n"
        "atexit.register(report)\n"
        "import batchprompt as bp\n"
        "lm = bp.LanguageModel.create(engine_options={'kv_cache_memory': 64 << 20, 'max_model_len': 1024})\n"
        "def slow(index, result):\n"
        "    ran['cancelled' if result.finish_reason == 'cancelled' else 'ok'] += 1\n"
        "    time.sleep(0.3)\n"
        "short = lm.create_batch([f'Name a colour ({i})' for i in range(6)], max_tokens=4)\n"
        "long = lm.create_batch([f'Write a long story about a cat named {i}' for i in range(10)], max_tokens=600,"
        " min_tokens=600)\n"
        "for b in (short, long):\n"
        "    batches.append(b)\n"
        "    b.on_result(slow).on_complete(lambda results: ran.update(['complete'])).start()\n"
        "deadline = time.monotonic() + 120\n"
        "while short.progress.done < 6 and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "print('leaving', short.progress.done, long.progress.done, flush=True)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "leaving" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
    report = re.search(r"REPORT (\d+) (\d+) (\d+) (\d+) (\d+)", proc.stdout)
    assert report, proc.stdout + proc.stderr[-2000:]
    cancelled, finished, ran_ok, ran_cancelled, ran_complete = map(int, report.groups())
    assert cancelled > 0 and finished >= 6, proc.stdout  # the exit cut the long batch short
    # the short batch's on_complete ran (it finished); the long one's did not
    assert (ran_ok, ran_cancelled, ran_complete) == (finished, 0, 1), proc.stdout
    plural = "prompt" if cancelled == 1 else "prompts"
    assert (f"the script ended with {cancelled} {plural} unfinished: cancelled, without the {cancelled + 1} callback "
            f"calls due for them. Call wait() on a batch") in proc.stderr, proc.stderr[-2000:]


def test_at_exit_the_callbacks_of_results_that_came_all_run_however_long_they_take_in_all(tmp_path):
    """Every result was in, and the script ended while its slow on_result callbacks ran: the
    exit's fixed 10 s deadline dropped the rest, and on_complete, without a word. Now they run
    while each finishes within the wait (here lowered to 1 s, against 6 callbacks of 0.4 s)."""
    import subprocess
    import sys

    script = tmp_path / "slow_callbacks.py"
    script.write_text(
        "import time\n"
        "import batchprompt as bp\n"
        "import batchprompt.api.service as service\n"
        "service.EXIT_WAIT_S = 1.0\n"
        "lm = bp.LanguageModel.create(max_tokens=3, engine_options={'kv_cache_memory': 64 << 20, "
        "'max_model_len': 1024})\n"
        "b = lm.create_batch([f'Name a colour ({i})' for i in range(6)])\n"
        "b.on_result(lambda i, r: (time.sleep(0.4), print('on_result', i, flush=True)))\n"
        "b.on_complete(lambda rs: print('on_complete', len(rs), flush=True))\n"
        "b.start()\n"
        "while not b.done:\n"
        "    time.sleep(0.02)\n"
        "print('leaving', flush=True)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "leaving" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("on_result")) == [
        f"on_result {i}" for i in range(6)], proc.stdout
    assert "on_complete 6" in proc.stdout and "not waited for" not in proc.stderr, (proc.stdout, proc.stderr[-2000:])


def test_a_callback_stuck_at_exit_is_left_with_a_warning():
    from batchprompt.api.callbacks import CallbackThread

    stuck = threading.Event()
    thread = CallbackThread("test-stuck-callbacks")
    thread.dispatch(lambda: stuck.wait(30))
    thread.dispatch(lambda: None)
    thread.close()
    started = time.monotonic()
    assert thread.drain(0.3) == 2  # the one running and the one after it
    assert time.monotonic() - started < 5
    stuck.set()
    assert thread.drain(5) == 0


def test_engine_builds_run_one_at_a_time(engine32):
    """A build left running by a Ctrl-C (its caller gone) and the retry's build ran at once, and
    the retry failed importing transformers beside the first ("cannot import name
    'AutoTokenizer'"). The second build now waits for the first to end."""
    from batchprompt.api.service import EngineService

    first_running, first_done, overlapped = threading.Event(), threading.Event(), []

    def slow_build():
        first_running.set()
        time.sleep(1.0)
        first_done.set()
        return engine32

    def second_build():
        overlapped.append(not first_done.is_set())
        return engine32

    services = []
    t = threading.Thread(target=lambda: services.append(EngineService(slow_build, name="build-1")), daemon=True)
    t.start()
    assert first_running.wait(30)
    services.append(EngineService(second_build, name="build-2"))
    t.join(30)
    assert overlapped == [False]
    for service in services:
        service.shutdown(30)


def test_a_ctrl_c_while_the_engines_stop_at_exit_ends_the_process_at_once(monkeypatch):
    """A second Ctrl-C while the exit waited for an engine thread to leave its step printed
    "Exception ignored in atexit callback ... KeyboardInterrupt" with its traceback."""
    from batchprompt.api import service as service_module

    class Stopping:
        cancelled_at_stop = callbacks_dropped = 0
        stopped = False

        def shutdown(self, timeout=None, at_exit=False):
            raise KeyboardInterrupt  # as the signal lands in the wait for the engine thread

    exits = []
    monkeypatch.setattr(service_module, "_alive", [Stopping()])
    monkeypatch.setattr(service_module.os, "_exit", exits.append)
    service_module._stop_at_exit()
    assert exits == [130]


def test_at_exit_only_the_callbacks_on_cut_results_are_dropped():
    """At exit every callback dispatched from then on was dropped, also those of results that
    finished normally in the engine's last step (a warning counted 13 for 5 cancelled prompts)."""
    from batchprompt.api.callbacks import CallbackThread

    calls = []
    thread = CallbackThread("test-callbacks")
    thread.drop_cut()
    thread.dispatch(calls.append, "finished in the last step")
    thread.dispatch(calls.append, "cancelled by the exit", cut=True)
    thread.close()
    thread.thread.join(10)
    assert calls == ["finished in the last step"] and thread.dropped == 1


def test_a_stop_at_exit_says_so_and_blames_no_call(engine32):
    """A thread still building a session when the script ended got "the engine was shut down
    (bp.shutdown() or LanguageModel.close())", a call the user never made."""
    from batchprompt.api.service import SHUT_DOWN_AT_EXIT, EngineService

    service = EngineService(engine32, name="exit-test")
    assert service.shutdown(timeout=30, at_exit=True)
    assert service.stop_reason == SHUT_DOWN_AT_EXIT and "bp.shutdown()" not in service.stop_reason


@pytest.mark.parametrize("model", [5, 2.5, ["smollm2-135m"]])
def test_shutdown_names_a_model_that_is_not_one(model):
    """bp.shutdown(5) (a time limit, meant as timeout=5) raised os.path's "expected str, bytes or
    os.PathLike object, not int"."""
    with pytest.raises(TypeError, match=r"shutdown's model must be a model id or path.*for a time limit give "
                                        r"timeout=\.\.\."):
        bp.shutdown(model)


def test_engine_options_that_are_no_dict_are_named():
    """It said "LLMEngine.from_pretrained() argument after ** must be a mapping, not int"."""
    with pytest.raises(TypeError, match="engine_options must be a dict of EngineConfig fields.*got int"):
        bp.LanguageModel.create(engine_options=5)
