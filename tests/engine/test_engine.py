"""The engine end to end on a tiny random Llama (fast) and the embedded model (slow)."""
from __future__ import annotations

import math

import pytest
import torch

from batchprompt import EngineConfig, LLMEngine, SamplingParams
from batchprompt.models import build_model, load_hf_weights, resolve_model
from batchprompt.models.ops import TorchOps
from batchprompt.runner.kv_tensors import KVTensors

from ..conftest import SPAM_SYSTEM, full_logits, sms_rows

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    args, weights = load_hf_weights(resolve_model(tiny_model_dir))
    return build_model(args, weights, torch.float32, torch.device("cpu"))


def engine(model, **cfg) -> LLMEngine:
    return LLMEngine.from_model(model, None, EngineConfig(**cfg))


def prompts(n: int, shared: int = 9) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 97, (shared,), generator=g).tolist()
    return [prefix + torch.randint(3, 97, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_batched_equals_alone_with_chunking_and_prefix_cache(tiny_model):
    ps = prompts(20)
    alone = [engine(tiny_model).generate([p], GREEDY)[0].output_token_ids for p in ps]
    eng = engine(tiny_model, max_num_batched_tokens=64, max_num_seqs=8)
    outs = eng.generate(ps, GREEDY)
    assert [o.output_token_ids for o in outs] == alone
    assert eng.stats.prefix_cache_hit_rate > 0.1
    assert eng.pool.num_used == 0


def test_preemption_in_a_tiny_cache_gives_the_same_tokens(tiny_model):
    ps = prompts(12)
    ref = [o.output_token_ids for o in engine(tiny_model).generate(ps, GREEDY)]
    per_block = KVTensors.bytes_per_block(tiny_model.args, EngineConfig().block_size, torch.float32)
    eng = engine(tiny_model, kv_cache_memory=60 * per_block, watermark=0.0)
    outs = eng.generate(ps, GREEDY)
    assert eng.stats.preemptions > 0
    assert [o.output_token_ids for o in outs] == ref


def test_greedy_tokens_follow_reference_logits(tiny_model):
    p = prompts(1)[0]
    out = engine(tiny_model).generate([p], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                          logprobs=True))[0]
    seq = list(p)
    for tok, lp in zip(out.output_token_ids, out.logprobs):
        logits = full_logits(tiny_model, seq)[-1]
        assert tok == int(logits.argmax())
        assert lp == pytest.approx(float(torch.log_softmax(logits, -1)[tok]), abs=1e-4)
        seq.append(tok)


def test_prompt_log_probs_and_their_top_ones_follow_reference_logits(tiny_model):
    """A completion's echo with logprobs (lm-eval's loglikelihood) needs each prompt token's
    log-prob and, at each position, the most likely tokens: checked against the full forward,
    with a prompt long enough to be prefilled in chunks."""
    p = prompts(1, shared=30)[0]
    out = engine(tiny_model, max_num_batched_tokens=16).generate(
        [p], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs_from=1, prompt_top_logprobs=3))[0]
    reference = torch.log_softmax(full_logits(tiny_model, p), -1)
    assert len(out.prompt_logprobs) == len(out.prompt_top_logprobs) == len(p) - 1
    for pos in range(1, len(p)):
        expected = reference[pos - 1]
        assert out.prompt_logprobs[pos - 1] == pytest.approx(float(expected[p[pos]]), abs=1e-4)
        values, ids = torch.topk(expected, 3)
        assert [t for t, _ in out.prompt_top_logprobs[pos - 1]] == ids.tolist()
        assert [v for _, v in out.prompt_top_logprobs[pos - 1]] == pytest.approx(values.tolist(), abs=1e-4)
    with pytest.raises(ValueError, match="prompt_top_logprobs must be an integer from 0 to 20, with prompt_logprobs"):
        SamplingParams(prompt_top_logprobs=2)


