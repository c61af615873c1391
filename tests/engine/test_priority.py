"""Priority classes in the scheduler (a fake runner, as in test_scheduler) and the engine (the
tiny model): admission by priority, preemption of the lowest first, the lower classes' step
limit, no starvation, and the same tokens whatever the mix."""
from __future__ import annotations

import pytest
import torch

from batchprompt import EngineConfig, SamplingParams
from batchprompt.engine.block_pool import BlockPool
from batchprompt.engine.kv_cache import KVCacheManager
from batchprompt.engine.request import Request
from batchprompt.engine.scheduler import Scheduler
from batchprompt.engine.step_cost import StepCost
from batchprompt.runner.kv_tensors import KVTensors

from .test_engine import engine, tiny_model  # noqa: F401  (fixture; one definition for tests/engine)
from .test_scheduler import alone, fake_next_token

BULK, INTERACTIVE = -1, 0


def req(name: str, prompt: list[int], n: int, priority: int) -> Request:
    return Request(name, prompt, SamplingParams(max_tokens=n), priority=priority)


def scheduler(max_blocks: int = 200, budget: int = 64, max_seqs: int = 64, **cfg) -> Scheduler:
    return Scheduler(EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, **cfg),
                     KVCacheManager(BlockPool(max_blocks), block_size=4))


def step(sched: Scheduler) -> tuple[list[str], list[Request]]:
    """One step with the fake model; returns (ids scheduled, requests finished)."""
    out = sched.schedule()
    done = []
    for r in sched.advance(out):
        r.append_token(fake_next_token(r.token_ids), None)
        if len(r.output_token_ids) == r.params.max_tokens:
            sched.finish(r)
            r.finish("length")
            done.append(r)
    return [c.request_id for c in out.chunks], done


def test_a_high_priority_request_is_admitted_ahead_of_queued_bulk_ones():
    sched = scheduler(budget=16, max_seqs=64, priority_slowdown=None)
    for i in range(10):
        sched.add(req(f"bulk{i}", [i + 1] * 8, 4, BULK))
    sched.add(req("chat", [50] * 8, 4, INTERACTIVE))  # queued last
    ids, _ = step(sched)
    assert ids[0] == "chat"  # first come would have admitted bulk0 and bulk1 (16 tokens)
    assert ids == ["chat", "bulk0"]


def test_a_high_priority_request_takes_a_slot_from_running_bulk():
    sched = scheduler(max_seqs=2, priority_slowdown=None)
    bulk = [req(f"bulk{i}", [i + 1] * 5, 50, BULK) for i in range(4)]
    for r in bulk:
        sched.add(r)
    step(sched)
    assert [r.request_id for r in sched.running] == ["bulk0", "bulk1"]
    chat = req("chat", [60] * 5, 3, INTERACTIVE)
    sched.add(chat)
    ids, _ = step(sched)
    assert "chat" in ids  # first come: it would wait for bulk0 or bulk1 to finish 48 steps on
    assert bulk[1].num_preemptions == 1 and bulk[0].num_preemptions == 0  # the latest bulk made room
    while not chat.is_finished:
        step(sched)
    assert chat.output_token_ids == alone(chat.prompt_token_ids, 3)


def test_memory_pressure_preempts_the_lowest_priority_first():
    # 5 requests that grow to 40 tokens (10 blocks) each in 30 blocks: preemptions are certain.
    sched = scheduler(max_blocks=30, budget=64, priority_slowdown=None)
    chats = [req(f"chat{i}", [i + 70] * 8, 32, INTERACTIVE) for i in range(2)]
    bulk = [req(f"bulk{i}", [i + 1] * 8, 32, BULK) for i in range(3)]
    for r in bulk + chats:  # the chats come last: first come would preempt them first
        sched.add(r)
    for _ in range(2000):
        if not sched.has_work:
            break
        step(sched)
    assert not sched.has_work
    assert sched.num_preemptions > 0
    assert [c.num_preemptions for c in chats] == [0, 0]
    assert sum(b.num_preemptions for b in bulk) == sched.num_preemptions
    for r in chats + bulk:  # recomputed after a preemption, the tokens are the same
        assert r.output_token_ids == alone(r.prompt_token_ids, 32)
    assert sched.kv.pool.num_used == 0


