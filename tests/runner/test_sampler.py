"""The sampler's logit adjustments, min_p and top log-probs against values computed by hand."""
from __future__ import annotations

import math

import pytest
import torch

from batchprompt.engine import SamplingParams
from batchprompt.models.ops import TORCH_OPS
from batchprompt.runner.sampler import _filtered_probs, adjust_logits, sample
from batchprompt.steps import ScheduledChunk

GREEDY = dict(temperature=0.0, max_tokens=32)


def chunk(params: SamplingParams, prompt=(), output=(), banned=()) -> ScheduledChunk:
    c = ScheduledChunk("r", [0], 0, [0], True, params)
    if params.adjusts_logits:  # what the engine attaches (attach_sampling_state)
        c.prompt_token_ids, c.output_token_ids, c.banned_token_ids = list(prompt), list(output), tuple(banned)
    return c


def test_presence_and_frequency_penalties_count_generated_tokens():
    # counts over the output [1, 1, 3]: token 1 twice, token 3 once; the prompt does not count.
    c = chunk(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, **GREEDY), prompt=[2, 2], output=[1, 1, 3])
    row = torch.tensor([0.0, 1.0, 2.0, 3.0])
    adjust_logits(row, c)
    # 1: 1 - 0.5 - 2*0.25 = 0; 3: 3 - 0.5 - 0.25 = 2.25; 0 and 2 unseen in the output.
    assert row.tolist() == [0.0, 0.0, 2.0, 2.25]


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    plain = chunk(SamplingParams(**GREEDY), output=[3])
    penalized = chunk(SamplingParams(presence_penalty=0.5, frequency_penalty=1.0, **GREEDY), output=[3])
    assert sample(logits.clone(), [plain])[0] == [3]
    assert sample(logits.clone(), [penalized])[0] == [2]  # 3 - 0.5 - 1.0 = 1.5 < 2


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    c = chunk(SamplingParams(repetition_penalty=2.0, **GREEDY), prompt=[0], output=[3, 3])
    row = torch.tensor([-1.0, 1.0, 2.0, 3.0])
    adjust_logits(row, c)
    assert row.tolist() == [-2.0, 1.0, 2.0, 1.5]  # seen once or more: the same, not per count


def test_logit_bias_is_added_and_min_tokens_ban_wins_over_it():
    row = torch.tensor([0.0, 1.0, 2.0, 3.0])
    adjust_logits(row, chunk(SamplingParams(logit_bias={"0": 5, 2: -1.5}, **GREEDY)))
    assert row.tolist() == [5.0, 1.0, 0.5, 3.0]
    row = torch.tensor([0.0, 1.0, 2.0, 3.0])
    adjust_logits(row, chunk(SamplingParams(logit_bias={3: 100}, min_tokens=2, **GREEDY), banned=[3]))
    assert row[3] == -math.inf and row[:3].tolist() == [0.0, 1.0, 2.0]


def test_only_rows_that_ask_are_adjusted_and_greedy_rows_keep_bf16():
    seen = []

    class Recording(type(TORCH_OPS)):
        def argmax(self, logits):
            seen.append(logits.dtype)
            return super().argmax(logits)

    ops = Recording()
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 2, dtype=torch.bfloat16)
    plain = [chunk(SamplingParams(**GREEDY), output=[3]) for _ in range(2)]
    assert sample(logits.clone(), plain, ops)[0] == [3, 3]
    assert seen == [torch.bfloat16]  # no option asked: argmax on the model's dtype, no copy
    mixed = [chunk(SamplingParams(logit_bias={0: 10}, **GREEDY)), plain[1]]
    assert sample(logits.clone(), mixed, ops)[0] == [0, 3]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    c = chunk(SamplingParams(min_p=0.2, temperature=1.0))
    out = _filtered_probs(probs.log(), [c])
    # floor 0.2 * 0.5 = 0.1: only the 0.05 token goes; the others keep their probabilities.
    assert torch.allclose(out, torch.tensor([[0.5, 0.3, 0.15, 0.0]]), atol=1e-6)
    off = _filtered_probs(probs.log(), [chunk(SamplingParams(temperature=1.0))])
    assert torch.allclose(off, probs, atol=1e-6)


def test_top_logprobs_are_the_k_most_likely_of_the_raw_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    c = chunk(SamplingParams(top_logprobs=2, logit_bias={0: 10}, **GREEDY))
    tokens, lps = sample(logits.clone(), [c])
    lse = math.log(1 + math.e + math.e ** 2 + math.e ** 3)
    assert tokens == [0]  # the bias picks token 0; log-probs are the model's, before it
    assert lps[0] == pytest.approx(0 - lse, abs=1e-6)
    assert [t for t, _ in lps[0].top] == [3, 2]
    assert [v for _, v in lps[0].top] == pytest.approx([3 - lse, 2 - lse], abs=1e-6)
    plain = sample(logits.clone(), [chunk(SamplingParams(logprobs=True, **GREEDY))])[1][0]
    assert not hasattr(plain, "top")


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_greedy_token_comes_first_among_top_logprobs_of_equal_value(k):
    """In bfloat16 two tokens' logits are often equal: argmax takes the lower id, and topk's order
    put the other first ("chosen 506, top [(5248, -0.84), (506, -0.84)]")."""
    vocab = 4096
    logits = torch.full((1, vocab), -5.0, dtype=torch.bfloat16)
    logits[0, [7, 900, 3000]] = 2.0  # three equal at the top
    logits[0, 11] = 1.0
    tokens, lps = sample(logits.clone(), [chunk(SamplingParams(top_logprobs=k, **GREEDY))])
    assert tokens == [7]
    assert [t for t, _ in lps[0].top] == [7, 900, 3000][:k]


@pytest.mark.parametrize("options", [dict(temperature=1e-300), dict(temperature=1.0, top_p=1e-300),
                                     dict(temperature=1.0, repetition_penalty=1e-300)],
                         ids=["temperature", "top_p", "repetition_penalty"])
@pytest.mark.parametrize("seed", [None, 7], ids=["unseeded", "seeded"])
def test_options_below_float32_keep_the_most_likely_token_and_spare_the_other_rows(options, seed):
    # Valid options whose float32 value is 0 (or overflows a logit to inf) left a row of NaN
    # probabilities; torch.multinomial then raised, and the engine failed every request of the step.
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    odd = chunk(SamplingParams(seed=seed, max_tokens=32, **options), prompt=[2, 3])
    if seed is not None:
        odd.generator = torch.Generator().manual_seed(seed)
    other = chunk(SamplingParams(temperature=0.5, max_tokens=32))
    tokens, _ = sample(logits.clone(), [odd, other])
    assert tokens[0] == 2  # the limit of those options: the most likely token
    assert tokens[1] in range(4)
    assert sample(logits.clone(), [chunk(SamplingParams(**GREEDY)), odd])[0] == [2, 0]
