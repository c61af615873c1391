"""SamplingParams: how one request picks its tokens and when it stops."""
from __future__ import annotations

from dataclasses import dataclass

from ..structured.grammar import Grammar


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding options, validated on creation.

    temperature 0 means greedy. `top_k` 0 and `top_p` 1 switch those filters off. With a
    `seed`, a request draws from its own random stream, so its output does not depend on what
    else shares the batch.
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
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        object.__setattr__(self, "score_choices", tuple(tuple(c) for c in self.score_choices))
        _check(all(self.score_choices), "score_choices must be non-empty token id lists")
        _check(not (self.grammar is not None and self.score_choices),
               "give either a grammar or score_choices, not both")
        _check(self.prompt_logprobs_from is None or self.prompt_logprobs_from >= 1,
               "prompt_logprobs_from must be >= 1 (the first token has no log-prob)")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)

