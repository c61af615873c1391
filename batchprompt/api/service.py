"""EngineService: one engine per model in a process, stepped on a background thread.

Every caller (threads, asyncio tasks, sessions) hands its prompts to the service as a
`Source`, a queue of items. The engine thread feeds the engine from the sources round-robin,
keeping a window of requests in the engine that follows the measured completion rate: enough
that every step is full, few enough that cancelling is cheap and that one huge batch does not
hold back a single prompt from another caller. How many of the fed requests run at once is
the scheduler's call and follows free KV memory.

Callbacks given with items run on the engine thread and must be quick; user callbacks go
through `dispatch`, a second thread, so a slow callback never stalls the engine.

Every item is answered exactly once, whatever fails: a prompt the engine refuses to queue
fails alone; a result handler that raises is called again with an error; and if the engine
thread itself dies, or the service is shut down, every item still waiting is answered with
the reason, the service leaves the registry, and the next caller gets a fresh engine.
"""
from __future__ import annotations

import atexit
import ctypes
import dataclasses
import gc
import itertools
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Mapping

# noqa F401: the seam's types, imported from here too
from ..backends.base import Item, Source, StopCounts, answer, stopped_output  # noqa: F401
from ..device import check_not_forked_from_cuda, prepare_engine_thread
from ..engine import EngineConfig, EngineStats, LLMEngine, RequestOutput, SamplingParams
from ..engine.config import EngineConfigError
from ..units import wait_seconds
from .callbacks import CallbackThread
from .result import EngineStoppedError

log = logging.getLogger("batchprompt")

SHUT_DOWN = "the engine was shut down (bp.shutdown() or LanguageModel.close())"
# At interpreter exit: the same stop, which the user did not call (a thread still building a
# session blamed bp.shutdown()).
SHUT_DOWN_AT_EXIT = "the engine was shut down as the Python interpreter exited (the script ended)"
# In a child forked from a process whose engine ran (multiprocessing's default start on Linux).
FORKED = ("the engine runs in the process this one was forked from, and a forked child cannot use it (a new "
          "session in the child builds an engine of its own; or start children with multiprocessing's 'spawn')")
MADE_EVERY_S = 1.0  # how often the sources' tokens made so far are counted (Source.made)


