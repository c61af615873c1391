"""The local backend feeds sources by priority: an interactive source goes ahead of a big bulk
source already queued, and the bulk source still finishes (the tiny random Llama)."""
from __future__ import annotations

import threading

import pytest
import torch

from batchprompt import EngineConfig, LLMEngine, SamplingParams
from batchprompt.api.service import EngineService
from batchprompt.backends import BULK, Item, Source
from batchprompt.models import build_model, load_hf_weights, resolve_model

WAIT_S = 120  # bounded waits: a broken build fails instead of hanging
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture()
def service(tiny_model_dir):
    args, weights = load_hf_weights(resolve_model(tiny_model_dir))
    model = build_model(args, weights, torch.float32, torch.device("cpu"))
    # 8 sequences at once: the service's window (8 + at least 64) holds far more bulk rows than run.
    svc = EngineService(LLMEngine.from_model(model, None, EngineConfig(max_num_seqs=8)), name="priority")
    yield svc
    svc.shutdown()


def prompt(i: int) -> list[int]:
    return [3 + i % 90, 4 + i % 89, 5, 6, 7, 8 + i % 80]


def test_an_interactive_source_is_fed_and_run_ahead_of_a_big_bulk_source_already_queued(service):
    engine = service.engine
    answered: list[tuple[str, int]] = []  # (which, engine steps when answered), on the engine thread
    bulk_started, bulk_done, chat_done = threading.Event(), threading.Event(), threading.Event()

    def on_bulk(out):
        answered.append(("bulk" if out.error is None else out.error, engine.stats.steps))
        bulk_started.set()
        if sum(w == "bulk" for w, _ in answered) == 400:
            bulk_done.set()

    def on_chat(out):
        answered.append(("chat" if out.error is None else out.error, engine.stats.steps))
        chat_done.set()

    bulk = Source(priority=BULK)
    bulk.items.extend(Item(prompt(i), PARAMS, on_bulk) for i in range(400))
    service.submit(bulk)
    assert bulk_started.wait(WAIT_S)  # the bulk rows fill the window and the engine's queue
    steps_before = service.call(lambda: engine.stats.steps).result(WAIT_S)
    in_engine = service.in_flight
    chat = Source()  # interactive, the default
    chat.items.append(Item(prompt(1000), PARAMS, on_chat))
    service.submit(chat)
    assert chat_done.wait(WAIT_S)
    assert bulk_done.wait(WAIT_S)  # and every bulk row ran too
    chat_step = next(s for w, s in answered if w == "chat")
    assert in_engine > 8  # bulk rows were waiting in the engine, ahead of the chat in arrival order
    # Fed at once and admitted the next step: its prefill and three decode steps, and at most the
    # step under way when it was submitted. First come, it would wait behind the queued bulk rows.
    assert chat_step - steps_before <= 4 + 2
    assert sum(w == "bulk" for w, s in answered if s > chat_step) > 300  # most were still to run
    assert len(answered) == 401


def test_an_interactive_source_submitted_mid_step_is_answered_inside_that_step(service, monkeypatch):
    """A chat request that arrives while a bulk step runs does not wait for its end: the engine
    pauses between layers, and the service feeds the chat and runs it there."""
    from batchprompt.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "PAUSE_MIN_S", 0.0)  # the tiny model's steps are short
    monkeypatch.setattr(engine_module, "INSIDE_SHARE", float("inf"))
    engine = service.engine
    chat_done, bulk_done = threading.Event(), threading.Event()
    seen: dict[str, tuple[int, int]] = {}  # when: (steps, steps inside others), on the engine thread
    bulk_answers = []

    def on_bulk(out):
        bulk_answers.append(out.error)
        if len(bulk_answers) == 40:
            bulk_done.set()

    def on_chat(out):
        seen["answered"] = (engine.stats.steps, engine.stats.inside_steps)
        seen["error"] = out.error
        chat_done.set()

    chat = Source()
    chat.items.append(Item(prompt(1000), PARAMS, on_chat))
    original = service._between_layers

    def arrives_mid_step():
        if "submitted" not in seen and engine.stats.steps >= 2:
            seen["submitted"] = (engine.stats.steps, engine.stats.inside_steps)
            service.submit(chat)
        original()

    monkeypatch.setattr(service, "_between_layers", arrives_mid_step)
    bulk = Source(priority=BULK)
    bulk.items.extend(Item(prompt(i), PARAMS, on_bulk) for i in range(40))
    service.submit(bulk)
    assert chat_done.wait(WAIT_S) and bulk_done.wait(WAIT_S)
    assert seen["error"] is None and bulk_answers == [None] * 40
    (steps0, inside0), (steps1, inside1) = seen["submitted"], seen["answered"]
    # Every step between the submission and the answer ran inside the bulk step under way:
    # its prefill and three decode steps.
    assert inside1 - inside0 == 4
    assert steps1 - steps0 == inside1 - inside0