@pytest.mark.parametrize("top", [0, 2])
def test_prompt_tokens_ranks_follow_reference_logits(tiny_model, top):
    """vLLM's prompt_logprobs gives each prompt token's rank in the vocabulary (1: the likeliest),
    with or without the top ones; checked against the full forward, prefilled in chunks."""
    p = prompts(1, shared=30)[0]
    out = engine(tiny_model, max_num_batched_tokens=16).generate(
        [p], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs_from=1, prompt_top_logprobs=top,
                            prompt_ranks=True))[0]
    reference = torch.log_softmax(full_logits(tiny_model, p), -1)
    assert len(out.prompt_ranks) == len(out.prompt_logprobs) == len(p) - 1
    assert (out.prompt_top_logprobs is None) == (top == 0)
    for pos in range(1, len(p)):
        expected = reference[pos - 1]
        assert out.prompt_ranks[pos - 1] == int((expected > expected[p[pos]]).sum()) + 1
        assert out.prompt_logprobs[pos - 1] == pytest.approx(float(expected[p[pos]]), abs=1e-4)
    assert min(out.prompt_ranks) >= 1 and max(out.prompt_ranks) > 1  # a random model's prompt: not all likeliest
    with pytest.raises(ValueError, match="prompt_ranks needs prompt_logprobs_from"):
        SamplingParams(prompt_ranks=True)


def test_seed_gives_same_output_whatever_the_batch(tiny_model):
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=20, seed=123, ignore_eos=True)
    ps = prompts(6)
    alone = engine(tiny_model).generate([ps[2]], sp)[0].output_token_ids
    mixed = engine(tiny_model).generate(ps, [SamplingParams(max_tokens=7, temperature=0.7)] * 2 + [sp]
                                        + [SamplingParams(max_tokens=3, temperature=1.0)] * 3)
    assert mixed[2].output_token_ids == alone
    other_seed = engine(tiny_model).generate([ps[2]], SamplingParams(**{**sp.__dict__, "seed": 7}))[0]
    assert other_seed.output_token_ids != alone


def test_top_k_one_is_greedy(tiny_model):
    p = prompts(1)[0]
    greedy = engine(tiny_model).generate([p], GREEDY)[0].output_token_ids
    k1 = engine(tiny_model).generate([p], SamplingParams(max_tokens=12, temperature=2.0, top_k=1,
                                                         ignore_eos=True))[0].output_token_ids
    assert k1 == greedy


def test_bad_requests_fail_alone(tiny_model):
    eng = engine(tiny_model, max_model_len=64)
    good = prompts(3)
    outs = eng.generate([good[0], [], list(range(3, 70)), good[1], [500], good[2]], GREEDY)
    assert [o.ok for o in outs] == [True, False, False, True, False, True]
    assert "empty" in outs[1].error
    assert "shorten the prompt" in outs[2].error
    assert "vocabulary" in outs[4].error
    assert all(len(o.output_token_ids) == 12 for o in outs if o.ok)


def test_a_max_model_len_past_the_models_context_is_refused(tiny_model):
    """As vLLM refuses it; it was cut to the model's context without a word."""
    longest = tiny_model.args.max_position
    assert engine(tiny_model, max_model_len=longest).max_model_len == longest
    with pytest.raises(ValueError, match=f"max_model_len {longest + 1} is longer than the model's context of "
                                         f"{longest} tokens: give at most {longest}"):
        engine(tiny_model, max_model_len=longest + 1)


def test_stop_token_ids_and_max_tokens(tiny_model):
    p = prompts(1)[0]
    free = engine(tiny_model).generate([p], GREEDY)[0].output_token_ids
    stop_at = free[4]
    out = engine(tiny_model).generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                          stop_token_ids=(stop_at,)))[0]
    assert out.finish_reason == "stop"
    assert out.output_token_ids == free[:free.index(stop_at) + 1]
    assert out.stop_reason == stop_at  # vLLM's stop_reason: the stop token id
    long = engine(tiny_model).generate([p], GREEDY)[0]
    assert long.finish_reason == "length" and long.stop_reason is None


