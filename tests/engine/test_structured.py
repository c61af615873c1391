"""Structured output in the engine: scoring candidates (tiny random Llama), and grammar
masks in the sampling step (embedded model)."""
from __future__ import annotations

import pytest
import torch

from batchprompt import EngineConfig, LLMEngine, SamplingParams
from batchprompt.runner.kv_tensors import KVTensors
from batchprompt.structured import Grammar

from ..conftest import SPAM_SYSTEM, full_logits, sms_rows
from .test_engine import engine, prompts, tiny_model  # noqa: F401  (fixture)

CANDIDATES = ((5,), (7, 8), (7, 9, 10), (11, 12, 13, 14))


def reference_scores(model, prompt: list[int]) -> list[float]:
    """Each candidate's log-likelihood from one full forward pass over prompt + candidate."""
    scores = []
    for cand in CANDIDATES:
        seq = prompt + list(cand)
        lp = torch.log_softmax(full_logits(model, seq), dim=-1)
        scores.append(sum(float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(cand)))
    return scores


def test_scores_equal_full_sequence_log_likelihoods(tiny_model):
    ps = prompts(6)
    eng = engine(tiny_model, max_num_batched_tokens=48)  # long prompts are chunked
    outs = eng.generate(ps, SamplingParams(max_tokens=1, temperature=0, score_choices=CANDIDATES))
    for p, out in zip(ps, outs):
        ref = reference_scores(tiny_model, p)
        assert out.choice_logprobs == pytest.approx(ref, abs=1e-4)
        assert out.output_token_ids == list(CANDIDATES[max(range(4), key=ref.__getitem__)])
        assert out.finish_reason == "stop"
    assert eng.pool.num_used == 0


def test_candidates_reuse_the_prompts_kv(tiny_model):
    p = prompts(1, shared=0)[0] + list(range(20, 60))  # 40+ tokens: many full blocks
    eng = engine(tiny_model)
    eng.generate([p], SamplingParams(max_tokens=1, temperature=0, score_choices=CANDIDATES))
    s = eng.stats
    # Three candidates run past the first token; each finds the prompt's full blocks cached.
    full = len(p) // eng.config.block_size * eng.config.block_size
    assert s.cached_prompt_tokens >= 3 * full
    assert s.prefill_tokens < len(p) + 3 * (eng.config.block_size + 4)


def test_scoring_survives_preemption_and_abort(tiny_model):
    ps = prompts(10)
    params = SamplingParams(max_tokens=1, temperature=0, score_choices=CANDIDATES)
    ref = [o.choice_logprobs for o in engine(tiny_model).generate(ps, params)]
    per_block = KVTensors.bytes_per_block(tiny_model.args, EngineConfig().block_size, torch.float32)
    eng = engine(tiny_model, kv_cache_memory=40 * per_block, watermark=0.0, max_num_batched_tokens=32)
    mixed = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 4
    outs = eng.generate(ps + prompts(4), [params] * len(ps) + mixed)
    assert eng.stats.preemptions > 0
    for o, r in zip(outs, ref):
        assert o.choice_logprobs == pytest.approx(r, abs=1e-4)
    ids = [eng.add_request(p, params) for p in ps]
    for _ in range(3):
        eng.step()
    for i in ids:
        eng.abort(i)
    while eng.has_unfinished():
        eng.step()
    assert eng.pool.num_used == 0


def test_grammar_requests_mix_with_free_ones(engine32):
    tok = engine32.tokenizer
    ps = [tok.encode_prompt(text, SPAM_SYSTEM) for _, text in sms_rows(8)]
    free = SamplingParams(max_tokens=10, temperature=0)
    alone = [o.output_token_ids for o in engine32.generate(ps, free)]
    choice = SamplingParams(max_tokens=8, temperature=0, grammar=Grammar.choices(["spam", "ham"]))
    bad = SamplingParams(max_tokens=8, temperature=0, grammar=Grammar.regex("a(b"))
    plist = [free, choice, bad] * 8
    outs = engine32.generate([p for p in ps for _ in range(3)], plist)
    for i, p in enumerate(ps):
        f, c, b = outs[3 * i: 3 * i + 3]
        assert f.output_token_ids == alone[i]  # requests without a grammar are untouched
        assert c.text in ("spam", "ham") and c.finish_reason == "stop"
        assert b.error and "regex" in b.error and "unclosed group" in b.error


