"""Typed data handed between the engine's layers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .sampling_params import SamplingParams


@dataclass
class ScheduledChunk:
    """Tokens of one request that the runner computes this step."""

    request_id: str
    token_ids: list[int]  # the new tokens, starting at position `start`
    start: int  # tokens already in the cache for this request
    block_ids: list[int]  # the request's block table
    sample: bool  # the chunk reaches the request's last token: sample the next one
    params: SamplingParams
    generator: torch.Generator | None = None
    matcher: Any = None  # the request's grammar state: its token mask applies when sampling
    # Log-probs to compute inside this chunk: (offset of the predicting token, the target token).
    score_targets: list[tuple[int, int]] = field(default_factory=list)

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[str] = field(default_factory=list)
    num_blocks: int = 0  # blocks the pool holds; the runner's cache must be this big

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class ModelRunnerOutput:
    """One sampled token (and its log-probability, if asked) per chunk with `sample` set."""

    sampled: dict[str, int]
    logprobs: dict[str, float] = field(default_factory=dict)
    # Prompt-token log-probs asked through score_targets: request id -> [(token index, log-prob)].
    prompt_logprobs: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # For scoring requests: the log-prob of each candidate's first token after the prompt.
    choice_logprobs: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """A finished request, as the engine hands it back."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str  # "stop", "length", "abort" or "error"
    error: str | None = None
    logprobs: list[float] | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    prompt_logprobs: list[float] | None = None  # from params.prompt_logprobs_from on
    choice_logprobs: list[float] | None = None  # scoring: each candidate's log-likelihood

    @property
    def ok(self) -> bool:
        return self.error is None
