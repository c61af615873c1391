"""The data one engine step hands from the scheduler to the model runner and back.

A leaf module (it imports no other part of batchprompt at run time), as vLLM v1 keeps its
SchedulerOutput and ModelRunnerOutput: the engine imports the runner, and both import these,
so importing the runner alone never pulls in the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .engine.sampling_params import SamplingParams


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
    # Set by the engine only where params.adjusts_logits (penalties, logit_bias, min_tokens):
    # the request's token lists (not copies) and the tokens banned while under min_tokens.
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    banned_token_ids: tuple[int, ...] = ()

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[str] = field(default_factory=list)
    num_blocks: int = 0  # blocks the pool holds; the runner's cache must be this big
    # Requests admitted by this step -> their num_cached_tokens before, so that a step the
    # runner could not run can be undone (Scheduler.undo).
    admitted: dict[str, int] = field(default_factory=dict)

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
    # With params.prompt_top_logprobs k: request id -> [(token index, the k most likely (id, log-prob))].
    prompt_top: dict[str, list[tuple[int, list[tuple[int, float]]]]] = field(default_factory=dict)
    # With params.prompt_ranks: request id -> [(token index, that token's rank in the vocabulary)].
    prompt_ranks: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    # For scoring requests: the log-prob of each candidate's first token after the prompt.
    choice_logprobs: dict[str, list[float]] = field(default_factory=dict)