def test_bulk_is_not_starved_by_a_steady_stream_of_interactive_requests():
    def run(max_starved_steps: int) -> tuple[Request, list[Request], int]:
        sched = scheduler(budget=8, max_seqs=8, max_starved_steps=max_starved_steps, priority_slowdown=None)
        bulk = req("bulk", [3] * 6, 4, BULK)
        sched.add(bulk)
        chats, steps = [], 0
        while not bulk.is_finished and steps < 400:
            for _ in range(2):  # two new chat requests every step: more than the budget serves
                chats.append(req(f"chat{len(chats)}", [len(chats) % 90 + 1] * 7, 2, INTERACTIVE))
                sched.add(chats[-1])
            step(sched)
            steps += 1
        return bulk, chats, steps

    starved, _, _ = run(max_starved_steps=10**9)
    assert not starved.is_finished  # the stream alone would keep bulk out for ever
    bulk, chats, steps = run(max_starved_steps=20)
    assert bulk.is_finished and bulk.output_token_ids == alone(bulk.prompt_token_ids, 4)
    assert steps <= 20 + 3 * 4 + 4  # promoted after 20 steps without a token, then it runs through
    assert sum(c.is_finished for c in chats) > 10  # and the chats went first meanwhile
    assert bulk.promoted


def test_lower_priorities_take_few_tokens_beside_a_high_one_and_for_a_while_after():
    sched = scheduler(budget=64, max_seqs=64, priority_slowdown=2.0)
    for n in (1, 64, 1, 64, 8, 32):  # a step costs 10 ms plus 1 ms a token
        sched.cost.observe(n, 0.010 + 0.001 * n)
    now = [100.0]
    sched.clock = lambda: now[0]
    for i in range(20):
        sched.add(req(f"bulk{i}", [i + 1] * 30, 8, BULK))
    ids, _ = step(sched)
    assert len(ids) == 3  # no interactive request yet: the whole budget (30 + 30 + 4)
    chat = req("chat", [80] * 5, 3, INTERACTIVE)
    sched.add(chat)
    seen = 0
    while not chat.is_finished:
        out = sched.schedule()
        bulk_tokens = sum(len(c.token_ids) for c in out.chunks if c.request_id != "chat")
        chat_tokens = sum(len(c.token_ids) for c in out.chunks if c.request_id == "chat")
        # alone the chat's step costs 10 + chat_tokens ms; twice that leaves 10 + chat_tokens for bulk
        assert bulk_tokens <= 10 + chat_tokens
        seen += chat_tokens
        for r in sched.advance(out):
            r.append_token(fake_next_token(r.token_ids), None)
            if r is chat and len(r.output_token_ids) == 3:
                sched.finish(r)
                r.finish("length")
    assert seen == 5 + 2
    now[0] += 0.5  # within hold_s: still limited, a next chat request is likely
    out = sched.schedule()
    assert out.num_tokens <= 10 + 1
    sched.undo(out)
    now[0] += sched.hold_s
    out = sched.schedule()
    assert out.num_tokens == 64  # the batch has the whole step again


def test_step_cost_fits_the_fixed_and_per_token_parts():
    cost = StepCost()
    assert cost.extra_tokens(2.0, 1, measure=False) is None  # no step yet
    assert cost.extra_tokens(2.0, 1) == 0  # measure: run the tokens alone first
    for n in (500, 500, 500):
        cost.observe(n, 0.02 + 0.0005 * n)
    assert cost.per_token_s is None  # steps of one size: no line
    for n in (1, 40, 2048, 1, 300, 7):
        cost.observe(n, 0.02 + 0.0005 * n)
    assert cost.fixed_s == pytest.approx(0.02, rel=1e-6)
    assert cost.per_token_s == pytest.approx(0.0005, rel=1e-6)
    assert cost.extra_tokens(2.0, 1) == 41  # 20 ms + 0.5 ms: 41 more tokens double it
    assert cost.extra_tokens(1.5, 40) == 40
    assert cost.extra_tokens(2.0, 4000) == 4040  # past the largest step: the line's slope


# Step times measured on a 2-core CPU (float32): far from a line at few tokens.
CPU_STEPS = {1: 0.030, 4: 0.039, 16: 0.061, 64: 0.167, 128: 0.283, 600: 1.0, 2048: 3.0}


