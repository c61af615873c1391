"""Choice scoring: each candidate continuation's log-likelihood after a prompt.

The prompt runs once as a request of its own; its last position gives every candidate's
first-token log-prob. A candidate longer than one token goes on as a child request (the prompt
plus the candidate) that computes only prompt log-probs, queued first so that the prompt's
blocks, just computed and in the prefix cache, are reused rather than recomputed. The parent
finishes with the most likely candidate once every child has added its score.
"""
from __future__ import annotations

from .request import Request, RequestStatus
from .sampling_params import SamplingParams


def start_scoring(req: Request, first: list[float]) -> list[Request]:
    """`req`'s prompt is in, and `first` holds each candidate's first-token log-prob. Returns
    the child requests to queue (none: every candidate is scored already)."""
    req.status = RequestStatus.SCORING
    req.choice_logprobs = list(first)
    start = req.num_prompt_tokens + 1  # the first candidate token is scored already
    children = []
    for i, cand in enumerate(req.params.score_choices):
        if len(cand) == 1:
            continue
        child = Request(f"{req.request_id}#{i}", req.prompt_token_ids + list(cand),
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs_from=start),
                        parent=req, choice_index=i, priority=req.priority, promoted=req.promoted)
        req.pending_children.add(child.request_id)
        children.append(child)
    return children


def add_candidate_score(child: Request) -> Request:
    """A child's prompt log-probs are in: add its candidate's score to the parent (returned)."""
    parent = child.parent
    expected = range(parent.num_prompt_tokens + 1, child.num_prompt_tokens)
    parent.choice_logprobs[child.choice_index] += sum(child.prompt_logprobs[p] for p in expected)
    parent.pending_children.discard(child.request_id)
    return parent


def choose_best(req: Request) -> None:
    """Every candidate is scored: the most likely one becomes the request's output."""
    scores = req.choice_logprobs
    best = max(range(len(scores)), key=scores.__getitem__)
    req.output_token_ids = list(req.params.score_choices[best])
    req.finish("stop")
