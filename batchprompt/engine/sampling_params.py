"""SamplingParams: how one request picks its tokens and when it stops."""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

from ..structured.grammar import Grammar

#: Seeds are 64-bit signed integers, as in vLLM; torch's generator refuses what is beyond.
SEED_RANGE = (-2**63, 2**63 - 1)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding options, validated on creation.

    temperature 0 means greedy. `top_k` 0 (or -1, as in vLLM) and `top_p` 1 switch those
    filters off. With a `seed`, a request draws from its own random stream, so its output does
    not depend on what else shares the batch. Every number is checked here (type, NaN and
    infinity, range), so the engine, the batch API and jobs refuse the same values with the
    same message.
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        # NaN compares false with everything and inf passes ">= 0", so finiteness is its own test
        # (JSON's 1e400 parses as inf).
        _check(_is_finite(self.temperature) and self.temperature >= 0,
               f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_finite(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be a number in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1,
               f"top_k must be an integer >= 0 (0 or -1 = off), got {self.top_k!r}")
        _check(self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
               f"seed must be a 64-bit integer (from -2**63 to 2**63-1), got {self.seed!r}")
        # Plain Python numbers from here on (numpy scalars in, JSON-serialisable values out).
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "top_k", max(int(self.top_k), 0))
        object.__setattr__(self, "seed", None if self.seed is None else int(self.seed))
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        object.__setattr__(self, "score_choices", tuple(tuple(c) for c in self.score_choices))
        _check(all(self.score_choices), "score_choices must be non-empty token id lists")
        _check(not (self.grammar is not None and self.score_choices),
               "give either a grammar or score_choices, not both")
        _check(self.prompt_logprobs_from is None or self.prompt_logprobs_from >= 1,
               "prompt_logprobs_from must be >= 1 (the first token has no log-prob)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_finite(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)

