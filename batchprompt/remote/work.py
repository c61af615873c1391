"""The pool's queue: items waiting for an endpoint, per caller (source), and the sub-batches
cut from it.

A sub-batch is consecutive items of one source that share their sampling parameters (one
/v1/completions request has one set), cut to a token budget: prompt plus max_tokens per item.
Items sorted by prompt (the batch API's trie order) stay together, so a sub-batch's prompts
share their prefixes. Sources of a higher priority are served first; one pick in
`STARVATION_EVERY` goes to the others in turn, so bulk work still moves under interactive load.
Runs on the pool's loop thread only.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..backends.base import Item, Source
from ..engine import SamplingParams

STARVATION_EVERY = 8
LOOKAHEAD = 512  # items scanned past the head for ones with the same parameters


@dataclass(eq=False)
class Work:
    """One item on its way: where it came from, its cost, its tries."""

    item: Item
    source: Source
    params: SamplingParams  # the item's, max_tokens clamped to the context
    tokens: int  # prompt + max_tokens: what it may cost the endpoint
    attempts: int = 0  # failed tries so far
    failing_since: float | None = None  # time.monotonic() of its first failed try
    first_sent: float | None = None  # time.monotonic() its first try was sent (a failure's message)
    avoid: frozenset[int] = frozenset()  # the endpoints that failed it
    refused: str | None = None  # one endpoint's refusal of it (a 4xx): another is asked once before it fails
    cap: int | None = None  # after a split: the most prompts its sub-batch may hold
    answered: bool = False


@dataclass(eq=False)
class SubBatch:
    works: list[Work]
    source: Source
    params: SamplingParams
    tokens: int
    endpoint: object = None
    task: object = None
    started: float = 0.0
    twin: "SubBatch | None" = None  # a hedge: the same works sent to another endpoint; first answer wins
    superseded: bool = False  # its twin answered first: it was cancelled, its works are answered


@dataclass
class WorkQueue:
    _queues: dict[int, deque[Work]] = field(default_factory=dict)  # id(source) -> its works
    _sources: dict[int, Source] = field(default_factory=dict)
    _order: deque[int] = field(default_factory=deque)  # round-robin order of source ids
    _picks: int = 0  # sub-batches cut so far (every STARVATION_EVERY-th goes to a lower priority)
    queued: int = 0
    queued_tokens: int = 0

    def __bool__(self) -> bool:
        return self.queued > 0

    def add(self, works: list[Work], front: bool = False) -> None:
        """Queue works (of one source); `front`: before that source's others (a retry keeps its place)."""
        if not works:
            return
        source = works[0].source
        key = id(source)
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = deque()
            self._sources[key] = source
            self._order.append(key)
        if front:
            q.extendleft(reversed(works))
        else:
            q.extend(works)
        self.queued += len(works)
        self.queued_tokens += sum(w.tokens for w in works)

    def drop(self, source: Source) -> list[Work]:
        """Take every queued work of `source` out (a cancel)."""
        key = id(source)
        q = self._queues.pop(key, None)
        self._sources.pop(key, None)
        if key in self._order:
            self._order.remove(key)
        works = list(q or ())
        self.queued -= len(works)
        self.queued_tokens -= sum(w.tokens for w in works)
        return works

    def take_expired(self, since_before: float) -> list[Work]:
        """Take out the works that have been failing since before `since_before` (time.monotonic())."""
        out: list[Work] = []
        for q in self._queues.values():
            kept: list[Work] = []
            for w in q:
                (out if w.failing_since is not None and w.failing_since < since_before else kept).append(w)
            q.clear()
            q.extend(kept)
        self.queued -= len(out)
        self.queued_tokens -= sum(w.tokens for w in out)
        return out

    def drain(self) -> list[Work]:
        out = []
        for source in list(self._sources.values()):
            out += self.drop(source)
        return out

    def head(self) -> Work | None:
        """The next work to send (by priority, round-robin within a priority), left in place."""
        key = self._pick()
        return self._queues[key][0] if key is not None else None

    def _pick(self) -> int | None:
        while self._order:
            live = [k for k in self._order if self._queues.get(k)]
            for k in [k for k in self._order if not self._queues.get(k)]:
                self._order.remove(k)
                self._queues.pop(k, None)
                self._sources.pop(k, None)
            if not live:
                return None
            top = max(self._sources[k].priority for k in live)
            rest = [k for k in live if self._sources[k].priority != top]
            if rest and self._picks % STARVATION_EVERY == STARVATION_EVERY - 1:
                return rest[0]
            return next(k for k in live if self._sources[k].priority == top)
        return None

    def take(self, budget_tokens: int, max_prompts: int, endpoint: int | None = None) -> SubBatch | None:
        """Cut the next sub-batch: the head work, then works of its source with the same
        parameters, within `budget_tokens` and `max_prompts` (the head goes whatever its size).
        `endpoint`: the index of the endpoint it goes to; works that endpoint failed stay queued
        (the head's own were avoided in choosing it, but a retry that rode along with a fresh
        head went back to a server answering 500 to everything, and failed there again)."""
        key = self._pick()
        if key is None:
            return None
        q = self._queues[key]
        head = q.popleft()
        if head.cap is not None:
            max_prompts = min(max_prompts, head.cap)
        works, tokens, kept = [head], head.tokens, []
        scanned = 0
        while q and len(works) < max_prompts and scanned < LOOKAHEAD:
            w = q[0]
            if w.params != head.params or (endpoint is not None and endpoint in w.avoid):
                kept.append(q.popleft())
                scanned += 1
                continue
            if tokens + w.tokens > budget_tokens:
                break
            works.append(q.popleft())
            tokens += w.tokens
            scanned += 1
        q.extendleft(reversed(kept))
        # Round-robin: the source goes to the back of the order after its turn.
        self._order.remove(key)
        self._order.append(key)
        self._picks += 1
        self.queued -= len(works)
        self.queued_tokens -= tokens
        return SubBatch(works, head.source, head.params, tokens)
