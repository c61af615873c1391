"""Batch: a set of prompts whose results stream back as they complete.

    batch = lm.create_batch(prompts)
    batch.on_result(lambda index, result: ...)      # completion order, on a callback thread
    batch.on_complete(lambda results: ...)          # once, results in input order
    batch.start(); results = batch.wait()
    for index, result in lm.create_batch(prompts): ...         # as completed
    async for index, result in lm.create_batch(prompts): ...   # the same, in asyncio
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator

from ..engine import RequestOutput, SamplingParams
from .result import BatchError, Result, Usage
from .service import EngineService, Item, Source
from .structured import OutputSpec


@dataclass(frozen=True)
class Progress:
    done: int
    total: int
    failed: int
    completion_tokens: int
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far; None before the first result."""
        if not self.done:
            return None
        return self.elapsed_s / self.done * (self.total - self.done)

    def __str__(self) -> str:
        eta = "?" if self.eta_s is None else f"{self.eta_s:.0f}s"
        return (f"{self.done}/{self.total} done ({self.failed} failed), "
                f"{self.tokens_per_s:,.0f} tok/s, ETA {eta}")


@dataclass(frozen=True)
class Prepared:
    """A prompt turned into token ids, or the reason it could not be."""

    index: int
    token_ids: list[int] | None
    params: SamplingParams
    error: str | None = None
    spec: OutputSpec | None = None  # structured output: checks and parses the result


def to_result(index: int, out: RequestOutput, spec: OutputSpec | None = None) -> Result:
    cancelled = out.finish_reason == "abort"
    result = Result(
        index=index, text=out.text,
        finish_reason="cancelled" if cancelled else out.finish_reason,
        usage=Usage(len(out.prompt_token_ids), len(out.output_token_ids), out.num_cached_tokens),
        error="cancelled before it finished" if cancelled else out.error,
        logprobs=out.logprobs, token_ids=out.output_token_ids,
    )
    return spec.finish(result, out.choice_logprobs) if spec is not None else result


