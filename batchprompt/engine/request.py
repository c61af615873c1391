"""Request: one prompt's state as it moves through the scheduler."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SCORING = "scoring"  # prompt done; waiting for its candidates' log-likelihoods
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    # Priority class: higher is admitted first and preempted last (see scheduler.py).
    priority: int = 0
    # Set by the scheduler when its class starved: then ahead of every class until it finishes.
    promoted: bool = False
    by_driver: bool = False  # added on the thread of a service that steps the engine (engine.driver)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    num_preemptions: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # params.top_logprobs > 0
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    error: str | None = None
    stop_text_len: int | None = None  # output text is cut here when a stop string or stop token ended it
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (vLLM's)
    # A stop string counts only where it ends past this many characters of the output text:
    # the text of the first min_tokens tokens (vLLM's rule).
    stop_floor: int = 0
    # The output text's characters searched for stop strings so far (a new token's text may be
    # long: "\n" and 23 spaces is one token, and a stop string in its start was missed).
    stop_scanned: int = 0
    first_token_time: float | None = None
    matcher: Any = None  # the grammar's state (llguidance LLMatcher) when params.grammar is set
    prompt_logprobs: dict[int, float] = field(default_factory=dict)  # prompt token index -> log-prob
    prompt_top: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # index -> its top (id, log-prob)
    prompt_ranks: dict[int, int] = field(default_factory=dict)  # prompt token index -> its rank (params.prompt_ranks)
    # Scoring (params.score_choices): each candidate's log-likelihood, filled as parts arrive.
    choice_logprobs: list[float] = field(default_factory=list)
    pending_children: set[str] = field(default_factory=set)
    parent: "Request | None" = None
    choice_index: int = -1  # which candidate a scoring child computes
    # n / best_of: the request the sample belongs to, and its index among the samples.
    sample_of: "Request | None" = None
    sample_index: int = -1

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)  # prompt + output, grows

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token: int, logprob: float | None) -> None:
        self.token_ids.append(token)
        self.output_token_ids.append(token)
        if logprob is not None:
            self.logprobs.append(float(logprob))
            top = getattr(logprob, "top", None)  # the sampler's Logprob when top_logprobs is asked
            if top is not None:
                self.top_logprobs.append(top)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
