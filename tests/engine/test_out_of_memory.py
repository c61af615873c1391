"""A step that runs out of device memory is retried smaller; requests do not fail for it."""
from __future__ import annotations

import torch

from .test_engine import GREEDY, engine, prompts, tiny_model  # noqa: F401  (fixture)


def inject_oom(eng, too_big):
    """Make the runner raise torch.OutOfMemoryError, before computing anything, on every step
    for which `too_big(sched)` holds; returns the limits seen after each step that ran."""
    real, seen = eng.runner.execute, []

    def execute(sched):
        if too_big(sched):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        out = real(sched)
        seen.append((eng.scheduler.limits.max_num_seqs, eng.scheduler.limits.max_num_batched_tokens))
        return out

    eng.runner.execute = execute
    return seen


def test_steps_too_big_for_memory_are_retried_smaller_and_limits_recover(tiny_model):
    ps = prompts(16)
    ref = [o.output_token_ids for o in engine(tiny_model).generate(ps, GREEDY)]
    eng = engine(tiny_model, max_num_seqs=8, max_num_batched_tokens=64)
    limits = eng.scheduler.limits
    limits.recover_after = 3
    faulty = True
    seen = inject_oom(eng, lambda sched: faulty and len(sched.chunks) > 3)
    outs = eng.generate(ps, GREEDY)
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    # The same tokens: nothing the failed steps registered in the prefix cache was served.
    assert [o.output_token_ids for o in outs] == ref
    assert limits.num_shrinks > 0
    assert min(s for s, _ in seen) <= 3 and min(t for _, t in seen) < 64
    assert eng.pool.num_used == 0
    faulty = False  # memory is back: the limits climb to the configured ones
    assert [o.output_token_ids for o in eng.generate(ps, GREEDY)] == ref
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (8, 64)


def test_a_request_that_runs_out_of_memory_alone_fails_alone(tiny_model):
    ps = prompts(6)
    ref = [o.output_token_ids for o in engine(tiny_model).generate(ps, GREEDY)]
    eng = engine(tiny_model, max_num_batched_tokens=64)
    inject_oom(eng, lambda sched: any(c.request_id == "req-2" for c in sched.chunks))
    outs = eng.generate(ps, GREEDY)
    assert outs[2].finish_reason == "error"
    assert "ran out of memory running this request alone" in outs[2].error
    assert "OutOfMemoryError" in outs[2].error
    assert [o.output_token_ids for i, o in enumerate(outs) if i != 2] == ref[:2] + ref[3:]
    assert all(o.ok for i, o in enumerate(outs) if i != 2)
    assert eng.pool.num_used == 0
