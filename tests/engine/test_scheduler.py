"""The scheduler with a fake runner: budgets, chunked prefill, preemption, no leaks."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from batchprompt.engine.block_pool import BlockPool
from batchprompt.engine.kv_cache import KVCacheManager
from batchprompt.engine.request import Request
from batchprompt.engine.sampling_params import SamplingParams
from batchprompt.engine.config import EngineConfig
from batchprompt.engine.scheduler import Scheduler


def fake_next_token(history: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole history."""
    return (sum(history) * 31 + len(history)) % 97


def run(requests: list[Request], max_blocks: int, budget: int, max_seqs: int = 64, abort_at=None):
    kv = KVCacheManager(BlockPool(max_blocks), block_size=4)
    sched = Scheduler(EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv)
    for r in requests:
        sched.add(r)
    steps = 0
    while sched.has_work:
        out = sched.schedule()
        assert out.num_tokens <= budget
        assert len({c.request_id for c in out.chunks}) == len(out.chunks)
        assert out.chunks, "the scheduler must make progress"
        for c in out.chunks:  # the chunk continues exactly where the cache ends
            r = next(x for x in requests if x.request_id == c.request_id)
            assert c.token_ids == r.token_ids[c.start:c.context_len]
        for r in sched.advance(out):
            r.append_token(fake_next_token(r.token_ids), None)
            if len(r.output_token_ids) == r.params.max_tokens:
                sched.finish(r)
                r.finish("length")
        steps += 1
        if abort_at is not None and steps == abort_at and sched.running:
            victim = sched.running[0]
            sched.finish(victim)
            victim.finish("abort")
    assert kv.pool.num_used == 0, "blocks leaked"
    return sched


def alone(prompt: list[int], n: int) -> list[int]:
    history, out = list(prompt), []
    for _ in range(n):
        t = fake_next_token(history)
        history.append(t)
        out.append(t)
    return out


def make(i: int, prompt: list[int], n: int) -> Request:
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=n))


def test_chunked_prefill_splits_a_long_prompt():
    long = make(0, list(range(50)), 2)
    short = make(1, [1, 2, 3], 2)
    kv = KVCacheManager(BlockPool(100), block_size=4)
    sched = Scheduler(EngineConfig(max_num_seqs=8, max_num_batched_tokens=16), kv)
    sched.add(long)
    sched.add(short)
    first = sched.schedule()
    assert [len(c.token_ids) for c in first.chunks] == [16]
    assert not first.chunks[0].sample


def test_preemption_under_memory_pressure_keeps_outputs_exact():
    reqs = [make(i, [i + 1] * (5 + i), 12) for i in range(6)]
    sched = run(reqs, max_blocks=12, budget=32)
    assert sched.num_preemptions > 0
    for r in reqs:
        assert r.output_token_ids == alone(r.prompt_token_ids, 12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 10)), min_size=1, max_size=12),
       st.integers(14, 60), st.integers(8, 64), st.one_of(st.none(), st.integers(1, 6)))
def test_any_workload_finishes_exactly_and_leaks_nothing(shapes, max_blocks, budget, abort_at):
    # Prompts share a prefix so that the prefix cache is exercised too.
    reqs = [make(i, [7, 7, 7, 7, 7] + list(range(i, i + n)), m) for i, (n, m) in enumerate(shapes)]
    run(reqs, max_blocks=max_blocks, budget=budget, abort_at=abort_at)
    for r in reqs:
        if r.finish_reason == "length":
            assert r.output_token_ids == alone(r.prompt_token_ids, r.params.max_tokens)