class Batch:
    def __init__(self, service: EngineService, prepared: list[Prepared], progress: bool = False,
                 group_by_prefix: bool = True):
        self._service = service
        self._prepared = prepared
        self.total = len(prepared)
        self._group = group_by_prefix
        self._show_progress = progress
        self._lock = threading.Lock()
        self._results: list[Result | None] = [None] * self.total
        self._order: list[int] = []  # indices in completion order
        self._failed = self._tokens = 0
        self._subscribers: list[Callable[[int, Result], None]] = []
        self._on_result: list[Callable[[int, Result], None]] = []
        self._on_complete: list[Callable[[list[Result]], None]] = []
        self._done = threading.Event()
        self._start_lock = threading.Lock()  # start() and cancel() do not interleave
        self._source: Source | None = None
        self._started_at: float | None = None
        self._finished_at: float | None = None
        self._bar = None

    # ---- set-up ---------------------------------------------------------------------------
    def on_result(self, fn: Callable[[int, Result], None]) -> "Batch":
        """Call `fn(index, result)` for each result as it completes (on a callback thread)."""
        self._on_result.append(fn)
        return self

    def on_complete(self, fn: Callable[[list[Result]], None]) -> "Batch":
        """Call `fn(results)` once, when all are done, with the results in input order."""
        self._on_complete.append(fn)
        return self

    def start(self) -> "Batch":
        with self._start_lock:
            if self._started_at is None:
                self._start()
        return self

    def _start(self) -> None:
        self._started_at = time.monotonic()
        if self._show_progress:
            from tqdm import tqdm
            self._bar = tqdm(total=self.total, unit="prompt", dynamic_ncols=True, smoothing=0.1)
        source = Source()
        order = [p for p in self._prepared if p.token_ids is not None]
        if self._group and len(order) > 1:
            # Prompts that share a prefix go to the engine together, so the prefix is computed
            # once and is still cached while its group runs (a trie order of the token ids).
            order.sort(key=lambda p: p.token_ids)
        for p in order:
            source.items.append(Item(p.token_ids, p.params, self._handler(p.index, p.spec)))
        self._source = source
        for p in self._prepared:
            if p.token_ids is None:
                self._deliver(Result(index=p.index, error=p.error))
        if self.total == 0:
            self._complete()
        elif source.items:
            self._service.submit(source)

    def _handler(self, index: int, spec: OutputSpec | None) -> Callable[[RequestOutput], None]:
        return lambda out: self._deliver(to_result(index, out, spec))

    # ---- results --------------------------------------------------------------------------
    def _deliver(self, result: Result) -> None:
        with self._lock:
            if self._results[result.index] is not None:
                return
            self._results[result.index] = result
            self._order.append(result.index)
            self._failed += result.error is not None
            self._tokens += result.usage.completion_tokens
            complete = len(self._order) == self.total
            subscribers = list(self._subscribers)
        for fn in subscribers:
            fn(result.index, result)
        for fn in self._on_result:
            self._service.dispatch(fn, result.index, result)
        if self._bar is not None:
            self._bar.update(1)
            if self._failed:
                self._bar.set_postfix(failed=self._failed, refresh=False)
        if complete:
            self._complete()

    def _complete(self) -> None:
        self._finished_at = time.monotonic()
        if self._bar is not None:
            self._bar.close()
        results = list(self._results)
        for fn in self._on_complete:
            self._service.dispatch(fn, results)
        self._done.set()

    def cancel(self) -> None:
        """Stop what has not finished (those results say 'cancelled'); keep what has."""
        with self._start_lock:
            if self._started_at is None:
                self._cancel_unstarted()
        if self._source.cancelled:
            return
        def on_pending(item: Item) -> None:
            item.on_done(RequestOutput("", item.token_ids, [], "", "abort"))
        self._service.cancel(self._source, on_pending).result()

    def _cancel_unstarted(self) -> None:
        self._started_at = time.monotonic()
        self._source = Source(cancelled=True)
        for p in self._prepared:
            self._deliver(Result(index=p.index, finish_reason="cancelled", error="cancelled before it started"))
        if self.total == 0:
            self._complete()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def progress(self) -> Progress:
        with self._lock:
            end = self._finished_at or time.monotonic()
            elapsed = end - self._started_at if self._started_at else 0.0
            return Progress(len(self._order), self.total, self._failed, self._tokens, elapsed)

    @property
    def results(self) -> list[Result | None]:
        """Results so far, in input order (None where not finished)."""
        with self._lock:
            return list(self._results)

    def wait(self, timeout: float | None = None, errors: str = "return") -> list[Result]:
        """Start if needed, block until every result is in, return them in input order.
        errors="raise" raises BatchError (naming the failed indices) instead, if any failed."""
        self.start()
        if not self._done.wait(timeout):
            raise TimeoutError(f"the batch did not finish within {timeout}s ({self.progress})")
        return check_errors(list(self._results), errors)

    async def wait_async(self, errors: str = "return") -> list[Result]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.on_complete(lambda results: loop.call_soon_threadsafe(_set, fut, results))
        self.start()
        if self._done.is_set() and not fut.done():
            fut.set_result(list(self._results))
        return check_errors(await fut, errors)

    # ---- iteration, as completed ----------------------------------------------------------
    def _subscribe(self, fn: Callable[[int, Result], None]) -> list[int]:
        with self._lock:
            self._subscribers.append(fn)
            return list(self._order)

    def __iter__(self) -> Iterator[tuple[int, Result]]:
        q: queue.SimpleQueue = queue.SimpleQueue()
        seen = self._subscribe(lambda i, r: q.put((i, r)))
        self.start()
        for i in seen:
            yield i, self._results[i]
        for _ in range(self.total - len(seen)):
            yield q.get()

    async def __aiter__(self) -> AsyncIterator[tuple[int, Result]]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        seen = self._subscribe(lambda i, r: loop.call_soon_threadsafe(q.put_nowait, (i, r)))
        self.start()
        for i in seen:
            yield i, self._results[i]
        for _ in range(self.total - len(seen)):
            yield await q.get()

    def __len__(self) -> int:
        return self.total


def _set(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def check_errors(results: list[Result], errors: str) -> list[Result]:
    if errors not in ("return", "raise"):
        raise ValueError(f"errors must be 'return' (failed items carry .error) or 'raise', got {errors!r}")
    if errors == "raise" and any(r.error is not None and r.finish_reason != "cancelled" for r in results):
        raise BatchError(results)
    return results