def test_step_cost_follows_a_curve_that_is_no_line():
    cost = StepCost()
    for _ in range(3):
        for n, t in CPU_STEPS.items():
            cost.observe(n, t)
    assert cost.seconds(1) == pytest.approx(0.030)
    assert cost.seconds(64) == pytest.approx(0.167)
    extra = cost.extra_tokens(2.0, 1)
    # twice a one-token step is 60 ms: about a 16-token step, not the 40-odd tokens that the
    # line through all steps (about 50 ms + 1.4 ms a token) allows
    assert 10 <= extra <= 16
    line = int((cost.fixed_s + cost.per_token_s) / cost.per_token_s)  # what the line alone allows
    assert line > 40 and cost.seconds(1 + line) > 3.5 * cost.seconds(1)  # a step 3.5x the chat's


def test_a_step_size_never_measured_or_long_ago_is_measured_alone():
    now = [0.0]
    cost = StepCost(clock=lambda: now[0])
    for n in (64, 2048, 64, 2048):
        cost.observe(n, CPU_STEPS[n])
    assert cost.needs_measuring(1) and cost.extra_tokens(2.0, 1) == 0
    assert cost.extra_tokens(2.0, 1, measure=False) > 0  # estimated below the smallest size
    cost.observe(1, CPU_STEPS[1])  # the step of the chat's token alone
    assert not cost.needs_measuring(1) and cost.extra_tokens(2.0, 1) > 0
    now[0] += cost.stale_s + 1
    assert cost.extra_tokens(2.0, 1) == 0  # a minute later: measured again
    assert cost.extra_tokens(2.0, 64, measure=False) > 0


def test_a_scheduler_measures_a_chat_token_alone_once_then_adds_batch_tokens():
    sched = scheduler(budget=256, max_seqs=64, priority_slowdown=2.0)
    for n in (64, 256, 64, 256):
        sched.cost.observe(n, CPU_STEPS[64] if n == 64 else 0.4)
    for i in range(20):
        sched.add(req(f"bulk{i}", [i + 1] * 30, 20, BULK))
    step(sched)
    chat = req("chat", [80] * 5, 6, INTERACTIVE)
    sched.add(chat)
    sizes = []
    while not chat.is_finished:
        out = sched.schedule()
        ids = [c.request_id for c in out.chunks]
        sizes.append((len(ids) - ("chat" in ids), "chat" in ids))
        sched.cost.observe(out.num_tokens, CPU_STEPS[1] if ids == ["chat"] else 0.06)
        for r in sched.advance(out):
            r.append_token(fake_next_token(r.token_ids), None)
            if r is chat and len(r.output_token_ids) == 6:
                sched.finish(r)
                r.finish("length")
    decode = sizes[1:]  # after the step that admitted it, the chat decodes one token a step
    assert decode[0] == (0, True)  # its first decode step runs alone: a one-token step is measured
    assert all(bulk > 0 for bulk, _ in decode[1:])  # then the batch rides along again


# ---- the engine on the tiny model: priorities change the order, never the tokens ----------------
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_mixed_priorities_give_every_request_the_tokens_it_gets_alone(tiny_model):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(16)]
    ref = [engine(tiny_model).generate([p], GREEDY)[0].output_token_ids for p in prompts]
    per_block = KVTensors.bytes_per_block(tiny_model.args, 4, torch.float32)
    eng = engine(tiny_model, max_num_seqs=4, max_num_batched_tokens=24, kv_cache_memory=40 * per_block,
                 watermark=0.0, max_starved_steps=3)
    ids = {}
    for i, p in enumerate(prompts[:10]):
        ids[eng.add_request(p, GREEDY, priority=BULK)] = i
    outs = {}
    for k in range(400):
        if k < 6:  # interactive requests arrive while the bulk ones run
            i = 10 + k
            ids[eng.add_request(prompts[i], GREEDY, priority=INTERACTIVE)] = i
        outs.update({o.request_id: o for o in eng.step()})
        if len(outs) == len(prompts):
            break
    assert len(outs) == len(prompts)
    assert eng.stats.preemptions > 0 and eng.scheduler.num_promotions > 0  # every path was taken
    for rid, o in outs.items():
        assert o.finish_reason == "length" and o.output_token_ids == ref[ids[rid]], rid
    assert eng.pool.num_used == 0
