"""What the batch API hands back: one Result per prompt."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Result:
    """One prompt's answer. `str(result)` is its text; a failed item has `error` set.

    With structured output: `parsed` holds the JSON value (or the pydantic instance) of a
    json_schema / response_format call; `choice_probs` the probability of every label of a
    `choices` call scored by log-likelihood (choice_mode="score")."""

    index: int
    text: str = ""
    finish_reason: str = "error"  # "stop", "length", "cancelled" or "error"
    usage: Usage = field(default_factory=Usage)
    error: str | None = None
    logprobs: list[float] | None = None
    # per position, the most likely tokens and their log-probs (top_logprobs=k), else None
    top_logprobs: list[list[tuple[int, float]]] | None = field(default=None, repr=False)
    token_ids: list[int] = field(default_factory=list, repr=False)
    parsed: Any = None
    choice_probs: dict[str, float] | None = None
    # The prompt did not fail on its own account: its backend stopped, or no endpoint of a pool
    # answered for `give_up_after` seconds. Sent again, it may well succeed.
    retryable: bool = False
    # The stop string or stop token id that ended the text (as vLLM's stop_reason); None when
    # EOS, max_tokens or anything else ended it.
    stop_reason: str | int | None = None
    # The prompt's tokens, and (where asked: a completion's echo with logprobs) the log-prob of
    # each after the first, and their top ones.
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)
    prompt_logprobs: list[float] | None = field(default=None, repr=False)
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = field(default=None, repr=False)
    prompt_ranks: list[int] | None = field(default=None, repr=False)  # vLLM's prompt_logprobs: each token's rank

    @property
    def ok(self) -> bool:
        return self.error is None

    def __str__(self) -> str:
        return self.text


class BatchError(Exception):
    """Raised by `errors="raise"` once every other item has finished; carries all results."""

    def __init__(self, results: list[Result]):
        self.results = results
        self.failed = [r for r in results if r is not None and not r.ok and r.finish_reason != "cancelled"]
        indices = [r.index for r in self.failed]
        listed = f"{indices[:20]}{'...' if len(indices) > 20 else ''}"
        shown = "; ".join(f"[{r.index}] {r.error}" for r in self.failed[:3])
        more = f" (and {len(self.failed) - 3} more)" if len(self.failed) > 3 else ""
        super().__init__(f"{len(self.failed)} of {len(results)} prompts failed, at indices "
                         f"{listed}: {shown}{more}")


class SessionDestroyedError(RuntimeError):
    pass


class EngineStoppedError(RuntimeError):
    """The engine behind a session was shut down, or its thread failed; its message says which.
    A new session (or the next `batch_prompt`) starts a fresh engine."""