def test_greedy_constrained_output_is_the_same_alone_and_in_a_batch(engine32):
    tok = engine32.tokenizer
    schema = Grammar.json_schema({"type": "object", "properties": {"spam": {"type": "boolean"},
                                  "topic": {"type": "string", "maxLength": 20}}, "required": ["spam", "topic"]})
    params = SamplingParams(max_tokens=40, temperature=0, grammar=schema)
    ps = [tok.encode_prompt(text + "\nAnswer in JSON.", SPAM_SYSTEM) for _, text in sms_rows(12)]
    together = engine32.generate(ps, params)
    for p, out in zip(ps, together):
        assert engine32.generate([p], params)[0].output_token_ids == out.output_token_ids


def test_grammar_state_survives_preemption(engine32):
    tok = engine32.tokenizer
    model = engine32.model
    ps = [tok.encode_prompt(text, "Answer with a number.") for _, text in sms_rows(10)]
    params = SamplingParams(max_tokens=12, temperature=0, grammar=Grammar.regex(r"[0-9]{3,6}(\.[0-9]+)?"))
    ref = [o.text for o in engine32.generate(ps, params)]
    per_block = KVTensors.bytes_per_block(model.args, 4, torch.float32)
    small = LLMEngine.from_model(model, tok, EngineConfig(kv_cache_memory=90 * per_block, watermark=0.0))
    outs = small.generate(ps, params)
    assert small.stats.preemptions > 0
    assert [o.text for o in outs] == ref


