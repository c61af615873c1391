"""Scheduler: which requests run this step, and how many tokens each.

One rule covers prefill, chunked prefill, prefix-cache hits and decode: every request has
`num_computed_tokens`, and each step gives it tokens to catch up with `num_tokens`, within a
per-step token budget. Running requests go first; when the cache is full the last running
request is preempted (its blocks freed, recomputed later). Then waiting requests are admitted
while budget, sequence slots and memory last.

Priority. A request's `priority` is its class, higher first (the server runs chat and
completion requests at 0, Batch API rows and background batches at -1). Its rank is
(promoted, priority), see waiting.py:

- Waiting requests are admitted by rank, first come first served within a rank; running
  requests keep the same order (a request joins after those of its rank or higher) and take
  their tokens in it. So the request preempted when memory runs short is the lowest-ranked,
  and of those the latest admitted.
- A waiting request that outranks the last running one and lacks a sequence slot or the KV
  blocks for its first chunk has lower-ranked running requests preempted for it (last first),
  before the step is built: a chat request never waits for a batch's rows to finish.
- Step time: while requests of more than one priority are in the engine, and for `hold_s`
  seconds after (a client's next request is likely to come), requests below the highest
  priority take only as many tokens a step as keep the step within
  `EngineConfig.priority_slowdown` times the time the higher ones would take alone, from the
  measured step times of each size (step_cost.py: a size never measured, or not for a
  minute, is measured by one step of the higher-priority tokens alone; before any step, an
  eighth of the token budget). On a GPU that limit is rarely reached; on a CPU it is what
  keeps a chat request fast beside a batch, at the batch's expense while chat requests run.
- Steps inside a step (with a caller that pauses long steps, see LLMEngine.step): while the
  lower classes have the tokens for a long step, `schedule(defer=top)` leaves the top class
  out of it, and `schedule_inside` builds the steps that run at its pauses: only requests that
  outrank all of the paused step, free blocks only, no preemption.
- No starvation: a class that has requests in the engine but got no token for
  `max_starved_steps` steps in a row while a higher class did has its oldest request
  promoted: it ranks above every class (admitted first, preempted last, never limited) until
  it finishes. A class thus finishes a request at least every `max_starved_steps` steps plus
  that request's own, however many higher-priority requests keep coming.

With every request at one priority (or `priority_scheduling` off) this is the first-come
scheduler with preemption of the youngest that it was before priorities.
"""
from __future__ import annotations

import itertools
import time

from ..steps import ScheduledChunk, SchedulerOutput
from .config import EngineConfig
from .kv_cache import KVCacheManager
from .limits import StepLimits
from .request import Request, RequestStatus
from .step_cost import StepCost
from .waiting import WaitingQueue, rank


