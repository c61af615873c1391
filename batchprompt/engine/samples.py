"""n and best_of: one prompt, several samples, its prefill computed once.

A request with params.num_samples > 1 becomes a parent (never scheduled) and one child
request per sample, queued one after another. The scheduler registers a chunk's full blocks
in the prefix cache as soon as it is scheduled, so the children after the first find the
prompt's blocks cached (even in the same step) and compute only its last, partial block.
When every child is done, the parent comes back as one RequestOutput whose `samples` are the
n returned (with best_of, the n with the highest cumulative log-prob, as in vLLM).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from .outputs import RequestOutput
from ..steps import ScheduledChunk
from .request import Request
from .sampling_params import SamplingParams


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index`'s parameters: one sequence; with a seed, seed + index (so the samples
    differ yet each is reproducible); log-probs computed where best_of ranks by them."""
    seed = None if params.seed is None else params.seed + index
    rank = params.best_of is not None and params.best_of > params.n
    return replace(params, n=1, best_of=None, seed=seed, logprobs=params.logprobs or rank)


class SampleGroups:
    """The engine's parents with samples still running, and the collection of their outputs."""

    def __init__(self) -> None:
        self.parents: dict[str, Request] = {}
        self.done: dict[str, list[RequestOutput | None]] = {}
        self.owner: dict[str, str] = {}  # sample request id -> its parent's id

    def add(self, parent: Request, children: list[Request]) -> None:
        self.parents[parent.request_id] = parent
        self.done[parent.request_id] = [None] * len(children)
        for c in children:
            c.sample_of = parent
            parent.pending_children.add(c.request_id)
            self.owner[c.request_id] = parent.request_id

    def discard(self, parent: Request) -> None:
        """Forget a parent whose adding failed part way (its samples are not running)."""
        self.parents.pop(parent.request_id, None)
        self.done.pop(parent.request_id, None)
        for cid in parent.pending_children:
            self.owner.pop(cid, None)
        parent.pending_children.clear()

    def collect(self, outputs: list[RequestOutput], requests: dict[str, Request],
                drop: Callable[[Request], None]) -> list[RequestOutput]:
        """Outputs of a step with the samples' outputs gathered into their parent's (emitted
        once every sample is done). A failed sample fails its request: the other samples are
        dropped with `drop`; those that finished in the same step are discarded."""
        result = []
        for out in outputs:
            parent_id = self.owner.pop(out.request_id, None)
            if parent_id is None:
                if out.request_id in self.parents:  # the parent itself, aborted: forget it
                    self._forget(out.request_id, requests, drop)
                result.append(out)
                continue
            if parent_id not in self.parents:  # its request failed already
                continue
            parent = self.parents[parent_id]
            self.done[parent_id][sample_index(out.request_id)] = out
            parent.pending_children.discard(out.request_id)
            if out.error is not None or out.finish_reason == "abort":
                self._forget(parent_id, requests, drop)
                result.append(replace(out, request_id=parent_id, output_token_ids=[], text="",
                                      logprobs=None, top_logprobs=None, samples=None))
            elif not parent.pending_children:
                result.append(self._merge(parent, self.done[parent_id]))
                self._forget(parent_id, requests, drop)
        return result

    def _forget(self, parent_id: str, requests: dict[str, Request], drop: Callable[[Request], None]) -> None:
        parent = self.parents.pop(parent_id)
        self.done.pop(parent_id)
        for cid in parent.pending_children:
            child = requests.pop(cid, None)
            if child is not None:  # still running: stop it. Otherwise its output is on its way.
                drop(child)
                self.owner.pop(cid, None)
        parent.pending_children.clear()
        requests.pop(parent_id, None)

    @staticmethod
    def _merge(parent: Request, outs: list[RequestOutput | None]) -> RequestOutput:
        p = parent.params
        samples = [o for o in outs if o is not None]
        if p.best_of is not None and p.best_of > p.n:
            samples.sort(key=lambda o: sum(o.logprobs or ()), reverse=True)
        samples = samples[:p.n]
        if not p.logprobs:  # computed only to rank them
            samples = [replace(o, logprobs=None) for o in samples]
        samples = [replace(o, request_id=sample_id(parent.request_id, i)) for i, o in enumerate(samples)]
        first = samples[0]
        # The prompt's cost is the first sample's: the others read its blocks from the cache.
        return replace(first, request_id=parent.request_id, num_cached_tokens=outs[0].num_cached_tokens,
                       samples=samples)


def sample_id(parent_id: str, index: int) -> str:
    return f"{parent_id}#s{index}"


def sample_index(sample_request_id: str) -> int:
    return int(sample_request_id.rpartition("#s")[2])


def attach_sampling_state(chunks: list[ScheduledChunk], requests: dict[str, Request],
                          eos_token_ids: frozenset[int]) -> None:
    """Give the chunks whose rows adjust logits what the sampler needs: the request's tokens
    (penalties) and, while under min_tokens, the tokens it must not pick (EOS, stop tokens)."""
    for c in chunks:
        p = c.params
        if not (c.sample and p.adjusts_logits):
            continue
        req = requests[c.request_id]
        c.prompt_token_ids, c.output_token_ids = req.prompt_token_ids, req.output_token_ids
        if len(req.output_token_ids) < p.min_tokens:
            eos = () if p.ignore_eos else tuple(eos_token_ids)
            c.banned_token_ids = tuple(sorted(set(eos) | set(p.stop_token_ids)))


def prompt_ids_problem(ids, vocab_size: int) -> str | None:
    """What the engine cannot run in a prompt's token ids: ids outside the vocabulary."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        return f"the prompt has token ids outside the vocabulary [0, {vocab_size})"
    return None


def sampling_problem(params: SamplingParams, vocab_size: int) -> str | None:
    """What the engine cannot run in these parameters (token ids outside the vocabulary)."""
    for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
        bad = sorted(t for t in ids if not 0 <= t < vocab_size)
        if bad:  # the message starts with the field: the server's error names it in `param`
            return (f"{name} names token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}; use ids of "
                    f"this model's tokenizer")
    return None
