"""Steps run inside a longer step (LLMEngine.step_inside): requests that outrank every request
of the step in progress run at its pause between layers, with the tokens they get alone, and
nothing of the paused step is disturbed."""
from __future__ import annotations

import pytest
import torch

from batchprompt.engine import engine as engine_module
from batchprompt.runner import kv_tensors

from .test_engine import GREEDY, engine, tiny_model  # noqa: F401  (fixture)

BULK, INTERACTIVE = -1, 0


@pytest.fixture(autouse=True)
def pause_every_step(monkeypatch):
    """The tiny model's steps are far shorter than a real one's: let every step pause, and
    hold any number of steps inside it."""
    monkeypatch.setattr(engine_module, "PAUSE_MIN_S", 0.0)
    monkeypatch.setattr(engine_module, "INSIDE_SHARE", float("inf"))


def random_prompts(n: int, seed: int, lo: int = 4, hi: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def alone(model, prompt: list[int]) -> list[int]:
    return engine(model).generate([prompt], GREEDY)[0].output_token_ids


class Arrival:
    """A `pause` that adds `prompt` at the first pause of the engine's next step and runs steps
    inside it for as long as there are any, as the service does."""

    def __init__(self, eng, prompt: list[int], priority: int):
        self.eng, self.prompt, self.priority = eng, prompt, priority
        self.rid: str | None = None
        self.inside: list = []  # outputs finished inside the step
        self.pauses = 0

    def __call__(self) -> None:
        self.pauses += 1
        if self.rid is None:
            self.rid = self.eng.add_request(self.prompt, GREEDY, priority=self.priority)
        while (outs := self.eng.step_inside()) is not None:
            self.inside += outs


def run(eng, pause=None, limit: int = 500) -> dict:
    outs = {}
    for _ in range(limit):
        outs.update({o.request_id: o for o in eng.step(pause)})
        pause = None  # the arrival comes once, in the first step
        if not eng.has_unfinished():
            return outs
    raise AssertionError("the engine did not finish")


def test_a_request_arriving_mid_step_runs_inside_it_with_the_tokens_it_gets_alone(tiny_model):
    bulk = random_prompts(6, seed=11)
    # The chat's prompt starts with a bulk prompt's blocks, which the paused step has listed in
    # the prefix cache but not yet written: it must compute them, not read them half written.
    chat = bulk[0][:16] + [7, 8, 9, 10, 11]
    ref = {i: alone(tiny_model, p) for i, p in enumerate(bulk)}
    eng = engine(tiny_model, max_num_batched_tokens=512)
    ids = {eng.add_request(p, GREEDY, priority=BULK): i for i, p in enumerate(bulk)}
    arrival = Arrival(eng, chat, INTERACTIVE)
    outs = run(eng, arrival)
    # The chat ran start to finish inside the first step: 12 tokens, 12 steps.
    assert [o.request_id for o in arrival.inside] == [arrival.rid]
    assert arrival.inside[0].output_token_ids == alone(tiny_model, chat)
    assert eng.stats.inside_steps == 12
    assert arrival.pauses == 1  # the tiny model has two layers: one pause a step
    for rid, i in ids.items():
        assert outs[rid].output_token_ids == ref[i], rid
    assert eng.pool.num_used == 0


def test_nothing_runs_inside_a_step_that_has_a_request_of_the_same_rank(tiny_model):
    eng = engine(tiny_model)
    first = eng.add_request(random_prompts(1, seed=1)[0], GREEDY, priority=INTERACTIVE)
    arrival = Arrival(eng, random_prompts(1, seed=2)[0], INTERACTIVE)
    outs = run(eng, arrival)
    assert arrival.inside == [] and eng.stats.inside_steps == 0
    assert {first, arrival.rid} == set(outs)


def test_a_request_the_kv_tensors_cannot_hold_without_growing_waits_for_the_step(tiny_model, monkeypatch):
    """Growing the KV tensors replaces them, under the paused step: such a request runs after it."""
    monkeypatch.setattr(kv_tensors, "SPARE_MIN_BLOCKS", 0)  # no spare blocks beyond the doubling
    monkeypatch.setattr(kv_tensors, "SPARE_SHARE", 0.0)
    bulk = random_prompts(4, seed=3)
    chat = random_prompts(1, seed=4, lo=240, hi=241)[0]  # 60 blocks: with the bulk's, past the first 64
    eng = engine(tiny_model, max_num_batched_tokens=512)
    ids = {eng.add_request(p, GREEDY, priority=BULK): i for i, p in enumerate(bulk)}
    arrival = Arrival(eng, chat, INTERACTIVE)
    outs = run(eng, arrival)
    assert arrival.inside == [] and eng.stats.inside_steps == 0
    assert outs[arrival.rid].output_token_ids == alone(tiny_model, chat)
    for rid, i in ids.items():
        assert outs[rid].output_token_ids == alone(tiny_model, bulk[i]), rid
    assert eng.pool.num_used == 0


def test_steps_inside_one_step_are_bounded_so_the_lower_class_still_gets_tokens(tiny_model, monkeypatch):
    eng = engine(tiny_model, max_num_batched_tokens=512)
    bulk = eng.add_request(random_prompts(1, seed=5)[0], GREEDY, priority=BULK)
    eng.step()  # a measured step: the next one's predicted time is known
    monkeypatch.setattr(engine_module, "INSIDE_SHARE", 1e-9)  # the first step inside uses it all up
    arrival = Arrival(eng, random_prompts(1, seed=6)[0], INTERACTIVE)
    eng.step(arrival)
    assert eng.stats.inside_steps == 1 and arrival.inside == []
    rest = run(eng)
    assert rest[arrival.rid].output_token_ids == alone(tiny_model, arrival.prompt)
    assert rest[bulk].output_token_ids == alone(tiny_model, random_prompts(1, seed=5)[0])


def test_a_step_of_a_size_never_measured_holds_steps_inside_for_its_own_time(tiny_model, monkeypatch):
    """A fresh engine's first step has no predicted time: the steps inside it were held to
    INSIDE_SHARE times PAUSE_MIN_S, so on a fresh server the first chat beside a long batch
    step waited for that whole step (4 s to 40 s where a warm server answers in 0.6 s). The
    step's own time so far now counts too."""
    monkeypatch.setattr(engine_module, "INSIDE_SHARE", 1e6)  # of the step's own time: ample
    eng = engine(tiny_model, max_num_batched_tokens=512)
    assert eng.scheduler.cost.seconds(100) is None  # nothing measured yet
    bulk = eng.add_request(random_prompts(1, seed=7, lo=200, hi=201)[0], GREEDY, priority=BULK)
    arrival = Arrival(eng, random_prompts(1, seed=8)[0], INTERACTIVE)
    eng.step(arrival)
    assert [o.request_id for o in arrival.inside] == [arrival.rid]
    assert arrival.inside[0].output_token_ids == alone(tiny_model, arrival.prompt)
    rest = run(eng)
    assert rest[bulk].output_token_ids == alone(tiny_model, random_prompts(1, seed=7, lo=200, hi=201)[0])


def test_the_first_growth_leaves_spare_blocks_for_a_request_arriving_mid_step(tiny_model):
    """A fresh engine grew its KV tensors to exactly the blocks of the first step: a chat arriving
    during a long prompt's prefill needed blocks past them, and waited for the whole step (29 s
    on a fresh server where a warm one answered in 0.3 s)."""
    eng = engine(tiny_model, max_num_batched_tokens=512)
    prompt = random_prompts(1, seed=9, lo=250, hi=251)[0]  # 63 blocks: past the old first growth's 64
    bulk = [eng.add_request(prompt, GREEDY, priority=BULK), eng.add_request(prompt[::-1], GREEDY, priority=BULK)]
    arrival = Arrival(eng, random_prompts(1, seed=10)[0], INTERACTIVE)
    eng.step(arrival)
    assert [o.request_id for o in arrival.inside] == [arrival.rid]
    assert arrival.inside[0].output_token_ids == alone(tiny_model, arrival.prompt)
    rest = run(eng)
    assert [rest[b].output_token_ids for b in bulk] == [alone(tiny_model, prompt), alone(tiny_model, prompt[::-1])]


def test_step_inside_outside_a_step_runs_nothing(tiny_model):
    eng = engine(tiny_model)
    eng.add_request([5, 6, 7], GREEDY, priority=INTERACTIVE)
    assert eng.step_inside() is None
    assert eng.stats.steps == 0


def test_a_waiting_request_that_outranks_a_long_step_is_left_out_of_it_and_run_at_its_first_pause(tiny_model):
    bulk = random_prompts(6, seed=21)
    chat = random_prompts(1, seed=22)[0]
    eng = engine(tiny_model, max_num_batched_tokens=512)
    ids = {eng.add_request(p, GREEDY, priority=BULK): i for i, p in enumerate(bulk)}
    eng.step()  # the bulk rows run; measured
    rid = eng.add_request(chat, GREEDY, priority=INTERACTIVE)
    inside, pending = [], []

    def pause():
        pending.append(eng.inside_pending)
        while (outs := eng.step_inside()) is not None:
            inside.extend(outs)

    steps = eng.stats.steps
    outs = {o.request_id: o for o in eng.step(pause)}
    assert pending[0] is True  # the step left the chat out, for its first pause to run
    assert [o.request_id for o in inside] == [rid]  # all 12 tokens, inside that one step
    assert inside[0].output_token_ids == alone(tiny_model, chat)
    assert eng.stats.steps - steps == 12 + 1
    outs.update(run(eng))
    for r, i in ids.items():
        assert outs[r].output_token_ids == alone(tiny_model, bulk[i]), r


def test_a_left_out_request_runs_before_the_first_layer_of_the_step_it_was_left_out_of(tiny_model):
    """It need not wait for the step's first layer (a tenth of a second in a long step of the
    real model): the step pauses once before it."""
    bulk = random_prompts(6, seed=23)
    chat = random_prompts(1, seed=24, lo=9, hi=10)[0]
    eng = engine(tiny_model, max_num_batched_tokens=512)
    for p in bulk:
        eng.add_request(p, GREEDY, priority=BULK)
    eng.step()  # the bulk rows' prompts; each has its first token
    rid = eng.add_request(chat, GREEDY, priority=INTERACTIVE)
    rows = []  # the tokens of each call of the first layer, in order (its metadata's count: the
    # residual stream may carry the GEMMs' padding rows)
    hook = tiny_model.layers[0].register_forward_hook(lambda mod, args, out: rows.append(args[6].num_tokens))
    inside = []

    def pause():
        while (outs := eng.step_inside()) is not None:
            inside.extend(outs)

    try:
        eng.step(pause)
    finally:
        hook.remove()
    assert [o.request_id for o in inside] == [rid]
    assert rows == [len(chat)] + [1] * 11 + [len(bulk)]  # the chat's 12 steps, then the batch's step


def test_a_left_out_request_with_no_free_memory_inside_is_scheduled_as_usual_next(tiny_model):
    """Inside a step nothing is preempted: a chat request that finds no free blocks there must
    not be left out again (it would wait for the whole batch); the next step admits it as
    usual, preempting batch rows for it."""
    from batchprompt.runner.kv_tensors import KVTensors

    per_block = KVTensors.bytes_per_block(tiny_model.args, 4, torch.float32)
    bulk = random_prompts(30, seed=31, lo=20, hi=30)
    chat = random_prompts(1, seed=32, lo=28, hi=29)[0]
    eng = engine(tiny_model, max_num_batched_tokens=512, kv_cache_memory=40 * per_block, watermark=0.0)
    ids = {eng.add_request(p, GREEDY, priority=BULK): i for i, p in enumerate(bulk)}
    eng.step()
    assert eng.pool.num_free < 8  # the batch holds the memory the chat needs
    rid = eng.add_request(chat, GREEDY, priority=INTERACTIVE)

    order = []

    def pause():
        while (outs := eng.step_inside()) is not None:
            order.extend(o.request_id for o in outs)

    for _ in range(5000):  # after the chat, steps stay small for a second: many tiny steps
        order += [o.request_id for o in eng.step(pause)]
        if not eng.has_unfinished():
            break
    assert eng.stats.preemptions > 0  # batch rows made room for it
    assert order[0] == rid  # before any of the batch's rows: it did not wait for them to free memory
    assert sorted(order) == sorted([rid, *ids])