class Scheduler:
    hold_s = 1.0  # how long steps stay limited after requests of a higher priority left

    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.limits = StepLimits(config)  # the config's ceilings, lowered after running out of memory
        self.kv = kv
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # by rank, then in the order admitted
        self.num_preemptions = 0
        self.num_promotions = 0
        self.slowdown = config.priority_slowdown
        self.max_starved_steps = config.max_starved_steps
        self.cost = StepCost()  # the engine reports every step's tokens and time
        self.clock = time.monotonic
        self._top: int | None = None  # the highest priority while priorities were mixed ...
        self._mixed_at = 0.0  # ... and when they last were
        self._starved: dict[int, int] = {}  # priority -> steps in a row it got no token

    def add(self, request: Request, front: bool = False) -> None:
        """Queue a request; `front` puts it ahead of the others of its rank (a scoring
        request's candidates, admitted while the prompt's blocks are still in the prefix cache)."""
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, defer: int | None = None) -> SchedulerOutput:
        """The next step. `defer` (see `deferrable`): leave the requests of that priority and
        higher out of it, unlimited lower ones in: the caller runs them inside the step."""
        present = self.waiting.priorities() | {r.priority for r in self.running}
        if defer is None:
            return self._schedule(present, None)
        taken = self.waiting.take_out(defer)
        try:
            return self._schedule(present, defer)
        finally:
            self.waiting.put_back(taken)

    def deferrable(self, min_s: float) -> int | None:
        """While priorities are mixed (and the step limit is on): the top priority, if the lower
        classes have the tokens for a step predicted to last `min_s` or more. A caller that
        runs steps inside long ones (LLMEngine.step with a pause) then leaves the top class out
        of the step and runs it inside, alone, at the step's first pause, instead of beside a
        few lower-class tokens in short steps."""
        present = self.waiting.priorities() | {r.priority for r in self.running}
        if self.slowdown is None or len(present) < 2:
            return None
        top, budget, tokens = max(present), self.limits.max_num_batched_tokens, 0
        for req in itertools.chain(self.running, self.waiting):
            if _below(req, top):
                tokens += req.num_tokens - req.num_computed_tokens
                if tokens >= budget:
                    break
        seconds = self.cost.seconds(min(tokens, budget))
        return top if tokens and (seconds is None or seconds >= min_s) else None

    def _schedule(self, present: set[int], defer: int | None) -> SchedulerOutput:
        budget = self.limits.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = [] if defer is not None else self._make_room()
        admitted: dict[str, int] = {}
        top, low_left = (None, None) if defer is not None else self._lower_limit(present)
        served: set[int] = set()
        grown_over = None  # the highest rank preempted because a running request could not grow
        i = 0
        # Running requests past max_num_seqs (lowered after a step ran out of memory) wait.
        while i < len(self.running) and budget > 0 and len(chunks) < self.limits.max_num_seqs:
            req = self.running[i]
            if defer is not None and not _below(req, defer):
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            limited = low_left is not None and _below(req, top)
            if limited:  # so is every request after it: the order is by rank
                n = min(n, low_left)
                if n <= 0:
                    break
            while not self.kv.allocate(req, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                grown_over = max(grown_over or rank(victim), rank(victim))
                if victim is req:
                    break
            else:
                chunks.append(self._chunk(req, n))
                served.add(req.priority)
                budget -= n
                if limited:
                    low_left -= n
                i += 1
                continue
            break
        self._admit(chunks, budget, admitted, top, low_left, grown_over, served)
        # A deferred class is served too: inside the step.
        self._count_starved(present, served if defer is None else served | {defer})
        return SchedulerOutput(chunks, preempted, self.kv.pool.num_blocks, admitted)

    def schedule_inside(self, outer: SchedulerOutput) -> SchedulerOutput | None:
        """A step to run while `outer` is half computed (between its layers): the requests that
        outrank every request of `outer`, running or waiting, with free blocks only. Nothing of
        `outer` is touched: no preemption, and no prefix-cache hit on a block whose K/V `outer`
        is still writing. None when there is no such request, or no room for one."""
        inside = {c.request_id for c in outer.chunks}
        floor = max((rank(r) for r in self.running if r.request_id in inside), default=None)
        if floor is None:
            return None
        budget = self.limits.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for req in self.running:  # by rank: those above the floor come first
            if rank(req) <= floor or budget <= 0 or len(chunks) >= self.limits.max_num_seqs:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate(req, req.num_computed_tokens + n):
                break
            chunks.append(self._chunk(req, n))
            budget -= n
        admitted: dict[str, int] = {}
        # Slots: max_num_seqs bounds this step's rows; the running requests may exceed it for a
        # while (a full batch keeps every slot, and none of its requests can be preempted now).
        self._admit(chunks, budget, admitted, None, None, floor, set(),
                    unwritten=_unwritten(outer, self.kv.block_size), slots=len(self.running) + self.limits.max_num_seqs)
        if not chunks:
            return None
        return SchedulerOutput(chunks, [], self.kv.pool.num_blocks, admitted)

    def _admit(self, chunks: list[ScheduledChunk], budget: int, admitted: dict[str, int], top: int | None,
               low_left: int | None, grown_over: tuple[bool, int] | None, served: set[int],
               unwritten: frozenset[int] = frozenset(), slots: int | None = None) -> None:
        """Admit waiting requests in rank order, while fewer than `slots` requests run (default
        max_num_seqs) and the step has fewer than max_num_seqs chunks. After a running request
        could not grow (memory is short), only requests that outrank every one it preempted are
        admitted. A prefix hit stops at the first block in `unwritten` (its K/V are being
        computed)."""
        slots = self.limits.max_num_seqs if slots is None else slots
        while (self.waiting and budget > 0 and len(self.running) < slots
               and len(chunks) < self.limits.max_num_seqs):
            req = self.waiting[0]
            if grown_over is not None and rank(req) <= grown_over:
                break
            hits = self.kv.find_cached_prefix(req)
            if unwritten:
                hits = list(itertools.takewhile(lambda b: b.block_id not in unwritten, hits))
            first = req.params.prompt_logprobs_from
            if first is not None:  # positions whose log-probs are asked must be computed
                hits = hits[:(first - 1) // self.kv.block_size]
            cached = len(hits) * self.kv.block_size
            n = min(req.num_tokens - cached, budget)
            limited = low_left is not None and _below(req, top)
            if limited:
                n = min(n, low_left)
                if n <= 0:
                    break
            if not self.kv.allocate(req, cached + n, hits, admitting=True):
                break
            self.waiting.popleft()
            admitted[req.request_id] = req.num_cached_tokens
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = cached
            self._insert_running(req)
            chunks.append(self._chunk(req, n))
            served.add(req.priority)
            budget -= n
            if limited:
                low_left -= n

    def _insert_running(self, req: Request) -> None:
        """After the running requests of its rank or higher."""
        r, i = rank(req), len(self.running)
        while i > 0 and rank(self.running[i - 1]) < r:
            i -= 1
        self.running.insert(i, req)

    # ---- priorities -----------------------------------------------------------------------
    def _make_room(self) -> list[str]:
        """Preempt running requests ranked below the first waiting one (last first) until it
        has a sequence slot and the blocks for its first chunk beside what the running requests
        take this step. Before the step is built: nothing scheduled has to be undone."""
        if not self.waiting or not self.running or rank(self.running[-1]) >= rank(self.waiting[0]):
            return []
        head, preempted = self.waiting[0], []
        while self.running and rank(self.running[-1]) < rank(head) and not self._fits(head):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
        return preempted

    def _fits(self, head: Request) -> bool:
        if len(self.running) >= self.limits.max_num_seqs:
            return False
        budget, growth = self.limits.max_num_batched_tokens, 0
        for req in self.running:  # what the running requests take this step, in their order
            if budget <= 0:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            budget -= n
            growth += self.kv.blocks_to_grow(req, req.num_computed_tokens + n)
        hits = self.kv.find_cached_prefix(head)
        cached = len(hits) * self.kv.block_size
        n = min(head.num_tokens - cached, max(budget, 1))
        return self.kv.can_allocate(head, cached + n, hits, admitting=True, reserve=growth)

    def _lower_limit(self, present: set[int]) -> tuple[int | None, int | None]:
        """(top, tokens): requests below priority `top`, not promoted, may take `tokens` this
        step; (None, None): no limit."""
        if self.slowdown is None:
            return None, None
        now = self.clock()
        if len(present) > 1:
            self._top, self._mixed_at = max(present), now
        if self._top is None or now - self._mixed_at > self.hold_s:
            return None, None
        high = sum(min(r.num_tokens - r.num_computed_tokens, self.limits.max_num_batched_tokens)
                   for r in self.running if not _below(r, self._top))
        # With higher-priority tokens to run, a step may run them alone to measure their cost
        # (extra 0, once a minute per size class); with none (the hold after them), never.
        extra = self.cost.extra_tokens(self.slowdown, max(high, 1), measure=high > 0)
        if extra is None:
            extra = self.limits.max_num_batched_tokens // 8
        return self._top, extra if high > 0 else max(extra, 1)

    def _count_starved(self, present: set[int], served: set[int]) -> None:
        """Count the steps each class went without a token while a higher one got some; promote
        the oldest request of a class that reached max_starved_steps."""
        best = max(served, default=None)
        for p in list(self._starved):
            if p not in present:
                del self._starved[p]
        for p in present:
            if p in served or best is None or best < p:
                self._starved.pop(p, None)
                continue
            self._starved[p] = self._starved.get(p, 0) + 1
            if self._starved[p] >= self.max_starved_steps:
                del self._starved[p]
                self._promote(p)

    def _promote(self, priority: int) -> None:
        req = self.waiting.promote_first(priority)
        if req is None:  # its requests all run, but get no tokens: the oldest goes first
            req = next((r for r in self.running if r.priority == priority and not r.promoted), None)
            if req is None:
                return
            self.running.remove(req)
            req.promoted = True
            self._insert_running(req)
        self.num_promotions += 1

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


def _unwritten(out: SchedulerOutput, block_size: int) -> frozenset[int]:
    """The blocks `out` writes K/V into (its chunks' tokens), which the prefix cache may
    already list."""
    ids: set[int] = set()
    for c in out.chunks:
        ids.update(c.block_ids[c.start // block_size:-(-(c.start + len(c.token_ids)) // block_size)])
    return frozenset(ids)


def _score_targets(req: Request, start: int, n: int) -> list[tuple[int, int]]:
    """Positions in this chunk whose next token is a prompt token to score (prompt_logprobs_from)."""
    first = req.params.prompt_logprobs_from
    if first is None:
        return []
    lo, hi = max(start, first - 1), min(start + n, req.num_prompt_tokens - 1)
    return [(p - start, req.token_ids[p + 1]) for p in range(lo, hi)]


def _below(req: Request, top: int | None) -> bool:
    """Whether `req` is one whose tokens are limited while priorities are mixed."""
    return top is not None and not req.promoted and req.priority < top
