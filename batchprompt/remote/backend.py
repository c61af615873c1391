"""RemoteBackend: the backend seam (backends/base.py) over a pool of OpenAI-compatible servers.

Callers hand it sources of items (token ids, sampling parameters, a done-callback), exactly as
they hand them to the local engine; an event loop on a thread of its own sends them:

- cut into sub-batches (work.py) sized to the endpoint's share of the remaining work, measured
  by its speed, and to `batch_tokens` / `batch_prompts`, never one giant request per endpoint;
  one /v1/completions request per sub-batch, a list of token-id prompts; several in flight per
  endpoint, as many as its adaptive limit allows (endpoint.py);
- routed by least outstanding tokens with prefix affinity (routing.py);
- hedged at the end: once nothing is queued, an idle endpoint re-sends a sub-batch that is late
  elsewhere; the first answer wins and the other request is cancelled (closing its connection
  makes the server abort it), so a slow endpoint does not hold the end of a batch;
- on a fault: a timeout, a 429/503 (the endpoint's limit halves and it waits, Retry-After or
  backoff with jitter), a dead endpoint (drained: its work goes to the others; probed until it
  answers again, then taken back), a 4xx/5xx (the sub-batch is split in halves and retried, so
  one bad prompt fails alone; a 5xx also slows the endpoint down, as a 429 does). A retry goes
  to another endpoint than the one that failed it while another is alive. A work is retried at
  most `max_retries` times, then answered with the last error; work waiting while no endpoint
  is alive fails after `give_up_after`.

Every item is answered exactly once (result, error, or 'abort' after a cancel or a shutdown);
a sub-batch runs to completion twice only when its first try failed (a hedged copy that
loses is cancelled). User callbacks run on one callback
thread, in order (api/callbacks.py)."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

from ..api.callbacks import CallbackThread
from ..api.result import EngineStoppedError
from ..backends.base import Item, Source, StopCounts, answer, stopped_output
from ..engine import EngineStats, RequestOutput, SamplingParams
from . import wire
from .endpoint import Endpoint, backoff
from .errors import EndpointError
from .routing import Router
from .work import SubBatch, Work, WorkQueue

if TYPE_CHECKING:
    from .pool import EndpointPool

log = logging.getLogger("batchprompt")

SHUT_DOWN = "the endpoint pool was shut down (LanguageModel.close(), pool.close() or bp.shutdown())"
SHUT_DOWN_AT_EXIT = "the endpoint pool was shut down as the Python interpreter exited (the script ended)"
#: Tail hedging: once nothing is queued, an idle endpoint re-sends a sub-batch that has been in
#: flight elsewhere for HEDGE_AFTER times the usual request time (of its size); the first answer wins and the
#: other request is cancelled (its connection closed: the server aborts it), so a slow endpoint
#: never holds the end of a batch.
HEDGE_AFTER = 1.25
PROBE_MIN_S, PROBE_MAX_S = 0.5, 10.0
#: The longest wait before an endpoint that keeps going down right after it is taken back is asked again.
FLAP_MAX_S = 120.0
SERVER_ERRORS_WARNED = 3  # 5xx answers in a row from one endpoint that make a warning


class RemoteBackend(StopCounts):
    """The remote backend (see backends/base.py): a pool of OpenAI-compatible endpoints."""

    SHUT_DOWN_REASONS = (SHUT_DOWN, SHUT_DOWN_AT_EXIT)

    def __init__(self, pool: "EndpointPool", endpoints: list[Endpoint], model: str, tokenizer, max_model_len: int | None):
        self.pool = pool
        self.name = f"remote-{model}"
        self.model = model
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self.endpoints = endpoints
        self.router = Router(endpoints, slack_tokens=pool.batch_tokens)
        self.queue = WorkQueue()
        self.stop_reason: str | None = None
        self._stopping = False
        self._cut_short = 0  # items answered 'abort' by a shutdown
        self._flying: set[SubBatch] = set()
        self._in_flight_items = 0
        self._ids = itertools.count()
        self._sessions: set[str] = set()
        self._stats = EngineStats()
        self._no_endpoint_since: float | None = None
        self._request_s: float | None = None  # a successful request's usual time (smoothed)
        self._token_s: float | None = None  # ... and its usual time per token it holds (smoothed)
        self.hedges = 0  # sub-batches sent again to an idle endpoint because they were late
        self._probes: dict[int, asyncio.Task] = {}
        self._delayed: dict[int, list[Work]] = {}  # works waiting out a backoff before their retry
        self._callbacks = CallbackThread(f"batchprompt-callbacks-{self.name}")
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run_loop, args=(ready,), name=f"batchprompt-{self.name}", daemon=True)
        self._thread.start()
        ready.wait()
        from ..api.service import stop_at_exit
        stop_at_exit(self)

    # ---- the protocol's properties ------------------------------------------------------------
    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len or 1 << 30  # unknown: each server's own limit applies (its 400)

    def refuses(self, params: SamplingParams) -> str | None:
        return wire.unsupported(params)

    @property
    def stopped(self) -> bool:
        return self._stopping

    @property
    def in_flight(self) -> int:
        return self._in_flight_items

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    def add_session(self, name: str) -> None:
        with self._lock:
            self._sessions.add(name)

    def close_session(self, name: str) -> None:
        with self._lock:
            self._sessions.discard(name)

    def pin_prefix(self, name: str, token_ids: list[int]) -> Future:
        """Servers keep prefixes their own way (their prefix caches); routing keeps a session's
        prompts on the endpoint that holds its prefix. Nothing is pinned: 0 tokens."""
        return _done(0)

    def copy_pin(self, source: str, name: str) -> Future:
        return _done(0)

    def dispatch(self, fn: Callable, *args, cut: bool = False) -> None:
        self._callbacks.dispatch(fn, *args, cut=cut)

    # ---- callers' side (any thread) -----------------------------------------------------------
    def submit(self, source: Source) -> None:
        items = []
        while source.items:
            items.append(source.items.popleft())
        if not self._call_soon(self._add, source, items):
            for item in items:
                answer(item, stopped_output(item, self.stop_reason, self._shut_down))

    def cancel(self, source: Source, on_pending: Callable[[Item], None]) -> Future:
        fut: Future = Future()

        def run() -> None:
            source.cancelled = True
            while source.items:  # not submitted yet
                on_pending(source.items.popleft())
            for w in self.queue.drop(source):
                w.answered = True
                source.in_engine.pop(w.item.request_id or "", None)
                on_pending(w.item)
            for works in self._delayed.values():
                for w in works:
                    if w.source is source and not w.answered:
                        w.answered = True
                        on_pending(w.item)
            for sb in list(self._flying):
                if sb.source is source and sb.task is not None:
                    sb.task.cancel()  # its works are answered 'abort' as the task ends
            fut.set_result(None)

        if not self._call_soon(run):
            fut.set_exception(EngineStoppedError(self.stop_reason))
        return fut

    def stats(self, timeout: float | None = None) -> EngineStats:
        fut: Future = Future()

        def snap() -> None:
            s = dataclasses.replace(self._stats)
            s.running, s.waiting = self._in_flight_items, self.queue.queued
            s.busy_seconds = time.monotonic() - s.started
            fut.set_result(s)

        if not self._call_soon(snap):
            raise EngineStoppedError(self.stop_reason)
        return fut.result(timeout)

    def endpoint_stats(self, timeout: float | None = 30) -> list[dict]:
        """Each endpoint's state and counters (requests, prompts, tokens, errors, deaths)."""
        fut: Future = Future()
        if not self._call_soon(lambda: fut.set_result([e.describe() for e in self.endpoints])):
            return [e.describe() for e in self.endpoints]
        return fut.result(timeout)

    def run_coroutine(self, coro) -> Future:
        """Run `coro` on the pool's loop (the swarm methods' direct requests)."""
        if self._stopping:
            coro.close()
            raise EngineStoppedError(self.stop_reason)
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def shutdown(self, timeout: float | None = None, at_exit: bool = False) -> bool:
        """Stop: every item still waiting or in flight is answered ('abort'); the loop ends.
        Returns once the loop and the callbacks have ended (True), or after `timeout` seconds
        (60 when None; False). `at_exit`: the callbacks on the items it cuts short are not run
        (counted instead)."""
        if at_exit:
            self._callbacks.drop_cut()
        with self._lock:
            if self._stopping:
                first = False
            else:
                self._stopping, first = True, True
                self.stop_reason = SHUT_DOWN_AT_EXIT if at_exit else SHUT_DOWN
        if first:
            try:
                asyncio.run_coroutine_threadsafe(self._close(), self.loop)
            except RuntimeError:  # the loop is already closed
                pass
        # Not from the loop's own thread: it closes the callbacks' thread once it has ended.
        current = threading.current_thread()
        own = (self._thread, self._callbacks.thread)
        waited = [] if current is self._thread else [t for t in own if t is not current]
        deadline = time.monotonic() + (60 if timeout is None else timeout)
        for thread in waited:
            thread.join(max(deadline - time.monotonic(), 0))
        self.pool._backend_stopped(self)
        return not any(t.is_alive() for t in waited)

    def call_on_loop(self, fn: Callable, *args) -> bool:
        """Run `fn(*args)` on the pool's loop (False once stopped)."""
        return self._call_soon(fn, *args)

    def _call_soon(self, fn: Callable, *args) -> bool:
        with self._lock:
            if self._stopping:
                return False
            try:
                self.loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:
                return False
        return True

    # ---- the loop thread --------------------------------------------------------------------------
    def _run_loop(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self._wake = asyncio.Event()
        pump = self.loop.create_task(self._pump())
        ready.set()
        try:
            self.loop.run_until_complete(pump)
        except BaseException:  # noqa: BLE001
            log.exception("the endpoint pool's loop failed")
        finally:
            with self._lock:
                if not self._stopping:
                    self._stopping = True
                    self.stop_reason = "the endpoint pool's loop failed (see the log); create the pool again"
            try:  # callbacks scheduled before the stop (a submit) run first, then everything is answered
                self.loop.run_until_complete(asyncio.sleep(0))
            except BaseException:  # noqa: BLE001
                pass
            self._answer_all(self.stop_reason)
            try:
                self.loop.run_until_complete(self._close_clients())
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())  # streams' readers left early
                self.loop.run_until_complete(asyncio.sleep(0))
            except BaseException:  # noqa: BLE001
                pass
            self.loop.close()
            self._callbacks.close()

    async def _close(self) -> None:
        self._kick()

    async def _close_clients(self) -> None:
        probes = list(self._probes.values())
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        for e in self.endpoints:
            await e.close()

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _add(self, source: Source, items: list[Item]) -> None:
        works = []
        for item in items:
            if source.cancelled:
                answer(item, RequestOutput("", item.token_ids, [], "", "abort"))
                continue
            item.request_id = rid = f"{self.name}-{next(self._ids)}"
            problem = wire.unsupported(item.params) or self._too_long(item)
            if problem:
                answer(item, RequestOutput(rid, item.token_ids, [], "", "error", error=problem))
                continue
            params = self._clamped(item)
            works.append(Work(item, source, params, len(item.token_ids) + params.max_tokens * params.num_samples))
        self.queue.add(works)
        self._kick()

    def _too_long(self, item: Item) -> str | None:
        ctx = self._max_model_len
        if ctx and len(item.token_ids) >= ctx:
            return (f"the prompt has {len(item.token_ids)} tokens, but the context holds {ctx} "
                    f"(prompt plus at least one generated token): shorten the prompt")
        return None

    def _clamped(self, item: Item):
        """max_tokens cut to what the context leaves (as the local engine stops at its end;
        vLLM refuses a request whose prompt + max_tokens exceed the context). A greedy row's
        seed is left out: it changes nothing, and rows share a request only where their
        parameters are equal (a seed per row sent greedy rows one request each, 3x slower)."""
        p, ctx = item.params, self._max_model_len
        if p.temperature == 0 and p.seed is not None:
            p = dataclasses.replace(p, seed=None)
        if ctx and len(item.token_ids) + p.max_tokens > ctx:
            room = ctx - len(item.token_ids)
            return dataclasses.replace(p, max_tokens=room, min_tokens=min(p.min_tokens, room))
        return p

    async def _pump(self) -> None:
        """Send sub-batches while there is work and an endpoint with room; sleep otherwise."""
        assert self._wake is not None
        while not self._stopping:
            self._dispatch()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self._next_wake())
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
        # stopping: cancel what flies; each task answers its works 'abort'
        tasks = [sb.task for sb in self._flying if sb.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _next_wake(self) -> float | None:
        """How long the pump may sleep: until a backoff ends, or a second while work waits for
        an endpoint (to notice `give_up_after`), or until a sub-batch in flight is late enough to
        hedge; None: until kicked."""
        now = time.monotonic()
        if not self.queue:
            unhedged = [sb.started + self._late_after(sb) for sb in self._flying
                        if sb.twin is None and not sb.superseded]
            if not unhedged or self._request_s is None:
                return None
            return max(0.2, min(unhedged) - now)
        ends = [e.backoff_until - now for e in self.endpoints if e.alive and e.backoff_until > now]
        return max(0.01, min(ends + [1.0]))

    def _dispatch(self) -> None:
        now = time.monotonic()
        if self.queue and not any(e.alive for e in self.endpoints):
            self._no_endpoint_since = self._no_endpoint_since or now
            if now - self._no_endpoint_since > self.pool.give_up_after:
                reasons = "; ".join(e.dead_reason if (e.dead_reason or "").startswith(e.url) else f"{e.url}: {e.dead_reason}"
                                    for e in self.endpoints)
                for w in self.queue.drain():
                    self._finish_error(w, f"no endpoint of the pool answered for {self.pool.give_up_after:g}s "
                                          f"({reasons})", retryable=True)
                self._no_endpoint_since = None  # work submitted from now on waits give_up_after afresh
            return
        self._no_endpoint_since = None
        while self.queue:
            candidates = [e for e in self.endpoints if e.has_room(now)]
            if not candidates:
                self._give_up_waiting(now)
                return
            head = self.queue.head()
            if head is None:
                return
            if self._waits_for_another(head, candidates):
                return
            self.router.slack_tokens = self._affinity_slack()
            e = self.router.choose(head.item.token_ids, candidates, head.avoid)
            sb = self.queue.take(self._budget(e), self.pool.batch_prompts if self.pool.use_batch else 1, e.index)
            if sb is None:
                return
            self._launch(sb, e)
        if not self.queue:
            self._hedge(now)

    def _give_up_waiting(self, now: float) -> None:
        """Works failing for longer than give_up_after while every endpoint is backed off (an
        endpoint answering 429 with a long Retry-After): they ended only at their next try, a
        Retry-After (up to 60 s) past the bound. Not while an endpoint is only full: its work
        goes on."""
        if not all(e.backoff_until > now for e in self.endpoints if e.alive):
            return
        expired = self.queue.take_expired(now - self.pool.give_up_after)
        if not expired:
            return
        waits = "; ".join(f"{e.url}: backed off for {e.backoff_until - now:.0f}s more"
                          for e in self.endpoints if e.alive and e.backoff_until > now)
        for w in expired:
            self._finish_error(w, f"gave up after {w.attempts} tries{self._since(w)} (give_up_after "
                                  f"{self.pool.give_up_after:g}s from the first failure), waiting for a busy "
                                  f"endpoint ({waits or 'none free'})", retryable=True)

    def _waits_for_another(self, head: Work, candidates: list[Endpoint]) -> bool:
        """A retry goes to an endpoint that has not failed it, while one is alive (a load
        balancer's next-upstream rule): it waits for that one's free slot rather than go back to
        an endpoint that may fail everything (a server answering 500 to every request). All the
        endpoints that failed it count: with the last alone, a work bounced between two failing
        ones (a 500 and a 429) until its tries ran out, beside a healthy one."""
        if not head.avoid or any(e.index not in head.avoid for e in candidates):
            return False
        return any(e.alive and e.index not in head.avoid for e in self.endpoints)

    def _hedge(self, now: float) -> None:
        usual = self._request_s
        if usual is None:
            return
        for e in self.endpoints:
            if not (e.has_room(now) and e.in_flight == 0):
                continue
            late = [sb for sb in self._flying if sb.twin is None and not sb.superseded and sb.endpoint is not e
                    and not sb.source.cancelled and now - sb.started > self._late_after(sb)]
            if not late:
                return
            old = min(late, key=lambda sb: sb.started)
            rest = [w for w in old.works if not w.answered]  # what its stream has not answered yet
            if not rest:
                continue
            twin = SubBatch(rest, old.source, old.params, sum(w.tokens for w in rest))
            old.twin, twin.twin = twin, old
            self.hedges += 1
            self._launch(twin, e)

    def _late_after(self, sb: SubBatch) -> float:
        """How long a sub-batch may be in flight before it counts as late: HEDGE_AFTER times the
        usual request time, or times what its size usually takes where that is longer (a quick
        request of 3 prompts made a 27-prompt one look late, and it was sent again whole)."""
        usual = max(self._request_s or 0.0, (self._token_s or 0.0) * sb.tokens)
        return HEDGE_AFTER * usual

    def _budget(self, e: Endpoint) -> int:
        """Tokens for `e`'s next sub-batch: its share (by measured speed, else weight) of the
        work not yet answered (queued and in flight), less what it holds already, over the
        requests it may still send, from min_batch_tokens (fewer, fuller requests) to
        batch_tokens. At the start each endpoint so gets its whole share at once, in requests
        that its server batches together (a second round of smaller requests would cost every
        server a second pass of decoding steps); a slow endpoint's share is then re-sent
        elsewhere once it is late (hedging)."""
        alive = [x for x in self.endpoints if x.alive]
        rates = [x.rate for x in alive]
        if all(r is not None for r in rates) and rates:
            share = (e.rate or 0.0) / sum(rates)  # type: ignore[arg-type]
        else:
            share = e.weight / sum(x.weight for x in alive)
        remaining = self._unanswered_tokens(alive)
        free_slots = e.free_places
        rest_of_share = remaining * share - e.outstanding_tokens
        # The floor is never more than the endpoint's share: a small job's first request took
        # 1,024 tokens, most of it, and its other endpoints had little or nothing to do.
        floor = min(self.pool.min_batch_tokens, max(1, int(remaining * share)))
        return min(self.pool.batch_tokens, max(floor, int(rest_of_share / free_slots)))

    def _affinity_slack(self) -> int:
        """How many tokens more than the least loaded endpoint one may hold and still get a
        sub-batch for its prefix: batch_tokens, or half a fair share of the work not yet
        answered where that is less, so that a small job's shared system prompt does not draw
        it all to the endpoint that got its first sub-batch."""
        alive = [x for x in self.endpoints if x.alive] or self.endpoints
        return min(self.pool.batch_tokens, int(self._unanswered_tokens(alive) / (2 * len(alive))))

    def _unanswered_tokens(self, alive: list[Endpoint]) -> int:
        """The work not yet answered, in tokens: queued, and in flight on the `alive` endpoints."""
        return self.queue.queued_tokens + sum(x.outstanding_tokens for x in alive)

    def _launch(self, sb: SubBatch, e: Endpoint) -> None:
        sb.endpoint, sb.started = e, time.monotonic()
        e.begin(sb.tokens, len(sb.works))
        self._flying.add(sb)
        self._in_flight_items += len(sb.works)
        for w in sb.works:
            sb.source.in_engine[w.item.request_id] = w.item
            if w.first_sent is None:
                w.first_sent = sb.started
        self.router.record(e, [w.item.token_ids for w in sb.works])
        sb.task = self.loop.create_task(self._send(sb, e))

    async def _send(self, sb: SubBatch, e: Endpoint) -> None:
        done_tokens = 0
        try:
            done_tokens = await self._request(sb, e)
        except asyncio.CancelledError:
            reason = self.stop_reason if self._stopping else None
            for w in ([] if sb.superseded else sb.works):
                self._answer(w, RequestOutput(w.item.request_id or "", w.item.token_ids, [], "", "abort", error=reason))
        except Exception as err:  # noqa: BLE001  (a bug here must still answer the works)
            log.exception("sending a sub-batch failed")
            self._retry(sb, e, EndpointError("server", f"{type(err).__name__}: {err}"))
        finally:
            e.end(sb.tokens, done_tokens, len(sb.works))
            self._flying.discard(sb)
            self._in_flight_items -= len(sb.works)
            for w in sb.works:
                sb.source.in_engine.pop(w.item.request_id, None)
            self._kick()

    async def _request(self, sb: SubBatch, e: Endpoint) -> int:
        """Send the sub-batch and answer its works, each as its answer arrives (a stream), or
        hand the failure of those not answered to _retry; the tokens the endpoint computed, for
        its speed."""
        text = e.accepts_token_ids is False
        stream = wire.CompletionStream(len(sb.works), sb.params.n, e.url)

        def arrived(chunk: Any) -> None:
            for prompt, samples in stream.feed(chunk):
                self._answer_samples(sb, e, sb.works[prompt], samples)

        try:
            answer, text = await self._post(sb, e, text, arrived)
            if isinstance(answer, dict):  # the server answered in one body
                usage = answer
                for w, samples in zip(sb.works, wire.parse_completions(answer, len(sb.works), sb.params.n, e.url)):
                    self._answer_samples(sb, e, w, samples)
            elif stream.unfinished():
                raise EndpointError("connection" if answer is False else "server",
                                    f"{e.url}/v1/completions: the stream ended with {stream.unfinished()} of "
                                    f"{len(sb.works)} prompts unanswered"
                                    + ("" if answer is False else " (after its [DONE])"), 200)
            else:
                usage = {"usage": stream.usage}
        except EndpointError as err:
            rest = [w for w in sb.works if not w.answered]
            if rest:
                self._retry(dataclasses.replace(sb, works=rest), e, err)
            else:  # every prompt was answered (a hedge's twin, or before the stream broke)
                self._note_fault(e, err)
            return 0
        took = time.monotonic() - sb.started
        self._request_s = took if self._request_s is None else 0.8 * self._request_s + 0.2 * took
        per = took / max(sb.tokens, 1)
        self._token_s = per if self._token_s is None else 0.8 * self._token_s + 0.2 * per
        twin = sb.twin
        if twin is not None and twin.task is not None and not twin.task.done():
            twin.superseded = True  # this answer won: the other request is cancelled
            twin.task.cancel()
        prompt_tokens, cached, completion = wire.usage_of(usage)
        if e.unproven and e.flaps:
            log.warning("endpoint %s answers requests again: it gets work again", e.url)
            e.flaps = 0
        e.on_success()
        if not text:
            e.accepts_token_ids = True
        c = e.counters
        c.prompt_tokens += prompt_tokens
        c.cached_tokens += cached
        c.completion_tokens += completion
        s = self._stats
        s.prompt_tokens += prompt_tokens
        s.cached_prompt_tokens += cached
        s.prefill_tokens += prompt_tokens - cached
        s.decode_tokens += completion
        s.steps += 1
        return prompt_tokens + completion or sb.tokens

    def _answer_samples(self, sb: SubBatch, e: Endpoint, w: Work, samples: list) -> None:
        if w.answered:  # by a hedge's twin, first
            return
        one_cached = 0  # a list request reports its total only
        try:
            out = wire.to_output(w.item.request_id or "", w.item.token_ids, samples, sb.params, self._tokenizer,
                                 one_cached)
        except Exception as err:  # noqa: BLE001  (one answer that cannot be read fails alone)
            out = RequestOutput(w.item.request_id or "", w.item.token_ids, [], "", "error",
                                error=f"the answer from {e.url} cannot be read: {type(err).__name__}: {err}")
        if out.error is None:
            e.counters.prompts += 1  # as each is answered: the request's usage comes after its last prompt
        self._answer(w, out)
        twin = sb.twin
        if (twin is not None and twin.task is not None and not twin.task.done()
                and all(x.answered for x in twin.works)):
            twin.superseded = True  # everything the other request holds is answered: it is cancelled
            twin.task.cancel()

    async def _post(self, sb: SubBatch, e: Endpoint, text: bool, arrived: Callable[[Any], None]) -> tuple[Any, bool]:
        """POST the sub-batch's prompts as token ids (as text where the endpoint refuses ids),
        asked as a stream whose chunks go to `arrived`; (the answer: a whole body, or whether
        the stream ended with [DONE]; whether it went as text). While it is not known whether
        the endpoint takes ids, a 400/422 is tried once more as text: if that is answered, it
        refuses ids."""
        streamed = self.pool.use_stream and wire.streams(sb.params)

        def body(as_text: bool) -> dict:
            prompts = [self._as_text(w.item.token_ids) if as_text else w.item.token_ids for w in sb.works]
            return wire.completion_body(self.model, prompts, sb.params, self.pool.structured, stream=streamed)

        async def send(as_text: bool) -> Any:
            def chunk(data: Any) -> None:
                if not as_text and e.accepts_token_ids is None:
                    e.accepts_token_ids = True  # it streams an answer to token-id prompts
                arrived(data)

            if streamed:
                return await e.post_stream("/v1/completions", body(as_text), chunk)
            return await e.post_json("/v1/completions", body(as_text))

        try:
            return await send(text), text
        except EndpointError as err:
            # Also once it is known to refuse ids: requests sent as ids before another's answer
            # said so failed as their prompts' own fault (6 of 20 rows, journaled as failed).
            if text or e.accepts_token_ids is True or err.kind != "request" or err.status not in (400, 422):
                raise
            answer = await send(True)  # its failure is the prompts' own
            if e.accepts_token_ids is None:  # one warning, from the first request that learns it
                log.warning("%s refuses token-id prompts (%s): it gets text from now on (the same tokens, decoded)",
                            e.url, err.message)
            e.accepts_token_ids = False
            return answer, True

    def _as_text(self, ids: list[int]) -> str:
        return self._tokenizer.hf.decode(ids, skip_special_tokens=False)

    def _retry(self, sb: SubBatch, e: Endpoint, err: EndpointError) -> None:
        """A failed sub-batch: move it (endpoint faults), split it (request faults), or fail it."""
        twin = sb.twin
        if twin is not None and twin.task is not None and not twin.task.done():
            twin.twin = None  # the twin goes on alone: its failure is then retried as any
            for w in sb.works:  # and not on this endpoint again (it was left out of their avoid)
                w.avoid = w.avoid | {e.index}
            self._note_fault(e, err)
            return
        if err.endpoint_fault:
            self._note_fault(e, err)
            self._requeue(sb.works, e, err, delay=0.0)
            return
        if err.kind == "server":  # a 5xx: the endpoint may be failing; it sends less for a while
            # As long as the works' own tries say: each sub-batch in flight that failed added to
            # the endpoint's faults, and its backoff reached 30 s within a few (an endpoint that
            # answered 500 to everything failed 30 prompts after 150 s, silently).
            e.on_overload(None, self.pool.backoff_s, attempt=max(w.attempts for w in sb.works) + 1)
            self._note_server_error(e, err)
        if len(sb.works) > 1:  # one prompt may be the cause: halves, each retried on its own
            mid = len(sb.works) // 2
            count = err.kind == "server"  # a 4xx names the request: splitting is no retry
            for half in (sb.works[:mid], sb.works[mid:]):
                for w in half:  # the halves go on their own (the queue would join them again)
                    w.cap = len(half)
                self._requeue(half, e, err, delay=backoff(self.pool.backoff_s, 1) if count else 0.0, count=count)
            return
        w = sb.works[0]
        if err.kind == "request":  # the server refuses this prompt: its answer, once another agrees
            # One endpoint's 4xx may be its own (a proxy's 404, its own 413 or 422, a server behind
            # it that refuses ids): the row failed for good while healthy endpoints were there.
            # Another endpoint that has not failed it is asked once (a prompt too long for every
            # server costs one more request).
            self._note_refusal(e, err)
            if w.refused is None and any(x.alive and x.index != e.index and x.index not in w.avoid
                                         for x in self.endpoints):
                w.refused = err.message
                self._requeue([w], e, err, delay=0.0, count=False)
                return
            # Both answers where they differ: which is the prompt's fault and which a proxy's own
            # cannot be told (the one asked second hid the other's reason).
            first = w.refused if w.refused is not None and w.refused != err.message else None
            self._finish_error(w, err.message if first is None else f"{first}; asked again: {err.message}")
            return
        self._requeue([w], e, err, delay=backoff(self.pool.backoff_s, w.attempts + 1))

    @staticmethod
    def _since(w: Work) -> str:
        return "" if w.first_sent is None else f" over {time.monotonic() - w.first_sent:.0f}s"

    def _note_server_error(self, e: Endpoint, err: EndpointError) -> None:
        """A warning once an endpoint has answered several requests in a row with a 5xx (a
        server behind a broken proxy, a failing model): its work is retried, then fails."""
        e.server_errors += 1
        if e.server_errors == SERVER_ERRORS_WARNED:
            log.warning("endpoint %s answered its last %d requests with an error of its own (%s): their prompts are "
                        "tried again (at most %d tries each, max_retries + 1, within %gs, give_up_after), then fail",
                        e.url, e.server_errors, err.message, self.pool.max_retries + 1, self.pool.give_up_after)

    def _note_refusal(self, e: Endpoint, err: EndpointError) -> None:
        """A warning once an endpoint has refused several lone prompts in a row with a 4xx (a
        proxy that answers 404 to every POST): each is asked of another endpoint, but the
        endpoint keeps its share of the work."""
        e.refusals += 1
        if e.refusals == SERVER_ERRORS_WARNED:
            log.warning("endpoint %s refused its last %d prompts (%s): each is asked of another endpoint once. If it "
                        "refuses every prompt, check its address (a proxy's route?)", e.url, e.refusals, err.message)

    def _note_fault(self, e: Endpoint, err: EndpointError) -> None:
        if not err.endpoint_fault:
            return
        if err.kind == "timeout" and not e.timeout_warned:  # the wait was silent (300 s by default)
            e.timeout_warned = True
            log.warning("%s (a server that takes requests and never answers?): its prompts are tried again, on "
                        "another endpoint where one is alive; a second timeout takes it as down. A request may "
                        "take up to the timeout (EndpointPool(timeout=...), batchprompt run --request-timeout)",
                        err.message)
        if err.kind in ("connection", "gateway", "auth", "model") or (err.kind == "timeout" and e.failures >= 1):
            self._mark_dead(e, err.message)
        else:  # a 429/503, or a first timeout: the endpoint slows down
            wait = e.on_overload(err.retry_after, self.pool.backoff_s)
            if err.kind == "overloaded" and e.failures == SERVER_ERRORS_WARNED:  # as for 5xx: it was silent
                log.warning("endpoint %s answered its last %d requests as busy (%s): it gets less work and waits "
                            "%.0fs; prompts that wait for it fail after give_up_after (%gs)", e.url, e.failures,
                            err.message, wait, self.pool.give_up_after)

    def _requeue(self, works: list[Work], e: Endpoint, err: EndpointError, delay: float, count: bool = True) -> None:
        again = []
        for w in works:
            if w.answered:
                continue
            if w.source.cancelled:
                self._answer(w, RequestOutput(w.item.request_id or "", w.item.token_ids, [], "", "abort"))
                continue
            if count:
                w.attempts += 1
                if w.failing_since is None:
                    w.failing_since = time.monotonic()
            if w.attempts > self.pool.max_retries:  # the endpoints' fault (a 5xx, a timeout): retryable
                self._finish_error(w, f"failed after {w.attempts} tries{self._since(w)}; the last: {err.message}",
                                   retryable=err.kind != "request")
                continue
            if count and time.monotonic() - w.failing_since > self.pool.give_up_after:  # tries that take long
                # It said "failed for 10s" (give_up_after) of tries that had taken 40 s (two timeouts).
                self._finish_error(w, f"gave up after {w.attempts} tries{self._since(w)} (give_up_after "
                                      f"{self.pool.give_up_after:g}s from the first failure); the last: {err.message}",
                                   retryable=err.kind != "request")
                continue
            w.avoid = w.avoid | {e.index}
            again.append(w)
        if not again:
            return
        if delay <= 0:
            self.queue.add(again, front=True)
            self._kick()
            return
        key = next(self._ids)
        self._delayed[key] = again

        def later() -> None:
            works = self._delayed.pop(key, None)
            if works is None or self._stopping:  # answered by a cancel or the shutdown
                return
            live = [w for w in works if not w.answered and not w.source.cancelled]
            for w in works:
                if not w.answered and w.source.cancelled:
                    self._answer(w, RequestOutput(w.item.request_id or "", w.item.token_ids, [], "", "abort"))
            self.queue.add(live, front=True)
            self._kick()

        self.loop.call_later(delay, later)

    def _mark_dead(self, e: Endpoint, reason: str, warn: bool = True) -> None:
        flap = e.alive and e.unproven  # it answered GET /v1/models, then failed its requests again
        if flap:
            e.flaps += 1
        if e.alive and warn and flap:  # said once, not each time its list answers and its requests fail
            (log.warning if e.flaps == 1 else log.debug)(
                "endpoint %s is down again (%s) with no request answered since its GET /v1/models answered: it "
                "is taken back less and less often (up to every %.0fs) while its requests fail", e.url, reason,
                FLAP_MAX_S)
        elif e.alive and warn:
            if any(x.alive for x in self.endpoints if x is not e):
                log.warning("endpoint %s is down (%s): its work goes to the others until it answers again",
                            e.url, reason)
            else:
                log.warning("endpoint %s is down (%s), and no endpoint of the pool is left: the work waits up to "
                            "%gs for one to answer again, then fails (EndpointPool(give_up_after=...), "
                            "batchprompt run --give-up-after)", e.url, reason, self.pool.give_up_after)
        e.mark_dead(reason)
        self.router.forget(e)
        if e.index not in self._probes or self._probes[e.index].done():
            self._probes[e.index] = self.loop.create_task(self._probe(e))

    async def _probe(self, e: Endpoint) -> None:
        """Ask a dead endpoint GET /v1/models until it answers with the model; then take it back.
        One that went down again before answering a request (`flaps`) is asked later each time."""
        wait = PROBE_MIN_S if not e.flaps else min(FLAP_MAX_S, PROBE_MAX_S * 2 ** (e.flaps - 1))
        while not self._stopping and not e.alive:
            await asyncio.sleep(wait)
            wait = min(max(PROBE_MAX_S, wait), wait * 2)
            try:
                data = await e.get_json("/v1/models", timeout=5.0)
            except EndpointError:
                continue
            if self.model in served_models(data):
                (log.warning if not e.flaps else log.debug)("endpoint %s answers again: it gets work again", e.url)
                e.mark_alive()
                self._kick()

    # ---- answers ------------------------------------------------------------------------------
    def _finish_error(self, w: Work, message: str, retryable: bool = False) -> None:
        self._answer(w, RequestOutput(w.item.request_id or "", w.item.token_ids, [], "", "error", error=message,
                                      retryable=retryable))

    def _answer(self, w: Work, out: RequestOutput) -> None:
        if w.answered:
            return
        w.answered = True
        w.source.in_engine.pop(w.item.request_id or "", None)
        if out.finish_reason != "abort":
            self._stats.finished += 1
            self._stats.failed += out.error is not None
        elif self._stopping and self._shut_down and not w.source.cancel_asked:  # cut short by the stop
            self._cut_short += w.item.prompts
        answer(w.item, out)

    def _answer_all(self, reason: str | None) -> None:
        """The loop is ending: every work not answered yet is, now."""
        shut_down = self._shut_down

        def stop(w: Work) -> None:
            self._answer(w, stopped_output(w.item, self.stop_reason, shut_down))

        delayed, self._delayed = list(self._delayed.values()), {}
        for works in delayed:
            for w in works:
                stop(w)
        for w in self.queue.drain():
            stop(w)
        for sb in list(self._flying):
            for w in sb.works:
                stop(w)
        self._flying.clear()
        self._in_flight_items = 0


def served_models(data: Any) -> list[str]:
    """The model ids a /v1/models answer lists."""
    items = data.get("data") if isinstance(data, dict) else None
    return [m.get("id") for m in items or [] if isinstance(m, dict) and m.get("id")]


def _done(value) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut
