"""SamplingParams: how one request picks its tokens and when it stops."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from numbers import Integral, Real

from ..structured.grammar import Grammar

#: Seeds are 64-bit signed integers, as in vLLM; torch's generator refuses what is beyond.
SEED_RANGE = (-2**63, 2**63 - 1)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on the top tokens returned per position


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding options, validated on creation.

    The defaults are vLLM's (temperature 1.0, max_tokens 16); the batch API and `batchprompt
    run` choose greedy and 256 tokens instead (see GenerationOptions).

    temperature 0 means greedy. `top_k` 0 (or -1, as in vLLM) and `top_p` 1 switch those
    filters off. With a `seed`, a request draws from its own random stream, so its output does
    not depend on what else shares the batch. Every number is checked here (type, NaN and
    infinity, range), so the engine, the batch API and jobs refuse the same values with the
    same message.

    Logit adjustments, with vLLM's and OpenAI's meanings and ranges: `presence_penalty` and
    `frequency_penalty` (-2..2) subtract `presence * (count > 0) + frequency * count` from each
    token's logit, counting the tokens generated so far; `repetition_penalty` (> 0, 1 = off)
    divides the positive logits (multiplies the negative ones) of every token already in the
    prompt or the output; `logit_bias` ({token id: -100..100}; JSON's string keys accepted) is
    added to the logits; `min_tokens` suppresses EOS and `stop_token_ids` (and stop strings)
    until that many tokens are out; `min_p` (0..1) drops tokens whose probability is below
    `min_p` times the most likely one's. Rows that use none of them pay nothing.

    `top_logprobs` (0..20) returns the k most likely tokens and their log-probs at each
    position (it implies `logprobs`); `logprobs=k` (an int, as in vLLM) is `top_logprobs=k`. `include_stop_str_in_output` keeps a matched stop string
    in the text. `n` samples per prompt share one prefill (through the prefix cache); with
    `best_of`, that many are generated and the `n` with the highest cumulative log-prob are
    returned, as in vLLM.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    grammar: Grammar | None = None
    score_choices: tuple[tuple[int, ...], ...] = ()
    prompt_logprobs_from: int | None = None
    prompt_top_logprobs: int = 0  # with prompt_logprobs_from: the k most likely tokens at each of those positions
    prompt_ranks: bool = False  # with prompt_logprobs_from: each of those tokens' rank in the vocabulary (1: likeliest)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: Mapping[int, float] | None = None
    top_logprobs: int = 0
    include_stop_str_in_output: bool = False
    n: int = 1
    best_of: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.logprobs, bool):  # vLLM's logprobs=N: the sampled token's and the top N
            _check(_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                   f"logprobs must be True, False or an integer from 0 to {MAX_TOP_LOGPROBS} (vLLM's top-N), "
                   f"got {self.logprobs!r}")
            _check(not self.top_logprobs or self.top_logprobs == self.logprobs,
                   f"give logprobs={self.logprobs} (vLLM's top-N) or top_logprobs={self.top_logprobs}, not both")
            object.__setattr__(self, "top_logprobs", int(self.logprobs))
            object.__setattr__(self, "logprobs", True)
        if self.stop == "":  # shown as given (it said "got ['']")
            raise ValueError("stop is an empty string: leave stop out, or give strings of one character or more")
        if self.stop is None or isinstance(self.stop, str):  # None: OpenAI's null
            object.__setattr__(self, "stop", () if self.stop is None else (self.stop,))
        _check(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop),
               lambda: f"stop must be a string or a list of strings, got {self.stop!r:.200}")
        object.__setattr__(self, "stop", tuple(self.stop))
        _check(isinstance(self.stop_token_ids, (list, tuple))
               and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               lambda: f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r:.200}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for name in ("ignore_eos", "include_stop_str_in_output"):  # "no" was taken as true
            _check(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        _check(self.max_tokens is not None, "max_tokens must be an integer >= 1, got None: vLLM's None (up to the "
               "end of the context) is not taken here; give a number (a request stops at the context's end anyway)")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        # NaN compares false with everything and inf passes ">= 0", so finiteness is its own test
        # (JSON's 1e400 parses as inf).
        _check(_is_finite(self.temperature) and self.temperature >= 0,
               f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_finite(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be a number in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1,
               f"top_k must be an integer >= -1 (0 or -1 = off), got {self.top_k!r}")
        _check(self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
               f"seed must be a 64-bit integer (from -2**63 to 2**63-1), got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_finite(v) and -2 <= v <= 2, f"{name} must be a number from -2 to 2, got {v!r}")
        _check(_is_finite(self.repetition_penalty) and self.repetition_penalty > 0,
               f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}")
        _check(_is_finite(self.min_p) and 0 <= self.min_p <= 1,
               f"min_p must be a number from 0 to 1, got {self.min_p!r}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer from 0 to max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        _check(_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
               f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}")
        _check(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(self.best_of is None or (_is_int(self.best_of) and self.best_of >= self.n),
               f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        # Greedy samples are all the same one: best_of would run best_of times for it (vLLM refuses it too).
        _check(self.best_of is None or self.best_of <= self.n or self.temperature > 0,
               f"best_of {self.best_of} with temperature 0 (greedy) computes {self.best_of} identical samples: "
               f"set a temperature > 0, or leave out best_of")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        # Plain Python numbers from here on (numpy scalars in, JSON-serialisable values out).
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        # A top_k at least the vocabulary keeps every token: as off (a larger number than the
        # sampler's tensors hold, 1e30 from JSON, must not fail the step it runs in).
        object.__setattr__(self, "top_k", max(int(self.top_k), 0) if self.top_k < TOP_K_ALL else 0)
        # -1 is no seed, as vLLM reads it (its SamplingParams: "if self.seed == -1: self.seed = None").
        object.__setattr__(self, "seed", None if self.seed is None or self.seed == -1 else int(self.seed))
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("min_tokens", "top_logprobs", "n"):
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "best_of", None if self.best_of is None else int(self.best_of))
        if self.top_logprobs:
            object.__setattr__(self, "logprobs", True)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(self.stop)!r}: leave stop out, "
                             f"or give strings of one character or more")
        object.__setattr__(self, "score_choices", tuple(tuple(c) for c in self.score_choices))
        _check(all(self.score_choices), "score_choices must be non-empty token id lists")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):  # a dict failed in add_request
            raise TypeError(f"grammar must be a batchprompt Grammar (Grammar.regex(...), Grammar.json_schema(...), "
                            f"Grammar.choices(...), Grammar.lark(...)), got a {type(self.grammar).__name__}")
        _check(not (self.grammar is not None and self.score_choices),
               "give either a grammar or score_choices, not both")
        _check(self.prompt_logprobs_from is None or self.prompt_logprobs_from >= 1,
               "prompt_logprobs_from must be >= 1 (the first token has no log-prob)")
        _check(_is_int(self.prompt_top_logprobs) and 0 <= self.prompt_top_logprobs <= MAX_TOP_LOGPROBS
               and (not self.prompt_top_logprobs or self.prompt_logprobs_from is not None),
               f"prompt_top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, with prompt_logprobs_from")
        _check(not self.prompt_ranks or self.prompt_logprobs_from is not None,
               "prompt_ranks needs prompt_logprobs_from")
        _check(not (self.score_choices and self.num_samples > 1),  # it named score_choices, a field of ours
               "n and best_of do not apply to choice_mode='score': each label's probability is computed once; "
               "leave them out, or use choice_mode='decode' to sample")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def num_samples(self) -> int:
        """How many sequences are generated for the prompt (best_of, else n)."""
        return self.best_of or self.n

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this row's logits before choosing (the others keep the
        fast path: greedy argmax on the model's dtype)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)


TOP_K_ALL = 2**31  # no vocabulary is this large


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_finite(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def _logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias} with int keys; JSON objects bring the ids as strings ("50256")."""
    if bias is None:
        return None
    items = bias.items() if isinstance(bias, Mapping) else bias
    out: dict[int, float] = {}
    try:
        pairs = list(items)
    except TypeError:
        pairs = None
    _check(pairs is not None, lambda: f"logit_bias must map token ids to numbers, got {bias!r:.200}")
    for pair in pairs:  # a list of numbers failed with a TypeError, read as a bug of batchprompt's
        _check(isinstance(pair, (tuple, list)) and len(pair) == 2,
               lambda: f"logit_bias must map token ids to numbers ({{\"50256\": -100}}), got {bias!r:.80}")
        key, value = pair
        tid = key
        if isinstance(key, str):
            tid = int(key) if key.strip().lstrip("-").isdigit() else None
        _check(_is_int(tid) and tid >= 0, lambda: f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        _check(_is_finite(value) and -100 <= value <= 100,
               lambda: f"logit_bias values must be numbers from -100 to 100, got {value!r} for token {key!r}")
        out[int(tid)] = float(value)
    return out or None


def _check(ok: bool, message: str | Callable[[], str]) -> None:
    """ValueError(message) unless ok. A message that quotes what was given is passed as a
    function, made only on failure: quoting a 49,152-entry logit_bias once per entry took a
    request minutes (the server's CPU with it)."""
    if not ok:
        raise ValueError(message() if callable(message) else message)