def test_abort_returns_the_request_and_frees_memory(tiny_model):
    eng = engine(tiny_model)
    ids = [eng.add_request(p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
           for p in prompts(4)]
    eng.step()
    assert eng.abort(ids[1])
    assert not eng.abort("no-such-id")
    finished = {}
    while eng.has_unfinished():
        for o in eng.step():
            finished[o.request_id] = o
    assert finished[ids[1]].finish_reason == "abort"
    assert [finished[i].finish_reason for i in ids if i != ids[1]] == ["length"] * 3
    assert eng.pool.num_used == 0


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_32_sms_batched_equal_alone_on_embedded_model(dtype, embedded_engine):
    """Continuous batching and the prefix cache do not change greedy text beyond rounding.

    The noise that batching causes is the log-prob of the same token in the same context,
    batched and alone. Where a text differs, the two candidate tokens at the divergence must be
    a tie at the dtype's resolution: their logits at most two rounding steps apart (one step
    each way). In bfloat16 (8 significant bits) the step at a logit of 16 to 32 is 1/8, at 32
    to 64 it is 1/4; this model's logits stay below 64. (Measured: float32 gives identical
    texts, noise 2e-5; bfloat16 gives a few divergences, each 0 to 1 step apart, and noise
    0.2 in log-prob.) The bounds are fixed, so a batching bug cannot widen its own tolerance.
    """
    eng = embedded_engine if dtype == "bfloat16" else LLMEngine.from_pretrained(dtype=dtype)
    tok = eng.tokenizer
    ps = [tok.encode_prompt(text, system=SPAM_SYSTEM) for _, text in sms_rows(32)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True)
    batched = eng.generate(ps, sp)
    assert eng.stats.prefix_cache_hit_rate > 0.3
    alone = [eng.generate([p], sp)[0] for p in ps]
    noise = 0.0
    for a, b in zip(alone, batched):
        for x, y, la, lb in zip(a.output_token_ids, b.output_token_ids, a.logprobs, b.logprobs):
            if x != y:
                break
            noise = max(noise, abs(la - lb))
    # A log-prob is a logit minus the log-sum-exp: rounding moves it by about two steps at most.
    assert noise <= (1e-3 if dtype == "float32" else 2 * 0.25), noise
    eps = torch.finfo(next(eng.model.parameters()).dtype).eps  # a step is eps times the power of two below
    for p, a, b in zip(ps, alone, batched):
        if a.output_token_ids == b.output_token_ids:
            continue
        i = next(k for k, (x, y) in enumerate(zip(a.output_token_ids, b.output_token_ids)) if x != y)
        logits = full_logits(eng.model, p + a.output_token_ids[:i])[-1].float()
        pair = logits[[a.output_token_ids[i], b.output_token_ids[i]]]
        step = eps * 2.0 ** math.floor(math.log2(float(pair.abs().max())))
        gap = float((pair[0] - pair[1]).abs())
        assert gap <= 2 * step, f"not a tie ({gap:.4f} > 2 steps of {step}): {a.text!r} vs {b.text!r}"


@pytest.mark.slow
def test_stop_strings_cut_the_text(embedded_engine):
    tok = embedded_engine.tokenizer
    p = tok.encode_prompt("Count from 1 to 10, separated by commas.")
    free = embedded_engine.generate([p], SamplingParams(max_tokens=30, temperature=0))[0]
    assert "4" in free.text
    cut = embedded_engine.generate([p], SamplingParams(max_tokens=30, temperature=0, stop=["zebra", "4"]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == "4"  # the string that matched (vLLM's)
    assert cut.text == free.text[:free.text.index("4")]
    eos = embedded_engine.generate([tok.encode_prompt("Say hi.")], SamplingParams(max_tokens=60, temperature=0))[0]
    assert eos.finish_reason == "stop" and eos.stop_reason is None  # EOS: null, as in vLLM


def test_decode_kernel_gives_the_pytorch_attention_results(tiny_model):
    """The compiled kernels (CPU) and the PyTorch paths agree on tokens and log-probs."""
    ps = prompts(10)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)
    fast = engine(tiny_model)
    if fast.runner.decode_op is None:
        pytest.skip("no compiled kernel on this machine")
    plain = engine(tiny_model)
    plain.runner.decode_op, plain.runner.ops = None, TorchOps()
    a, b = fast.generate(ps, sp), plain.generate(ps, sp)
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def test_one_variable_length_call_per_layer_gives_the_padded_groups_results(tiny_model):
    """The CUDA layout (every chunk's keys gathered back to back, one varlen call per layer) with
    the kernel's reference semantics in its place: the same tokens and log-probs as the padded
    SDPA groups, through chunked prefill, a shared prefix found in the cache, and decode rows."""
    from batchprompt.models.flash_attention import varlen_reference

    ps = prompts(12)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True)
    plain = engine(tiny_model, max_num_batched_tokens=48, max_num_seqs=6)
    plain.runner.decode_op, plain.runner.ops = None, TorchOps()
    varlen = engine(tiny_model, max_num_batched_tokens=48, max_num_seqs=6)
    calls = []

    def counted(*args):
        calls.append(args[3].numel() - 1)  # requests in the call
        return varlen_reference(*args)

    varlen.runner.decode_op, varlen.runner.ops, varlen.runner.varlen_op = None, TorchOps(), counted
    a, b = varlen.generate(ps, sp), plain.generate(ps, sp)
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    assert calls and max(calls) > 1  # steps with several requests in one call
    assert varlen.stats.prefix_cache_hit_rate > 0.1


def test_a_request_that_outgrows_the_kv_budget_fails_saying_what_to_do(tiny_model):
    """Its prompt fits, so it starts; alone and still growing, it preempts itself: it fails
    with what to change, and the request after it runs."""
    per_block = KVTensors.bytes_per_block(tiny_model.args, EngineConfig().block_size, torch.float32)
    eng = engine(tiny_model, kv_cache_memory=8 * per_block, watermark=0.0, max_num_seqs=1)
    p = prompts(2, shared=0)
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    outs = eng.generate([p[0][:12], p[1][:8]], [long, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)])
    assert outs[0].finish_reason == "error"
    assert "raise kv_cache_memory or lower max_tokens" in outs[0].error
    assert len(outs[0].output_token_ids) == 8 * 4 + 1 - 12  # it ran until its newest token found no room
    assert outs[1].ok and len(outs[1].output_token_ids) == 4
    assert eng.pool.num_used == 0
    assert "held by the system prompts" not in outs[0].error


