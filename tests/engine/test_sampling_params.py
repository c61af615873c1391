"""SamplingParams is the one place numbers are checked: the engine, the batch API and jobs share it."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from batchprompt.api.options import GenerationOptions
from batchprompt.engine import SamplingParams


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": float("inf")}, r"temperature must be a finite number >= 0, got inf"),
    ({"temperature": json.loads("1e400")}, r"temperature must be a finite number"),  # JSON's 1e400 is inf
    ({"temperature": float("nan")}, r"temperature must be a finite number"),
    ({"temperature": "0.5"}, r"temperature must be a finite number"),
    ({"temperature": True}, r"temperature must be a finite number"),
    ({"top_p": float("nan")}, r"top_p must be a number in \(0, 1\]"),
    ({"top_p": float("inf")}, r"top_p must be a number"),
    ({"top_k": -2}, r"top_k must be an integer >= -1"),
    ({"top_k": 2.5}, r"top_k must be an integer"),
    ({"max_tokens": True}, r"max_tokens must be an integer >= 1"),
    ({"max_tokens": math.inf}, r"max_tokens must be an integer"),
    ({"max_tokens": None}, r"vLLM's None \(up to the end of the context\) is not taken here; give a number"),
    ({"seed": 2**64}, r"seed must be a 64-bit integer"),
    ({"seed": -2**63 - 1}, r"seed must be a 64-bit integer"),
    ({"seed": 1.5}, r"seed must be a 64-bit integer"),
])
def test_bad_numbers_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_good_numbers_become_plain_python_numbers():
    p = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.5), top_p=1, top_k=-1,
                       seed=np.int64(2**63 - 1))
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (4, 0.5, 1.0, 0, 2**63 - 1)
    assert [type(v) for v in (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed)] == [int, float, float, int, int]
    json.dumps([p.max_tokens, p.temperature, p.seed])  # jobs key identical requests on this


def test_a_top_k_beyond_any_vocabulary_keeps_every_token():
    # 1e30 from a JSON body failed the whole step it ran in (the sampler's tensor overflowed).
    assert SamplingParams(top_k=10**30).top_k == 0 and SamplingParams(top_k=2**63).top_k == 0
    assert SamplingParams(top_k=2**31 - 1).top_k == 2**31 - 1


def test_the_batch_api_refuses_them_before_any_work():
    # merged() is what LanguageModel.create and every call run before anything reaches the engine.
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        GenerationOptions().merged({"temperature": float("inf")})
    with pytest.raises(ValueError, match="top_p"):
        GenerationOptions().merged({"top_p": float("nan")})
    with pytest.raises(ValueError, match="seed must be a 64-bit integer"):
        GenerationOptions().merged({"seed": 2**64})


def test_logprobs_as_an_int_is_vllms_top_n():
    """logprobs=5 was taken as True: no top log-probs came back."""
    p = SamplingParams(logprobs=5)
    assert (p.logprobs, p.top_logprobs) == (True, 5)
    assert (SamplingParams(logprobs=0).logprobs, SamplingParams(logprobs=0).top_logprobs) == (True, 0)
    assert SamplingParams(logprobs=3, top_logprobs=3).top_logprobs == 3
    for bad, match in ((2.5, "logprobs must be True, False or an integer"), (21, "from 0 to 20"),
                       ("5", "logprobs must be")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(logprobs=bad)
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(logprobs=2, top_logprobs=4)


def test_label_scoring_with_n_or_best_of_is_refused_in_the_users_words():
    """It named score_choices, a field of batchprompt's own, where the user had said choice_mode."""
    for extra in ({"n": 2}, {"best_of": 2}):
        with pytest.raises(ValueError, match="n and best_of do not apply to choice_mode='score'"):
            SamplingParams(score_choices=((1,), (2,)), **extra)


def test_a_large_logit_bias_is_checked_without_quoting_it_once_per_entry():
    """Each entry's check made its error message, quoting the whole mapping: a logit_bias of
    the whole vocabulary (49,152 entries) took a server minutes of CPU, beside every other
    request. The message is made only for an entry that fails."""

    class Quoted(dict):
        times = 0

        def __repr__(self):
            Quoted.times += 1
            return super().__repr__()

    bias = Quoted({str(i): 0.5 for i in range(2000)})
    assert len(SamplingParams(logit_bias=bias).logit_bias) == 2000
    assert Quoted.times == 0
    with pytest.raises(ValueError, match="got 500 for token '7'"):
        SamplingParams(logit_bias=Quoted({"3": 1, "7": 500}))
