"""Between the batch API and the engine: a prompt prepared for the engine, an engine output
turned into a Result, and what errors="raise" raises."""
from __future__ import annotations

from dataclasses import dataclass

from ..engine import RequestOutput, SamplingParams
from .result import BatchError, Result, Usage
from .structured import OutputSpec


@dataclass(frozen=True)
class Prepared:
    """A prompt turned into token ids, or the reason it could not be."""

    index: int
    token_ids: list[int] | None
    params: SamplingParams
    error: str | None = None
    spec: OutputSpec | None = None  # structured output: checks and parses the result


def to_result(index: int, out: RequestOutput, spec: OutputSpec | None = None, asked_stop: bool = False,
              max_tokens: int | None = None) -> Result:
    """`asked_stop`: the request gave stop strings or stop token ids (which may end a structured
    output before it is complete; see OutputSpec.finish); `max_tokens`: what it allowed."""
    cancelled = out.finish_reason == "abort"
    result = Result(
        index=index, text=out.text,
        finish_reason="cancelled" if cancelled else out.finish_reason,
        usage=Usage(len(out.prompt_token_ids), len(out.output_token_ids), out.num_cached_tokens),
        error=(out.error or "cancelled before it finished") if cancelled else out.error,
        logprobs=out.logprobs, top_logprobs=out.top_logprobs, token_ids=out.output_token_ids,
        retryable=out.retryable, stop_reason=out.stop_reason, prompt_token_ids=list(out.prompt_token_ids),
        prompt_logprobs=out.prompt_logprobs, prompt_top_logprobs=out.prompt_top_logprobs,
        prompt_ranks=out.prompt_ranks,
    )
    if spec is None:
        return result
    return spec.finish(result, out.choice_logprobs, out.grammar_complete, asked_stop, max_tokens)


def check_errors(results: list[Result], errors: str) -> list[Result]:
    if errors not in ("return", "raise"):
        raise ValueError(f"errors must be 'return' (failed items carry .error) or 'raise', got {errors!r}")
    if errors == "raise" and any(r.error is not None and r.finish_reason != "cancelled" for r in results):
        raise BatchError(results)
    return results
