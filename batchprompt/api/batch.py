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
import copy
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable, Iterator, Sequence

from ..engine import RequestOutput, SamplingParams
from ..units import wait_seconds
from .callbacks import on_callback_thread
from .items import Prepared, check_errors, to_result
from .progress import Progress
from .result import EngineStoppedError, Result
from ..backends.base import INTERACTIVE, Backend, Item, Source

log = logging.getLogger("batchprompt")


class Batch:
    """Results come in on the engine thread; `on_result`/`on_complete` callbacks run on the
    service's callback thread. A batch is *finished* once every result is in and every callback
    of the batch has run: `wait()`, `wait_async()` and iteration end only then. A waiter that
    goes away (Ctrl-C in `wait()`, a cancelled task, leaving an iteration early) cancels what
    has not finished, so the engine does not go on computing answers nobody reads."""

    def __init__(self, service: Backend, prepared: list[Prepared], progress: bool = False,
                 group_by_prefix: bool = True, priority: int = INTERACTIVE):
        self._service = service
        self._priority = priority
        self._prepared = prepared
        self.total = len(prepared)
        self._group = group_by_prefix
        self._show_progress = progress
        self._lock = threading.Lock()  # results, callbacks, subscribers and waiters
        self._results: list[Result | None] = [None] * self.total
        self._order: list[int] = []  # indices in completion order
        self._failed = self._cancelled = self._tokens = 0
        self._subscribers: list[Callable[[int, Result], None]] = []
        self._on_result: list[Callable[[int, Result], None]] = []
        self._on_complete: list[Callable[[list[Result]], None]] = []
        # (fn, with the last, inline: ours, called on the engine's thread; else on the callback thread)
        self._on_tokens: list[tuple[Callable[..., None], bool, bool, bool]] = []  # fn, last, inline, logprobs
        self._dispatched = False  # a callback of this batch went to the callback thread
        self._completed = False  # every result is in and the on_complete callbacks are taken
        self._done = threading.Event()  # every result is in
        self._finished = threading.Event()  # ... and every callback of the batch has run
        self._waiters: list[Callable[[], None]] = []  # called once finished
        # start() and cancel() do not interleave; reentrant, because starting or cancelling
        # delivers results, and a subscriber whose event loop has closed cancels from there.
        self._start_lock = threading.RLock()
        self._source: Source | None = None
        self._cancelling: Future | None = None
        self._started_at: float | None = None
        self._finished_at: float | None = None
        self._bar = None
        # Why the batch was cancelled by its owner (the session destroyed): its unfinished results
        # say so, and a one-prompt call raises this error type instead of ValueError.
        self._cancel_reason: str | None = None
        self._cancel_error: type[Exception] | None = None

    # ---- set-up ---------------------------------------------------------------------------
    def on_result(self, fn: Callable[[int, Result], None]) -> "Batch":
        """Call `fn(index, result)` for each result as it completes (on a callback thread).
        Added after results came in, it is called for those at once, in completion order (as
        concurrent.futures calls a callback added to a finished future)."""
        _check_callable("on_result", fn)
        with self._lock:
            self._on_result.append(fn)
            earlier = [self._results[i] for i in self._order]
            self._dispatched |= bool(earlier)
        for result in earlier:
            self._service.dispatch(fn, result.index, result)
        return self

    def on_complete(self, fn: Callable[[list[Result]], None]) -> "Batch":
        """Call `fn(results)` once, when all are done, with the results in input order (at
        once, on the callback thread, if they already are)."""
        _check_callable("on_complete", fn)
        with self._lock:
            results = list(self._results) if self._completed else None
            if results is None:
                self._on_complete.append(fn)
        if results is not None:
            self._service.dispatch(fn, results)
        return self

    def on_tokens(self, fn: Callable[[int, list[int]], None], *, last: bool = True) -> "Batch":
        """Call `fn(index, token_ids)` with each prompt's new tokens as the engine makes them
        (on the callback thread, before that prompt's `on_result`, whose result has them all):
        joined, they are every token of its result. `last=False` leaves out those of the step
        that finished the prompt (for a consumer that takes the end from the result). Set it
        before `start()`. Only the local engine streams tokens; on a pool of endpoints or Ray
        replicas `fn` is not called and each result comes whole."""
        _check_callable("on_tokens", fn)
        return self._add_on_tokens(fn, last, inline=False)

    def _add_on_tokens(self, fn: Callable[..., None], last: bool, inline: bool, logprobs: bool = False) -> "Batch":
        """`inline`: `fn` is ours, quick and never raises (a queue's put), and is called on the
        engine's thread: a stream must not wait behind user callbacks on the shared callback
        thread (one that blocked froze every prompt_streaming in the process). `logprobs`: `fn`
        takes a third argument, the tokens' (log-probs, top log-probs) where the prompt asked
        for them (else None)."""
        with self._start_lock:
            if self._started_at is not None:
                raise RuntimeError("on_tokens must be set before the batch starts")
            self._on_tokens.append((fn, last, inline, logprobs))
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

            from ..progress_bar import width_options
            self._bar = tqdm(total=self.total, unit="prompt", smoothing=0.1, **width_options())
        source = Source(priority=self._priority)
        order = [p for p in self._prepared if p.token_ids is not None]
        if self._group and len(order) > 1:
            # Prompts that share a prefix go to the engine together, so the prefix is computed
            # once and is still cached while its group runs (a trie order of the token ids).
            order.sort(key=lambda p: p.token_ids)
        twins = _greedy_twins(order)
        for p in order:
            if p.index in twins.followers:
                continue
            also = twins.of.get(p.index, ())
            source.items.append(Item(p.token_ids, p.params, self._handler(p, also),
                                     on_tokens=self._token_handler(p.index, also) if self._on_tokens else None,
                                     prompts=1 + len(also)))
        self._source = source
        for p in self._prepared:
            if p.token_ids is None:
                self._deliver(Result(index=p.index, error=p.error))
        if self.total == 0:
            self._complete()
        elif source.items:
            self._service.submit(source)

    def _handler(self, p: Prepared, twins: Sequence[int] = ()) -> Callable[[RequestOutput], None]:
        """`twins`: the indices of prompts computed by this one's request (_greedy_twins), whose
        results are its own."""
        asked_stop = bool(p.params.stop or p.params.stop_token_ids)

        def handle(out: RequestOutput) -> None:
            try:
                result = to_result(p.index, out, p.spec, asked_stop, p.params.max_tokens)
            except Exception as e:  # noqa: BLE001  (a defect reading one output fails that item alone)
                # Answered here, not by the backend's second call with an error output: a
                # conversion that fails on every output left its item unanswered, and the
                # batch's waiters waited for ever.
                log.exception("a result could not be handled")
                result = Result(index=p.index, error=f"the result could not be handled: {type(e).__name__}: {e}")
            self._deliver(result)
            for i in twins:  # each a copy of its own: a caller that changes one result's lists changes no other
                self._deliver(copy.deepcopy(replace(result, index=i)))
        return handle

    def _token_handler(self, index: int, twins: Sequence[int] = ()) -> Callable[..., None]:
        def handle(ids: list[int], last: bool, logprobs: tuple | None = None) -> None:
            for fn, with_last, inline, with_logprobs in self._on_tokens:
                if last and not with_last:
                    continue
                for i in (index, *twins):
                    args = (i, ids, logprobs) if with_logprobs else (i, ids)
                    if inline:
                        fn(*args)
                    else:
                        self._dispatched = True  # wait() ends after it ran (it ended before, on_tokens alone)
                        self._service.dispatch(fn, *args)
        return handle

    # ---- results --------------------------------------------------------------------------
    def _deliver(self, result: Result) -> None:
        if result.finish_reason == "cancelled" and self._cancel_reason is not None:
            result = replace(result, error=self._cancel_reason)
        with self._lock:
            if self._results[result.index] is not None:
                return
            self._results[result.index] = result
            self._order.append(result.index)
            if result.finish_reason == "cancelled":
                self._cancelled += 1
            else:
                self._failed += result.error is not None
            self._tokens += result.usage.completion_tokens
            complete = len(self._order) == self.total
            subscribers, on_result = list(self._subscribers), list(self._on_result)
            self._dispatched |= bool(on_result)
        try:
            for fn in subscribers:  # ours, quick, and they do not raise
                fn(result.index, result)
            for fn in on_result:
                self._service.dispatch(fn, result.index, result, cut=result.finish_reason == "cancelled")
            if self._bar is not None:
                self._bar.update(1)
                if self._failed:
                    self._bar.set_postfix(failed=self._failed, refresh=False)
        finally:  # whatever failed above, the batch completes
            if complete:
                self._complete()

    def _complete(self) -> None:
        with self._lock:
            self._finished_at = time.monotonic()
            results = list(self._results)
            on_complete = list(self._on_complete)
            self._completed = True  # an on_complete added from now on is called at once
            through_callbacks = self._dispatched or bool(on_complete)
            cut = self._cancelled > 0
        if self._bar is not None:
            self._bar.close()
        for fn in on_complete:
            self._service.dispatch(fn, results, cut=cut)
        self._done.set()
        if through_callbacks:  # queued behind this batch's callbacks: runs after them
            self._service.dispatch(self._finish)
        else:
            self._finish()

    def _finish(self) -> None:
        with self._lock:
            self._finished.set()
            waiters, self._waiters = self._waiters, []
        for fn in waiters:
            fn()

    def _when_finished(self, fn: Callable[[], None]) -> None:
        """Call `fn` once the batch is finished: now if it is, else from whoever finishes it.
        Registration and finishing share one lock, so no waiter is missed."""
        with self._lock:
            if not self._finished.is_set():
                self._waiters.append(fn)
                return
        fn()

    # ---- cancel ---------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop what has not finished (those results say 'cancelled'); keep what has. Returns
        once the engine has dropped the rest."""
        fut = self.request_cancel()
        if fut is not None:
            try:
                fut.result()
            except EngineStoppedError:  # the stopped service has answered every item already
                pass

    async def cancel_async(self) -> None:
        """cancel() for asyncio: awaits the engine's drop without holding a thread."""
        fut = self.request_cancel()
        if fut is not None:
            try:
                await asyncio.wrap_future(fut)
            except EngineStoppedError:
                pass

    def cancel_for(self, reason: str, error: type[Exception]) -> None:
        """Cancel without waiting, because its owner went away (a destroyed session): the
        unfinished results say `reason`, and `raise_for` raises `error` for them. A batch not
        started yet is answered at once, and start() then runs nothing."""
        with self._start_lock:
            if self._cancel_reason is None:
                self._cancel_reason, self._cancel_error = reason, error
        self.abandon()

    def raise_for(self, result: Result) -> None:
        """A one-prompt call's error (prompt(), prompt_streaming()): ValueError for a prompt that
        failed; what cancelled it for one cancelled (SessionDestroyedError, EngineStoppedError)."""
        if result.error is None:
            return
        if result.finish_reason == "cancelled":
            if self._cancel_error is not None:
                raise self._cancel_error(result.error)
            if self._service.stopped:
                raise EngineStoppedError(result.error)
        if result.retryable and self._service.stopped:  # the engine's thread failed under it: not the
            raise EngineStoppedError(result.error)  # prompt's fault (a ValueError said it was)
        raise ValueError(result.error)

    def request_cancel(self) -> Future | None:
        """cancel() without waiting (safe on any thread, never blocks): the engine thread is
        asked to drop what has not finished. The future (None if nothing had started) resolves
        once it has; a thread that must not wait on the engine (a server shutting down) uses this."""
        with self._start_lock:
            if self._started_at is None:
                self._cancel_unstarted()
                return None
            if self._cancelling is None and not self._done.is_set():
                self._source.cancel_asked = True

                def on_pending(item: Item) -> None:
                    item.on_done(RequestOutput("", item.token_ids, [], "", "abort"))
                self._cancelling = self._service.cancel(self._source, on_pending)
            return self._cancelling

    def abandon(self) -> None:
        """The waiter went away (Ctrl-C, a cancelled task, an iteration left early, a closed
        stream): request_cancel(), never raising (what fails is logged)."""
        try:
            self.request_cancel()
        except Exception:  # noqa: BLE001  (never hide the exception the waiter is leaving with)
            log.exception("could not cancel an abandoned batch")

    def _cancel_unstarted(self) -> None:
        self._started_at = time.monotonic()
        self._source = Source(cancelled=True)
        for p in self._prepared:
            self._deliver(Result(index=p.index, finish_reason="cancelled", error="cancelled before it started"))
        if self.total == 0:
            self._complete()

    # ---- state ----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def finished(self) -> bool:
        """Every result is in and every callback of the batch has run."""
        return self._finished.is_set()

    def stop_strings(self, index: int) -> tuple[str, ...]:
        """The stop strings prompt `index` runs with."""
        return tuple(self._prepared[index].params.stop)

    @property
    def progress(self) -> Progress:
        with self._lock:
            end = self._finished_at or time.monotonic()
            elapsed = end - self._started_at if self._started_at else 0.0
            # With the tokens of the prompts still running: with every prompt in flight at once,
            # those that finished are none until near the end (it read 0 tok/s for most of a run).
            running = self._source.made if self._source is not None and not self._completed else 0
            return Progress(len(self._order), self.total, self._failed, self._tokens + running, elapsed,
                            self._cancelled)

    @property
    def results(self) -> list[Result | None]:
        """Results so far, in input order (None where not finished)."""
        with self._lock:
            return list(self._results)

    # ---- waiting --------------------------------------------------------------------------
    def wait(self, timeout: float | None = None, errors: str = "return") -> list[Result]:
        """Start if needed, block until every result is in and every callback of the batch has
        run, return the results in input order. errors="raise" raises BatchError (naming the
        failed indices) instead, if any failed. Ctrl-C here cancels what has not finished.
        Called inside a callback (where the other callbacks cannot run until it returns), it
        waits for the results only."""
        timeout = wait_seconds(timeout)  # before anything: a bad one failed inside the wait, which cancelled
        check_errors([], errors)  # before the wait too: a bad one ran the whole batch, then raised
        try:
            self.start()
            finished = (self._done if on_callback_thread() else self._finished).wait(timeout)
        except BaseException:  # Ctrl-C: nobody will read the rest
            self.abandon()
            raise
        if not finished:  # not a cancel: the caller may wait again
            raise TimeoutError(f"the batch did not finish within {timeout}s ({self.progress})")
        return check_errors(self.results, errors)

    async def wait_async(self, errors: str = "return") -> list[Result]:
        """wait() for asyncio. Cancelling the awaiting task (task.cancel(), a timeout of
        asyncio.wait_for) cancels what has not finished."""
        check_errors([], errors)
        await self._finished_async()
        return check_errors(self.results, errors)

    async def _finished_async(self) -> None:
        """Until the batch is finished; inside a callback, until its results are in (as wait():
        the other callbacks cannot run before this one returns, and it waited for ever)."""
        loop = asyncio.get_running_loop()
        if on_callback_thread():
            fut = loop.run_in_executor(None, self._done.wait)
        else:
            fut = loop.create_future()
            self._when_finished(lambda: _call_soon(loop, _set, fut, None))
        try:
            self.start()
            await fut
        except BaseException:  # CancelledError: the task went away
            self.abandon()
            raise

    # ---- iteration, as completed ----------------------------------------------------------
    def _subscribe(self, fn: Callable[[int, Result], None]) -> list[int]:
        with self._lock:
            self._subscribers.append(fn)
            return list(self._order)

    def _unsubscribe(self, fn: Callable[[int, Result], None]) -> None:
        with self._lock:
            if fn in self._subscribers:
                self._subscribers.remove(fn)

    def __iter__(self) -> Iterator[tuple[int, Result]]:
        """Results as they complete. Leaving early (break, an exception, Ctrl-C) cancels the rest."""
        return self._as_completed(None)

    def with_ticks(self, every: float) -> Iterator[tuple[int, Result] | None]:
        """Iteration that also yields None whenever `every` seconds pass without a result, so a
        consumer with work due on time (a journal's commit) gets its thread back while a long
        prompt runs. Leaving early cancels the rest, as iteration does."""
        if not every > 0:
            raise ValueError(f"every must be a positive number of seconds, not {every!r}")
        return self._as_completed(every)

    def _as_completed(self, tick: float | None) -> Iterator:
        q: queue.SimpleQueue = queue.SimpleQueue()
        put = lambda i, r: q.put((i, r))  # noqa: E731
        seen = self._subscribe(put)
        try:
            self.start()
            for i in seen:
                yield i, self._results[i]
            remaining = self.total - len(seen)
            while remaining:
                try:
                    got = q.get(timeout=tick)
                except queue.Empty:  # only with a tick
                    yield None
                    continue
                remaining -= 1
                yield got
            if not on_callback_thread():
                self._finished.wait()
        finally:
            self._unsubscribe(put)
            if not self._done.is_set():
                self.abandon()

    async def __aiter__(self) -> AsyncIterator[tuple[int, Result]]:
        """Results as they complete, in asyncio. Leaving early cancels the rest."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def put(i: int, r: Result) -> None:  # on the engine thread
            if not _call_soon(loop, q.put_nowait, (i, r)):  # the loop closed: nobody reads on
                self._unsubscribe(put)
                self.abandon()

        seen = self._subscribe(put)
        try:
            self.start()
            for i in seen:
                yield i, self._results[i]
            for _ in range(self.total - len(seen)):
                yield await q.get()
            await self._finished_async()
        finally:
            self._unsubscribe(put)
            if not self._done.is_set():
                self.abandon()

    def __len__(self) -> int:
        return self.total


@dataclass
class _Twins:
    of: dict[int, list[int]] = field(default_factory=dict)  # a computed prompt's index -> its twins'
    followers: set[int] = field(default_factory=set)  # the twins: answered by another's request


def _greedy_twins(order: Sequence[Prepared]) -> _Twins:
    """Greedy prompts of the same tokens and options (a request's n choices at temperature 0,
    or a batch's repeated rows) computed once, each answered with that one's result: the same
    answer, as greedy decoding means, where computing them apart gave the first another answer
    (its prompt was computed in full, the others' read from the prefix cache, and in bfloat16
    the two round apart and flip near-ties), and no time spent on copies. A seed changes nothing
    in greedy decoding: it is left out of the comparison."""
    twins = _Twins()
    seen: dict[tuple[int, ...], list[Prepared]] = {}
    for p in order:
        if not p.params.greedy:
            continue
        same = seen.setdefault(tuple(p.token_ids), [])
        lead = next((q for q in same if q.spec is p.spec and _same_options(q.params, p.params)), None)
        if lead is None:
            same.append(p)
        else:
            twins.of.setdefault(lead.index, []).append(p.index)
            twins.followers.add(p.index)
    return twins


def _same_options(a: SamplingParams, b: SamplingParams) -> bool:
    return a == b or replace(a, seed=None) == replace(b, seed=None)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> bool:
    """loop.call_soon_threadsafe, or False where the loop has closed (its waiter is gone)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


def _set(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _check_callable(method: str, fn) -> None:
    if not callable(fn):
        raise TypeError(f"{method} takes a function, got {fn!r}")
