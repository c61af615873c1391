"""EngineService builds its engine on its own engine thread: what the build raises reaches the
caller as it was raised, and a failed build leaves no thread behind."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import batchprompt as bp
from batchprompt.api.service import EngineService


def service_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("batchprompt-engine-", "batchprompt-callbacks-"))]


def wait_gone(before: set[threading.Thread], timeout: float = 10.0) -> list[threading.Thread]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [t for t in service_threads() if t not in before]
        if not left:
            return []
        time.sleep(0.05)
    return left


def test_a_build_that_raises_raises_in_the_callers_thread_and_leaves_no_thread():
    before = set(service_threads())

    def build():
        raise ValueError("max_num_seqs must be >= 1")

    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineService(build, name="broken")
    assert wait_gone(before) == []


def test_a_bad_engine_option_is_the_engines_own_error():
    before = set(service_threads())
    with pytest.raises(ValueError, match="max_num_seqs"):
        bp.LanguageModel.create(engine_options={"max_num_seqs": 0})
    assert wait_gone(before) == []


def test_the_built_engine_is_stepped_by_the_service(engine32):
    service = EngineService(lambda: engine32, name="built")
    try:
        assert service.engine is engine32
        assert service.call(lambda: threading.current_thread().name).result(timeout=60) == "batchprompt-engine-built"
    finally:
        service.shutdown()


def test_a_kv_budget_below_one_full_context_request_is_refused_and_leaves_no_engine():
    """A budget of 4 tokens built an engine that failed every call after it, whatever options
    those gave (they were ignored: the broken engine was shared), until bp.shutdown()."""
    bp.shutdown()  # an engine of this process's earlier tests is not this test's
    before = set(service_threads())
    with pytest.raises(ValueError, match="the KV cache holds 4 tokens.*raise kv_cache_memory"):
        bp.batch_prompt(["hi"], max_tokens=2, engine_options={"kv_cache_memory": 1000})
    assert wait_gone(before) == []
    try:
        assert bp.batch_prompt(["hi"], max_tokens=2, dtype="float32")[0].ok
    finally:
        bp.shutdown()


def test_engine_options_that_differ_from_the_running_engines_are_an_error_not_ignored():
    small = {"max_num_seqs": 8, "max_model_len": 1024}
    bp.shutdown()  # an engine of this process's earlier tests is not this test's
    try:
        lm = bp.LanguageModel.create(engine_options=small, max_tokens=2)
        assert bp.batch_prompt(["hi"], engine_options=dict(small), max_tokens=2)[0].ok  # the same: shared
        assert bp.batch_prompt(["hi"], max_tokens=2)[0].ok  # none given: shared
        assert bp.batch_prompt(["hi"], engine_options={**small, "block_size": 4},
                               max_tokens=2)[0].ok  # one more option, at its default: the same config
        # (not max_num_batched_tokens: its default is the device's, 8192 on CUDA, where 2048 is a change)
        with pytest.raises(ValueError, match=r"already runs with engine_options=.*bp\.shutdown\(\)"):
            bp.batch_prompt(["hi"], engine_options={"max_num_seqs": 4}, max_tokens=2)
        assert isinstance(lm.prompt("hi"), str)  # the running engine is untouched
    finally:
        bp.shutdown()


def test_the_models_own_context_given_as_max_model_len_is_no_change():
    """max_model_len left out is the model's own context (8,192 for the embedded model): giving
    that number was a conflict with the running engine, another number still is."""
    small = {"kv_cache_memory": 256 << 20}  # room for one request of the whole context
    bp.shutdown()
    try:
        bp.LanguageModel.create(engine_options=small, max_tokens=2)
        assert bp.batch_prompt(["hi"], engine_options={**small, "max_model_len": 8192}, max_tokens=2)[0].ok
        with pytest.raises(ValueError, match="already runs with engine_options"):
            bp.batch_prompt(["hi"], engine_options={**small, "max_model_len": 4096}, max_tokens=2)
    finally:
        bp.shutdown()


def test_one_engine_per_model_whatever_the_spelling_of_its_device_and_dtype():
    """The registry was keyed by the spelling: device "auto" and "cpu" (and dtype "auto" and the
    dtype it picks) each built an engine, with its own copy of the weights and KV cache."""
    from batchprompt.api import service as svc
    from batchprompt.device import resolve_dtype

    device = "cuda" if torch.cuda.is_available() else "cpu"  # what "auto" picks
    picked = str(resolve_dtype("auto", torch.device(device))).removeprefix("torch.")
    sessions = [bp.LanguageModel.create(device=d, dtype=t, max_tokens=1)
                for d, t in (("auto", "auto"), (device, "auto"), ("auto", picked), (f"{device}:0", picked))]
    try:
        assert len({id(s.backend) for s in sessions}) == 1
        assert sessions[0].engine is sessions[3].engine
        assert sessions[1].prompt("hi") is not None
    finally:
        for s in sessions:
            s.close()
    assert not any("auto" in k for k in svc._services)


def test_an_engine_a_session_steps_runs_another_threads_generate_and_refuses_its_racing_steps(engine32, messages):
    """An engine built by hand, given to a session and also called directly: another thread's
    generate() stepped it beside the session's engine thread, and one took the other's
    requests (KeyError 'req-6': the session's 16 prompts failed, or generate hung). generate()
    now runs between the session's steps; add_request() and step(), which would race them, are
    refused while the session's engine thread runs, and work again once it is closed."""
    from batchprompt import SamplingParams

    greedy = SamplingParams(max_tokens=12, temperature=0)
    alone = engine32.generate(["Tell me about 1"], greedy)[0].output_token_ids
    lm = bp.LanguageModel.create(model=engine32, max_tokens=24)
    batch = lm.create_batch(messages[:16]).start()
    got: list = []
    caller = threading.Thread(target=lambda: got.append(engine32.generate(["Tell me about 1"], greedy)))
    caller.start()
    caller.join(120)
    assert not caller.is_alive(), "generate() beside a session hung"
    assert got[0][0].output_token_ids == alone  # float32 greedy: batching changes no token
    assert all(r.ok for r in batch.wait(timeout=120))
    with pytest.raises(RuntimeError, match=r"add_request\(\) from another thread while a LanguageModel session"):
        engine32.add_request("hi", greedy)
    with pytest.raises(RuntimeError, match=r"step\(\) from another thread"):
        engine32.step()
    with pytest.raises(RuntimeError, match=r"abort\(\) from another thread"):  # it failed the session's prompts
        engine32.abort("engine-0-1")
    lm.destroy()
    with pytest.raises(RuntimeError, match=r"close\(\) its last session, or bp.shutdown\(engine\)"):
        engine32.add_request("hi", greedy)  # its thread is still there, idle: it would step this request
    assert engine32.generate(["Tell me about 1"], greedy)[0].output_token_ids == alone
    lm.close()  # the engine's thread ends: the caller drives it
    rid = engine32.add_request("Tell me about 1", greedy)
    done = []
    while engine32.has_unfinished():
        done += engine32.step()
    assert [o.request_id for o in done] == [rid] and done[0].output_token_ids == alone
    # A request of the caller's own still in the engine when a session takes it: the session's
    # thread stepped it and dropped its output (the caller's step() never saw it).
    rid = engine32.add_request("Tell me about 1", greedy)
    with pytest.raises(RuntimeError, match="requests of its own in progress"):
        bp.LanguageModel.create(model=engine32)
    assert engine32.abort(rid)
    engine32.step()
    assert not engine32.has_unfinished()
