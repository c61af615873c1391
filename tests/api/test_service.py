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
        assert bp.batch_prompt(["hi"], engine_options={**small, "max_num_batched_tokens": 2048},
                               max_tokens=2)[0].ok  # one more option, at its default: the same config
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
