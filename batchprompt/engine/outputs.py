"""What the engine hands back for a finished request."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

# ScheduledChunk, SchedulerOutput and ModelRunnerOutput live in batchprompt/steps.py (a leaf that
# both the engine and the runner import); re-exported for code that imported them from here.
from ..steps import ModelRunnerOutput, ScheduledChunk, SchedulerOutput  # noqa: F401


class CompletionOutput(NamedTuple):
    """One sample of a request, in the shape of vLLM's CompletionOutput (`out.outputs[0].text`),
    for code written against vLLM's LLM.generate. `logprobs`: the chosen tokens' log-probs, a
    float each (vLLM gives a dict per position), where asked."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[float] | None
    finish_reason: str
    stop_reason: str | int | None


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
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None  # the same positions' top ones (k asked)
    prompt_ranks: list[int] | None = None  # the same tokens' ranks in the vocabulary (params.prompt_ranks)
    choice_logprobs: list[float] | None = None  # scoring: each candidate's log-likelihood
    # params.top_logprobs > 0: at each position, (token id, log-prob) of the k most likely tokens.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # n / best_of: every returned sample (the fields above are samples[0]'s), in index order, or
    # with best_of by cumulative log-prob, highest first. None for a single-sample request.
    samples: list["RequestOutput"] | None = None
    # Not run to its end for a reason not its own (the backend stopped, no endpoint of a pool
    # answered): sent again, it may well succeed. A job journals no such request.
    retryable: bool = False
    # A constrained output (params.grammar) that is a whole match of its grammar: also one that
    # max_tokens cut where the grammar could end ("a+" cut after "aaaa"). False otherwise; None
    # from backends that cannot tell (a remote server).
    grammar_complete: bool | None = False
    # The stop string or stop token id that ended the output (vLLM's stop_reason); None where EOS,
    # max_tokens or anything else ended it.
    stop_reason: str | int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    # vLLM's RequestOutput reads: a finished request's samples as CompletionOutputs.
    @property
    def outputs(self) -> list[CompletionOutput]:
        return [CompletionOutput(i, s.text, list(s.output_token_ids),
                                 None if s.logprobs is None else sum(s.logprobs), s.logprobs, s.finish_reason,
                                 s.stop_reason)
                for i, s in enumerate(self.samples or [self])]

    @property
    def finished(self) -> bool:
        """Always true: the engine hands back finished requests only (vLLM's streaming outputs are
        `add_request`'s output_ids() here)."""
        return True