class EngineService(StopCounts):
    """The local backend (see backends/base.py): one engine in this process."""

    SHUT_DOWN_REASONS = (SHUT_DOWN, SHUT_DOWN_AT_EXIT)

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], name: str = "model", lookahead_s: float = 2.0):
        """`engine`: an engine, or a function that builds one. The service calls that function
        on its engine thread (the constructor waits for it, and raises what it raises), so the
        engine's parallel ops, from loading on, run on one thread: the caller's thread gets no
        OpenMP team of its own, and the engine's team keeps the waiting that device.py explains."""
        build = None if isinstance(engine, LLMEngine) else engine
        self._engine: LLMEngine | None = None if build is not None else engine
        self.engine_options: dict = {}  # what get_service built it with
        self.name = name
        self.lookahead_s = lookahead_s
        self._cond = threading.Condition()
        self._sources: deque[Source] = deque()
        self._commands: list[tuple[Callable[[], Any], Future]] = []
        self._in_engine: dict[str, tuple[Source, Item]] = {}
        self._streaming: dict[str, tuple[Item, int]] = {}  # items with on_tokens: tokens handed out
        self._made: dict[str, int] = {}  # request id -> its tokens when Source.made was last counted
        self._made_due = 0.0
        self._ids = itertools.count()
        self._rate = 0.0  # requests finished per second, smoothed
        self._sessions: set[str] = set()  # names of the sessions' pinned prefixes
        self._stopping = False
        self._cut_short = 0  # prompts answered 'cancelled' by _end
        self._arrived = False  # a source was submitted since the engine thread last fed
        self.stop_reason: str | None = None  # why the service stopped, once it has
        self._callbacks = CallbackThread(f"batchprompt-callbacks-{name}")
        self._dispatcher = self._callbacks.thread
        self._built: Future = Future()
        if build is None:  # an engine built by hand: nothing to load
            self._built.set_result(None)
        self._thread = threading.Thread(target=self._loop, args=(build,), name=f"batchprompt-engine-{name}",
                                        daemon=True)
        _alive.add(self)
        self._thread.start()
        if build is not None:
            self._wait_built()

    def _after_fork(self) -> None:
        """In a forked child: this is a copy of the parent's service, with none of its threads (a
        call on it waited for ever). Stopped, it answers every call at once with FORKED; its locks
        are new, since a parent's thread may have held one at the fork."""
        self._cond = threading.Condition()
        self._stopping, self.stop_reason = True, FORKED
        self._callbacks.after_fork()
        # What the parent's batches had here is answered with FORKED: a batch running at the fork
        # waited for ever in the child (its engine thread is the parent's alone, so nothing is
        # dropped from the engine's copy).
        self._answer_pending(*self._take_pending(), discard=False)

    def _wait_built(self) -> None:
        """Wait for the engine thread to build the engine; its exception is raised here. If the
        wait itself is interrupted (Ctrl-C while loading), the thread ends once the build does."""
        try:
            self._built.result()
        except BaseException:
            with self._cond:
                if not self._stopping:
                    self._stopping, self.stop_reason = True, "the engine's build failed or was interrupted"
                self._cond.notify()
            self._callbacks.close()
            raise

    @property
    def loading(self) -> bool:
        """Its engine thread is still building the engine (a Ctrl-C left the load running)."""
        return not self._built.done() and self._thread.is_alive()

    @property
    def engine(self) -> LLMEngine:
        engine = self._engine
        if engine is None:  # released when the service stopped
            raise EngineStoppedError(f"{self.stop_reason}; create a new session with LanguageModel.create(...)")
        return engine

    @property
    def stopped(self) -> bool:
        return self._stopping

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        """The model's: token ids run from 0 to this, less one."""
        return self.engine.model.args.vocab_size

    def refuses(self, params: SamplingParams) -> str | None:
        return None  # the engine runs every option the API makes

    def stats(self, timeout: float | None = None) -> EngineStats:
        """A copy of the engine's counters, taken between steps (TimeoutError after `timeout`
        seconds, EngineStoppedError once stopped)."""
        return self.call(lambda: dataclasses.replace(self.engine.stats)).result(timeout)

    def pin_prefix(self, name: str, token_ids: list[int]) -> Future:
        """Prefill `token_ids` as a one-token request, then pin its blocks under `name` on the
        engine thread right after the prefill (before anything can evict them)."""
        fut: Future = Future()

        def done(out: RequestOutput) -> None:
            if out.error:  # on a stopped engine as every call there: what a retry catches
                error = EngineStoppedError if self.stopped else ValueError
                fut.set_exception(error(f"the session's system prompt cannot run: {out.error}"))
            else:
                try:
                    fut.set_result(self.engine.pin_prefix(name, token_ids))
                except BaseException as e:  # noqa: BLE001  (handed to the caller)
                    fut.set_exception(e)

        if not token_ids:
            fut.set_result(0)
            return fut
        source = Source()
        source.items.append(Item(list(token_ids), SamplingParams(max_tokens=1, temperature=0.0), done))
        self.submit(source)
        return fut

    def copy_pin(self, source: str, name: str) -> Future:
        return self.call(lambda: self.engine.copy_pin(source, name))

    # ---- callers' side (any thread) --------------------------------------------------------
    def submit(self, source: Source) -> None:
        """Queue `source`'s items. On a stopped service each is answered at once with the reason.
        Items whose grammar has not been compiled yet are queued once it has been, by a thread
        of their own: compiling on the engine's thread (seconds for a big list of labels or a
        large schema) held up every other request."""
        grammars = self._uncompiled_grammars(source)
        if not grammars:
            self._queue(source)
            return

        def compile_then_queue() -> None:
            try:
                for grammar in grammars:
                    self.engine.grammars.compile(grammar)  # a GrammarError is kept: each request gets it
            except BaseException:  # noqa: BLE001 - the engine compiles it again, and says why
                log.exception("compiling a grammar ahead of its requests failed")
            finally:
                self._queue(source)
        threading.Thread(target=compile_then_queue, name=f"batchprompt-grammar-{self.name}", daemon=True).start()

    def _uncompiled_grammars(self, source: Source) -> list:
        # `_engine`, not `engine`: on a stopped service that raises (not AttributeError), and a batch
        # started after bp.shutdown() was never answered (its first wait() raised, later ones hung)
        compiler = getattr(self._engine, "grammars", None)
        if compiler is None:
            return []
        seen: dict[int, Any] = {}  # by identity: a batch's items share one grammar object
        for item in list(source.items):
            grammar = item.params.grammar
            if grammar is not None and id(grammar) not in seen:
                seen[id(grammar)] = grammar
        return [g for g in dict.fromkeys(seen.values()) if not compiler.is_compiled(g)]

    def _queue(self, source: Source) -> None:
        with self._cond:
            if not self._stopping:
                self._sources.append(source)
                self._arrived = True
                self._cond.notify()
                return
        while source.items:
            item = source.items.popleft()
            answer(item, stopped_output(item, self.stop_reason, self._shut_down, ""))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the engine thread, between steps; its result comes back in the future
        (an EngineStoppedError once the service has stopped)."""
        fut: Future = Future()
        with self._cond:
            if not self._stopping:
                self._commands.append((fn, fut))
                self._cond.notify()
                return fut
        fut.set_exception(EngineStoppedError(self.stop_reason))
        return fut

    def cancel(self, source: Source, on_pending: Callable[[Item], None]) -> Future:
        """Drop `source`'s items not yet in the engine (each goes to `on_pending`) and abort
        those in it (their outputs come back through `on_done`, finish_reason 'abort')."""
        def run() -> None:
            source.cancelled = True
            while source.items:
                on_pending(source.items.popleft())
            for rid in list(source.in_engine):
                self.engine.abort(rid)
        return self.call(run)

    def dispatch(self, fn: Callable, *args, cut: bool = False) -> None:
        """Run a user callback on the callback thread, in the order dispatched (once the service
        has stopped, at once on this thread). `cut`: on results a stop cancelled (not run at exit)."""
        self._callbacks.dispatch(fn, *args, cut=cut)

    def add_session(self, name: str) -> None:
        with self._cond:
            self._sessions.add(name)

    def close_session(self, name: str) -> None:
        """Forget a session and release its pinned prefix (on the engine thread)."""
        with self._cond:
            self._sessions.discard(name)
        self.call(lambda: self.engine.unpin(name))

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    @property
    def in_flight(self) -> int:
        return len(self._in_engine)

    def shutdown(self, timeout: float | None = None, at_exit: bool = False) -> bool:
        """Stop both threads, answer every waiting item ('cancelled': the engine was shut down),
        leave the registry and drop the engine, so its weights and KV cache can be freed (unless
        the caller holds the engine). Returns once the threads have ended (True), except for the
        one it is called on, or after `timeout` seconds (False: the engine thread is still in a
        step; it ends after it). `at_exit`: the callbacks on the results the stop cancels are not
        run (counted in `callbacks_dropped`); those of results that come still run."""
        _unregister(self)
        if at_exit:
            self._callbacks.drop_cut()
        with self._cond:
            if not self._stopping:
                self._stopping, self.stop_reason = True, SHUT_DOWN_AT_EXIT if at_exit else SHUT_DOWN
            self._cond.notify()
        current = threading.current_thread()
        if current is self._thread:  # a command: the loop ends when it returns
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        self._thread.join(timeout)
        if at_exit:  # the callbacks are waited for afterwards, while they go on finishing (finish_callbacks)
            return not self._thread.is_alive()
        if current is not self._dispatcher:
            self._dispatcher.join(None if deadline is None else max(deadline - time.monotonic(), 0))
        return not self._thread.is_alive() and (current is self._dispatcher or not self._dispatcher.is_alive())

    # ---- engine thread ----------------------------------------------------------------------
    def _loop(self, build: Callable[[], LLMEngine] | None) -> None:
        prepare_engine_thread()  # before this thread runs any op: why, in device.py
        if build is not None:
            try:
                with _building:
                    self._engine = build()
            except BaseException as e:  # noqa: BLE001  (raised in the constructor's thread)
                self._built.set_exception(e)
                return
            self._built.set_result(None)
        # Another thread's engine.generate() runs here, between steps; its add_request() or step() is refused.
        self._engine.driver = (threading.current_thread(), lambda fn: self.call(fn).result())
        failure = None  # why the loop died, as text: the exception's traceback holds the engine
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._sources or self._stopping or self.engine.has_unfinished()):
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                for fn, fut in commands:
                    if not fut.set_running_or_notify_cancel():  # the caller cancelled it
                        continue
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001  (handed to the caller)
                        fut.set_exception(e)
                if self._stopping:
                    break
                self._feed()
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as e:  # noqa: BLE001  (the loop cannot go on: answer everyone, below)
            log.exception("the engine thread failed; its requests fail and the next call starts a fresh engine")
            failure = f"{type(e).__name__}: {e}"
        self._end(failure)

    def _window(self) -> int:
        cfg = self.engine.config
        return cfg.max_num_seqs + max(64, int(self._rate * self.lookahead_s))

    def _feed(self) -> None:
        """Move items from the sources into the engine: higher-priority sources first,
        round-robin within a priority class, each item with its source's priority.

        Each class has its own window: items of priority p enter while fewer than `_window()`
        items of priority p or higher are in the engine. So the bulk rows already fed never
        keep an interactive item out: it enters at once, and the engine admits it ahead of them
        (with `priority_scheduling` off, one window and one class, as before priorities)."""
        window = self._window()
        prioritized = self.engine.config.priority_scheduling
        refused: list[tuple[Item, RequestOutput]] = []
        with self._cond:
            self._arrived = False
            if not self._sources:
                return
            classes = self._sources_by_priority(prioritized)
            fed = self._fed_by_priority(prioritized)
            for priority in sorted(classes, reverse=True):
                queue = classes[priority]
                room = window - sum(n for p, n in fed.items() if p >= priority)
                while room > 0 and queue:
                    source = queue[0]
                    if source.cancelled or not source.items:
                        queue.popleft()
                        continue
                    item = source.items.popleft()
                    queue.rotate(-1)
                    item.request_id = rid = f"{self.name}-{next(self._ids)}"
                    try:
                        self.engine.add_request(item.token_ids, item.params, rid, priority=priority)
                    except Exception as e:  # noqa: BLE001  (e.g. a grammar's tokenizer cannot be built)
                        log.exception("the engine refused a request")
                        self._discard(rid)
                        refused.append((item, RequestOutput(rid, item.token_ids, [], "", "error", error=(
                            f"the engine could not queue this prompt: {type(e).__name__}: {e}"))))
                        continue
                    source.in_engine[rid] = item
                    self._in_engine[rid] = (source, item)
                    if item.on_tokens is not None:
                        self._streaming[rid] = (item, 0)
                    fed[priority] = fed.get(priority, 0) + 1
                    room -= 1
            self._sources = deque(s for p in sorted(classes, reverse=True) for s in classes[p]
                                  if s.items and not s.cancelled)
        for item, out in refused:
            answer(item, out)

    def _sources_by_priority(self, prioritized: bool) -> dict[int, deque[Source]]:
        """The waiting sources by priority class (all in one without priorities), each class in
        its round-robin order."""
        classes: dict[int, deque[Source]] = {}
        for source in self._sources:
            classes.setdefault(source.priority if prioritized else 0, deque()).append(source)
        return classes

    def _fed_by_priority(self, prioritized: bool) -> dict[int, int]:
        """How many items of each priority class are in the engine."""
        fed: dict[int, int] = {}
        for source, _ in self._in_engine.values():
            p = source.priority if prioritized else 0
            fed[p] = fed.get(p, 0) + 1
        return fed

    def _take_pending(self) -> tuple[list, list[Source], list[tuple[Source, Item]]]:
        """The commands, the sources waiting and the items in the engine, taken (hold `_cond`)."""
        commands, self._commands = self._commands, []
        sources, self._sources = list(self._sources), deque()
        in_engine, self._in_engine = list(self._in_engine.values()), {}
        return commands, sources, in_engine

    def _answer_pending(self, commands: list, sources: list[Source], in_engine: list[tuple[Source, Item]],
                        discard: bool) -> int:
        """Fail the commands and answer every item with the stop's reason (`discard`: drop those in
        the engine from it); returns how many prompts the items answered, those of batches whose
        cancel was asked left out (a Ctrl-C's: the stop did not cut them short)."""
        for _, fut in commands:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineStoppedError(self.stop_reason))
        prompts = 0
        for source, item in in_engine:
            source.in_engine.pop(item.request_id, None)
            if discard:
                self._discard(item.request_id)
            answer(item, stopped_output(item, self.stop_reason, self._shut_down))
            prompts += item.prompts * (not source.cancel_asked)
        for source in sources:
            source.cancelled = True
            while source.items:
                item = source.items.popleft()
                answer(item, stopped_output(item, self.stop_reason, self._shut_down, ""))
                prompts += item.prompts * (not source.cancel_asked)
        return prompts

    def _discard(self, rid: str) -> None:
        """Drop a request the engine may hold half-added, so it is not stepped for ever (its
        'abort' output comes back from a step and is ignored: it is no longer ours)."""
        try:
            self.engine.abort(rid)
        except Exception:  # noqa: BLE001
            log.exception("could not drop a request the engine refused")

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step(pause=self._between_layers)
        except Exception as e:  # a bug in the engine: fail what is in it, keep the thread alive
            log.exception("engine step failed")
            outputs = []
            for rid, (_, item) in list(self._in_engine.items()):
                self._discard(rid)
                outputs.append(RequestOutput(rid, item.token_ids, [], "", "error",
                                             error=f"the engine failed: {type(e).__name__}: {e}"))
        dt = max(time.perf_counter() - t0, 1e-6)
        self._rate = 0.9 * self._rate + 0.1 * (len(outputs) / dt)
        self._stream_tokens()
        self._deliver(outputs)
        self._count_made()

    def _count_made(self) -> None:
        """Each source's Source.made, at most every MADE_EVERY_S (it looks at every request in
        flight). A request that finishes takes its part off at once (_deliver), so that a batch's
        progress never counts its tokens twice."""
        now = time.monotonic()
        if now < self._made_due:
            return
        self._made_due = now + MADE_EVERY_S
        engine, made, totals = self.engine, {}, {}
        for rid, (source, _) in self._in_engine.items():
            made[rid] = k = engine.num_output_tokens(rid)
            totals[source] = totals.get(source, 0) + k
        for source, total in totals.items():
            source.made = total
        self._made = made

    def _between_layers(self) -> None:
        """The engine pauses a long step between its layers: take in what was submitted since,
        and let the engine run the requests that outrank the whole step (a chat request beside
        a batch) at once, inside it, answering each as it finishes."""
        if not (self._arrived or self.engine.inside_pending):
            return
        while True:
            if self._arrived:
                self._feed()
            outputs = self.engine.step_inside()
            if outputs is None:
                return
            self._stream_tokens()
            self._deliver(outputs)

    def _stream_tokens(self) -> None:
        """Hand each streamed item the tokens its request made since the last step (those that
        finished get the rest just before their output, in _deliver)."""
        for rid, (item, sent) in list(self._streaming.items()):
            ids = self.engine.output_ids(rid)
            if ids is None or len(ids) <= sent:
                continue
            self._streaming[rid] = (item, len(ids))
            logprobs = self.engine.output_logprobs(rid, sent) if item.params.logprobs else None
            _hand_tokens(item, ids[sent:], False, logprobs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            streamed = self._streaming.pop(out.request_id, None)
            if streamed is not None and len(out.output_token_ids) > streamed[1]:  # those of its last step
                sent = streamed[1]
                logprobs = ((list(out.logprobs[sent:]), list((out.top_logprobs or [])[sent:]))
                            if streamed[0].params.logprobs and out.logprobs is not None else None)
                _hand_tokens(streamed[0], out.output_token_ids[sent:], True, logprobs)
            entry = self._in_engine.pop(out.request_id, None)
            if entry is None:  # already answered (after an engine failure), or not ours
                continue
            source, item = entry
            source.in_engine.pop(out.request_id, None)
            source.made = max(source.made - self._made.pop(out.request_id, 0), 0)
            answer(item, out)

    def _end(self, failure: str | None) -> None:
        """The loop is over (shut down, or failed): answer every item still waiting, fail the
        commands, release the sessions' prefixes, and let go of the engine."""
        with self._cond:
            if not self._stopping:
                self._stopping = True
                self.stop_reason = f"the engine stopped: {failure} (the next call starts a fresh engine)"
            pending = self._take_pending()
            sessions, self._sessions = list(self._sessions), set()
            self._streaming.clear()
        _unregister(self)
        engine = self._engine
        self._cut_short += self._answer_pending(*pending, discard=True)
        for name in sessions:  # matters where the caller owns the engine and goes on using it
            try:
                engine.unpin(name)
            except Exception:  # noqa: BLE001
                log.exception("could not release a session's prefix")
        if engine is not None and engine.driver is not None and engine.driver[0] is threading.current_thread():
            engine.driver = None  # the caller may drive it now
        self._engine = engine = None
        _free_memory()
        self._callbacks.close()  # after the callbacks of the answers above


def _hand_tokens(item: Item, ids: list[int], last: bool, logprobs: tuple | None = None) -> None:
    """`logprobs`: (the tokens' log-probs, their top ones), where the request asked for them."""
    try:
        item.on_tokens(ids, last, logprobs)  # type: ignore[misc]
    except Exception:  # noqa: BLE001  (a streaming consumer's bug costs it its stream only)
        log.exception("a token stream's callback failed; the request goes on")


def _free_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    _trim_heap()


def _trim_heap() -> None:
    """Give the freed heap back to the system. glibc keeps what a dropped engine freed (its
    weights and cache come from the heap once a large block was freed), so each engine built
    again in one process (after bp.shutdown(), or another model) added about 0.9 GB of RSS that
    the process never gave back. A no-op where the C library has no malloc_trim (musl, macOS)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---- one service per model in a process ---------------------------------------------------------
_services: dict[tuple, EngineService] = {}
_services_lock = threading.Lock()
# Every service made in this process, and every backend given to `stop_at_exit`, for `_stop_at_exit`.
_alive: weakref.WeakSet = weakref.WeakSet()
#: One engine build at a time in a process. A build left running by a Ctrl-C (its caller gone)
#: and the retry's build imported transformers at once, and the retry failed ("cannot import name
#: 'AutoTokenizer' from 'transformers'"): the retry now waits for it.
_building = threading.Lock()
EXIT_WAIT_S = 10.0  # at exit, how long in all to wait for engine threads to leave their step


def _stop_at_exit() -> None:
    """At interpreter exit, stop every engine thread first. One left inside a model step (a
    script that ends without waiting for its batch, or whose engine's build just failed) runs
    PyTorch's C++ while the exit destroys its globals, and the process aborted ("terminate
    called without an active exception", exit status 134). Unfinished work is cancelled."""
    deadline = time.monotonic() + EXIT_WAIT_S
    services = list(_alive)
    running = [s for s in services if not s.stopped]  # those stopped before (bp.shutdown()) said so then
    loading = [s for s in services if getattr(s, "loading", False)]
    if loading:  # a load ends, however long it takes: the exit waits for it (the process aborted after 10 s)
        # A second Ctrl-C ends it at once where Ctrl-C raises (`batchprompt run` ignores a second one).
        raises = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        again = " (Ctrl-C again to end at once)" if raises else ""
        log.warning("the model is still loading: the exit waits for the load to end%s", again)
    for service in services:
        try:
            service.shutdown(None if service in loading else max(deadline - time.monotonic(), 0), at_exit=True)
        except KeyboardInterrupt:
            # A second Ctrl-C while an engine leaves its step: the user wants out now. _exit
            # skips what the wait was for (the C++ globals' destructors), as it does this
            # traceback ("Exception ignored in atexit callback ... KeyboardInterrupt").
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        except Exception:  # noqa: BLE001 - exiting: the others must still be stopped
            log.exception("stopping an engine at exit failed")
    # The callbacks of results that came before or during the exit run, however long they take
    # in all, while each finishes within EXIT_WAIT_S (the fixed deadline above dropped them).
    unrun = 0
    for service in services:
        try:
            finish = getattr(service, "finish_callbacks", None)
            unrun += finish(EXIT_WAIT_S) if finish is not None else 0
        except KeyboardInterrupt:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        except Exception:  # noqa: BLE001 - exiting: the others' callbacks must still run
            log.exception("running the callbacks at exit failed")
    if unrun:
        log.warning("the script ended while a batch callback ran on with none finishing for %gs: it and the "
                    "callbacks queued after it were not waited for", EXIT_WAIT_S)
    cut = sum(s.cancelled_at_stop for s in running)
    if cut:
        dropped = sum(s.callbacks_dropped for s in running)
        log.warning("the script ended with %d prompt%s unfinished: cancelled%s. Call wait() on a batch (or "
                    "iterate it) before the script ends to keep its results", cut, "" if cut == 1 else "s",
                    f", without the {dropped} callback call{'' if dropped == 1 else 's'} due for them"
                    if dropped else "")


atexit.register(_stop_at_exit)


def stop_at_exit(backend: Any) -> None:
    """Have the exit stop `backend` too (it has `stopped`, `shutdown(timeout, at_exit=)`,
    `cancelled_at_stop` and `callbacks_dropped`), and run that stop before every exit hook
    registered so far. A Ray backend calls this after `import ray`, so that its replicas are let
    go of before Ray's own hook shuts Ray down: after it, a session's release at exit called a
    replica, which started a new local Ray instance in the exiting process (seconds, and at times
    a segmentation fault)."""
    _alive.add(backend)
    atexit.unregister(_stop_at_exit)
    atexit.register(_stop_at_exit)


_service_ids = itertools.count()  # never reused: request ids stay unique within a shared engine


def get_service(model: str | LLMEngine | None = None, *, device: str = "auto", dtype: str = "auto",
                engine_options: dict | None = None) -> EngineService:
    """The process's service for `model` (an id, a path, None for the embedded model, or an
    engine built by hand), created on first use. `engine_options` (EngineConfig fields) apply
    when the engine is created; later callers share it as it is."""
    if engine_options is not None and not isinstance(engine_options, Mapping):  # it failed in from_pretrained(**...)
        raise TypeError(f"engine_options must be a dict of EngineConfig fields, such as {{'max_num_seqs': 64}}, "
                        f"got {type(engine_options).__name__}")
    if isinstance(model, LLMEngine):
        key: tuple = ("engine", id(model))
    else:
        from ..models import resolve_model
        source = resolve_model(model)  # fails fast, with the user's spelling, on an unknown model
        key = (str(source.path), *_engine_key(device, dtype))
    with _services_lock:
        service = _services.get(key)
        if service is None or service.stopped:
            if isinstance(model, LLMEngine):
                check_not_forked_from_cuda(model.runner.device)  # the parent's CUDA engine, copied by a fork
                if model.has_callers_requests():  # the session's thread would step them and drop their outputs
                    raise RuntimeError("this engine has requests of its own in progress (add_request()): step them "
                                       "to the end, or abort() them, before a session uses the engine")
                engine, name = model, "engine"
            else:
                def engine() -> LLMEngine:  # built on the service's engine thread
                    return build_engine(str(source.path), device, dtype, engine_options)
                name = source.name
            service = _services[key] = EngineService(engine, name=f"{name}-{next(_service_ids)}")
            service.engine_options = dict(engine_options or {})
        elif engine_options and not _same_config(EngineConfig.from_options(engine_options), service.engine):
            # Compared as configs: an option given at its default is no change.
            raise EngineOptionsConflict(
                f"this process's engine for {model if model is not None else 'the embedded model'} already runs with "
                f"engine_options={service.engine_options}; engine_options={dict(engine_options)} need a new one: "
                f"call bp.shutdown() first (it ends the sessions on that engine), or leave engine_options out "
                f"to share the running engine")
        return service


def _engine_key(device: str, dtype: str) -> tuple[str, str]:
    """The device and dtype an engine runs with, as resolved: "auto" and "cpu" (or "bfloat16" where
    "auto" picks it) each built an engine of their own, with a second copy of the weights."""
    import torch

    from ..device import resolve_device, resolve_dtype

    dev = resolve_device(device)
    if dev.type == "cpu":  # "cpu:0" is the CPU too
        dev = torch.device("cpu")
    elif dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev), str(resolve_dtype(dtype, dev))


def _same_config(asked: EngineConfig, engine: LLMEngine) -> bool:
    """Whether `asked` is the running engine's config, with what it leaves out taken as the
    engine took it: the device's defaults, and max_model_len None as the model's own context
    (so giving that context, 8,192 for the embedded model, is no change)."""
    asked, running = asked.for_device(engine.runner.device.type), engine.config
    if asked.max_model_len == engine.max_model_len and running.max_model_len is None:
        asked = dataclasses.replace(asked, max_model_len=None)
    return asked == running


class EngineOptionsConflict(ValueError):
    """Other engine_options than those of the engine already running for the model."""


class KVCacheTooSmall(EngineConfigError):
    """The KV budget asked for cannot hold one request of the full context."""


def build_engine(path: str, device: str, dtype: str, engine_options: dict | None) -> LLMEngine:
    """An engine for the model at `path`. Refused, as vLLM refuses to start, where its KV cache
    cannot hold one request of the full context: a budget that small answers every request with
    an error (or none at all, when even a session's system prompt does not fit)."""
    engine = LLMEngine.from_pretrained(path, device=device, dtype=dtype, **(engine_options or {}))
    tokens = engine.pool.max_blocks * engine.config.block_size
    if tokens < engine.max_model_len:
        raise KVCacheTooSmall(
            f"the KV cache holds {tokens} tokens, fewer than one request of the full context (max_model_len "
            f"{engine.max_model_len} tokens): raise kv_cache_memory (--kv-cache-memory), or lower max_model_len "
            f"(--max-model-len) to at most {tokens}")
    return engine


def _after_fork_in_child() -> None:
    """A forked child gets copies of the parent's services but not their threads: each is
    stopped, and the registry emptied, so a new session in the child builds its own engine."""
    global _services_lock
    _services_lock = threading.Lock()
    _services.clear()
    for service in list(_alive):
        if isinstance(service, EngineService):
            service._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _unregister(service: EngineService) -> None:
    with _services_lock:
        for key in [k for k, s in _services.items() if s is service]:
            del _services[key]


def shutdown(model: str | LLMEngine | None = None, timeout: float | None = None) -> int:
    """Release engines: every one in the process (model=None), or those of one model (as
    given to `LanguageModel.create`: an id, a path, 'smollm2-135m', or an LLMEngine). Work still
    waiting on them is cancelled ('the engine was shut down'), their threads end, and their
    weights and KV cache are freed unless you hold the engine yourself; sessions on them raise
    EngineStoppedError; the next call builds a fresh engine. Returns how many were released.
    `timeout`: wait at most this long in all for their threads (an engine thread stuck in a
    step is then left to end after it, logged); by default, wait until they end. With
    model=None, the Ray replicas and endpoint pools that sessions run on are let go of too."""
    if model is not None and not isinstance(model, (str, os.PathLike, LLMEngine)):
        # shutdown(5) meant a time limit: it was os.path's "expected str, bytes or os.PathLike object, not int"
        raise TypeError(f"shutdown's model must be a model id or path, or an LLMEngine (or None for all), got "
                        f"{type(model).__name__} {model!r:.60}; for a time limit give timeout=...")
    timeout = wait_seconds(timeout)  # -1 was taken, and logged as "did not finish within -1s"
    with _services_lock:
        services = list(dict.fromkeys(_services.values()))
    if model is None:  # backends of a RayCluster or an EndpointPool (it let their replicas run on)
        services += [b for b in list(_alive) if not isinstance(b, EngineService) and not b.stopped]
    else:
        if isinstance(model, LLMEngine):
            services = [s for s in services if s._engine is model]
        else:
            from ..models import resolve_model
            path = str(resolve_model(model).path)
            with _services_lock:
                services = list(dict.fromkeys(s for k, s in _services.items() if k[0] == path))
    deadline = None if timeout is None else time.monotonic() + timeout
    for service in services:
        left = None if deadline is None else max(deadline - time.monotonic(), 0)
        if not service.shutdown(left):
            log.warning("the engine of %s did not finish its step within %.0fs of its shutdown: not waited for",
                        service.name, timeout)
    return len(services)
