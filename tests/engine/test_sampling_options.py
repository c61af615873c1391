"""Sampling options end to end in the engine (tiny random Llama): n and best_of over one
prefill, min_tokens, logit_bias, top_logprobs; stop strings; validation; the batch API's options."""
from __future__ import annotations

import pytest

from batchprompt import SamplingParams
from batchprompt.api.options import GenerationOptions
from batchprompt.engine.request import Request
from batchprompt.engine.stop import check_stop

from .test_engine import engine, tiny_model  # noqa: F401  (fixture; one definition for tests/engine)

EOS = 2  # the tiny model's
PROMPT = list(range(3, 40))  # 37 tokens: full blocks, then a partial one




def sampled(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, **kw)


def test_n_samples_share_the_prompt_prefill_and_match_single_requests(tiny_model):
    eng = engine(tiny_model)
    out = eng.generate([PROMPT], sampled(n=3, seed=7))[0]
    singles = [engine(tiny_model).generate([PROMPT], sampled(seed=7 + i))[0] for i in range(3)]
    assert [s.output_token_ids for s in out.samples] == [s.output_token_ids for s in singles]
    assert out.output_token_ids == out.samples[0].output_token_ids
    assert len({tuple(s.output_token_ids) for s in out.samples}) > 1  # different seeds, different samples
    # The first sample computed the prompt; the others found its full blocks in the prefix cache.
    full = (len(PROMPT) - 1) // eng.config.block_size * eng.config.block_size
    assert full > 0 and [s.num_cached_tokens for s in out.samples] == [0, full, full]
    assert eng.stats.cached_prompt_tokens == 2 * full and not eng.has_unfinished()


def test_best_of_returns_the_n_with_the_highest_cumulative_logprob(tiny_model):
    out = engine(tiny_model).generate([PROMPT], sampled(n=2, best_of=4, seed=11))[0]
    singles = [engine(tiny_model).generate([PROMPT], sampled(seed=11 + i, logprobs=True))[0] for i in range(4)]
    ranked = sorted(singles, key=lambda s: sum(s.logprobs), reverse=True)
    assert [s.output_token_ids for s in out.samples] == [s.output_token_ids for s in ranked[:2]]
    assert out.logprobs is None and out.samples[0].logprobs is None  # computed to rank, not asked


def test_aborting_a_request_with_samples_stops_them_all(tiny_model):
    eng = engine(tiny_model)
    rid = eng.add_request(PROMPT, sampled(n=3))
    eng.step()
    assert eng.abort(rid)
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "abort")]
    assert not eng.has_unfinished() and not eng.scheduler.has_work


def test_min_tokens_keeps_eos_out_until_reached(tiny_model):
    eos_first = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={EOS: 100})
    assert engine(tiny_model).generate([PROMPT], eos_first)[0].output_token_ids == [EOS]
    out = engine(tiny_model).generate([PROMPT], SamplingParams(
        max_tokens=10, temperature=0.0, logit_bias={EOS: 100}, min_tokens=4))[0]
    assert len(out.output_token_ids) == 5 and EOS not in out.output_token_ids[:4]
    assert out.output_token_ids[4] == EOS and out.finish_reason == "stop"


def test_logit_bias_outside_the_vocabulary_fails_that_request_alone(tiny_model):
    bad, good = engine(tiny_model).generate([PROMPT, PROMPT], [
        SamplingParams(max_tokens=2, logit_bias={500: 1}), SamplingParams(max_tokens=2)])
    assert bad.error and "outside the vocabulary [0, 97)" in bad.error and "500" in bad.error
    assert good.ok and len(good.output_token_ids) == 2


def test_top_logprobs_per_position(tiny_model):
    out = engine(tiny_model).generate([PROMPT], SamplingParams(max_tokens=5, temperature=0.0,
                                                               ignore_eos=True, top_logprobs=3))[0]
    assert len(out.top_logprobs) == len(out.output_token_ids) == len(out.logprobs) == 5
    for token, lp, top in zip(out.output_token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 3 and top[0] == (token, pytest.approx(lp))  # greedy picks the top one
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


class CharTokenizer:
    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


@pytest.mark.parametrize("include, text_len", [(False, 2), (True, 4)])
def test_stop_string_kept_or_cut(include, text_len):
    req = Request("r", [0], SamplingParams(stop=("cd",), include_stop_str_in_output=include))
    for t in (0, 1, 2, 3):  # "abcd"
        req.append_token(t, None)
    assert check_stop(req, frozenset(), 100, CharTokenizer()) == "stop"
    assert req.stop_text_len == text_len


class WideTokenizer:
    """Token 0 is "\n" and 23 spaces, as SmolLM2 has; the others one letter each."""

    def decode(self, ids):
        return "".join("\n" + " " * 23 if i == 0 else chr(ord("a") + i) for i in ids)


@pytest.mark.parametrize("tokens, stop, text_len", [
    ((1, 0), "\n", 1),  # "b" then "\n" + 23 spaces: the "\n" is 24 characters from the end
    ((1, 2, 0), "c\n", 1),  # across the boundary with the token before
    ((0,), "\n", 0),
])
def test_a_stop_string_at_the_start_of_a_long_token_is_found(tokens, stop, text_len):
    """Only the last longest-stop + 16 characters were searched: stop=["\n"] was missed where one
    token wrote "\n" and 23 spaces (code), and the output ran on to the next newline."""
    req = Request("r", [0], SamplingParams(stop=(stop,)))
    found = None
    for t in tokens:
        req.append_token(t, None)
        found = check_stop(req, frozenset(), 100, WideTokenizer())
        if found:
            break
    assert found == "stop" and req.stop_text_len == text_len and req.stop_reason == stop


@pytest.mark.parametrize("ignore_eos, reason", [(False, None), (True, 1)])
def test_an_eos_that_is_also_a_stop_token_id_is_no_stop_reason(ignore_eos, reason):
    # As vLLM checks EOS first: stop_token_ids=[eos] answered stop_reason = the EOS id.
    req = Request("r", [0], SamplingParams(stop_token_ids=(1,), ignore_eos=ignore_eos))
    req.append_token(1, None)
    assert check_stop(req, frozenset({1}), 100, CharTokenizer()) == "stop"
    assert req.stop_reason == reason


def test_min_tokens_defers_stop_tokens_and_strings():
    req = Request("r", [0], SamplingParams(stop=("b",), stop_token_ids=(1,), min_tokens=3))
    req.append_token(0, None)
    req.append_token(1, None)
    assert check_stop(req, frozenset({1}), 100, CharTokenizer()) is None


def test_a_stop_string_inside_min_tokens_never_counts():
    """As vLLM: a stop string counts only where it ends after the first min_tokens tokens'
    text, so the output is never cut back into them."""
    req = Request("r", [0], SamplingParams(stop=("b",), min_tokens=3))
    for t in (0, 1, 2, 3):  # "abcd": the "b" is inside the first 3 tokens
        req.append_token(t, None)
        assert check_stop(req, frozenset(), 100, CharTokenizer()) is None
    req.append_token(1, None)  # "abcdb"
    assert check_stop(req, frozenset(), 100, CharTokenizer()) == "stop"
    assert req.stop_text_len == 4


@pytest.mark.parametrize("kwargs, match", [
    ({"presence_penalty": 2.5}, r"presence_penalty must be a number from -2 to 2"),
    ({"frequency_penalty": float("nan")}, r"frequency_penalty must be a number from -2 to 2"),
    ({"repetition_penalty": 0}, r"repetition_penalty must be a finite number > 0"),
    ({"min_p": 1.5}, r"min_p must be a number from 0 to 1"),
    ({"min_tokens": 17}, r"min_tokens must be an integer from 0 to max_tokens \(16\)"),
    ({"top_logprobs": 21}, r"top_logprobs must be an integer from 0 to 20"),
    ({"logit_bias": {"x": 1}}, r"logit_bias keys must be token ids"),
    ({"logit_bias": {5: 101}}, r"logit_bias values must be numbers from -100 to 100"),
    ({"n": 0}, r"n must be an integer >= 1"),
    ({"n": 3, "best_of": 2}, r"best_of must be an integer >= n \(3\)"),
    # it ran best_of identical greedy samples
    ({"best_of": 3, "temperature": 0}, r"best_of 3 with temperature 0 \(greedy\) computes 3 identical samples"),
    ({"stop": 5}, r"stop must be a string or a list of strings, got 5"),  # was a bare TypeError
    ({"stop": ["a", 1]}, r"stop must be a string or a list of strings"),
])
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_defaults_are_vllms_in_the_engine_and_greedy_in_the_batch_api():
    p = SamplingParams()
    assert (p.temperature, p.max_tokens, p.adjusts_logits, p.num_samples) == (1.0, 16, False, 1)
    assert SamplingParams(logit_bias={"7": -3}).logit_bias == {7: -3.0}
    assert SamplingParams(top_logprobs=2).logprobs  # top_logprobs implies logprobs
    api = GenerationOptions().merged({"presence_penalty": 0.5, "logit_bias": {"3": 1}, "top_logprobs": 2,
                                      "min_p": 0.1}).base_params()
    assert (api.temperature, api.max_tokens, api.presence_penalty, api.logit_bias, api.top_logprobs,
            api.min_p) == (0.0, 256, 0.5, {3: 1.0}, 2, 0.1)
    assert GenerationOptions().merged({"best_of": 2, "temperature": 0.5}).base_params().best_of == 2
    with pytest.raises(ValueError, match="min_p"):
        GenerationOptions().merged({"min_p": 2})
