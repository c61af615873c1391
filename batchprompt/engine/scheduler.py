"""Scheduler: which requests run this step, and how many tokens each.

One rule covers prefill, chunked prefill, prefix-cache hits and decode: every request has
`num_computed_tokens`, and each step gives it tokens to catch up with `num_tokens`, within a
per-step token budget. Running requests go first (oldest first); when the cache is full the
youngest running request is preempted (its blocks freed, recomputed later). Then waiting
requests are admitted while budget, sequence slots and memory last.
"""
from __future__ import annotations

from collections import deque

from ..steps import ScheduledChunk, SchedulerOutput
from .config import EngineConfig
from .kv_cache import KVCacheManager
from .limits import StepLimits
from .request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.limits = StepLimits(config)  # the config's ceilings, lowered after running out of memory
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request, front: bool = False) -> None:
        """Queue a request; `front` puts it ahead of the others (a scoring request's
        candidates, admitted while the prompt's blocks are still in the prefix cache)."""
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.limits.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        admitted: dict[str, int] = {}
        i = 0
        # Running requests past max_num_seqs (lowered after a step ran out of memory) wait.
        while i < len(self.running) and budget > 0 and len(chunks) < self.limits.max_num_seqs:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                chunks.append(self._chunk(req, n))
                budget -= n
                i += 1
                continue
            break
        if not preempted:
            self._admit(chunks, budget, admitted)
        return SchedulerOutput(chunks, preempted, self.kv.pool.num_blocks, admitted)

    def _admit(self, chunks: list[ScheduledChunk], budget: int, admitted: dict[str, int]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            req = self.waiting[0]
            hits = self.kv.find_cached_prefix(req)
            first = req.params.prompt_logprobs_from
            if first is not None:  # positions whose log-probs are asked must be computed
                hits = hits[:(first - 1) // self.kv.block_size]
            cached = len(hits) * self.kv.block_size
            n = min(req.num_tokens - cached, budget)
            if not self.kv.allocate(req, cached + n, hits, admitting=True):
                break
            self.waiting.popleft()
            admitted[req.request_id] = req.num_cached_tokens
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = cached
            self.running.append(req)
            chunks.append(self._chunk(req, n))
            budget -= n

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        self.kv.cache_full_blocks(req, start + n)
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=req.token_ids[start:start + n],
            start=start,
            block_ids=self.kv.block_ids(req.request_id),
            sample=start + n == req.num_tokens,
            params=req.params,
            generator=req.generator,
            matcher=req.matcher,
            score_targets=_score_targets(req, start, n),
        )

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def advance(self, out: SchedulerOutput) -> list[Request]:
        """After the runner ran `out`: count computed tokens.
        Returns the requests that reached their last token (they get a sampled token next)."""
        by_id = {r.request_id: r for r in self.running}
        sampled = []
        for chunk in out.chunks:
            req = by_id[chunk.request_id]
            req.num_computed_tokens += len(chunk.token_ids)
            if chunk.sample:
                sampled.append(req)
        return sampled

    def undo(self, out: SchedulerOutput) -> None:
        """The runner could not run `out`, and computed none of it: forget the blocks it
        registered in the prefix cache (their K/V were never written) and send the requests it
        admitted back to the front of the queue, in their order; running requests stay as they
        were. Scheduling again then builds the step anew."""
        by_id = {r.request_id: r for r in self.running}
        for chunk in reversed(out.chunks):
            req = by_id[chunk.request_id]
            self.kv.uncache_from(req, chunk.start)
            if req.request_id in out.admitted:
                self.running.remove(req)
                self.kv.free(req)
                req.status = RequestStatus.WAITING
                req.num_computed_tokens = 0
                req.num_cached_tokens = out.admitted[req.request_id]
                self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Remove a request wherever it is and free its blocks."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)


def _score_targets(req: Request, start: int, n: int) -> list[tuple[int, int]]:
    """Positions in this chunk whose next token is a prompt token to score (prompt_logprobs_from)."""
    first = req.params.prompt_logprobs_from
    if first is None:
        return []
    lo, hi = max(start, first - 1), min(start + n, req.num_prompt_tokens - 1)
    return [(p - start, req.token_ids[p + 1]) for p in range(lo, hi)]