def test_a_request_that_cannot_run_for_pinned_prefixes_names_the_sessions_that_hold_them(tiny_model):
    """It said only "raise kv_cache_memory or lower max_tokens", where open sessions' system
    prompts held the memory (destroying them frees it)."""
    per_block = KVTensors.bytes_per_block(tiny_model.args, EngineConfig().block_size, torch.float32)
    eng = engine(tiny_model, kv_cache_memory=40 * per_block, watermark=0.0, max_num_seqs=1)  # 160 tokens
    g = torch.Generator().manual_seed(7)
    a, b, c = (torch.randint(3, 97, (n,), generator=g).tolist() for n in (48, 48, 70))
    for name, prefix in (("a", a), ("b", b)):  # as a session's system prompt: computed, then pinned
        eng.generate([prefix], SamplingParams(max_tokens=1))
        assert eng.pin_prefix(name, prefix) == 48
    out = eng.generate([c], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "error", out
    assert "tokens are held by the system prompts of 2 open sessions: destroy() those no longer used" in out.error


def test_a_step_that_fails_on_one_request_fails_that_request_alone(tiny_model, monkeypatch, caplog):
    """A value no check foresaw (a top_k too big for the sampler's tensors once failed every
    request of its step): the step's requests run one by one, the one at fault fails with the
    error it raised, and the others give what they give without it."""
    import batchprompt.runner.model_runner as model_runner

    ps = prompts(4)
    want = engine(tiny_model).generate(ps, GREEDY)
    real = model_runner.sample

    def sample(logits, chunks, ops):
        if any(c.params.top_k == 7 for c in chunks):
            raise RuntimeError("this row breaks the sampler")
        return real(logits, chunks, ops)

    monkeypatch.setattr(model_runner, "sample", sample)
    poisoned = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, top_k=7)
    outs = engine(tiny_model).generate(ps, [GREEDY, poisoned, GREEDY, GREEDY])
    assert outs[1].finish_reason == "error" and "this row breaks the sampler" in outs[1].error
    assert [o.error for i, o in enumerate(outs) if i != 1] == [None] * 3
    assert [o.output_token_ids for i, o in enumerate(outs) if i != 1] == \
        [o.output_token_ids for i, o in enumerate(want) if i != 1]
    assert "running them one by one" in caplog.text