def test_jump_forward_skips_forced_tokens_and_keeps_the_answers(engine32):
    tok, model = engine32.tokenizer, engine32.model
    schema = Grammar.json_schema({"type": "object", "properties": {
        "sender_type": {"enum": ["person", "business", "automated"]},
        "urgency": {"enum": ["low", "medium", "high"]}, "contains_link": {"type": "boolean"}},
        "required": ["sender_type", "urgency", "contains_link"], "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False}})
    params = SamplingParams(max_tokens=40, temperature=0, grammar=schema)
    ps = [tok.encode_prompt(text + "\nAnswer in JSON.", SPAM_SYSTEM) for _, text in sms_rows(10)]
    runs = {}
    for jf in (False, True):
        eng = LLMEngine.from_model(model, tok, EngineConfig(jump_forward=jf))
        runs[jf] = ([o.text for o in eng.generate(ps, params)], eng.stats.decode_tokens)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] < runs[False][1] / 2  # the keys and punctuation came without decode steps


@pytest.mark.parametrize("jump_forward", [True, False])
def test_a_grammar_that_no_text_completes_fails_its_requests(engine32, jump_forward):
    """No answer is an error, never an empty or partial text that finished with "stop"."""
    tok, model = engine32.tokenizer, engine32.model
    eng = LLMEngine.from_model(model, tok, EngineConfig(jump_forward=jump_forward))
    p = tok.encode_prompt("Is this spam? Win money now!", SPAM_SYSTEM)
    nothing = [Grammar.regex(r"[^\s\S]"), Grammar.regex(r"(spam|ham)[^\s\S]")]  # caught when compiled
    dead_end = Grammar.lark('start: "spam" X\nX: /[^\\s\\S]/')  # caught only once "spam" is written
    good = Grammar.choices(["spam", "ham"])
    outs = eng.generate([p] * 4, [SamplingParams(max_tokens=8, temperature=0, grammar=g)
                                  for g in nothing + [dead_end, good]])
    for out in outs[:2]:
        assert out.finish_reason == "error" and "regex cannot be satisfied" in out.error, out
    assert outs[2].finish_reason == "error", outs[2]
    assert "lark cannot be satisfied: nothing can follow 'spam'" in outs[2].error
    assert outs[3].ok and outs[3].text in ("spam", "ham")
    assert eng.pool.num_used == 0
    # The failed request left the running list too: it stayed there and failed every later step
    # (KeyError in the engine) and every request in it.
    assert not eng.scheduler.running
    again = eng.generate([p] * 2, [SamplingParams(max_tokens=8, temperature=0, grammar=good),
                                   SamplingParams(max_tokens=4, temperature=0)])
    assert all(o.ok for o in again), again


def test_a_grammar_that_fails_mid_answer_fails_alone_and_choices_may_be_many(engine32, monkeypatch):
    """A Lark grammar of 2,001 alternatives, under llguidance's default limits (ours raise them to
    the grammar's width, which tests/structured checks), passes its checks and then meets the
    grammar engine's limit at its first token; requests beside it finish. Choices of 2,001 labels
    work."""
    from batchprompt.structured import compiler

    real_limits = compiler._limits
    monkeypatch.setattr(compiler, "_limits", lambda g, text: None if g.kind == "lark" else real_limits(g, text))
    tok, model = engine32.tokenizer, engine32.model
    eng = LLMEngine.from_model(model, tok, EngineConfig())
    p = tok.encode_prompt("Pick one.", SPAM_SYSTEM)
    wide = Grammar.lark("start: " + " | ".join(f'"y{i}"' for i in range(2001)))
    labels = [f"x{i}" for i in range(2001)]
    outs = eng.generate([p] * 4, [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 2
                        + [SamplingParams(max_tokens=8, temperature=0, grammar=wide),
                           SamplingParams(max_tokens=8, temperature=0, grammar=Grammar.choices(labels))])
    assert [o.finish_reason for o in outs[:2]] == ["length", "length"]
    assert outs[2].finish_reason == "error" and "max is 2000" in outs[2].error, outs[2]
    assert outs[3].ok and outs[3].text in labels, outs[3]
    assert not eng.scheduler.running and eng.pool.num_used == 0


def test_scoring_a_choice_longer_than_the_kv_budget_fails_alone(tiny_model):
    per_block = KVTensors.bytes_per_block(tiny_model.args, EngineConfig().block_size, torch.float32)
    eng = engine(tiny_model, kv_cache_memory=6 * per_block, watermark=0.0)
    long_choice = tuple(range(20, 40))  # the prompt fits in 6 blocks, prompt + choice does not
    prompt = prompts(1, shared=0)[0][:8]
    bad = eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, score_choices=((5,), long_choice)))
    ok = eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, score_choices=((5,), (6, 7))))
    finished = {}
    for _ in range(50):  # bounded: a request that never finishes fails the test, not hangs it
        finished.update((o.request_id, o) for o in eng.step())
        if not eng.has_unfinished():
            break
    assert set(finished) == {bad, ok}
    assert "raise kv_cache_memory" in finished[bad].error and finished[ok].ok
    assert eng.pool.num_used == 0


@pytest.mark.parametrize("pattern, stop, text", [("spam eggs", "eggs", "spam "), ("spam", "a", "sp")])
def test_a_stop_string_in_the_piece_that_completes_the_grammar_cuts_the_text(engine32, pattern, stop, text):
    """The grammar's completion ended the request before its stop strings were looked at."""
    tok = engine32.tokenizer
    p = tok.encode_prompt("Say spam.", SPAM_SYSTEM)
    out = engine32.generate([p], SamplingParams(max_tokens=8, temperature=0, stop=[stop],
                                                grammar=Grammar.regex(pattern)))[0]
    assert (out.text, out.finish_reason) == (text, "stop"), out