def test_an_output_cut_inside_a_character_leaves_the_character_out(engine32):
    """'😊' is three tokens here; max_tokens cut after the first wrote U+FFFD at the end of the
    text. As vLLM's detokenizer does, the incomplete character is left out; the token stays."""
    tok = engine32.tokenizer
    first = tok.encode("😊", add_special_tokens=False)[0]
    assert tok.decode([first]) == "\ufffd"
    rid = engine32.add_request("Hi", SamplingParams(max_tokens=1, temperature=0, logit_bias={first: 100}))
    outs = []
    while engine32.has_unfinished():
        outs += engine32.step()
    out = {o.request_id: o for o in outs}[rid]
    assert out.output_token_ids == [first] and out.finish_reason == "length"
    assert out.text == ""


def test_odd_prompts_fail_alone_and_one_string_is_one_prompt(embedded_engine, tiny_model):
    """A string given to generate() ran as one prompt per character; None or a list of text
    raised a bare TypeError out of generate() with the other prompts already queued."""
    outs = embedded_engine.generate("Hello", SamplingParams(max_tokens=1, temperature=0))
    assert len(outs) == 1 and outs[0].ok and outs[0].prompt_token_ids == embedded_engine.tokenizer.encode("Hello")
    eng = engine(tiny_model)
    good = prompts(1)[0]
    flat = eng.generate(good, SamplingParams(max_tokens=2, temperature=0))  # a list of ints is one prompt
    assert len(flat) == 1 and flat[0].ok and flat[0].prompt_token_ids == good
    with pytest.raises(TypeError, match="decode the bytes"):
        eng.generate(b"Hello")
    outs = eng.generate([None, good, ["a", "b"], [1.5, 2], torch.tensor(good), "text"],
                        SamplingParams(max_tokens=2, temperature=0))
    assert [o.ok for o in outs] == [False, True, False, False, True, False]
    assert "a string or a list of token ids, got NoneType" in outs[0].error
    assert all("integers only" in o.error for o in outs[2:4])
    assert outs[4].output_token_ids == outs[1].output_token_ids
    assert "no tokenizer" in outs[5].error
    assert eng.pool.num_used == 0 and not eng.has_unfinished()


def test_generate_collects_its_own_requests_only(tiny_model):
    """A request added before generate() and finishing first made generate() stop short and
    raise KeyError, losing both outputs; a params list of the wrong length queued the prompts
    it could pair and raised, leaving them running."""
    eng = engine(tiny_model)
    sp = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(ValueError, match="one per prompt: got 2 for 3 prompts"):
        eng.generate(prompts(3), [sp, sp])
    with pytest.raises(TypeError, match="SamplingParams"):
        eng.generate(prompts(2), {"max_tokens": 2})
    assert not eng.has_unfinished()
    other = eng.add_request(prompts(1)[0], SamplingParams(max_tokens=1, temperature=0))
    outs = eng.generate(prompts(2), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [len(o.output_token_ids) for o in outs] == [6, 6]
    assert eng.has_unfinished()  # the other request's output waits for the next step()
    assert [o.request_id for o in eng.step()] == [other]
    assert not eng.has_unfinished() and eng.pool.num_used == 0
